"""Threads from what the machine can give: the cores that other processes keep busy at the start
are left to them (read from /proc/stat), a resumed run keeps the threads it started with, and a
run whose steps slow down several times over says so once. Machines are described, never timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tba.config import load_config
from tba.machine import busy_between, run_ticks
from tba.plan import Hardware, make_plan
from tba.runtime.health import SlowdownWatch


def plan(overrides: list[str], hardware: Hardware):
    return make_plan(load_config(None, overrides), hardware)


SYNC, RAY = ["--runtime.type=sync"], ["--runtime.type=ray"]


@pytest.mark.parametrize(
    ("machine", "sync_threads", "ray_trainer_threads"),
    [
        (Hardware(cpus=2), None, 1),  # idle: torch's default (every core) in turns; a core each side by side
        (Hardware(cpus=2, busy=1.0), 1, 1),  # one core busy: the other one
        (Hardware(cpus=2, busy=0.3), None, 1),  # a little background work is not a core
        (Hardware(cpus=2, busy=2.0), 1, 1),  # every core busy: one thread still
        (Hardware(cpus=1), None, 1),  # limited by affinity (taskset, a container): what torch takes there
        (Hardware(cpus=8, busy=2.6), 5, 4),  # 2.6 cores' worth counts as 3; ray: and the searcher's 1
    ],
    ids=["idle", "one-busy", "background", "all-busy", "affinity-1", "8-cores-2.6-busy"],
)
def test_threads_leave_the_busy_cores_to_other_processes(machine, sync_threads, ray_trainer_threads):
    p = plan(SYNC, machine)
    assert p.trainer_threads == sync_threads
    if machine.busy_cpus:
        assert f"less the {machine.busy_cpus} kept busy by other processes" in p.why["trainer_threads"]
        assert f"  threads: {sync_threads} (generation and training in turns)" in p.lines()
        assert f"{machine.busy:.1f} of them busy with other processes" in p.lines()[0]
    else:
        assert "trainer_threads" not in p.why
    r = plan(RAY, machine)
    assert (r.trainer_threads, r.searcher_threads) == (ray_trainer_threads, 1)
    assert ("kept busy" in r.why["trainer_threads"]) == bool(machine.busy_cpus)


def test_threads_set_by_the_user_are_kept_whatever_the_load():
    loaded = Hardware(cpus=2, busy=1.0)
    assert plan([*SYNC, "--run.threads=2"], loaded).trainer_threads == 2
    assert plan([*RAY, "--runtime.trainer_cpus=2"], loaded).trainer_threads == 2
    assert "trainer_threads" not in plan([*SYNC, "--run.threads=2"], loaded).why


@pytest.mark.parametrize("started", [None, 1])
def test_a_resumed_run_keeps_the_threads_it_started_with(tmp_path, started):
    """The count decides how sums round, so a resume on a machine whose load changed keeps its own."""
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "plan.json").write_text(json.dumps({"trainer_threads": started}))
    where = [f"--run.output_dir={tmp_path}", "--run.name=r"]
    for machine in (Hardware(cpus=2), Hardware(cpus=2, busy=1.0)):
        p = plan([*SYNC, *where, "--run.resume=true"], machine)
        assert p.trainer_threads == started and "as the run started" in p.why["trainer_threads"]
    assert plan([*SYNC, *where, "--run.resume=true", "--run.threads=2"], Hardware(cpus=2)).trainer_threads == 2
    # a new run in another directory plans for the machine as it finds it
    assert (
        plan([*SYNC, f"--run.output_dir={tmp_path}", "--run.name=new"], Hardware(cpus=2, busy=1.0)).trainer_threads == 1
    )


STAT = """cpu  {all}
cpu0 {a} 0 {b} {idle0} 0 0 0 {steal0} 0 0
cpu1 {c} 0 0 {idle1} 0 0 0 0 0 0
cpu2 900 0 0 100 0 0 0 0 0 0
intr 12345
"""


def stat(a, b, idle0, steal0, c, idle1) -> str:
    return STAT.format(all="0 0 0 0 0 0 0 0 0 0", a=a, b=b, idle0=idle0, steal0=steal0, c=c, idle1=idle1)


def test_busy_cores_are_read_from_two_readings_of_proc_stat():
    before = stat(a=1000, b=200, idle0=5000, steal0=0, c=100, idle1=8000)
    # 30 ticks later: cpu0 busy throughout (20 user, 5 system, 5 steal), cpu1 idle; cpu2 is not ours
    after = stat(a=1020, b=205, idle0=5000, steal0=5, c=100, idle1=8030)
    assert busy_between(before, after, {0, 1}) == pytest.approx(1.0)
    assert busy_between(before, after, {1}) == 0.0
    # this process's own 15 ticks in the window are not another's
    assert busy_between(before, after, {0, 1}, own_ticks=15) == pytest.approx(0.5)
    assert busy_between(before, after, {0, 1}, own_ticks=60) == 0.0
    assert busy_between(before, before, {0, 1}) == 0.0  # no time passed: nothing to say
    assert Hardware(cpus=2, busy=0.49).busy_cpus == 0 and Hardware(cpus=2, busy=0.6).busy_cpus == 1
    assert Hardware(cpus=2, busy=3.0).busy_cpus == 2


def _ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
def test_a_runs_own_processes_are_not_other_processes():
    """A ray run's searchers and a vLLM engine's core are processes this one started: their CPU time
    is the run's own (:func:`tba.machine.run_ticks`), not load from elsewhere. A grandchild that has
    spent 0.3 s of CPU (by its own clock, whatever the machine's load) is counted in its ancestors'."""
    burn = (
        "import sys\nfrom subprocess import PIPE, Popen\n"
        "code = 'import sys, time\\nwhile time.process_time() < 0.3: pass\\nprint(1, flush=True)\\nsys.stdin.read()'\n"
        "child = Popen([sys.executable, '-c', code], stdin=PIPE, stdout=PIPE, text=True)\n"
        "print(child.pid, child.stdout.readline().strip(), flush=True)\n"
        "sys.stdin.read()\n"
        "child.stdin.close(); child.wait()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        grandchild, ready = proc.stdout.readline().split()
        assert ready == "1"
        spent = _ticks(int(grandchild))
        assert spent >= 0.3 * os.sysconf("SC_CLK_TCK") - 1  # (ticks are counted whole)
        assert run_ticks(pid=int(grandchild)) == spent  # no process under it
        assert run_ticks(pid=proc.pid) >= _ticks(proc.pid) + spent
        mine = _ticks(os.getpid())  # (read first: this process's own clock goes on)
        assert run_ticks() >= mine + _ticks(proc.pid) + spent
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def test_a_run_whose_steps_slow_down_says_so_once_with_the_setting_that_helps():
    asked = []

    def measure() -> float:
        asked.append(True)
        return 1.0

    watch = SlowdownWatch(Hardware(cpus=2), threads=None, measure=measure)
    said = [watch.observe(0.2) for _ in range(30)]  # 3 to warm up, 20 to learn the pace, then steady
    said += [watch.observe(s) for s in (0.3, 0.5, 0.6, 0.6, 0.7, 0.9, 0.9, 1.0, 1.0)]
    messages = [(i, m) for i, m in enumerate(said) if m]
    assert len(messages) == 1 and len(asked) == 1  # once; the load asked for only then
    i, message = messages[0]
    assert i == 30 + 3  # the median of the last 5 steps (0.5 s) is at least 2x the first 20's (0.2 s)
    assert message.startswith("steps take 2.5x as long as at the start (0.50 s against 0.20 s)")
    assert "1 of this machine's 2 core(s) are busy" in message and "torch's default threads" in message
    assert "--run.resume=true --run.threads=1" in message


def test_a_slowdown_under_the_factor_or_without_other_processes_says_nothing():
    watch = SlowdownWatch(Hardware(cpus=2), threads=1, measure=lambda: 1.0)
    assert not any(watch.observe(s) for s in [0.2] * 23 + [0.39] * 20)  # 1.95x: not yet
    # slower without another process on the cores (longer completions, say): the run's own business;
    # asked again only 20 steps later, when the load has come
    loads = iter([0.0, 1.0])
    asked = []

    def measure() -> float:
        asked.append(True)
        return next(loads)

    watch = SlowdownWatch(Hardware(cpus=2), threads=None, measure=measure)
    said = [watch.observe(s) for s in [0.2] * 23 + [1.0] * 40]
    assert [i for i, m in enumerate(said) if m] == [27 + 20] and len(asked) == 2
    # the run's one thread already fits the free core: nothing to change but the load
    watch = SlowdownWatch(Hardware(cpus=2), threads=1, measure=lambda: 1.0)
    (message,) = [m for m in (watch.observe(s) for s in [0.2] * 23 + [1.0] * 5) if m]
    assert "Its 1 thread(s) fit the free core(s)" in message and "--run.threads" not in message


def test_the_ray_runtimes_trainer_and_searchers_hear_to_free_the_cores():
    # a core each on 2 cores, one of them now busy: two threads on the free one, which no
    # --run.threads changes (each process keeps one)
    watch = SlowdownWatch(Hardware(cpus=2), threads=2, measure=lambda: 1.0, side_by_side=True)
    (message,) = [m for m in (watch.observe(s) for s in [0.25] * 23 + [0.5] * 5) if m]
    assert "trainer and searchers, side by side, run 2 thread(s) on 1 free core(s)" in message
    assert "--runtime.type=sync" in message and "--run.threads" not in message

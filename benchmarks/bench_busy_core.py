"""Threads beside a busy core: a run's seconds per step on a quiet machine and beside one process
that keeps a core busy, for the thread counts a run could take.

    .venv/bin/python benchmarks/bench_busy_core.py                                  # the demo, 40 steps, every arm
    .venv/bin/python benchmarks/bench_busy_core.py --setting real --steps 20 --arms plan all --limit 900
    .venv/bin/python benchmarks/bench_busy_core.py --setting demo --steps 600 --arms plan   # the whole demo

Each run is the real CLI (``tba train``, the setting's defaults, ``--run.seed=0``), with only the arm's
settings changed. "loaded": a ``while True: pass`` process runs beside the whole run (the script
starts it before and stops it after); "midrun": the same process starts once the run has logged a
quarter of its steps (a load that comes after the plan chose its threads: the run's notice, if it
gives one, is kept with the result). The arms:

- ``plan``: the run plan's threads (what ``tba train`` takes by itself: the cores that other
  processes leave, :func:`tba.plan.placement.planned_threads`);
- ``all``: ``--run.threads`` at every usable core (torch's default, the plan's choice before it
  watched the load);
- ``one``: ``--run.threads=1``;
- ``passive``: every core, with ``OMP_WAIT_POLICY=PASSIVE`` (OpenMP's threads sleep at once when
  they wait instead of spinning first);
- ``ray``: ``--runtime.type=ray`` with the plan's threads (a core each for the trainer and the
  searcher on 2 cores).

Printed per run: the threads it ran with, seconds per step over its steps (from the logged times),
the median generation and trainer step, and greedy accuracy before and after; then each arm's
loaded / quiet ratio. ``--limit``: seconds after which a run is stopped (its steps so far are
measured). Results go to ``--out``/busy_core.json, one entry per run as it finishes; a rerun skips
the runs already there (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

from harness import print_machine, train
from harness.measure import hog
from harness.report import row, rule
from harness.settings import SETTINGS

from tba.machine import usable_cores
from tba.metrics import read_metrics

ARMS = ("plan", "all", "one", "passive", "ray")


def arm_settings(arm: str) -> tuple[list[str], dict[str, str]]:
    """The arm's ``tba train`` arguments and environment."""
    cores = f"--run.threads={usable_cores()}"
    return {
        "plan": ([], {}),
        "all": ([cores], {}),
        "one": (["--run.threads=1"], {}),
        "passive": ([cores], {"OMP_WAIT_POLICY": "PASSIVE"}),
        "ray": (["--runtime.type=ray"], {}),
    }[arm]


class HogAt(threading.Thread):
    """Starts :func:`hog` once the run in ``run_dir`` has logged step ``step`` (at once for step 0)."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(daemon=True)
        self.metrics, self.step = run_dir / "metrics.jsonl", step
        self.proc: subprocess.Popen | None = None
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.step == 0 or (
                self.metrics.is_file() and any(r.get("step", 0) >= self.step for r in read_metrics(self.metrics))
            ):
                self.proc = hog()
                return
            time.sleep(0.5)

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def run_name(setting: str, steps: int, arm: str, machine: str) -> str:
    return f"{setting}{steps}-{arm}-{machine}"


def run(out: Path, setting: str, arm: str, machine: str, steps: int, limit: float | None) -> dict:
    name = run_name(setting, steps, arm, machine)
    args, env = arm_settings(arm)
    base = SETTINGS[setting]
    config, overrides = (base[0], base[1:]) if base and base[0].endswith(".yaml") else (None, base)
    overrides = [*overrides, *args, "--run.seed=0", "--logging.progress=false", f"--trainer.steps={steps}"]
    overrides += [f"--eval.every={steps}", "--trainer.checkpoint_every=null"]
    busy = None if machine == "quiet" else HogAt(out / name, 0 if machine == "loaded" else steps // 4)
    (out / name / "metrics.jsonl").unlink(missing_ok=True)  # (an earlier run's: the hog waits for this one's)
    if busy is not None:
        busy.start()
    try:
        done = train(overrides, out, name, config=config, env=env, timeout=limit, clear=True, check=False)
    finally:
        if busy is not None:
            busy.stop()
    if done.returncode not in (0, None):
        done.fail()
    records = done.steps()
    times = [r["time_s"] for r in records]
    plan = json.loads((done.run_dir / "plan.json").read_text())
    summary = done.summary() if done.ok else {}
    return {
        "name": name,
        "setting": setting,
        "arm": arm,
        "machine": machine,
        "loaded": machine != "quiet",
        "threads": plan["trainer_threads"],
        "busy_seen": plan["hardware"].get("busy", 0.0),
        "steps": len(records),
        "stopped": done.returncode is None,
        "wall_s": round(done.wall_s, 1),
        "s_per_step": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None,
        "generate_s": statistics.median(r["searcher/generate_s"] for r in records) if arm != "ray" else None,
        "train_step_s": statistics.median(r["train/step_s"] for r in records),
        "accuracy_initial": summary.get("eval/accuracy_initial"),
        "accuracy_final": summary.get("eval/accuracy_final"),
        "notice": notice(done.run_dir),
    }


def notice(run_dir: Path) -> str | None:
    """The run's slowdown notice (tba.runtime.health.SlowdownWatch), as ``errors.log`` keeps it."""
    log = run_dir / "errors.log"
    lines = log.read_text().splitlines() if log.is_file() else []
    return next((line.split(" ", 2)[2] for line in lines if "steps take" in line), None)


def table(rows: list[dict]) -> str:
    lines = [
        row(["arm", "machine", "threads", "steps", "s/step", "generate s", "train step s", "wall s", "accuracy"]),
        rule("llrrrrrrr"),
    ]
    for r in rows:
        accuracy = (
            f"{r['accuracy_initial']:.1%} -> {r['accuracy_final']:.1%}" if r["accuracy_final"] is not None else "-"
        )
        steps = f"{r['steps']}" + (" (stopped)" if r["stopped"] else "")
        threads = "torch's default" if r["threads"] is None else r["threads"]
        generate = "-" if r["generate_s"] is None else f"{r['generate_s']:.3f}"
        machine = r.get("machine", "loaded" if r["loaded"] else "quiet")
        lines.append(
            row([r["arm"], machine, threads, steps, f"{r['s_per_step']:.3f}", generate, f"{r['train_step_s']:.3f}",
                 f"{r['wall_s']:.0f}", accuracy])
        )  # fmt: skip
    lines += ["", row(["arm", "quiet s/step", "loaded s/step", "loaded / quiet"]), rule("lrrr")]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pair = {r.get("machine", "loaded" if r["loaded"] else "quiet"): r for r in rows if r["arm"] == arm}
        if "quiet" in pair and "loaded" in pair:
            q, b = pair["quiet"]["s_per_step"], pair["loaded"]["s_per_step"]
            lines.append(row([arm, f"{q:.3f}", f"{b:.3f}", f"{b / q:.2f}x"]))
    lines += [f"{r['name']}: {r['notice']}" for r in rows if r.get("notice")]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setting", choices=["demo", "real"], default="demo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--machines", nargs="+", choices=["quiet", "loaded", "midrun"], default=["quiet", "loaded"])
    p.add_argument("--limit", type=float, default=None, help="seconds after which a run is stopped")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/load"))
    p.add_argument("--fresh", action="store_true", help="forget earlier results in --out")
    a = p.parse_args()
    environment = print_machine()
    a.out.mkdir(parents=True, exist_ok=True)
    results_path = a.out / "busy_core.json"
    done = [] if a.fresh or not results_path.is_file() else json.loads(results_path.read_text())["runs"]
    for arm in a.arms:
        for machine in a.machines:
            if any(r["name"] == run_name(a.setting, a.steps, arm, machine) for r in done):
                continue
            result = run(a.out, a.setting, arm, machine, a.steps, a.limit)
            done.append(result)
            results_path.write_text(json.dumps({"environment": environment, "runs": done}, indent=2) + "\n")
            print(f"{result['name']}: {result['threads']} thread(s), {result['s_per_step']:.3f} s/step")
    print(table([r for r in done if r["name"].startswith(f"{a.setting}{a.steps}-")]))


if __name__ == "__main__":
    main()

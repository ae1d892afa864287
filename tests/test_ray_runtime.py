"""The asynchronous Ray runtime: versions and lags, a searcher on another node, failure handling."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import ray
import torch
from tests.conftest import SMALL_DEMO_ARGS, stored_rollouts
from tests.helpers.processes import session_processes, wait_until

from tba.checkpoint import latest_checkpoint
from tba.config import load_config
from tba.errors import ModelLoadError
from tba.metrics import read_metrics
from tba.plan import Plan
from tba.runtime.async_loop import run_ray

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

SMALL = ["--runtime.type=ray", *SMALL_DEMO_ARGS, "--logging.progress=false"]


def test_async_run_tags_versions_and_bounds_lag(tmp_path, demo_cache, local_ray):
    k, steps = 4, 40
    cfg = load_config(
        None,
        [
            *SMALL,
            f"--trainer.steps={steps}",
            f"--trainer.sync_interval={k}",
            f"--runtime.max_lag={k}",
            "--runtime.max_ahead=1",  # searchers pause once a step's worth waits: no deadlock with the lag bound
            "--eval.every=40",
            f"--model.cache_dir={demo_cache}",
            f"--run.output_dir={tmp_path}",
            "--run.name=a",
        ],
    )
    run_dir, summary = run_ray(
        cfg
    )  # (joins the tests' instance; a run's own goes with it: test_a_killed_searcher_comes_back_and_sigterm...)
    assert summary["trainer_steps"] == steps and summary["runtime"] == "ray"
    assert 0 < summary["trainer_busy_fraction"] <= 1 and summary["lag_mean"] is not None
    # where the time before the first step went, in order, the searcher's side from its own clock
    startup = summary["startup_s"]
    assert list(startup) == [
        "checks and run directory",
        "Ray",
        "starting searchers",
        "trainer's model",
        "first publication",
        "evaluation at step 0",
        "waiting for the first batch",
        "first step",
        "searcher: process and imports",
        "searcher: models",
        "searcher: first batch",
    ]
    driver = sum(v for k, v in startup.items() if not k.startswith("searcher: "))
    assert startup["trainer's model"] > 0 and startup["searcher: models"] > 0  # each loads a model
    assert driver <= summary["wall_clock_s"] + 0.1  # the phases are consecutive spans of the run (0.1: rounding)

    plan = Plan.load(run_dir)  # decided once, before anything loaded; the EOS ids once the tokenizer had
    assert (plan.runtime, plan.lag_bound, plan.transport) == ("ray", k, "object_store") and plan.eos_ids

    rollouts = stored_rollouts(run_dir, steps)
    assert rollouts
    for r in rollouts:
        version, arrival = r.policy_version, r.arrival_step
        assert version % k == 0, "searchers only ever hold published versions"
        assert version <= arrival <= steps
        assert arrival - version <= k, (arrival, version)  # runtime.max_lag, whatever the machine's load
        # TB with the sequence band needs the sampler's per-token log-probs: the searcher sent them
        assert r.sampler_token_logps is not None and len(r.sampler_token_logps) == len(r.completion)
    assert max(r.policy_version for r in rollouts) > 0  # searchers did pick up new weights

    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("train/loss") is not None]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    for key in (
        "train/lag_mean",
        "train/lag_max",
        "trainer/busy_fraction",
        "trainer/samples_per_s",
        "searcher/completions_per_s",
        "searcher/tokens_per_s",
        "buffer/size",
        "buffer/arrival_lag_max",
    ):
        assert all(r.get(key) is not None for r in train[5:]), key
    assert any("train/publish_s" in r for r in train)
    assert all(r["searcher/paused_s"] >= 0 for r in train[5:]) and plan.max_ahead == 1
    # the lag bound made the trainer wait for searchers to take new weights: the step to version 40
    # was taken once they had generated with version 36
    assert train[-1]["searcher/version_min"] >= steps - k
    assert all(r["train/lag_max"] >= r["train/lag_mean"] >= 0 for r in train)
    # the staleness of newly arrived data as trained, whatever the machine's load: within the bound
    assert all(0 <= r["train/lag_fresh"] <= k for r in train if "train/lag_fresh" in r)
    assert all(r["buffer/arrival_lag_max"] <= k for r in train if "buffer/arrival_lag_max" in r)


def test_searcher_on_another_node_contributes(tmp_path, demo_cache):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        worker = cluster.add_node(num_cpus=1, resources={"searcher_node": 1})
        cluster.wait_for_nodes()
        cfg = load_config(
            None,
            [
                *SMALL,
                "--trainer.steps=10",
                "--eval.every=10",
                f"--runtime.address={cluster.address}",
                "--runtime.searcher_resources={searcher_node: 1}",
                "--runtime.trainer_cpus=1",
                "--runtime.weight_transport=broadcast",  # what a searcher on another machine would use
                f"--model.cache_dir={demo_cache}",
                f"--run.output_dir={tmp_path}",
                "--run.name=c",
            ],
        )
        run_dir, summary = run_ray(cfg)
        assert summary["searcher_nodes"] == [worker.node_id]
        rollouts = stored_rollouts(run_dir, 10)
        assert rollouts, "the remote searcher's groups reached the buffer"
        assert Plan.load(run_dir).transport == "broadcast"
        train = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("train/loss") is not None]
        last = train[-1]  # the group formed once the searcher had registered, and carried what followed
        assert last["weights/broadcast_group"] == 1 and last["weights/fallbacks"] == 0
        # versions 1-10 publish after the steps; the metrics of step 10 are written before its own lands
        assert 1 <= last["weights/broadcasts"] <= 9
        # the searcher's receiver staged broadcasts (its counters reach the run's metrics), and lost none
        assert last["weights/received"] >= 1 and last["weights/receive_failures"] == 0
        assert max(r.policy_version for r in rollouts) > 0  # the searcher generated with broadcast weights
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


NEEDS_PROC = pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds Ray's processes through /proc")


def ray_processes(mark: str, wait_s: float = 15.0) -> list[str]:
    """Live Ray processes (raylet, GCS server, workers) that a test's ``tba train`` started: those
    whose environment carries ``TBA_TEST_MARK=mark``, which Ray passes on to every process it
    starts. Other Ray jobs on the machine don't count, nor exited processes awaiting their
    parent's reaping. Gives a just-finished shutdown up to ``wait_s`` seconds."""
    deadline = time.time() + wait_s
    tag = f"TBA_TEST_MARK={mark}".encode()
    while True:
        live = []
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                if tag not in (proc / "environ").read_bytes().split(b"\0"):
                    continue
                args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone meanwhile, or another user's
                continue
            if state != "Z" and any(name in args for name in ("raylet", "gcs_server", "ray::")):
                live.append(f"{proc.name} {args.strip()}")
        if not live or time.time() > deadline:
            return live
        time.sleep(0.5)


def marked_env() -> tuple[dict[str, str], str]:
    """The environment for a test's ``tba train`` child, with a mark ``ray_processes`` finds."""
    mark = uuid.uuid4().hex
    return {**os.environ, "TERM": "dumb", "TBA_TEST_MARK": mark}, mark


@NEEDS_PROC
def test_a_searcher_that_cannot_load_its_model_ends_the_run_in_one_line(tmp_path, demo_cache, local_ray, capsys):
    """``tba train`` (in this process, on the shared Ray instance): exit status 2, one line that
    names the model, no run directory, and the searcher's resources handed back to Ray."""
    from tba.cli import main

    # a reference whose config passes the driver's checks but whose weights only a searcher loads
    broken = tmp_path / "broken-reference"
    shutil.copytree(next(demo_cache.glob("tiny-arithmetic-*")), broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    args = [*SMALL, "--trainer.steps=20", f"--model.cache_dir={demo_cache}", f"--model.reference={broken}"]
    assert main(["train", *args, f"--run.output_dir={tmp_path}", "--run.name=f"]) == 2  # bad input
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("tba: ")]
    assert line.startswith("tba: searcher 0 could not start: cannot load model") and str(broken) in line
    assert "Traceback" not in err.split(line)[-1]
    assert not (tmp_path / "f").exists()  # nothing but the starting weights' evaluation was written
    deadline = time.time() + 30  # the failed searcher's actor is gone: its CPU is Ray's again
    while ray.available_resources().get("CPU") != ray.cluster_resources()["CPU"] and time.time() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]


def test_any_other_failure_of_a_searcher_at_start_ends_the_run_with_its_traceback():
    from ray.exceptions import RayActorError, RayTaskError

    from tba.runtime.errors import CouldNotStart, SearcherFailed
    from tba.runtime.restarts import SearcherPool

    pool = SearcherPool([], max_restarts=3, window_s=600, log=print)
    text = 'Traceback (most recent call last):\n  File "distributed.py", line 9\nZeroDivisionError: division by zero'
    with pytest.raises(SearcherFailed, match=r"(?s)searcher 0, while starting.*ZeroDivisionError: division by zero"):
        pool._died(0, RayActorError(error_msg=text, actor_init_failed=True))
    # bad input met while starting comes back from the searcher's first call as an exception of its
    # type, as Ray hands a task's exception over (nothing reads the traceback's text); a searcher's
    # own exception keeps its traceback
    user = ModelLoadError("cannot load model /m: bad header; check the folder")
    err = RayTaskError("SearcherWorker.run", "Traceback ...", CouldNotStart(user)).as_instanceof_cause()
    with pytest.raises(ModelLoadError, match=r"^searcher 0 could not start: cannot load model /m: bad header"):
        pool._raised(0, err)
    other = RayTaskError("SearcherWorker.run", "Traceback ...\nKeyError: 'x'", KeyError("x")).as_instanceof_cause()
    with pytest.raises(SearcherFailed, match=r"(?s)searcher 0\); the run stops.*KeyError"):
        pool._raised(0, other)


@NEEDS_PROC
def test_a_killed_searcher_comes_back_and_sigterm_then_stops_the_run_keeping_its_files(tmp_path, demo_cache):
    """One ``tba train`` run, two failures. A streaming searcher SIGKILLed after step 2, with prompts
    in flight: Ray starts a new process, which goes on from the dead one's place and takes new
    weights into its streams, while the trainer waits for data (counted as waiting, not as a
    pause) and loses no step. The replay bound (trainer.max_replay_ratio=1) keeps the trainer from
    training on without it: each step needs a batch of its own. Then SIGTERM, what a scheduler
    (Slurm, Kubernetes) sends: the run unwinds, exits 143, keeps its files and leaves no Ray
    process. (Ctrl-C takes the same way out: the sync runtime's test in test_cli_integration.py;
    a SIGKILL of ``tba train`` itself, whose Ray processes the watchdog stops, is
    tests/test_prompt_accounting.py's.)"""
    env, mark = marked_env()
    run_dir = tmp_path / "i"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tba", "train", *SMALL,
            "--trainer.steps=100000", "--eval.every=100000", "--trainer.max_replay_ratio=1",
            "--trainer.checkpoint_every=2",
            "--generation.stream=true",
            f"--model.cache_dir={demo_cache}", f"--run.output_dir={tmp_path}", "--run.name=i",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own session and process group: its processes are findable
    )  # fmt: skip
    metrics, errors = run_dir / "metrics.jsonl", run_dir / "errors.log"
    steps = lambda: sum(1 for r in read_metrics(metrics) if "train/loss" in r) if metrics.is_file() else 0  # noqa: E731
    searchers = lambda: {p for p, cmd in session_processes(proc.pid).items() if cmd.startswith("ray::SearcherWorker")}  # noqa: E731
    try:
        wait_until(proc, lambda: steps() >= 2, timeout=150, poll=0.2)
        (victim,) = searchers()
        os.kill(victim, signal.SIGKILL)
        wait_until(proc, lambda: errors.is_file() and "is back after" in errors.read_text(), timeout=150, poll=0.2)
        back = steps()
        wait_until(proc, lambda: steps() >= back + 3, timeout=150, poll=0.2)  # trained on the new process's batches
        successors = searchers() - {victim}
        running = ray_processes(mark, wait_s=0)  # what must be gone once it stops
        assert any("raylet" in p for p in running) and any("ray::SearcherWorker" in p for p in running), running
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)  # promptly
    finally:
        if proc.poll() is None:  # a failed test must not leave a run training in the background
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    assert "terminated (SIGTERM); what was written to the run directory is kept" in stderr
    assert "thread(s), jemalloc" in stderr  # the ray driver re-executed itself under jemalloc
    # the searchers find the board and inbox by name: no warning that their restart might fail
    assert "constructor arguments in the object store" not in stderr
    assert not ray_processes(mark), ray_processes(mark, wait_s=0)

    assert successors, "no searcher process replaced the killed one"
    assert "searcher 0 died" in stderr and "restarting it" in stderr
    assert "searcher 0 died" in errors.read_text()
    train = [r for r in read_metrics(metrics) if "train/loss" in r]
    last = train[-1]
    assert [r["step"] for r in train] == list(range(1, last["step"] + 1))  # no step lost
    assert last["searcher/restarts"] == 1 and train[0]["searcher/restarts"] == 0
    rollouts = stored_rollouts(run_dir, int(latest_checkpoint(run_dir).name.split("_")[1]))
    assert max(r.policy_version for r in rollouts) > 0  # the streams took new weights in flight
    # the lag bound (4 x trainer.sync_interval), counted from the oldest version of a completion
    assert all(r.arrival_step - r.policy_version <= 4 for r in rollouts)
    # every prompt taken: sent, dropped, in flight at the end, or lost with the killed process
    assert last["searcher/lost_in_flight"] > 0
    assert last["searcher/prompts_taken"] == (
        last["searcher/groups_sent"] + last["searcher/dropped_groups"] + last["searcher/in_flight"]
        + last["searcher/lost_in_flight"]
    )  # fmt: skip
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(train, train[1:], strict=False)]
    longest = last["trainer/longest_pause_s"]
    came_back = [line for line in stderr.splitlines() if "is back after" in line]
    print(
        f"\nsearcher restart: longest trainer pause {longest:.3f} s (widest gap between logged steps "
        f"{max(gaps):.3f} s, after step {gaps.index(max(gaps)) + 1} of {len(train)}); {came_back[0].strip()}"
    )
    # the trainer waited for data while its only searcher restarted: counted as waiting, not as a pause
    assert longest < 5.0, "a pause of the trainer beyond its wait for data"
    assert last["trainer/wait_total_s"] > 0


def test_a_local_ray_instance_gets_every_gpu_but_the_trainers():
    from tba.runtime.cluster import searcher_gpu_ids

    cuda, cuda2 = torch.device("cuda"), torch.device("cuda:2")
    assert searcher_gpu_ids(cuda, None, 4) == "1,2,3"
    assert searcher_gpu_ids(cuda2, None, 4) == "0,1,3"
    assert searcher_gpu_ids(cuda, "4,5,6,7", 4) == "5,6,7"  # indices count within the visible list
    assert searcher_gpu_ids(cuda2, "4, 5,6,7", 4) == "4,5,7"
    assert searcher_gpu_ids(cuda, None, 1) is None  # one GPU: trainer and searchers share it
    assert searcher_gpu_ids(torch.device("cpu"), None, 4) is None  # a CPU trainer takes no GPU from Ray

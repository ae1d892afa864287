"""Faults at scale, every prompt accounted for: bench_scale.py's stand-in searchers (the real ray
runtime, the model work replaced by waits), a quarter of them killed at random moments, then
``tba``'s trainer process (SIGKILL), then the run resumed to its end.

    .venv/bin/python benchmarks/bench_scale_faults.py                  # 32 searchers (~5 minutes)
    .venv/bin/python benchmarks/bench_scale_faults.py --searchers 4    # a quick look

The run is a process of its own (this script with ``--child``), so that it can be killed outright.
Each searcher numbers its draws and reports its place with every batch; the trainer's ledger
(``summary.json``, ``prompts``) must find every draw of every searcher delivered once, none twice,
none missing. Printed and written to ``--out``/faults.json: the searchers killed and how soon
each was back, the trainer's checkpoint and how much the killed trainer had taken in after it
(drawn again after the resume), the ledger's totals, and the resume's seconds to its first step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from harness import print_machine
from harness.standins import StandInUpdates, payload_of, stand_in_searcher
from tests.helpers.faults import drawn_at, frozen_after_new_groups, steps_done
from tests.helpers.processes import session_processes

from tba.checkpoint import latest_checkpoint
from tba.config import load_config


def child_config(a: argparse.Namespace, resume: bool):
    return load_config(
        None,
        [
            "--runtime.type=ray",
            f"--runtime.num_searchers={a.searchers}",
            f"--runtime.searcher_cpus={min(1.0, 1.0 / a.searchers)}",  # Ray's bookkeeping: they cost no CPU
            "--runtime.max_searcher_restarts=3",
            f"--trainer.steps={a.steps}",
            "--trainer.sync_interval=8",
            "--trainer.max_replay_ratio=1",
            "--runtime.max_lag=null",
            f"--trainer.checkpoint_every={a.checkpoint_every}",
            f"--eval.every={a.steps * 10}",
            "--eval.limit=4",
            "--logging.progress=false",
            f"--run.output_dir={a.out / 'runs'}",
            "--run.name=faults",
            "--run.seed=0",
            f"--run.resume={'true' if resume else 'false'}",
            "--generation.prompts_per_batch=8",
            "--trainer.batch_prompts=8",
        ],
    )


def child(a: argparse.Namespace) -> None:
    """The run itself (in the process the parent kills): stand-ins as in bench_scale.py."""
    import tba.runtime.async_loop as async_loop

    payload, real_build = payload_of(a.payload_params), async_loop.build_components

    def build(*args, **kwargs):
        c = real_build(*args, **kwargs)
        c.trainer.updates = StandInUpdates(c.trainer.updates, a.step_s, payload)
        return c

    async_loop.build_components = build
    async_loop.SearcherWorker = stand_in_searcher(a.batch_s, 256, a.load_s)
    async_loop.run_ray(child_config(a, a.resume))


def start(a: argparse.Namespace, resume: bool) -> subprocess.Popen:
    args = [sys.executable, __file__, "--child", f"--searchers={a.searchers}", f"--steps={a.steps}"]
    args += [f"--checkpoint-every={a.checkpoint_every}", f"--out={a.out}", f"--payload-params={a.payload_params}"]
    args += [f"--step-s={a.step_s}", f"--batch-s={a.batch_s}", f"--load-s={a.load_s}"]
    log = open(a.out / ("resume.log" if resume else "run.log"), "w")  # noqa: SIM115 (the child's, kept open)
    return subprocess.Popen([*args, *(["--resume"] if resume else [])], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def stand_ins(sid: int) -> list[int]:
    """The stand-in searcher processes of the run in session ``sid``."""
    return sorted(pid for pid, cmd in session_processes(sid).items() if cmd.startswith("ray::StandInSearcher"))


def wait(proc: subprocess.Popen, done, timeout: float = 900) -> None:
    deadline = time.time() + timeout
    while not done():
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"the run ended or stalled (exit {proc.poll()}); see {proc.args}")
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--searchers", type=int, default=32)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--step-s", type=float, default=0.125)
    p.add_argument("--batch-s", type=float, default=4.0)
    p.add_argument("--load-s", type=float, default=0.2)
    p.add_argument("--payload-params", type=int, default=50_000_000, help="parameters per publication (bf16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scale"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a)
    environment = print_machine()
    a.out.mkdir(parents=True, exist_ok=True)
    run_dir, chance = a.out / "runs" / "faults", random.Random(a.seed)
    shutil.rmtree(run_dir, ignore_errors=True)  # (an earlier run)
    proc = start(a, resume=False)
    wait(proc, lambda: steps_done(run_dir) >= 20 and len(stand_ins(proc.pid)) == a.searchers)
    victims = chance.sample(stand_ins(proc.pid), a.searchers // 4)
    kill_times = []
    for pid in victims:  # at random moments over about a searcher's two batches
        time.sleep(chance.uniform(0, 2 * a.batch_s / len(victims)))
        os.kill(pid, signal.SIGKILL)
        kill_times.append(steps_done(run_dir))
        print(f"killed searcher process {pid} at step {kill_times[-1]}", flush=True)
    errors = run_dir / "errors.log"
    wait(proc, lambda: errors.is_file() and errors.read_text().count("is back after") >= len(victims))
    lines = [line for line in errors.read_text().splitlines() if "is back after" in line]
    back = [line.split("is back after")[1].split(" s")[0].strip() for line in lines]
    after = (steps_done(run_dir) // a.checkpoint_every + 1) * a.checkpoint_every
    wait(proc, lambda: (run_dir / "checkpoints" / f"step_{after}").is_dir())

    wait(proc, lambda: frozen_after_new_groups(proc.pid, run_dir))
    checkpoint = int(latest_checkpoint(run_dir).name.split("_")[1])
    drawn_when_killed, drawn_at_checkpoint = drawn_at(run_dir, None), drawn_at(run_dir, checkpoint)
    killed_step = steps_done(run_dir)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    print(f"killed the trainer at step {killed_step} (checkpoint {checkpoint}); resuming", flush=True)
    time.sleep(3)  # the watchdog stops the killed run's Ray processes
    resumed = start(a, resume=True)
    if resumed.wait() != 0:
        raise SystemExit(f"the resumed run failed: see {a.out / 'resume.log'}")
    said = (a.out / "resume.log").read_text().split("start-up: first step ", 1)[1]
    first_step_s = float(said.split(" s after the start")[0])  # (the run's own start-up line)
    ledger = json.loads((run_dir / "summary.json").read_text())["prompts"]
    keys = ("drawn", "delivered", "dropped", "twice", "unaccounted")
    total = {k: sum(acc[k] for acc in ledger.values()) for k in keys}
    gaps = {s: acc["gaps"] for s, acc in ledger.items() if acc["gaps"]}
    result = {
        "environment": environment,
        "settings": {k: str(v) for k, v in vars(a).items() if k not in ("child", "resume")},
        "searchers_killed": len(victims),
        "killed_at_steps": kill_times,
        "back_after_s": [float(b) for b in back],
        "trainer_killed_at_step": killed_step,
        "resumed_from_checkpoint": checkpoint,
        "drawn_again_after_resume": drawn_when_killed - drawn_at_checkpoint,
        "resume_to_first_step_s": round(first_step_s, 1),
        "ledger": total,
        "searchers_with_gaps": gaps,
        "exact": total["twice"] == 0 and total["unaccounted"] == 0 and not gaps
        and total["delivered"] + total["dropped"] == total["drawn"],
    }  # fmt: skip
    (a.out / ("faults.json" if a.searchers == 32 else f"faults-{a.searchers}.json")).write_text(
        json.dumps(result, indent=2) + "\n"
    )
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))


if __name__ == "__main__":
    sys.exit(main())

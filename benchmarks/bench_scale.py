"""The ray runtime at many searchers: the real runtime with the model work replaced by waits.

    .venv/bin/python benchmarks/bench_scale.py             # 1, 2, 4, 8, 16, 32 and 64 searchers
    .venv/bin/python benchmarks/bench_scale.py --quick     # 1, 4 and 8 searchers: about 3 minutes
    .venv/bin/python benchmarks/bench_scale.py --searchers 32 --payload-params 0
    .venv/bin/python benchmarks/bench_scale.py --searchers 64 --plays 8    # 64 searchers from 8 processes

Each count is one ``run_ray`` in this process on a local Ray instance of its own: real searcher
actors (one process each), the weight board and the object store, the inbox, the replay buffer and
its bounds, the trainer loop, its publications (staged and put, as a real trainer's) and each
searcher's fetch of them. What is not run is the model:

- a searcher (:func:`stand_in_searcher`) waits ``--batch-s`` seconds per batch, then sends
  ``prompts_per_batch`` groups of ``group_size`` completions of ``--tokens`` tokens each, and waits
  ``--load-s`` when it takes new weights (a fetch from the object store, then the time an engine
  would take to load them);
- the trainer's update (:class:`StandInUpdates`) waits ``--step-s`` seconds; a publication is a state
  dict of ``--payload-params`` bf16 parameters (0.5B: 1 GB), staged and put like the policy's.

The ideal rate is min(1 / step_s, N x (prompts_per_batch / batch_prompts) / (batch_s + load_s))
steps a second (the load counted for the batches that start with new weights): the trainer alone,
or N searchers' data trained once each (``trainer.max_replay_ratio=1``). The staleness bound is off
(``runtime.max_lag=null``, ``--max-lag`` sets one): a batch of 4 s is 32 steps of a trainer at 8 steps
a second, more than the default bound of 4 x sync_interval, which then holds the trainer back by
design, not by overhead.
Printed per count: steps a second against the ideal (the efficiency), the trainer process's CPU
per ingested completion, the lag of trained data, the resident memory of one searcher process, the
trainer's busy fraction and wait. Results go to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

from harness import print_machine
from harness.report import row, rule
from harness.standins import StandInUpdates, payload_of, stand_in_searcher

import tba.runtime.async_loop as async_loop
from tba.config import load_config
from tba.machine import busy_between
from tba.metrics import read_metrics

COUNTS = (1, 2, 4, 8, 16, 32, 64)
QUICK = (1, 4, 8)


class Sampler(threading.Thread):
    """Reads the memory of the stand-in searchers' processes every second and keeps each one's
    largest: resident (``rss``, shared libraries counted in every process) and private (``uss``:
    what one more searcher adds), in MB, from ``/proc/<pid>/smaps_rollup``."""

    def __init__(self):
        super().__init__(daemon=True)
        self.rss_mb: dict[int, float] = {}
        self.uss_mb: dict[int, float] = {}
        self.cpu: list[tuple[float, float]] = []  # (time, this process's CPU seconds) each second
        self.machine: list[tuple[float, str]] = []  # (time, /proc/stat)
        self.stop = threading.Event()

    def cpu_between(self, start: float, end: float) -> float:
        """This process's CPU seconds between two times (read at the samples nearest them), less
        this thread's own (reading ``/proc`` is not the trainer's work)."""
        near = lambda t: min(self.cpu, key=lambda s: abs(s[0] - t))[1]  # noqa: E731
        return near(end) - near(start)

    def machine_between(self, start: float, end: float) -> float:
        """The machine's busy cores' worth (every process) between two times."""
        near = lambda t: min(self.machine, key=lambda s: abs(s[0] - t))[1]  # noqa: E731
        return busy_between(near(start), near(end), set(range(os.cpu_count() or 1)))

    def run(self) -> None:
        reads = 0
        while not self.stop.wait(1.0):
            usage = resource.getrusage(resource.RUSAGE_SELF)
            self.cpu.append((time.time(), usage.ru_utime + usage.ru_stime - time.thread_time()))
            self.machine.append((time.time(), Path("/proc/stat").read_text()))
            reads += 1
            if reads % 5 == 0:  # the memory every 5 seconds: smaps_rollup walks each process's pages
                self.read_memory()

    def read_memory(self) -> None:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if not (entry / "cmdline").read_bytes().startswith(b"ray::StandInSearcher"):
                    continue
                fields = dict(line.split(":", 1) for line in (entry / "smaps_rollup").read_text().splitlines()[1:])
            except (OSError, ValueError):
                continue
            kb = {k: int(v.split()[0]) for k, v in fields.items()}
            pid = int(entry.name)
            self.rss_mb[pid] = max(self.rss_mb.get(pid, 0.0), kb.get("Rss", 0) / 1024)
            uss = (kb.get("Private_Clean", 0) + kb.get("Private_Dirty", 0)) / 1024
            self.uss_mb[pid] = max(self.uss_mb.get(pid, 0.0), uss)


def ideal_rate(n: int, a: argparse.Namespace) -> float:
    """Steps a second with no overhead: the trainer's own rate, or what ``n`` searchers deliver
    (each batch ``batch_s``, plus ``load_s`` for the batches that start with new weights: every one
    once publications come faster than batches), trained once each."""
    per_step, rate = a.prompts_per_batch / a.batch_prompts, 1.0 / a.step_s
    for _ in range(50):  # the load's share depends on the rate: a fixed point
        loads = min(1.0, a.batch_s * rate / a.sync_interval)
        rate = min(1.0 / a.step_s, n * per_step / (a.batch_s + a.load_s * loads))
    return rate


def run_count(n: int, a: argparse.Namespace, out: Path) -> dict:
    if n % a.plays:
        raise SystemExit(f"--plays {a.plays} must divide every count of searchers ({n} does not)")
    actors = n // a.plays  # processes, each playing a.plays searchers
    name = f"searchers{n}" + (f"-in{actors}" if a.plays > 1 else "")
    # the replay window the plan gives n searchers (tba.plan.auto.replay_window), not n / plays
    window = max(16, math.ceil(2 * n * a.prompts_per_batch / a.batch_prompts))
    ideal = ideal_rate(n, a)
    # long enough for the measured steps (all but the first fifth) to span several batches of each searcher
    least = 10 if a.quick else 16
    steps = a.steps or max(least, round(ideal * max(a.seconds, least / 2 * a.batch_s) * 1.25))
    shutil.rmtree(out / name, ignore_errors=True)  # (an earlier run of this count)
    cfg = load_config(
        None,
        [
            "--runtime.type=ray",
            f"--runtime.num_searchers={actors}",
            f"--runtime.searcher_cpus={min(1.0, 1.0 / actors)}",  # Ray's bookkeeping: they cost no CPU
            "--runtime.max_searcher_restarts=0",
            f"--trainer.steps={steps}",
            f"--trainer.sync_interval={a.sync_interval}",
            "--trainer.max_replay_ratio=1",
            f"--runtime.max_lag={a.max_lag if a.max_lag is not None else 'null'}",
            "--trainer.checkpoint_every=null",
            f"--eval.every={steps * 10}",
            "--eval.limit=4",
            "--logging.progress=false",
            "--logging.quiet=true",
            f"--run.output_dir={out}",
            f"--run.name={name}",
            "--run.seed=0",
            f"--generation.prompts_per_batch={a.prompts_per_batch}",
            f"--trainer.batch_prompts={a.batch_prompts}",
            *([f"--trainer.replay_window={window}"] if a.plays > 1 else []),
            *a.overrides,
        ],
    )
    payload = payload_of(a.payload_params)
    real_build = async_loop.build_components

    def build(*args, **kwargs):
        c = real_build(*args, **kwargs)
        c.trainer.updates = StandInUpdates(c.trainer.updates, a.step_s, payload)
        return c

    async_loop.build_components = build
    async_loop.SearcherWorker = stand_in_searcher(a.batch_s, a.tokens, a.load_s, a.plays)
    sampler = Sampler()
    sampler.start()
    t0 = time.time()
    try:
        run_dir, summary = async_loop.run_ray(cfg)
    finally:
        sampler.stop.set()
        async_loop.build_components = real_build
    wall = time.time() - t0
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    warm = records[len(records) // 5 :]  # the first fifth: searchers still arriving
    steps_per_s = (len(warm) - 1) / (warm[-1]["time_s"] - warm[0]["time_s"])
    # the trainer process's CPU over the measured steps, per completion they trained (one each: the
    # replay bound of 1) and per completion delivered meanwhile
    cpu_s = sampler.cpu_between(t0 + warm[0]["time_s"], t0 + warm[-1]["time_s"])  # (time_s: from about t0)
    trained = (len(warm) - 1) * cfg.trainer.batch_prompts * cfg.generation.group_size
    rss, uss = list(sampler.rss_mb.values()), list(sampler.uss_mb.values())
    return {
        "searchers": n,
        "processes": actors,
        "steps": len(records),
        "steps_per_s": round(steps_per_s, 4),
        "ideal_steps_per_s": round(ideal, 4),
        "efficiency": round(steps_per_s / ideal, 4),
        "lag_mean": round(statistics.mean(r["train/lag_mean"] for r in warm), 3),
        "lag_max": max(r["train/lag_max"] for r in warm),
        "rss_mb_per_searcher": round(statistics.median(rss), 1) if rss else None,
        "uss_mb_per_searcher": round(statistics.median(uss), 1) if uss else None,
        "trainer_cpu_ms_per_completion": round(1000 * cpu_s / max(trained, 1), 3),
        "trainer_cpu_fraction": round(cpu_s / (warm[-1]["time_s"] - warm[0]["time_s"]), 3),
        "machine_busy_cores": round(sampler.machine_between(t0 + warm[0]["time_s"], t0 + warm[-1]["time_s"]), 2),
        "trainer_busy_fraction": summary.get("trainer_busy_fraction"),
        "trainer_wait_s": summary.get("trainer_wait_s"),
        "wall_s": round(wall, 1),
        "startup_s": summary.get("startup_s"),
    }


def table(rows: list[dict]) -> str:
    head = ["searchers", "steps/s", "ideal", "efficiency", "lag mean / max", "trainer CPU ms per completion"]
    lines = [row([*head, "searcher RSS / private MB", "trainer busy"]), rule("rrrrrrrr")]
    for r in rows:
        lines.append(
            row([r["searchers"], f"{r['steps_per_s']:.3f}", f"{r['ideal_steps_per_s']:.3f}", f"{r['efficiency']:.2f}",
                 f"{r['lag_mean']:.2f} / {r['lag_max']:.0f}", f"{r['trainer_cpu_ms_per_completion']:.2f}",
                 f"{r['rss_mb_per_searcher']} / {r['uss_mb_per_searcher']}", r["trainer_busy_fraction"]])
        )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=f"only {QUICK} searchers")
    p.add_argument("--searchers", type=int, nargs="+", default=None)
    p.add_argument("--steps", type=int, default=None, help="trainer steps per count (default: --seconds' worth)")
    p.add_argument("--seconds", type=float, default=40.0, help="training seconds per count at the ideal rate")
    p.add_argument("--prompts-per-batch", type=int, default=8, help="a searcher's prompts per batch")
    p.add_argument("--batch-prompts", type=int, default=8, help="the trainer's prompts per step")
    p.add_argument("--step-s", type=float, default=0.125, help="the trainer's update, seconds")
    p.add_argument("--batch-s", type=float, default=4.0, help="a searcher's batch, seconds")
    p.add_argument("--load-s", type=float, default=0.2, help="a searcher's load of new weights, seconds")
    p.add_argument("--tokens", type=int, default=256, help="tokens per completion")
    p.add_argument("--payload-params", type=int, default=500_000_000, help="parameters per publication (bf16)")
    p.add_argument("--sync-interval", type=int, default=8, help="trainer.sync_interval")
    p.add_argument("--max-lag", type=int, default=None, help="runtime.max_lag (default: no bound)")
    p.add_argument("--plays", type=int, default=1, help="searchers a process plays (as many from fewer processes)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scale"))
    p.add_argument("overrides", nargs="*", help="more tba train overrides (--section.key=value)")
    a = p.parse_args()
    counts = a.searchers or (QUICK if a.quick else COUNTS)
    if a.quick and a.seconds == p.get_default("seconds"):
        a.seconds = 16.0
    environment = print_machine()
    a.out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(a).items() if k not in ("out", "searchers")}
    rows = []
    for n in counts:
        row = run_count(n, a, a.out / "runs")
        rows.append(row)
        print(json.dumps(row), flush=True)
        results = {"environment": environment, "settings": settings, "rows": rows}
        (a.out / ("quick.json" if a.quick else "results.json")).write_text(json.dumps(results, indent=2) + "\n")
    print(table(rows))


if __name__ == "__main__":
    sys.exit(main())

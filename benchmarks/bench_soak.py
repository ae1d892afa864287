"""Memory over a long asynchronous run: does each process's resident memory stay flat?

    .venv/bin/python benchmarks/bench_soak.py                       # 10 minutes of the async demo
    .venv/bin/python benchmarks/bench_soak.py --minutes 30 -- --runtime.num_searchers=2

Starts ``tba train`` (the built-in demo on the ray runtime, with a step count it will not reach and
``buffer.capacity`` small enough that the buffer is full after a couple of minutes), samples every
``--interval`` seconds the resident memory (RSS) of the driver and of every process it started
(Ray's raylet and GCS, the searcher, inbox and weight-board actors), and stops the run with SIGINT
after ``--minutes``. Prints one row per sample: elapsed minutes, trainer step, buffer size, and each
process's RSS in MB; then, per process, its RSS at minute ``--reference`` (3), at the end, the
largest value after the reference, and whether it stayed within ``--tolerance`` (10%) of the
reference. The reference is the first sample at or after minute ``--reference`` at which the buffer
is full (memory is meant to grow while it fills). Processes are named from their command lines
(``ray::SearcherWorker`` and so on).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import psutil
from harness import ROOT, describe_machine, metrics, print_machine, start_train, stop


def process_name(p: psutil.Process, driver: int) -> str:
    if p.pid == driver:
        return "driver (trainer)"
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return "?"
    for key in ("SearcherWorker", "Inbox", "WeightBoard", "raylet", "gcs_server", "dashboard", "log_monitor"):
        if key in cmd:
            return key
    if "ray::IDLE" in cmd or "default_worker" in cmd:
        return "ray worker (idle)"
    return cmd.split()[0].rsplit("/", 1)[-1] if cmd else p.name()


def private_mb(pid: int) -> float:
    """Anonymous resident memory (the process's own heap) in MB: RSS less file-backed and shared
    pages, such as the Ray object store's shared memory that a process maps when it puts or gets."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def sample(driver: psutil.Process) -> tuple[dict[str, float], dict[str, float]]:
    """(RSS, anonymous RSS) in MB by process name (several processes of one name are numbered)."""
    rss: dict[str, float] = {}
    anon: dict[str, float] = {}
    try:
        procs = [driver, *driver.children(recursive=True)]
    except psutil.Error:
        return rss, anon
    for p in procs:
        try:
            value = p.memory_info().rss / 2**20
        except psutil.Error:
            continue
        name = process_name(p, driver.pid)
        key, n = name, 1
        while key in rss:
            n += 1
            key = f"{name} #{n}"
        rss[key], anon[key] = value, private_mb(p.pid)
    return rss, anon


def last_record(run_dir: Path) -> dict:
    if not (run_dir / "metrics.jsonl").is_file():
        return {}
    step, size = None, None
    for r in metrics(run_dir):  # a line being written is left out
        step = r.get("step", step)
        size = r.get("buffer/size", size)
    return {"step": step, "buffer": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--interval", type=float, default=60, help="seconds between samples")
    parser.add_argument("--reference", type=float, default=3, help="minute whose RSS the rest is compared with")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--capacity", type=int, default=10_000, help="buffer.capacity of the run")
    parser.add_argument("--json", type=Path, help="also write the samples here")
    parser.add_argument("overrides", nargs="*", help="after --: overrides for the run")
    a = parser.parse_args()
    print_machine()
    out = Path(tempfile.mkdtemp(prefix="tba-soak-"))
    overrides = [
        "--trainer.steps=1000000",
        f"--buffer.capacity={a.capacity}",
        "--eval.every=500",
        "--trainer.checkpoint_every=null",
        "--logging.progress=false",
        *a.overrides,
    ]
    log = open(out / "stderr.log", "w")  # noqa: SIM115 (open for the whole run)
    proc = start_train(overrides, out, "soak", log, cwd=ROOT)
    print(" ".join(proc.args[2:]), flush=True)
    driver = psutil.Process(proc.pid)
    start = time.time()
    rows = []
    try:
        while time.time() - start < a.minutes * 60 + 1:
            time.sleep(min(a.interval, max(0.0, start + (len(rows) + 1) * a.interval - time.time())))
            if proc.poll() is not None:
                sys.exit(f"the run ended early (exit {proc.returncode}); see {out / 'stderr.log'}")
            row = {"minute": (time.time() - start) / 60, **last_record(out / "soak")}
            row["rss"], row["anon"] = sample(driver)
            rows.append(row)
            procs = ", ".join(f"{k} {v:.0f} ({row['anon'][k]:.0f})" for k, v in sorted(row["rss"].items()))
            head = f"min {row['minute']:5.1f}  step {row['step']}  buffer {row['buffer']}"
            print(f"{head}  RSS (anon) MB: {procs}", flush=True)
    finally:
        stop(proc, grace=120)
    # the reference: the first sample at or after --reference minutes with the buffer full
    full = [r for r in rows if r["minute"] >= a.reference - 0.1 and (r["buffer"] or 0) >= a.capacity]
    if not full:
        sys.exit(f"the buffer never filled ({rows[-1]['buffer']} of {a.capacity}); run longer or lower --capacity")
    ref = full[0]
    later = [r for r in rows if r["minute"] > ref["minute"]]
    print(f"\nper process: RSS at minute {ref['minute']:.1f} (buffer {ref['buffer']}) against the rest of the run")
    print("| process | RSS at reference MB | at end MB | max after reference MB | change at max | flat | anon change |")
    print("|---|---:|---:|---:|---:|---|---:|")
    flat_all = True
    for name in sorted(ref["rss"]):
        values = [r["rss"][name] for r in later if name in r["rss"]]
        if not values:
            continue
        peak = max(values)
        change = peak / ref["rss"][name] - 1
        anon_change = max(r["anon"][name] for r in later if name in r["anon"]) / ref["anon"][name] - 1
        flat = change <= a.tolerance
        flat_all &= flat
        print(
            f"| {name} | {ref['rss'][name]:.0f} | {values[-1]:.0f} | {peak:.0f} | {change:+.1%} | "
            f"{'yes' if flat else 'NO'} | {anon_change:+.1%} |"
        )
    print(f"\nall within {a.tolerance:.0%} of minute {a.reference:g}: {'yes' if flat_all else 'no'}")
    if a.json:
        a.json.write_text(json.dumps({"environment": describe_machine(), "samples": rows}, indent=2))


if __name__ == "__main__":
    main()

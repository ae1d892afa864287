"""``tba train`` in a process of its own, and what a finished run left: its ``summary.json`` and
its metrics (through :func:`tba.metrics.read_metrics`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

ENV = {"TERM": "dumb"}
"""Set for every launched command, over the caller's environment: no terminal escapes in its output."""


def tba(*args: str, cwd: Path | None = None) -> str:
    """``tba ARGS`` (``python -m tba``) in its own process; its stdout. A failure stops the
    benchmark with the command's last error."""
    proc = subprocess.run(
        [sys.executable, "-m", "tba", *args], capture_output=True, text=True, cwd=cwd, env={**os.environ, **ENV}
    )
    if proc.returncode != 0:
        raise SystemExit(f"tba {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def train_command(overrides: list[str], out: Path, name: str, config: Path | str | None = None) -> list[str]:
    """The command line of ``tba train [CONFIG] OVERRIDES`` into ``out``/``name`` (those two last:
    where the run goes is the harness's, since it reads the run from there)."""
    head = [sys.executable, "-m", "tba", "train", *([str(config)] if config else [])]
    return [*head, *overrides, f"--run.output_dir={out}", f"--run.name={name}"]


@dataclass
class TrainRun:
    """One ``tba train`` process, finished or stopped at its time limit."""

    name: str
    run_dir: Path
    command: list[str]
    returncode: int | None
    """The exit status; None where the time limit stopped it."""
    wall_s: float
    """Seconds of the whole command, start-up included."""
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def error(self, tail: int = 3000) -> str:
        """What went wrong: the end of its stderr."""
        return self.stderr[-tail:]

    def fail(self) -> NoReturn:
        raise SystemExit(f"{self.name} failed:\n{self.error()}")

    def summary(self) -> dict:
        return summary(self.run_dir)

    def metrics(self) -> list[dict]:
        return metrics(self.run_dir)

    def steps(self) -> list[dict]:
        """The records of its trainer steps (:func:`trained`)."""
        return trained(self.metrics())


def train(
    overrides: list[str],
    out: Path,
    name: str,
    *,
    config: Path | str | None = None,
    timeout: float | None = None,
    log: Path | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    clear: bool = False,
    check: bool = True,
) -> TrainRun:
    """``tba train [config] overrides`` in a process of its own, into ``out``/``name``, and wait for it.

    ``timeout``: seconds after which the process is killed (the run's ``returncode`` is then None);
    ``log``: a file that takes its stdout and then its stderr when it ends (stopped or not);
    ``cwd``: its working folder (relative paths in ``overrides`` are read from there); ``env``:
    variables over this process's environment and :data:`ENV`; ``clear``: remove an earlier attempt's
    run folder first; ``check``: a failed run (non-zero exit, or the time limit) stops the benchmark
    with its last error (SystemExit) instead of being returned."""
    run_dir = Path(out) / name
    if clear:
        shutil.rmtree(run_dir, ignore_errors=True)  # an interrupted run's leftovers
    cmd = train_command(overrides, out, name, config)
    start = time.time()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env={**os.environ, **ENV, **(env or {})}
        )
        code, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        code, stdout, stderr = None, _text(e.stdout), _text(e.stderr)
    run = TrainRun(name, run_dir, cmd, code, time.time() - start, stdout, stderr)
    if log is not None:
        Path(log).write_text(stdout + stderr)
    if check and not run.ok:
        run.fail()
    return run


def _text(output: bytes | str | None) -> str:
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def start_train(
    overrides: list[str], out: Path, name: str, log: IO, *, config: Path | str | None = None, cwd: Path | None = None
) -> subprocess.Popen:
    """``tba train`` started in a session of its own (so :func:`stop` can end it and every process it
    started), its stdout and stderr to ``log``; returns at once."""
    cmd = train_command(overrides, out, name, config)
    return subprocess.Popen(cmd, stdout=log, stderr=log, cwd=cwd, start_new_session=True, env={**os.environ, **ENV})


def stop(proc: subprocess.Popen, grace: float = 120) -> None:
    """Stop a run of :func:`start_train` as Ctrl-C does (SIGINT: it unwinds and writes its
    summary); after ``grace`` seconds, kill its whole process group."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(os.getpgid(proc.pid), signal.SIGKILL)


def summary(run_dir: Path) -> dict:
    """A finished run's ``summary.json``."""
    return json.loads((Path(run_dir) / "summary.json").read_text())


def metrics(run_dir: Path) -> list[dict]:
    """A run's records (``metrics.jsonl``, read by :func:`tba.metrics.read_metrics`); none where it
    has not written the file."""
    from tba.metrics import read_metrics  # here: a script that reads no run does not import tba.config

    path = Path(run_dir) / "metrics.jsonl"
    return read_metrics(path) if path.is_file() else []


def trained(records: list[dict]) -> list[dict]:
    """The records of trainer steps (a finite ``train/loss``)."""
    return [r for r in records if r.get("train/loss") is not None]


def outcome(summary: dict, metric: str) -> dict:
    """A run's evaluation before and after training, from its ``summary.json``."""
    first, last = summary[f"{metric}_initial"], summary[f"{metric}_final"]
    return {
        "metric": metric,
        "initial": first,
        "final": last,
        "gain": last - first,
        "below_start": last < first,
        "lag_mean": summary.get("lag_mean"),
    }


def sampled(run_dir: Path) -> dict:
    """The searchers' reward (and exact answers, where the task logs them) over the run's first and
    last ten logged steps: what sampling made of the training, beside the greedy evaluation."""
    rows = metrics(run_dir)
    found = {}
    for key, name in (("searcher/reward_mean", "sampled"), ("reward/exact_mean", "exact")):
        values = [r[key] for r in rows if key in r]
        if len(values) >= 20:
            found[f"{name}_first10"] = statistics.mean(values[:10])
            found[f"{name}_last10"] = statistics.mean(values[-10:])
    return found


def parse_with_overrides(parser) -> tuple:
    """``parser``'s arguments, and what is left: ``tba train`` overrides for every run (after ``--``)."""
    a, extra = parser.parse_known_args()
    return a, [x for x in extra if x != "--"]


def results_folder(out: Path, note: str) -> Path:
    """Make ``out`` a results folder whose run directories git ignores (``note`` says what is kept);
    returns its ``results.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text(f"# {note}\n*/\n")
    return out / "results.json"


def load_results(path: Path, fresh: bool = False) -> dict:
    """What an earlier invocation kept in ``path`` (a JSON object); nothing where there is none or
    ``fresh``."""
    return json.loads(path.read_text()) if path.is_file() and not fresh else {}

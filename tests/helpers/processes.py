"""The processes of a run started in its own session."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path


def session_processes(sid: int) -> dict[int, str]:
    """pid → command line of the live processes of session ``sid`` (a run started with start_new_session)."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            out[int(name)] = cmd
    return out


def wait_until(proc: subprocess.Popen, done, timeout: float = 180, poll: float = 0.1) -> None:
    """Until ``done()`` while ``proc`` (its stderr piped) runs; its stderr's end as the failure if
    it ends first or ``timeout`` seconds pass."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if done():
            return
        time.sleep(poll)
    timed_out = proc.poll() is None
    if timed_out:  # stopped first: its stderr ends only with it (a run with no step limit never would)
        proc.kill()
    try:
        stderr = proc.communicate(timeout=60)[1][-3000:]
    except subprocess.TimeoutExpired:  # a child that inherited the pipe still holds it
        stderr = "(still held open by a child process a minute after the run was killed)"
    where = f"in {timeout:g} s (killed)" if timed_out else f"before it ended (exit {proc.returncode})"
    raise AssertionError(f"the run did not get there {where}; stderr:\n{stderr}")

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
    raise AssertionError(f"the run did not get there; stderr:\n{proc.communicate()[1][-3000:]}")

"""The processes of a run started in its own session."""

from __future__ import annotations

import os
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

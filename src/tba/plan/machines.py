"""Machines written out for ``tba train --print-plan --hardware=SPEC``: ``8xh100``, ``2x8xh100``,
``cpu:16``, as the :class:`tba.hardware.Hardware` the plan is made for."""

from __future__ import annotations

from tba.config import ConfigError
from tba.hardware import Hardware
from tba.plan.cost import parts


def described(spec: str) -> Hardware:
    """A machine or cluster written out (``tba train --print-plan --hardware=SPEC``): ``8xh100`` (8
    H100s), ``2x8xh100`` (two nodes of 8), ``cpu`` or ``cpu:16`` (cores, no GPU); ``,cpus=N`` sets
    the cores of each machine (default: 16 a GPU). GPUs of a kind the cost model knows have bf16."""
    head, *options = spec.lower().replace(" ", "").split(",")
    fields = dict(o.split("=", 1) for o in options if "=" in o)
    unknown = set(fields) - {"cpus"} or {o for o in options if "=" not in o}
    try:
        if unknown:
            raise ValueError
        if head.startswith("cpu"):
            return Hardware(cpus=int(fields.get("cpus", head.partition(":")[2] or 2)))
        *counts, kind = head.split("x")
        nodes, gpus = ([1] + [int(c) for c in counts])[-2:] if counts else (1, 1)
        if kind not in parts()["devices"] or nodes < 1 or gpus < 1:
            raise ValueError
    except ValueError:
        kinds = ", ".join(parts()["devices"])
        raise ConfigError(
            f"--hardware={spec} is not a machine: write GPUSxKIND (8xh100), NODESxGPUSxKIND (2x8xh100) or "
            f"cpu:CORES, then ,cpus=N for the cores of each machine; GPU kinds: {kinds}"
        ) from None
    name = parts()["devices"][kind]["name"]
    return Hardware(cpus=int(fields.get("cpus", 16 * gpus)), gpus=gpus, bf16=True, gpu_name=name, nodes=nodes)

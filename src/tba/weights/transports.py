"""The registry of weight transports: from a name (``runtime.weight_transport``, the plan's
``transport``) to what the transport is, what it can serve, and its two sides. This is the one place
that knows the transports by name; the config's rules, the plan and the runtimes ask it.

Standard library only: the config's checks read it before anything heavy is imported. The sides
are named as ``module:Class`` and imported when a runtime opens them
(:func:`tba.weights.ray.channel.open_channel`)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Transport:
    name: str
    summary: str
    to_processes: bool  # carries weights to searcher processes (the ray runtime)
    serves_ranks: bool  # trainer rank 0 can publish through it (trainer.num_ranks > 1)
    same_machine: bool  # searchers must be on the trainer's machine
    same_gpu: bool  # on a GPU, searchers must share the trainer's GPU
    sender: str | None = None  # "module:Class" of each side; None: the in-process store
    receiver: str | None = None
    board: str | None = None  # the side's own Ray actor (None: the weight board alone)
    cost_parts: str = "object_store"  # its entry in the cost model's parts (tba/plan/parts.json)

    @property
    def primary(self) -> bool:
        """Whether it needs the object store as its fallback (every process transport but that one)."""
        return self.to_processes and self.name != "object_store"

    def load(self, which: str):
        """The class of ``which`` side (``sender``, ``receiver`` or ``board``)."""
        module, _, name = getattr(self, which).partition(":")
        return getattr(importlib.import_module(module), name)


TRANSPORTS: dict[str, Transport] = {
    t.name: t
    for t in (
        Transport(
            "in_process",
            "a copy in the trainer's process (the sync runtime)",
            to_processes=False,
            serves_ranks=True,
            same_machine=True,
            same_gpu=False,
            cost_parts="in_process",
        ),
        Transport(
            "object_store",
            "Ray's object store: one copy in, read in place by searchers on the trainer's node",
            to_processes=True,
            serves_ranks=True,
            same_machine=False,
            same_gpu=False,
            sender="tba.weights.ray.board:ObjectStoreSender",
            receiver="tba.weights.ray.board:ObjectStoreReceiver",
        ),
        Transport(
            "broadcast",
            "a gloo group of the trainer and the searchers, the object store until it forms",
            to_processes=True,
            serves_ranks=True,
            same_machine=False,
            same_gpu=False,
            sender="tba.weights.ray.broadcast:BroadcastSender",
            receiver="tba.weights.ray.broadcast:BroadcastReceiver",
            board="tba.weights.ray.boards:GroupBoard",
            cost_parts="object_store",  # gloo's broadcast goes through host memory too (not measured apart on a GPU)
        ),
        Transport(
            "ipc",
            "two shared slots of the trainer's memory (CUDA IPC on a GPU, shared memory on a CPU)",
            to_processes=True,
            serves_ranks=False,  # ranks hold whole GPUs of their own, searchers others: nothing to share
            same_machine=True,
            same_gpu=True,
            sender="tba.weights.ray.ipc:SharedSender",
            receiver="tba.weights.ray.ipc:SharedReceiver",
            board="tba.weights.ray.boards:SlotBoard",
            cost_parts="ipc",
        ),
    )
}


def transport(name: str) -> Transport:
    """The transport called ``name``; a clear error for any other name."""
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(f"unknown weight transport {name!r}; known: {', '.join(TRANSPORTS)}") from None


def weight_transport(setting: str, between_processes: bool) -> str:
    """The transport a run uses: ``runtime.weight_transport`` (``auto``: the object store) between
    processes, the in-process store in one."""
    if not between_processes:
        return "in_process"
    return "object_store" if setting == "auto" else transport(setting).name

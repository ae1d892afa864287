"""The contract of a weight transport: a :class:`Sender` on the trainer's side and a
:class:`Receiver` on each searcher's. Every transport (in one process, by Ray's object store, by
broadcast, through shared slots) is one pair of these, found by its name in
:mod:`tba.weights.transports`; callers use only the methods declared here.

A state dict travels as it is given: a LoRA policy's adapter tensors, or the whole model's, floating
tensors already cast to the searchers' dtype (or cast by ``prepare`` on the sender's side).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

State = dict[str, torch.Tensor]


def map_shared(state_dict: State, fn) -> State:
    """``{k: fn(v)}``, with ``fn`` called once per distinct view of memory: entries that view the same
    memory (tied weights, such as an input embedding shared with the output head) get the same
    result object. A copy made per entry would double their memory, and a pickle (``ray.put``)
    stores an object once however often a dict holds it, not two tensors that share memory."""
    done: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in state_dict.items():
        key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
        if key not in done or v.data_ptr() == 0:  # 0: no memory (empty or meta): nothing to share
            done[key] = fn(v)
        out[k] = done[key]
    return out


def to_host(state_dict: State) -> State:
    """``state_dict`` in host memory, for another process (Ray pickles a CUDA tensor as one, which a
    process without that GPU cannot load). Host tensors are not copied: what sends them to another
    process (``ray.put``, a remote call's arguments) copies them as it serializes. Tied entries
    stay one object (:func:`map_shared`), so they are copied and sent once."""
    return map_shared(state_dict, lambda v: v.detach().to("cpu"))


def own_copy(state_dict: State) -> State:
    """A copy of ``state_dict`` in memory of its own (tied entries: one copy)."""
    return map_shared(state_dict, lambda v: v.detach().clone())


def shares_memory(state_dict: State, model: torch.nn.Module) -> bool:
    """Whether any entry of ``state_dict`` lives in the memory of ``model``'s parameters or buffers
    (no cast or copy made it its own), so that an optimizer step would change it."""
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return any(v.untyped_storage().data_ptr() in live for v in state_dict.values())


class CannotCarry(Exception):
    """A transport could not carry this publication (its group is not formed or broke, a peer died,
    the state changed its layout); :class:`tba.weights.ray.fallback.FallbackSender` sends it by
    the object store instead and counts it under ``reason``. Anything else a sender raises is a
    failure of the run."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


class Sender:
    """The trainer's side of a transport. :meth:`publish` is the front door; a transport implements
    :meth:`send` (and :meth:`stage` where it keeps a buffer of its own)."""

    #: GPU tensors go to :meth:`stage` as they are (the transport keeps GPU buffers of its own: CUDA
    #: IPC); otherwise a background publisher first copies them to pinned host memory.
    keeps_device = False

    def __init__(self) -> None:
        self.visible_version = -1  # the newest version searchers can fetch

    def publish(
        self,
        state_dict: State,
        version: int,
        *,
        aliases: bool = False,
        prepare: Callable[[State], State] | None = None,
    ) -> None:
        """Publish ``state_dict`` as ``version``. ``aliases``: it shares memory with the live weights
        (a sender that returns only once the state is sent need not care); ``prepare``: a function
        applied first that returns tensors of their own (the cast to the searchers' dtype)."""
        if prepare is not None:
            state_dict = prepare(state_dict)
        self.send(state_dict, version)
        self.visible_version = max(self.visible_version, version)

    def send(self, state_dict: State, version: int) -> None:
        """Carry ``state_dict`` to the searchers as ``version`` (newer than any sent before)."""
        raise NotImplementedError

    def stage(self, state_dict: State) -> State | None:
        """Copy ``state_dict`` into memory of the transport's own and return that copy, which
        :meth:`send` then carries without another copy; None: this transport keeps no buffer, and
        :meth:`send` reads ``state_dict`` itself (the live weights stay held until it returns)."""
        return None

    def settle(self) -> float:
        """Wait until no publication reads the live weights; the seconds waited. A sender that
        returns from :meth:`publish` once the state is sent has nothing in flight."""
        return 0.0

    def flush(self) -> None:
        """Wait until every publication handed over is where searchers fetch it."""

    def published_elsewhere(self, version: int, metrics: dict[str, float]) -> None:
        """``version`` went out through this transport from another process of the run (trainer
        rank 0, by :meth:`spec`), whose sender's counters are ``metrics``: searchers can fetch it."""
        self.visible_version = max(self.visible_version, version)

    def spec(self) -> Any | None:
        """What another process of this run (trainer rank 0) needs to open a sender of the same
        transport (``tba.weights.transports.open_sender``); None: only this process can publish."""
        return None

    def object_ref(self, version: int) -> Any | None:
        """The object-store copy of ``version``, if this sender put one there (the evaluation actor
        reads it instead of a second copy); None otherwise."""
        return None

    def metrics(self) -> dict[str, float]:
        """Counters and timings for the run's metrics (``weights/...``)."""
        return {}

    def close(self) -> None:
        """Free what the transport holds; called once no searcher reads from it any more."""


class NoSender(Sender):
    """The sender of a trainer that publishes nothing itself (a trainer rank: the driver's trainer
    publishes, through rank 0's own sender)."""

    def send(self, state_dict: State, version: int) -> None:
        raise RuntimeError("this trainer publishes nothing itself (a trainer rank: the driver's trainer publishes)")


class Receiver:
    """A searcher's side of a transport."""

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        """The newest weights as ``(version, state)`` if their version is above ``newer_than``, else
        None. The tensors may be views of the transport's buffers or read-only memory: load from
        them before the next fetch, and do not write to them."""
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Counters for the run's metrics (``weights/...``), cumulative over the searcher's life."""
        return {}

    def close(self) -> None:
        """Unmap and free what the receiver holds."""

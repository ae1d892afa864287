"""Weight publishing: the trainer publishes a state dict with its version; searchers fetch the
newest one between two generation batches. For a LoRA policy the state dict holds the adapter's
tensors only (``tba.models.lora.published_state``); the stores treat both kinds alike.

``LocalWeightStore`` serves one process (the ``sync`` runtime, and tests). Transports for other
processes implement the same three methods.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

import torch


def map_shared(state_dict: dict[str, torch.Tensor], fn) -> dict[str, torch.Tensor]:
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


def to_host(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state_dict`` in host memory, for another process (Ray pickles a CUDA tensor as one, which a
    process without that GPU cannot load). Host tensors are not copied: what sends them to another
    process (``ray.put``, a remote call's arguments) copies them as it serializes. Tied entries
    stay one object (:func:`map_shared`), so they are copied and sent once."""
    return map_shared(state_dict, lambda v: v.detach().to("cpu"))


class WeightStore(Protocol):
    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None: ...

    def latest_version(self) -> int: ...

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest weights if their version is above ``newer_than``, else None."""
        ...


class LocalWeightStore:
    """Keeps a detached copy of the newest weights, so later optimizer steps do not leak into
    what searchers load (their data must be tagged with the version that really produced it).
    ``keep`` > 1 also keeps that many of the latest publications, for :class:`DelayedWeights`."""

    def __init__(self, keep: int = 1) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 publication, got {keep}")
        self._lock = threading.Lock()
        self._history: deque[tuple[int, dict[str, torch.Tensor]]] = deque(maxlen=keep)

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        copy = map_shared(state_dict, lambda v: v.detach().clone())  # tied weights: one copy
        with self._lock:
            if version <= self._newest():
                raise ValueError(f"published version {version} is not newer than {self._newest()}")
            self._history.append((version, copy))

    def _newest(self) -> int:
        return self._history[-1][0] if self._history else -1

    def latest_version(self) -> int:
        with self._lock:
            return self._newest()

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        return self.fetch_delayed(newer_than, 0)

    def fetch_delayed(self, newer_than: int, delay: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The newest weights published at least ``delay`` versions before the newest (the oldest
        kept while there is none that old yet), if their version is above ``newer_than``."""
        with self._lock:
            if not self._history:
                return None
            cutoff = self._history[-1][0] - delay
            chosen = next((item for item in reversed(self._history) if item[0] <= cutoff), self._history[0])
            return chosen if chosen[0] > newer_than else None


class DelayedWeights:
    """What a searcher sees of a :class:`LocalWeightStore` when it must sample with old weights
    (``runtime.extra_lag``): the newest publication at least ``delay`` versions behind the newest."""

    def __init__(self, store: LocalWeightStore, delay: int) -> None:
        self.store = store
        self.delay = delay

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self.store.publish(state_dict, version)

    def latest_version(self) -> int:
        return self.store.latest_version()

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        return self.store.fetch_delayed(newer_than, self.delay)


def publications_to_keep(delay: int, sync_interval: int) -> int:
    """Publications a store must keep so that one at least ``delay`` versions old is among them
    (one every ``sync_interval`` versions)."""
    return -(-delay // sync_interval) + 1

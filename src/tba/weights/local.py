"""Weights within one process (the ``sync`` runtime, and tests): a store that keeps copies of the
newest publications, and the view of it that a stale sampler (``runtime.extra_lag``) sees."""

from __future__ import annotations

import threading
from collections import deque

from tba.weights.base import Receiver, Sender, State, own_copy


class LocalWeightStore(Sender, Receiver):
    """Keeps a detached copy of the newest weights, so later optimizer steps do not leak into
    what searchers load (their data must be tagged with the version that really produced it).
    ``keep`` > 1 also keeps that many of the latest publications, for :class:`DelayedWeights`."""

    def __init__(self, keep: int = 1) -> None:
        super().__init__()
        if keep < 1:
            raise ValueError(f"keep must be >= 1 publication, got {keep}")
        self._lock = threading.Lock()
        self._history: deque[tuple[int, State]] = deque(maxlen=keep)

    def send(self, state_dict: State, version: int) -> None:
        copy = own_copy(state_dict)  # tied weights: one copy
        with self._lock:
            newest = self._history[-1][0] if self._history else -1
            if version <= newest:
                raise ValueError(f"published version {version} is not newer than {newest}")
            self._history.append((version, copy))

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        return self.fetch_delayed(newer_than, 0)

    def fetch_delayed(self, newer_than: int, delay: int) -> tuple[int, State] | None:
        """The newest weights published at least ``delay`` versions before the newest (the oldest
        kept while there is none that old yet), if their version is above ``newer_than``."""
        with self._lock:
            if not self._history:
                return None
            cutoff = self._history[-1][0] - delay
            chosen = next((item for item in reversed(self._history) if item[0] <= cutoff), self._history[0])
            return chosen if chosen[0] > newer_than else None


class DelayedWeights(Receiver):
    """What a searcher sees of a :class:`LocalWeightStore` when it must sample with old weights
    (``runtime.extra_lag``): the newest publication at least ``delay`` versions behind the newest."""

    def __init__(self, store: LocalWeightStore, delay: int) -> None:
        self.store = store
        self.delay = delay

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        return self.store.fetch_delayed(newer_than, self.delay)


def publications_to_keep(delay: int, sync_interval: int) -> int:
    """Publications a store must keep so that one at least ``delay`` versions old is among them
    (one every ``sync_interval`` versions)."""
    return -(-delay // sync_interval) + 1

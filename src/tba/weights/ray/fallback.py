"""The object store behind every other transport, in one place: :class:`FallbackSender` tries its
primary first and sends by the object store what the primary cannot carry
(:class:`~tba.weights.base.CannotCarry`: a group not formed yet, a broadcast a dead searcher broke,
a layout the slots do not hold), counting each by its reason and logging each failure once, with
the version. :class:`FallbackReceiver` returns the newer of what the two hold."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from tba.weights.base import CannotCarry, Receiver, Sender, State
from tba.weights.ray.board import ObjectStoreReceiver, ObjectStoreSender

QUIET = {"forming", "closing"}  # reasons that are part of a normal run: counted, not logged


class FallbackSender(Sender):
    def __init__(
        self, primary: Sender, object_store: ObjectStoreSender, log: Callable[[str], None], name: str, channel=None
    ) -> None:
        super().__init__()
        self.primary, self.object_store, self.log, self.name, self.channel = primary, object_store, log, name, channel
        self.keeps_device = primary.keeps_device
        self.fallbacks: Counter[str] = Counter()  # publications the object store carried, by reason
        self._last_reason: str | None = None

    def stage(self, state_dict: State) -> State | None:
        try:
            return self.primary.stage(state_dict)
        except CannotCarry:  # not staged: send() finds out again, says why, and reads the state itself
            return None

    def send(self, state_dict: State, version: int) -> None:
        try:
            self.primary.publish(state_dict, version)
            self._last_reason = None
            return
        except CannotCarry as why:
            self.fallbacks[why.reason] += 1
            if why.reason not in QUIET and (why.reason == "failed" or why.reason != self._last_reason):
                self.log(f"weights: version {version} went by the object store, not by {self.name}: {why}")
            self._last_reason = why.reason
        self.object_store.publish(state_dict, version)

    def spec(self):
        return self.channel

    def object_ref(self, version: int):
        return self.object_store.object_ref(version)

    def metrics(self) -> dict[str, float]:
        out = self.primary.metrics()
        out["weights/by_object_store"] = float(sum(self.fallbacks.values()))
        out["weights/fallbacks"] = float(sum(n for reason, n in self.fallbacks.items() if reason not in QUIET))
        return out

    def close(self) -> None:
        self.primary.close()


class FallbackReceiver(Receiver):
    def __init__(self, primary: Receiver, object_store: ObjectStoreReceiver) -> None:
        self.primary, self.object_store = primary, object_store

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        got = self.primary.fetch(newer_than)
        other = self.object_store.fetch(got[0] if got is not None else newer_than)  # only if newer still
        return other if other is not None else got

    def metrics(self) -> dict[str, float]:
        return self.primary.metrics()

    def close(self) -> None:
        self.primary.close()

"""The boards of the weight transports: small Ray actors that hold what a transport's two sides
agree on (versions, references, handles, leases), never weights. A module of their own, with no
torch: an actor's process imports the module that defines its class, and these start with every run.

- :class:`WeightBoard`: the object store's newest version and its reference (:mod:`.board`);
- :class:`GroupBoard`: the broadcast group's rendezvous and heartbeats (:mod:`.broadcast`);
- :class:`SlotBoard`: the shared slots' handles, newest slot and leases (:mod:`.ipc`).
"""

from __future__ import annotations

import time

import ray


@ray.remote(num_cpus=0)
class WeightBoard:
    """The newest version published by the object store, and its reference there."""

    def __init__(self) -> None:
        self.version = -1
        self.ref = None

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def set(self, version: int, boxed_ref: list) -> None:
        if version > self.version:  # a list keeps Ray from resolving the reference on the way in
            self.version, self.ref = version, boxed_ref[0]

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def get_if_newer(self, version: int):
        return (self.version, [self.ref]) if self.version > version else None


@ray.remote(num_cpus=0)
class GroupBoard:
    """The group's rendezvous: each searcher's incarnation, the newest generation of the group, the
    broadcast announced last, and when each member last said it was alive."""

    def __init__(self) -> None:
        self.registered: dict[int, str] = {}  # searcher index -> its incarnation token
        self.group: tuple[int, dict] | None = None
        self.pending: tuple[int, int] | None = None  # (version, generation) announced last
        self.polled: dict[int, float] = {}

    def register(self, index: int, token: str) -> None:
        self.registered[index] = token
        self.polled[index] = time.monotonic()

    @ray.method(enable_task_events=False)  # polled twice a second by the trainer's side
    def members(self) -> dict[int, str]:
        return dict(self.registered)

    def announce_group(self, generation: int, spec: dict) -> None:
        self.group = (generation, spec)

    @ray.method(enable_task_events=False)  # once a publication
    def announce_broadcast(self, version: int, generation: int) -> None:
        self.pending = (version, generation)

    @ray.method(enable_task_events=False)  # called 4 times a second by each searcher
    def beat(self, index: int) -> None:
        self.polled[index] = time.monotonic()

    @ray.method(enable_task_events=False)  # called 20 times a second by each searcher
    def poll(self, generation: int, index: int):
        """(the group's newest generation if newer than ``generation``, the broadcast announced last)"""
        self.polled[index] = time.monotonic()
        newer = self.group if self.group is not None and self.group[0] > generation else None
        return newer, self.pending

    def silent(self, seconds: float) -> list[int]:
        """The registered searchers that have not said they are alive for ``seconds``."""
        now = time.monotonic()
        return sorted(i for i in self.registered if now - self.polled.get(i, 0.0) > seconds)


@ray.remote(num_cpus=0)
class SlotBoard:
    """The slots' handles and layout, the newest version and the slot that holds it, and the leases
    of the searchers that copy a slot now."""

    def __init__(self) -> None:
        self.version = -1
        self.slot: int | None = None
        self.spec: dict | None = None
        self.leases: dict[str, tuple[int, float, int | None]] = {}  # reader -> (slot, when leased, searcher index)

    def announce(self, spec: dict) -> None:
        self.spec = spec

    def slots(self) -> dict | None:
        return self.spec

    @ray.method(enable_task_events=False)  # once a publication
    def set(self, version: int, slot: int) -> None:
        if version > self.version:
            self.version, self.slot = version, slot

    @ray.method(enable_task_events=False)  # once a fetch
    def lease(self, newer_than: int, reader: str, index: int | None = None) -> tuple[int, int] | None:
        """(the newest version, its slot), leased to ``reader`` until it calls :meth:`release`, if the
        newest version is above ``newer_than``; else None."""
        if self.version <= newer_than or self.slot is None:
            return None
        self.leases[reader] = (self.slot, time.monotonic(), index)
        return self.version, self.slot

    @ray.method(enable_task_events=False)  # once a fetch
    def release(self, reader: str) -> None:
        self.leases.pop(reader, None)

    @ray.method(enable_task_events=False)  # polled while a publication waits for a slot
    def slot_leased(self, slot: int, timeout_s: float) -> tuple[bool, list]:
        """Whether a reader copies ``slot`` now, and the leases older than ``timeout_s`` (their reader
        died mid-copy), dropped now, as (reader, slot, searcher index)."""
        now = time.monotonic()
        expired = [(r, s, i) for r, (s, t, i) in self.leases.items() if now - t > timeout_s]
        for r, _, _ in expired:
            del self.leases[r]
        return any(s == slot for s, _, _ in self.leases.values()), expired

"""Published weights over Ray. A :class:`WeightBoard` actor holds a reference to the newest state
dict in Ray's object store: publishing is one ``ray.put`` and a small call, so a slow or dead
searcher cannot block it. :class:`RayWeightStore` is the ``WeightStore`` interface over a board,
usable from any process (the trainer, trainer rank 0, searchers).

The state dict travels as numpy arrays (:func:`pack`; bfloat16 and float16 viewed as 16-bit
integers, which numpy lacks): Ray writes their bytes into the object store with one copy instead of
pickling them, and a process on the same node reads them in place, without a copy
(:func:`unpack` wraps them as read-only tensors, which loading copies from)."""

from __future__ import annotations

import time
import warnings

import numpy as np
import ray
import torch

from tba.weights import map_shared, to_host

_AS_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16)}


def pack(state_dict: dict[str, torch.Tensor]) -> dict:
    """A host state dict as numpy arrays that Ray stores without pickling their data; tied entries
    stay one array (:func:`tba.weights.map_shared`), stored once."""

    def as_array(t: torch.Tensor) -> np.ndarray:
        t = t.detach().contiguous()
        return (t.view(_AS_INT[t.dtype]) if t.dtype in _AS_INT else t).numpy()

    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in state_dict.items() if v.dtype in _AS_INT}
    return {"arrays": map_shared(to_host(state_dict), as_array), "views": dtypes}


def unpack(packed: dict) -> dict[str, torch.Tensor]:
    """The tensors of :func:`pack`'s arrays, sharing their memory (read-only when Ray maps them from
    the object store: load from them, do not write to them)."""
    out, done = {}, {}
    with warnings.catch_warnings():  # "The given NumPy array is not writable": nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        for k, a in packed["arrays"].items():
            if id(a) not in done:
                t = torch.from_numpy(a)
                view = packed["views"].get(k)
                done[id(a)] = t.view(_DTYPE_NAMES[view]) if view else t
            out[k] = done[id(a)]
    return out


@ray.remote(num_cpus=0)
class WeightBoard:
    """The newest published weights: a version and an object-store reference."""

    def __init__(self) -> None:
        self.version = -1
        self.ref = None  # None for a version that went by broadcast (tba.runtime.broadcast)
        self.registered: dict[int, str] = {}  # broadcast: each searcher's incarnation token
        self.group: tuple[int, dict] | None = None  # broadcast: the newest generation of the group
        self.pending: tuple[int, int] | None = None  # broadcast: (version, generation) announced last
        self.slot: int | None = None  # ipc: the shared slot holding the newest version (None: not by ipc)
        self.slot_spec: dict | None = None  # ipc: the slots' layout and handles (tba.runtime.shared_weights)
        self.leases: dict[str, tuple[int, float]] = {}  # ipc: reader -> (slot, when leased)

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def set(self, version: int, boxed_ref: list) -> None:
        if version > self.version:  # a list keeps Ray from resolving the reference on the way in
            self.version, self.ref, self.slot = version, boxed_ref[0], None

    def announce_slots(self, spec: dict) -> None:
        self.slot_spec = spec

    def slots(self) -> dict | None:
        return self.slot_spec

    @ray.method(enable_task_events=False)  # once a publication
    def set_slot(self, version: int, slot: int) -> None:
        if version > self.version:
            self.version, self.ref, self.slot = version, None, slot

    @ray.method(enable_task_events=False)  # once a fetch
    def lease(self, newer_than: int, reader: str) -> tuple[int, int] | None:
        """(the newest version, its slot), leased to ``reader`` until it calls :meth:`release`, if the
        newest version is above ``newer_than`` and sits in a shared slot; else None."""
        if self.version <= newer_than or self.slot is None:
            return None
        self.leases[reader] = (self.slot, time.monotonic())
        return self.version, self.slot

    @ray.method(enable_task_events=False)  # once a fetch
    def release(self, reader: str) -> None:
        self.leases.pop(reader, None)

    @ray.method(enable_task_events=False)  # polled while a publication waits for a slot
    def slot_leased(self, slot: int, timeout_s: float) -> bool:
        """Whether a reader copies ``slot`` now; leases older than ``timeout_s`` (their reader died
        mid-copy) are dropped."""
        now = time.monotonic()
        self.leases = {r: (s, t) for r, (s, t) in self.leases.items() if now - t <= timeout_s}
        return any(s == slot for s, _ in self.leases.values())

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def get_if_newer(self, version: int):
        return (self.version, [self.ref]) if self.version > version else None

    def register(self, index: int, token: str) -> None:
        self.registered[index] = token

    @ray.method(enable_task_events=False)  # polled twice a second by the trainer's side
    def members(self) -> dict[int, str]:
        return dict(self.registered)

    def announce_group(self, generation: int, spec: dict) -> None:
        self.group = (generation, spec)

    @ray.method(enable_task_events=False)  # once a publication
    def announce_broadcast(self, version: int, generation: int) -> None:
        self.pending = (version, generation)

    @ray.method(enable_task_events=False)  # called 20 times a second by each searcher
    def poll(self, generation: int):
        """(the group's newest generation if newer than ``generation``, the broadcast announced last)"""
        newer = self.group if self.group is not None and self.group[0] > generation else None
        return newer, self.pending


class RayWeightStore:
    """The ``WeightStore`` interface over a ``WeightBoard`` actor, usable from any process."""

    def __init__(self, board) -> None:
        self.board = board
        self.last: tuple[int, ray.ObjectRef] | None = None  # the newest publication from this process

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        ref = ray.put(pack(state_dict))
        ray.get(self.board.set.remote(version, [ref]))
        self.last = (version, ref)

    def latest_version(self) -> int:
        newest = ray.get(self.board.get_if_newer.remote(-1))
        return -1 if newest is None else newest[0]

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        newest = ray.get(self.board.get_if_newer.remote(newer_than))
        if newest is None:
            return None
        version, (ref,) = newest
        if ref is None:  # by broadcast or ipc: tba.runtime.broadcast / shared_weights deliver those
            return None
        return version, unpack(ray.get(ref))

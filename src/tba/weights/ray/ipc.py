"""Weights through shared memory (``runtime.weight_transport=ipc``): the trainer copies each
publication into one of two buffers allocated once, which the searchers on its machine map into
their own processes, instead of the object store. On a GPU the buffers are GPU memory shared by CUDA
IPC handles (a searcher on the trainer's GPU copies device to device, nothing crosses the host); on a
CPU they are shared host memory (``multiprocessing.shared_memory``), which the tests use.

- **Handles once.** With its first publication the trainer announces the layout
  (:class:`tba.weights.layout.Layout`) and the two buffers' handles on the slots' board
  (:class:`~tba.weights.ray.boards.SlotBoard`), with
  the GPU's UUID; a searcher maps them at its first fetch and refuses a GPU it does not see.
- **A publication.** The trainer writes the slot that holds neither the newest version nor a
  searcher's lease, waits for the copy to land, then sets the version and slot on the board.
- **A fetch.** A searcher asks the board for a lease on the newest slot (the board is one actor:
  a lease and the trainer's check of it cannot cross), copies the slot into a staging buffer of its
  own and returns the lease: the trainer waits at most for one device-to-device copy, never for a
  searcher's generation. A lease older than ``lease_timeout_s`` (its searcher died mid-copy) is
  dropped, and the trainer logs and counts it (``weights/expired_leases``).
- **What it cannot carry.** A state whose names or shapes changed mid-run raises
  :class:`~tba.weights.base.CannotCarry`: it goes by the object store (:mod:`tba.weights.ray.fallback`).

A version fetched from the staging buffer stays there until the searcher's next fetch (its tensors
are being loaded until then), as with the broadcast's staging buffers.
"""

from __future__ import annotations

import threading
import time
from multiprocessing import resource_tracker, shared_memory

import ray
import torch

from tba.weights.base import CannotCarry, Receiver, Sender, State
from tba.weights.layout import Layout

LEASE_TIMEOUT_S = 30.0  # a lease held longer than this belongs to a searcher that died mid-copy
SLOTS = 2


class Slots:
    """The trainer's two buffers of ``nbytes`` bytes on ``device`` and the handles that map them."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.shm: list[shared_memory.SharedMemory] = []
        if device.type == "cuda":
            from torch.multiprocessing.reductions import reduce_tensor

            self.buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(SLOTS)]
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.spec = {"kind": "cuda", "uuid": uuid, "handles": [reduce_tensor(b) for b in self.buffers]}
        else:
            self.shm = [shared_memory.SharedMemory(create=True, size=nbytes) for _ in range(SLOTS)]
            self.buffers = [torch.frombuffer(s.buf, dtype=torch.uint8, count=nbytes) for s in self.shm]
            self.spec = {"kind": "cpu", "names": [s.name for s in self.shm]}
        self.spec["nbytes"] = nbytes

    def close(self) -> None:
        self.buffers = []  # the views go first: shared memory with exported pointers cannot close
        for s in self.shm:
            s.close()
            s.unlink()
        self.shm = []


def cuda_index_of(uuid: str) -> int:
    """The index, in this process, of the GPU whose UUID is ``uuid``; raises if it sees no such GPU."""
    seen = [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]
    if uuid not in seen:
        raise RuntimeError(
            f"runtime.weight_transport=ipc: this searcher sees GPU(s) {seen or 'none'}, not the trainer's GPU "
            f"{uuid}; CUDA IPC needs searchers on the trainer's GPU. Set runtime.weight_transport=object_store"
        )
    return seen.index(uuid)


def open_slots(spec: dict) -> tuple[list[torch.Tensor], list[shared_memory.SharedMemory]]:
    """Map the trainer's buffers (``Slots.spec``) into this process: (the buffers, what keeps them open)."""
    if spec["kind"] == "cuda":
        index = cuda_index_of(spec["uuid"])
        buffers = []
        for rebuild, args in spec["handles"]:
            args = list(args)
            args[6] = index  # the device, as this process numbers its GPUs
            buffers.append(rebuild(*args))
        return buffers, []
    shms = []
    for name in spec["names"]:
        shm = shared_memory.SharedMemory(name=name)
        # the trainer owns the memory: this process must not unlink it when it exits
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (Python < 3.13 has no track=False)
        shms.append(shm)
    return [torch.frombuffer(s.buf, dtype=torch.uint8, count=spec["nbytes"]) for s in shms], shms


def _synchronize(t: torch.Tensor) -> None:
    if t.is_cuda:
        torch.cuda.current_stream(t.device).synchronize()


class SharedSender(Sender):
    """The trainer's side: publishes into the shared slots. :meth:`stage` copies a state dict into the
    free slot and returns its views, so that a background publisher lets the optimizer go on before
    the version is set."""

    keeps_device = True  # takes GPU tensors as they are (the publisher stages no host copy)

    def __init__(self, board, log=print, poll_s: float = 0.001, lease_timeout_s: float = LEASE_TIMEOUT_S) -> None:
        super().__init__()
        self.board, self.log, self.poll_s, self.lease_timeout_s = board, log, poll_s, lease_timeout_s
        self.lock = threading.Lock()
        self.layout: Layout | None = None
        self.slots: Slots | None = None
        self.newest: int | None = None  # the slot holding the newest version set on the board
        self.publications = self.expired = 0
        self.wait_s = 0.0  # seconds spent waiting for a searcher's lease, all publications

    @classmethod
    def open(cls, board, searchers: int, log) -> SharedSender:
        return cls(board, log)

    def stage(self, state_dict: State) -> State:
        with self.lock:
            slot = self._write(state_dict)  # (the first one makes the layout and the slots)
            return self.layout.views(self.slots.buffers[slot])

    def send(self, state_dict: State, version: int) -> None:
        with self.lock:
            buffers = self.slots.buffers if self.slots is not None else []
            held = next((i for i, b in enumerate(buffers) if Layout.holds(b, state_dict)), None)
            slot = self._write(state_dict) if held is None else held  # what :meth:`stage` returned is in place
            ray.get(self.board.set.remote(version, slot))
            self.newest = slot
            self.publications += 1

    def _write(self, state_dict: State) -> int:
        layout = Layout.of(state_dict)
        if self.layout is None:
            self.layout = layout
            self.slots = Slots(layout.nbytes, next(iter(state_dict.values())).device)
            ray.get(self.board.announce.remote({**self.slots.spec, "layout": layout}))
        elif layout != self.layout:
            raise CannotCarry(
                "layout", "the published state changed its names or shapes; the shared slots hold one layout"
            )
        slot = next(i for i in range(SLOTS) if i != self.newest)
        start = time.perf_counter()
        while True:
            leased, expired = ray.get(self.board.slot_leased.remote(slot, self.lease_timeout_s))
            for _, held, index in expired:
                self.expired += 1
                who = "a searcher" if index is None else f"searcher {index}"
                self.log(
                    f"weights: {who} held slot {held} for over {self.lease_timeout_s:g} s (it died while copying); "
                    "its lease is dropped"
                )
            if not leased:
                break
            time.sleep(self.poll_s)  # a searcher copies it (a device-to-device copy: milliseconds)
        self.wait_s += time.perf_counter() - start
        buffer = self.slots.buffers[slot]
        self.layout.fill(buffer, state_dict)
        _synchronize(buffer)  # landed before any searcher can lease it
        return slot

    def metrics(self) -> dict[str, float]:
        return {
            "weights/shared_publications": float(self.publications),
            "weights/slot_wait_s": self.wait_s,
            "weights/expired_leases": float(self.expired),
        }

    def close(self) -> None:
        """After the searchers have stopped: frees the buffers (host memory: unlinks it)."""
        with self.lock:
            if self.slots is not None:
                self.slots.close()


class SharedReceiver(Receiver):
    """A searcher's side: :meth:`fetch` copies the newest slot into a staging buffer of its own
    under a lease, and returns that buffer's views."""

    def __init__(self, board, token: str, index: int | None = None) -> None:
        self.board, self.token, self.index = board, token, index
        self.layout: Layout | None = None
        self.slots: list[torch.Tensor] = []
        self._keep: list = []  # what keeps host slots mapped
        self.staging: torch.Tensor | None = None
        self.copies = 0

    @classmethod
    def open(cls, board, index: int, token: str) -> SharedReceiver:
        return cls(board, token, index)

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        leased = ray.get(self.board.lease.remote(newer_than, self.token, self.index))
        if leased is None:
            return None
        version, slot = leased
        try:
            if not self.slots:
                spec = ray.get(self.board.slots.remote())
                self.slots, self._keep = open_slots(spec)
                self.layout = spec["layout"]
            source = self.slots[slot]
            if self.staging is None:
                self.staging = torch.empty_like(source)
            self.staging.copy_(source)
            _synchronize(self.staging)
        finally:
            self.board.release.remote(self.token)  # ordered after the lease: calls from one process keep their order
        self.copies += 1
        return version, self.layout.views(self.staging)

    def metrics(self) -> dict[str, float]:
        return {"weights/slot_copies": float(self.copies)}

    def close(self) -> None:
        self.slots, self.staging = [], None
        for s in self._keep:
            s.close()
        self._keep = []

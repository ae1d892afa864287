"""Weights by broadcast (``runtime.weight_transport=broadcast``): a ``torch.distributed`` group of
the trainer (rank 0) and the searchers, over gloo, that carries each publication as one byte buffer
in buckets, instead of the object store.

- **Its own group.** The trainer's process hosts a ``TCPStore`` and the group is built on it
  (``ProcessGroupGloo`` on a prefix of that store): no default process group is made, so trainer
  ranks (which own the default group in their processes) and this group never meet.
- **Forming.** Each searcher registers with the weight board (its index and a token of its
  incarnation). Once every searcher has, and the trainer has a first publication (whose layout
  the searchers need), the trainer announces generation ``g`` of the group (members, address,
  layout) and every member joins. Until a group has formed, publications go by the object store.
- **A publication.** The trainer copies the state into a send buffer allocated once, tells the
  board that version ``v`` is coming in generation ``g`` and broadcasts a header and the buffer.
  Searchers poll the board on a thread of their own and join a broadcast only when one is announced,
  so none waits in a collective that will not come, and each receives into one of two staging
  buffers while its generation loop goes on: a searcher in the middle of a batch does not stall
  the broadcast. The version is visible once the broadcast completes.
- **Failures.** A searcher that dies or hangs makes the broadcast fail (at once for a closed
  connection, after ``timeout_s`` for a hang): that version and the next go by the object store,
  the trainer logs it and counts it (``weights/fallbacks``), and forms the group again, with the
  restarted searcher, once every searcher is registered (``weights/broadcast_group`` is 0 meanwhile).

On one machine the object store is the faster path (a searcher maps the weights in place); the
broadcast is for searchers on other machines (``benchmarks/bench_weight_sync.py``).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import ray
import torch
import torch.distributed as dist

from tba.runtime.weight_board import RayWeightStore, unpack
from tba.weights import map_shared, to_host

TIMEOUT_S = 60.0  # a broadcast or a group's forming, on the trainer's side
POLL_S = 0.05  # how often a searcher asks the board for an announced broadcast
BUCKET_BYTES = 64 << 20
ALIGN = 64  # byte offsets of the tensors in the buffer (any dtype's view of them is aligned)


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a state dict sits in one byte buffer: ``entries`` holds (name, dtype,
    shape, byte offset); tied names share an offset."""

    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]
    nbytes: int

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> Layout:
        end = 0

        def place(t: torch.Tensor) -> int:  # called once per distinct tensor (ties: map_shared)
            nonlocal end
            at, end = end, end + -(-t.numel() * t.element_size() // ALIGN) * ALIGN
            return at

        offsets = map_shared(state, place)
        entries = [(k, str(t.dtype).removeprefix("torch."), tuple(t.shape), offsets[k]) for k, t in state.items()]
        return cls(tuple(entries), end)

    def fill(self, buffer: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` into ``buffer`` (bytes) at this layout's offsets."""
        for (name, _, _, _), view in zip(self.entries, self.views(buffer).values(), strict=True):
            view.copy_(state[name])

    @staticmethod
    def holds(buffer: torch.Tensor, state: dict[str, torch.Tensor]) -> bool:
        """Whether ``state`` is already views of ``buffer`` (what :meth:`views` of it returned)."""
        first = next(iter(state.values()))
        return first.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state dict that ``buffer`` holds, as views of it (tied names: one tensor)."""
        out, made = {}, {}
        for name, dtype, shape, offset in self.entries:
            if (offset, dtype) not in made:
                dt = getattr(torch, dtype)  # a dtype's name as str(dtype) writes it
                size = torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                made[(offset, dtype)] = buffer[offset : offset + size].view(dt).view(shape)
            out[name] = made[(offset, dtype)]
        return out


def _group(host: str, port: int, generation: int, rank: int, world: int, timeout_s: float, store=None):
    """Join generation ``generation`` of the group (blocks until every member has, or raises)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store = dist.TCPStore(host, port, None, False, timeout=timeout)
    return dist.ProcessGroupGloo(dist.PrefixStore(f"tba-weights-{generation}", store), rank, world, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.broadcast([tensor], opts).wait()


class BroadcastSender:
    """The trainer's side: a :class:`tba.weights.WeightStore` that broadcasts to the group when it
    has formed, and publishes by the object store while it has not (or after a failure)."""

    def __init__(self, board, searchers: int, log: Callable[[str], None], timeout_s: float = TIMEOUT_S) -> None:
        self.board, self.searchers, self.log, self.timeout_s = board, searchers, log, timeout_s
        self.object_store = RayWeightStore(board)
        self.host = ray.util.get_node_ip_address()
        self.store = dist.TCPStore(
            self.host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.lock = threading.Lock()  # the group and the send buffer: a publication, or a new group
        self.group, self.generation, self.members = None, 0, {}
        self.retired: list = []  # groups given up (kept: destroying one whose peers died can abort the process)
        self.broken_at: float | None = None
        self.layout: Layout | None = None
        self.buffer: torch.Tensor | None = None
        self.by_broadcast = self.fallbacks = 0
        self.last: tuple[int, ray.ObjectRef | None] | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_group, name="tba-weights-group", daemon=True)
        self._thread.start()

    @property
    def formed(self) -> bool:
        return self.group is not None and self.broken_at is None

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        layout = Layout.of(state_dict)
        with self.lock:
            if self.layout is None:
                self.layout = layout
            if self.formed and layout == self.layout and not self._closed.is_set():
                if self._broadcast(state_dict, version):
                    return
            # formed once when this version was sent (not by the thread forming it meanwhile): this
            # version did not go the way it should
            fell_back = self.group is not None
        self.object_store.publish(state_dict, version)
        self.last = self.object_store.last
        if fell_back:
            self.fallbacks += 1

    def stage(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``state_dict`` into the send buffer and return it as views of the buffer: the live
        weights are free once this returns (:class:`tba.weights.BackgroundPublisher` lets the
        optimizer go on), and :meth:`publish` sends the buffer without a second copy."""
        layout = Layout.of(state_dict)
        with self.lock:
            if self.layout is None:
                self.layout = layout
            if layout != self.layout:
                return state_dict
            self._fill(state_dict)
            return self.layout.views(self.buffer)

    def _fill(self, state_dict: dict[str, torch.Tensor]) -> None:
        """``state_dict`` into the send buffer (allocated once), unless :meth:`stage` put it there."""
        if self.buffer is None:
            self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        if not Layout.holds(self.buffer, state_dict):
            self.layout.fill(self.buffer, to_host(state_dict))

    def _broadcast(self, state_dict: dict[str, torch.Tensor], version: int) -> bool:
        self._fill(state_dict)
        try:
            ray.get(self.board.announce_broadcast.remote(version, self.generation))
            _broadcast(self.group, torch.tensor([version, self.generation], dtype=torch.int64))
            for start in range(0, self.layout.nbytes, BUCKET_BYTES):
                _broadcast(self.group, self.buffer[start : start + BUCKET_BYTES])
        except Exception as err:  # a searcher died or hung: the object store until the group forms again
            self.broken_at = time.monotonic()
            if self._closed.is_set():  # the run is ending: its searchers are stopped
                return False
            reason = " ".join(str(err).split())[:160]
            self.log(
                f"weights: the broadcast of version {version} failed ({reason}); publishing by the object store "
                "until the group forms again"
            )
            return False
        ray.get(self.board.set.remote(version, [None]))
        self.last = (version, None)
        self.by_broadcast += 1
        return True

    def _keep_group(self) -> None:
        """Form the group when every searcher has registered and the layout is known; again when the
        registered incarnations change (a searcher restarted) or, after a failure, every 30 s."""
        while not self._closed.wait(0.5):
            try:
                members = ray.get(self.board.members.remote())
            except Exception:  # the board is gone: the run is ending
                return
            if len(members) < self.searchers or self.layout is None:
                continue
            retry = self.broken_at is not None and time.monotonic() - self.broken_at > 30
            if (self.group is None and self.broken_at is None) or members != self.members or retry:
                self._form(members)

    def _form(self, members: dict[int, str]) -> None:
        ranks = {token: rank for rank, (_, token) in enumerate(sorted(members.items()), start=1)}
        world = len(ranks) + 1
        with self.lock:  # no broadcast in the old group after this: its members leave it for the new one
            generation = self.generation + 1
            spec = {"host": self.host, "port": self.store.port, "world": world, "ranks": ranks, "layout": self.layout}
            ray.get(self.board.announce_group.remote(generation, spec))
            if self.group is not None:
                self.retired.append(self.group)
            self.group, self.generation, self.members = None, generation, members
        try:  # meanwhile publications go by the object store
            group = _group(self.host, self.store.port, generation, 0, world, self.timeout_s, store=self.store)
        except Exception as err:
            if self.broken_at is None or members != self.members:
                self.log(f"weights: the broadcast group did not form ({' '.join(str(err).split())[:160]}); will retry")
            self.broken_at = time.monotonic()
            return
        with self.lock:
            self.group, self.broken_at = group, None
        self.log(
            f"weights: broadcast group formed (the trainer and {len(members)} searcher(s), generation {generation})"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "weights/broadcast_group": float(self.formed),
            "weights/broadcasts": float(self.by_broadcast),
            "weights/fallbacks": float(self.fallbacks),
        }

    def latest_version(self) -> int:
        return self.object_store.latest_version()

    def fetch(self, newer_than: int):
        return self.object_store.fetch(newer_than)

    def close(self) -> None:
        """Before the searchers stop: what is still published goes by the object store."""
        self._closed.set()


class BroadcastReceiver:
    """A searcher's side: a :class:`tba.weights.WeightStore` whose :meth:`fetch` returns the newest
    version, from a staging buffer when it came by broadcast, else from the object store. A fetched
    staging buffer is not written again until the next fetch (its tensors are being loaded)."""

    def __init__(self, board, index: int, token: str, timeout_s: float = 2 * TIMEOUT_S) -> None:
        self.board, self.token, self.timeout_s = board, token, timeout_s
        self.object_store = RayWeightStore(board)
        self.lock = threading.Lock()
        self.group, self.generation, self.layout = None, 0, None
        self.buffers: list[torch.Tensor] = []
        self.newest: tuple[int, int] | None = None  # (version, buffer index) of the newest staged version
        self.leased: int | None = None  # the buffer index the searcher is loading from
        self.received = 0
        self._closed = threading.Event()
        ray.get(board.register.remote(index, token))
        self._thread = threading.Thread(target=self._run, name="tba-weights-receiver", daemon=True)
        self._thread.start()

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        with self.lock:
            self.leased = None  # the previous fetch's tensors are loaded by now
            staged = self.newest
        newest = ray.get(self.board.get_if_newer.remote(newer_than))
        if newest is not None and newest[1][0] is not None and (staged is None or newest[0] > staged[0]):
            return newest[0], unpack(ray.get(newest[1][0]))
        if staged is None or staged[0] <= newer_than:
            return None
        with self.lock:
            version, index = self.newest
            self.leased = index
            return version, self.layout.views(self.buffers[index])

    def latest_version(self) -> int:
        return self.object_store.latest_version()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                group, pending = ray.get(self.board.poll.remote(self.generation))
            except Exception:  # the board is gone: the run is ending
                return
            if group is not None:
                self._join(*group)
            staged = -1 if self.newest is None else self.newest[0]
            if self.group is not None and pending is not None and pending[1] == self.generation and pending[0] > staged:
                self._receive(pending[0])
            else:
                time.sleep(POLL_S)

    def _join(self, generation: int, spec: dict) -> None:
        self.generation, self.group = generation, None
        if self.token not in spec["ranks"]:
            return
        try:
            group = _group(
                spec["host"], spec["port"], generation, spec["ranks"][self.token], spec["world"], self.timeout_s
            )
        except Exception:  # the trainer forms it again
            return
        if spec["layout"] != self.layout:
            with self.lock:
                self.layout, self.newest, self.leased = spec["layout"], None, None
                self.buffers = [torch.empty(spec["layout"].nbytes, dtype=torch.uint8) for _ in range(2)]
        self.group = group

    def _receive(self, version: int) -> None:
        with self.lock:  # a buffer neither being loaded nor holding the newest version (if it can be)
            free = [i for i in range(2) if i != self.leased]
            index = next((i for i in free if self.newest is None or i != self.newest[1]), free[0])
            if self.newest is not None and self.newest[1] == index:
                self.newest = None  # overwritten now
        header = torch.zeros(2, dtype=torch.int64)
        try:
            _broadcast(self.group, header)
            if header.tolist() != [version, self.generation]:
                raise RuntimeError(f"expected version {version}, got {header.tolist()}")
            buffer = self.buffers[index]
            for start in range(0, self.layout.nbytes, BUCKET_BYTES):
                _broadcast(self.group, buffer[start : start + BUCKET_BYTES])
        except Exception:  # the trainer gave this group up: wait for the next one
            self.group = None
            return
        with self.lock:
            self.newest = (version, index)
        self.received += 1

    def close(self) -> None:
        self._closed.set()

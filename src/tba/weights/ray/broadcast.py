"""Weights by broadcast (``runtime.weight_transport=broadcast``): a ``torch.distributed`` group of
the trainer (rank 0) and the searchers, over gloo, that carries each publication as one byte buffer
in buckets, instead of the object store.

- **Its own group.** The trainer's process hosts a ``TCPStore`` and the group is built on it
  (``ProcessGroupGloo`` on a prefix of that store): no default process group is made, so trainer
  ranks (which own the default group in their processes) and this group never meet.
- **Forming.** Each searcher registers with the group's board
  (:class:`~tba.weights.ray.boards.GroupBoard`: its index and a token of its incarnation). Once
  every searcher has, and the trainer has a first publication (whose layout the searchers need), the
  trainer announces generation ``g`` of the group (members, address, layout) and every member joins.
  Until a group has formed, publications go by the object store.
- **A publication.** The trainer copies the state into a send buffer allocated once, tells the
  board that version ``v`` is coming in generation ``g`` and broadcasts a header and the buffer.
  Searchers poll the board on a thread of their own and join a broadcast only when one is announced,
  so none waits in a collective that will not come, and each receives into one of two staging
  buffers while its generation loop goes on: a searcher in the middle of a batch does not stall
  the broadcast. The version is visible once the broadcast completes.
- **Failures.** A searcher that dies or hangs makes the broadcast fail (at once for a closed
  connection, after ``timeout_s`` for a hang): the sender raises
  :class:`~tba.weights.base.CannotCarry` naming the version and the searchers that stopped polling,
  so that version and the next go by the object store (:mod:`tba.weights.ray.fallback` logs and
  counts them), and forms the group again, with the restarted searcher, once every searcher is
  registered (``weights/broadcast_group`` is 0 meanwhile). A searcher logs and counts a group it
  could not join and a broadcast it could not receive (``weights/join_failures``,
  ``weights/receive_failures``). Any other error in either side's thread fails the run at the
  next call of that side.

On one machine the object store is the faster path (a searcher maps the weights in place); the
broadcast is for searchers on other machines (``benchmarks/bench_weight_sync.py``).
"""

from __future__ import annotations

import datetime
import sys
import threading
import time
from collections.abc import Callable

import ray
import torch
import torch.distributed as dist

from tba.weights.base import CannotCarry, Receiver, Sender, State, to_host
from tba.weights.layout import Layout

TIMEOUT_S = 60.0  # a broadcast or a group's forming, on the trainer's side
POLL_S = 0.05  # how often a searcher asks the board for an announced broadcast
BEAT_S = 0.25  # how often a searcher's receiver says it is alive (a thread of its own: never blocked in gloo)
SILENT_S = 2.0  # a member silent this long after a failed broadcast is named in the log (its process died)
BUCKET_BYTES = 64 << 20


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


def _short(err: BaseException) -> str:
    return " ".join(str(err).split())[:160]


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class BroadcastSender(Sender):
    """The trainer's side: broadcasts each publication to the group once it has formed; raises
    :class:`~tba.weights.base.CannotCarry` while it has not (or after a failure)."""

    def __init__(self, board, searchers: int, log: Callable[[str], None], timeout_s: float = TIMEOUT_S) -> None:
        super().__init__()
        self.board, self.searchers, self.log, self.timeout_s = board, searchers, log, timeout_s
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
        self.by_broadcast = self.failures = 0
        self._error: BaseException | None = None  # what the group's thread raised, for the next call
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._keep_group, name="tba-weights-group", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, board, searchers: int, log: Callable[[str], None]) -> BroadcastSender:
        return cls(board, searchers, log)

    @property
    def formed(self) -> bool:
        return self.group is not None and self.broken_at is None

    def send(self, state_dict: State, version: int) -> None:
        self._raise()
        with self.lock:
            self._hold_layout(state_dict)
            if self._closed.is_set():
                raise CannotCarry("closing", "the run is ending")
            if not self.formed:
                raise CannotCarry(
                    "forming" if self.group is None and self.broken_at is None else "broken",
                    "the broadcast group has not formed (again) yet",
                )
            self._broadcast(state_dict, version)

    def stage(self, state_dict: State) -> State:
        """Copy ``state_dict`` into the send buffer and return it as views of the buffer: the live
        weights are free once this returns, and :meth:`send` sends the buffer without a second copy.
        A state of another layout than the group's raises :class:`CannotCarry`."""
        with self.lock:
            self._hold_layout(state_dict)
            self._fill(state_dict)
            return self.layout.views(self.buffer)

    def _hold_layout(self, state_dict: State) -> None:
        """(The lock held.) The group carries the first publication's layout; a state of another
        raises :class:`CannotCarry`."""
        layout = Layout.of(state_dict)
        if self.layout is None:
            self.layout = layout
        if layout != self.layout:
            raise CannotCarry("layout", "the published state changed its names or shapes; the group holds one layout")

    def _fill(self, state_dict: State) -> None:
        """``state_dict`` into the send buffer (allocated once), unless :meth:`stage` put it there."""
        if self.buffer is None:
            self.buffer = torch.empty(self.layout.nbytes, dtype=torch.uint8)
        if not Layout.holds(self.buffer, state_dict):
            self.layout.fill(self.buffer, to_host(state_dict))

    def _broadcast(self, state_dict: State, version: int) -> None:
        self._fill(state_dict)
        ray.get(self.board.announce_broadcast.remote(version, self.generation))
        try:
            _broadcast(self.group, torch.tensor([version, self.generation], dtype=torch.int64))
            for start in range(0, self.layout.nbytes, BUCKET_BYTES):
                _broadcast(self.group, self.buffer[start : start + BUCKET_BYTES])
        except RuntimeError as err:  # gloo's errors: a searcher died (closed connection) or hung (timeout)
            self.broken_at = time.monotonic()
            self.failures += 1
            time.sleep(SILENT_S)  # (the publisher's thread) a dead searcher's heartbeat stops meanwhile
            silent = ray.get(self.board.silent.remote(SILENT_S))
            who = (
                f"searcher(s) {', '.join(map(str, silent))} stopped answering" if silent else "no searcher went silent"
            )
            raise CannotCarry("failed", f"the broadcast of version {version} failed ({_short(err)}); {who}") from err
        self.by_broadcast += 1

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"weights by broadcast: the group's thread failed: {self._error!r}") from self._error

    def _keep_group(self) -> None:
        """Form the group when every searcher has registered and the layout is known; again when the
        registered incarnations change (a searcher restarted) or, after a failure, every 30 s."""
        try:
            while not self._closed.wait(0.5):
                members = ray.get(self.board.members.remote())
                if len(members) < self.searchers or self.layout is None:
                    continue
                retry = self.broken_at is not None and time.monotonic() - self.broken_at > 30
                if (self.group is None and self.broken_at is None) or members != self.members or retry:
                    self._form(members)
        except Exception as err:  # after close: the run's Ray session is ending
            if not self._closed.is_set():
                self._error = err

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
        except RuntimeError as err:  # a member did not join in time
            if self.broken_at is None or members != self.members:
                self.log(f"weights: the broadcast group did not form ({_short(err)}); will retry")
            self.broken_at = time.monotonic()
            return
        with self.lock:
            self.group, self.broken_at = group, None
        self.log(
            f"weights: broadcast group formed (the trainer and {len(members)} searcher(s), generation {generation})"
        )

    def metrics(self) -> dict[str, float]:
        self._raise()
        return {
            "weights/broadcast_group": float(self.formed),
            "weights/broadcasts": float(self.by_broadcast),
            "weights/broadcast_failures": float(self.failures),
        }

    def close(self) -> None:
        """What is still published goes by the object store; the group's thread stops."""
        self._closed.set()


class BroadcastReceiver(Receiver):
    """A searcher's side: :meth:`fetch` returns the newest version staged from a broadcast. A
    fetched staging buffer is not written again until the next fetch (its tensors are being loaded)."""

    def __init__(
        self, board, index: int, token: str, timeout_s: float = 2 * TIMEOUT_S, log: Callable[[str], None] = _stderr
    ) -> None:
        self.board, self.index, self.token, self.timeout_s, self.log = board, index, token, timeout_s, log
        self.lock = threading.Lock()
        self.group, self.generation, self.layout = None, 0, None
        self.buffers: list[torch.Tensor] = []
        self.newest: tuple[int, int] | None = None  # (version, buffer index) of the newest staged version
        self.leased: int | None = None  # the buffer index the searcher is loading from
        self.received = self.join_failures = self.receive_failures = 0
        self._error: BaseException | None = None
        self._closed = threading.Event()
        ray.get(board.register.remote(index, token))
        self._thread = threading.Thread(target=self._run, name="tba-weights-receiver", daemon=True)
        self._thread.start()
        self._beat = threading.Thread(target=self._beat_run, name="tba-weights-heartbeat", daemon=True)
        self._beat.start()

    @classmethod
    def open(cls, board, index: int, token: str) -> BroadcastReceiver:
        return cls(board, index, token)

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        if self._error is not None:
            raise RuntimeError(f"weights by broadcast: the receiver's thread failed: {self._error!r}") from self._error
        with self.lock:
            self.leased = None  # the previous fetch's tensors are loaded by now
            if self.newest is None or self.newest[0] <= newer_than:
                return None
            version, index = self.newest
            self.leased = index
            return version, self.layout.views(self.buffers[index])

    def metrics(self) -> dict[str, float]:
        return {
            "weights/received": float(self.received),
            "weights/join_failures": float(self.join_failures),
            "weights/receive_failures": float(self.receive_failures),
        }

    def _run(self) -> None:
        try:
            while not self._closed.is_set():
                group, pending = ray.get(self.board.poll.remote(self.generation, self.index))
                if group is not None:
                    self._join(*group)
                staged = -1 if self.newest is None else self.newest[0]
                if (
                    self.group is not None
                    and pending is not None
                    and pending[1] == self.generation
                    and pending[0] > staged
                ):
                    self._receive(pending[0])
                else:
                    time.sleep(POLL_S)
        except Exception as err:  # fetch raises it
            if not self._closed.is_set():
                self._error = err

    def _beat_run(self) -> None:
        """Tell the board this process lives, from a thread that no collective blocks (the trainer
        names the searchers that went silent when a broadcast fails)."""
        try:
            while not self._closed.wait(BEAT_S):
                ray.get(self.board.beat.remote(self.index))
        except Exception as err:  # fetch raises it
            if not self._closed.is_set():
                self._error = err

    def _join(self, generation: int, spec: dict) -> None:
        self.generation, self.group = generation, None
        if self.token not in spec["ranks"]:
            return
        try:
            group = _group(
                spec["host"], spec["port"], generation, spec["ranks"][self.token], spec["world"], self.timeout_s
            )
        except RuntimeError as err:  # the trainer forms it again
            self.join_failures += 1
            self.log(f"weights: searcher {self.index} could not join broadcast group {generation} ({_short(err)})")
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
        except RuntimeError as err:  # the group broke (another member died): wait for the next one
            self.group = None
            self.receive_failures += 1
            self.log(f"weights: searcher {self.index} lost the broadcast of version {version} ({_short(err)})")
            return
        with self.lock:
            self.newest = (version, index)
        self.received += 1

    def close(self) -> None:
        self._closed.set()

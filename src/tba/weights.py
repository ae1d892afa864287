"""Weight publishing: the trainer publishes a state dict with its version; searchers fetch the
newest one between two generation batches. For a LoRA policy the state dict holds the adapter's
tensors only (``tba.models.lora.published_state``); the stores treat both kinds alike.

``LocalWeightStore`` serves one process (the ``sync`` runtime, and tests). Transports for other
processes implement the same three methods. :class:`BackgroundPublisher` puts a thread in front of
any of them, so that the trainer does not wait while its weights travel.
"""

from __future__ import annotations

import threading
import time
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


def shares_memory(state_dict: dict[str, torch.Tensor], model: torch.nn.Module) -> bool:
    """Whether any entry of ``state_dict`` lives in the memory of ``model``'s parameters or buffers
    (no cast or copy made it its own), so that an optimizer step would change it."""
    live = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    return any(v.untyped_storage().data_ptr() in live for v in state_dict.values())


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


class BackgroundPublisher:
    """A :class:`WeightStore` front that publishes on a thread of its own, off the trainer's path:
    :meth:`publish` hands the state dict over and returns, and the thread puts it in ``store``
    (for the ray runtime: into the object store, then the board), while the trainer goes on with
    its next step.

    - **Newest wins**: a publication the thread has not started when a newer one arrives is
      dropped for it, and counted (``superseded``).
    - **Live weights**: a state dict that aliases the weights the optimizer will change (no cast
      made a copy: fp32, a LoRA adapter) must not change while the thread reads it. The trainer
      calls :meth:`settle` before each optimizer step, which waits for such a publication (the
      forward and backward passes, which only read the weights, overlap it).
    - **GPU tensors** are first copied into pinned host buffers allocated once (reused by every
      later publication of the same shapes) on a CUDA stream of the thread's own, after the work
      queued when the trainer handed them over; from then on the publication reads only its own
      copy, and the trainer need not wait for the rest (into the object store). A store that keeps
      GPU buffers of its own (``keeps_device``: CUDA IPC) copies into those instead, on that stream.
    - **Visibility**: ``visible_version`` is the newest version the store holds, which is what
      searchers can fetch.
    - **Errors**: an exception in the thread is raised on the trainer's next call here.
    """

    def __init__(self, store: WeightStore) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._pending: tuple | None = None  # state, version, whether it aliases live weights, CUDA event
        self._busy_live: bool | None = None  # the publication in flight (whether it reads live weights)
        self._error: BaseException | None = None
        self._closed = False
        self._pinned: dict[str, torch.Tensor] = {}  # host staging buffers for GPU tensors, by name
        self._stream = None  # the thread's CUDA stream, made on first use
        # a store with GPU buffers of its own (tba.runtime.shared_weights) takes GPU tensors as they are
        self._keeps_device = bool(getattr(store, "keeps_device", False))
        self.superseded = 0
        self.published = 0
        self.background_s = 0.0  # the thread's seconds, all publications
        self.last_background_s = 0.0
        self.visible_version = -1
        self._thread = threading.Thread(target=self._run, name="tba-publisher", daemon=True)
        self._thread.start()

    def publish(self, state_dict: dict[str, torch.Tensor], version: int, aliases: bool = True, prepare=None) -> None:
        """Hand ``state_dict`` over as ``version`` (``aliases``: it shares memory with the live
        weights). ``prepare``: a function the thread applies first that returns tensors of their
        own (the cast to the searchers' dtype); the state counts as live until it has run."""
        ready = None
        if any(v.is_cuda for v in state_dict.values()):  # the copy starts after what is queued now
            ready = torch.cuda.Event()
            ready.record()
        with self._cond:
            self._raise()
            if self._closed:
                raise RuntimeError("the publisher is closed")
            if self._pending is not None:
                self.superseded += 1
            self._pending = (state_dict, version, aliases, ready, prepare)
            self._cond.notify_all()

    def settle(self) -> float:
        """Wait until no publication, pending or in flight, reads the live weights; returns the
        seconds waited (time on the trainer's path)."""
        start = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not self._reads_live())
            self._raise()
        return time.perf_counter() - start

    def flush(self) -> None:
        """Wait until every handed-over publication is in the store (or was superseded)."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (self._pending is None and self._busy_live is None))
            self._raise()

    def close(self) -> None:
        """Publish what is pending, then stop the thread; raises what the thread raised."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (self._pending is None and self._busy_live is None))
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self._raise()

    def latest_version(self) -> int:
        return self.store.latest_version()

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        return self.store.fetch(newer_than)

    def _reads_live(self) -> bool:
        return bool(self._pending is not None and self._pending[2]) or bool(self._busy_live)

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._closed = True
            raise RuntimeError(f"publishing weights failed: {error!r}") from error

    def _stage(self, state: dict[str, torch.Tensor], ready) -> dict[str, torch.Tensor]:
        """``state`` with its GPU tensors copied into the pinned host buffers, on the thread's stream
        after ``ready`` (tied entries stay one tensor); the buffers are free again once the store
        has published (this thread stages the next publication only after that)."""
        stream = self._side_stream()
        out: dict[str, torch.Tensor] = {}
        done: dict[tuple, torch.Tensor] = {}
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            for name, v in state.items():
                key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), v.stride())
                if key not in done:
                    if v.is_cuda:
                        buf = self._pinned.get(name)
                        if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                            buf = self._pinned[name] = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                        buf.copy_(v.detach(), non_blocking=True)
                        v = buf
                    done[key] = v
                out[name] = done[key]
        stream.synchronize()
        return out

    def _side_stream(self):
        """The thread's CUDA stream for its copies, made on first use."""
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _on_device(self, state: dict[str, torch.Tensor], ready) -> dict[str, torch.Tensor]:
        """``state`` copied by the store into buffers of its own on the GPU (``stage``), on the thread's
        stream after ``ready``; the copy has landed when this returns."""
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            return self.store.stage(state)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                state, version, aliases, ready, prepare = self._pending
                self._pending, self._busy_live = None, aliases
            start = time.perf_counter()
            try:
                if prepare is not None:
                    state = prepare(state)
                    if ready is not None:  # the staging copy starts after the kernels prepare queued
                        ready = torch.cuda.Event()
                        ready.record()
                    else:  # tensors of its own now: the optimizer may go on
                        with self._cond:
                            self._busy_live = False
                            self._cond.notify_all()
                if ready is not None:  # GPU tensors: into the store's own GPU buffers, else to pinned host memory
                    state = self._on_device(state, ready) if self._keeps_device else self._stage(state, ready)
                    with self._cond:  # the publication reads its own copy from here on
                        self._busy_live = False
                        self._cond.notify_all()
                if self._busy_live and hasattr(self.store, "stage"):  # a store that copies first, then sends
                    state = self.store.stage(state)
                    with self._cond:
                        self._busy_live = False
                        self._cond.notify_all()
                self.store.publish(state, version)
            except BaseException as err:  # surfaces on the trainer's next call
                with self._cond:
                    self._error, self._busy_live = err, None
                    self._cond.notify_all()
                return
            del state
            with self._cond:
                took = time.perf_counter() - start
                self.background_s += took
                self.last_background_s = took
                self.published += 1
                self.visible_version = max(self.visible_version, version)
                self._busy_live = None
                self._cond.notify_all()

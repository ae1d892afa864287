"""Publication off the trainer's path: :class:`BackgroundPublisher` puts a thread in front of any
:class:`~tba.weights.base.Sender`, so that the trainer does not wait while its weights travel."""

from __future__ import annotations

import threading
import time

import torch

from tba.weights.base import Sender, State


class BackgroundPublisher(Sender):
    """A :class:`~tba.weights.base.Sender` in front of another that publishes on a thread of its own,
    off the trainer's path: :meth:`publish` hands the state dict over and returns, and the thread puts
    it in ``sender``
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
      copy, and the trainer need not wait for the rest (into the object store). A sender that keeps
      GPU buffers of its own (``keeps_device``: CUDA IPC) copies into those instead, on that stream.
    - **Staging**: a sender with a buffer of its own (:meth:`~tba.weights.base.Sender.stage`: the
      broadcast's send buffer, the shared slots) takes a copy of live weights first, and the
      optimizer goes on once it is made.
    - **Visibility**: ``visible_version`` is the newest version the sender holds, which is what
      searchers can fetch.
    - **Errors**: an exception in the thread is raised on the trainer's next call here.
    """

    def __init__(self, sender: Sender) -> None:
        super().__init__()
        self.sender = sender
        self.keeps_device = sender.keeps_device
        self._cond = threading.Condition()
        self._pending: tuple | None = None  # state, version, whether it aliases live weights, CUDA event
        self._busy_live: bool | None = None  # the publication in flight (whether it reads live weights)
        self._error: BaseException | None = None
        self._closed = False
        self._pinned: State = {}  # host staging buffers for GPU tensors, by name
        self._stream = None  # the thread's CUDA stream, made on first use
        self.superseded = 0
        self.published = 0
        self.background_s = 0.0  # the thread's seconds, all publications
        self.last_background_s = 0.0
        self._thread = threading.Thread(target=self._run, name="tba-publisher", daemon=True)
        self._thread.start()

    def publish(self, state_dict: State, version: int, *, aliases: bool = True, prepare=None) -> None:
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
        """Publish what is pending, stop the thread, then close the sender; raises what the thread
        raised."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or (self._pending is None and self._busy_live is None))
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        try:
            with self._cond:
                self._raise()
        finally:
            self.sender.close()

    def spec(self):
        return self.sender.spec()

    def object_ref(self, version: int):
        return self.sender.object_ref(version)

    def metrics(self) -> dict[str, float]:
        """The last publication's seconds on the thread, the publications superseded, and the
        transport's own counters."""
        with self._cond:
            self._raise()
            own = {"weights/publish_background_s": self.last_background_s, "weights/superseded": float(self.superseded)}
        return {**own, **self.sender.metrics()}

    def _reads_live(self) -> bool:
        return bool(self._pending is not None and self._pending[2]) or bool(self._busy_live)

    def _raise(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            self._closed = True
            raise RuntimeError(f"publishing weights failed: {error!r}") from error

    def _stage(self, state: State, ready) -> State:
        """``state`` with its GPU tensors copied into the pinned host buffers, on the thread's stream
        after ``ready`` (tied entries stay one tensor); the buffers are free again once the store
        has published (this thread stages the next publication only after that)."""
        stream = self._side_stream()
        out: State = {}
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

    def _on_device(self, state: State, ready) -> State | None:
        """``state`` copied by the sender into buffers of its own on the GPU (``stage``), on the
        thread's stream after ``ready``; the copy has landed when this returns (None: not staged)."""
        stream = self._side_stream()
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            return self.sender.stage(state)

    def _free_live(self) -> None:
        """The publication reads its own copy from here on: the optimizer may go on."""
        with self._cond:
            self._busy_live = False
            self._cond.notify_all()

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
                    else:  # tensors of its own now
                        self._free_live()
                if ready is not None:  # GPU tensors: into the sender's own GPU buffers, else to pinned host memory
                    staged = self._on_device(state, ready) if self.keeps_device else self._stage(state, ready)
                    if staged is not None:
                        state = staged
                        self._free_live()
                if self._busy_live:  # a sender with a buffer of its own copies first, then sends
                    staged = self.sender.stage(state)
                    if staged is not None:
                        state = staged
                        self._free_live()
                self.sender.publish(state, version)
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

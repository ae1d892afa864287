"""Reward calls off the generating thread: a pool of worker threads, each call with a deadline.

A streaming searcher hands the groups that leave its engine to a :class:`ScoringPool` and goes
on generating; what the pool has finished is collected between two engine steps. Reward functions
that wait (on a sandbox, a remote grader, a sleep) then cost the engine nothing, and a reward model
runs beside it. The functions must be thread-safe when ``workers`` > 1: calls for different groups
may run at once.

``timeout`` (seconds, per call, from its start): a call still running past it is given up: its tag
comes back in :meth:`ScoringPool.collect`'s second list, and the caller drops and counts what it was
scoring. Python cannot stop a thread, so the call runs on to its end in the background and its
result is ignored; the pool starts fresh threads for the calls that follow, so a reward function
that hangs for good costs one idle thread per hang, not the run.

An exception that escapes a call (a bug outside the per-sample guard of :mod:`tba.rewards`) is
raised again by :meth:`ScoringPool.collect`: the searcher fails loudly, and the runtime's failure
rules apply as they do to any exception in a searcher's step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait


class ScoringPool:
    def __init__(self, workers: int, timeout: float | None = None):
        if workers < 1:
            raise ValueError(f"a scoring pool needs at least one worker, got {workers}")
        if timeout is not None and timeout <= 0:
            raise ValueError(f"the reward timeout must be positive seconds, got {timeout}")
        self.workers, self.timeout = workers, timeout
        self._executor = self._new_executor()
        self._calls: dict[Future, tuple[object, list[float], Callable, tuple]] = {}  # call → (tag, start, fn, args)
        self.timed_out = 0  # calls given up
        self.busy_s = 0.0  # worker seconds spent in calls that finished

    def _new_executor(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(self.workers, thread_name_prefix="tba-reward")

    def submit(self, tag, fn: Callable, *args) -> None:
        """Run ``fn(*args)`` on a worker; ``tag`` comes back with its result."""
        box: list[float] = []  # the call's start, once a worker has taken it
        self._calls[self._executor.submit(self._timed, box, fn, *args)] = (tag, box, fn, args)

    @staticmethod
    def _timed(box: list[float], fn, *args):
        box.append(time.monotonic())
        result = fn(*args)
        return result, time.monotonic() - box[0]

    def _deadline(self, box: list[float]) -> float:
        """When a call is given up: ``timeout`` after it started (time queued behind others does
        not count)."""
        return box[0] + self.timeout if box and self.timeout is not None else float("inf")

    def pending(self) -> int:
        return len(self._calls)

    def pending_tags(self) -> list:
        return [call[0] for call in self._calls.values()]

    def collect(self, wait_s: float = 0.0) -> tuple[list[tuple[object, object]], list[object]]:
        """The calls that finished, as ``(tag, result)``, and the tags of calls given up at their
        deadline. Waits up to ``wait_s`` seconds for the first call to finish if none has."""
        if wait_s > 0 and self._calls and not any(f.done() for f in self._calls):
            nearest = min(self._deadline(call[1]) for call in self._calls.values())
            timeout = max(0.0, min(wait_s, nearest - time.monotonic()))
            wait(list(self._calls), timeout=timeout, return_when=FIRST_COMPLETED)
        done, expired, now = [], [], time.monotonic()
        for future, (tag, box, _, _) in list(self._calls.items()):
            if future.done():
                del self._calls[future]
                result, seconds = future.result()  # a call's own exception is raised here
                self.busy_s += seconds
                done.append((tag, result))
            elif now >= self._deadline(box):
                del self._calls[future]
                expired.append(tag)
        if expired:
            self.timed_out += len(expired)
            # the hung calls keep the old executor's threads: calls running there finish as they
            # would; calls still queued there move to fresh threads
            old, self._executor = self._executor, self._new_executor()
            for future, (tag, _, fn, args) in list(self._calls.items()):
                if future.cancel():
                    del self._calls[future]
                    self.submit(tag, fn, *args)
            old.shutdown(wait=False)
        return done, expired

    def close(self) -> list[object]:
        """Stop taking calls; the tags of those not finished (never waits for them)."""
        tags = self.pending_tags()
        self._calls.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)
        return tags

"""Searchers that come back: a searcher process that dies is restarted, a searcher that raises ends the run.

Each searcher actor is created with unlimited Ray restarts (``max_restarts=-1``): when its
process dies (killed, out of memory, a crash in native code, its node lost), Ray starts a new
one and runs ``__init__`` again, which loads the models; the new incarnation's first step pulls
the newest published weights. What Ray does not do is re-launch the ``run`` loop, and this pool
does, once the actor answers again. Groups already in the inbox (its own actor) are kept.

Deaths are counted per searcher; ``max_restarts`` deaths within ``window_s`` seconds end the run
with the last failure's message, and so does a searcher that has not come back ``window_s``
seconds after it died (a process that dies while loading its models, again and again, shows up
only as "restarting"). Two failures are never retried:

- a Python exception raised by the searcher's step (a bug, a reward function that escaped the
  per-sample guard): a restart would run the same code on the same kind of data and fail again,
  so the run ends at once with the searcher's traceback;
- an exception in the actor's constructor (a missing model, a bad setting): the same; where it
  is a :class:`tba.errors.UserError` (a vLLM engine that cannot start, say), the actor keeps it
  and raises it from its first call (:class:`tba.runtime.errors.CouldNotStart`), so that it comes
  back with its type, and the run ends as any bad input does, with its one line.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import ray
from ray.exceptions import RayActorError, RayError

from tba.runtime.errors import CouldNotStart, SearcherFailed

_POLL_S = 0.5  # how often a restarting searcher is asked whether it is back


class SearcherPool:
    """The searcher actors and their ``run`` loops; :meth:`check` between two trainer steps."""

    def __init__(
        self,
        actors: list,
        max_restarts: int,
        window_s: float,
        log: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.actors = actors
        self.max_restarts, self.window_s = max_restarts, window_s
        self.log, self.clock = log, clock
        self.runs: list = [a.run.remote() for a in actors]  # None while the searcher restarts
        self.waiting: dict[int, tuple[float, object | None, float]] = {}  # i → (died at, ready ref, last poll)
        self.deaths: list[deque[float]] = [deque() for _ in actors]
        self.restarts = 0

    def check(self) -> None:
        """Raise ``SearcherFailed`` if a searcher raised or keeps dying; restart those that died."""
        running = [ref for ref in self.runs if ref is not None]
        done, _ = ray.wait(running, num_returns=len(running), timeout=0) if running else ([], [])
        for ref in done:
            i = self.runs.index(ref)
            try:
                ray.get(ref)
            except RayActorError as err:
                self._died(i, err)
                continue
            except RayError as err:  # the searcher's own exception, with its traceback
                self._raised(i, err)
            raise SearcherFailed(f"searcher {i} stopped unexpectedly; the run stops")
        for i in list(self.waiting):
            self._poll(i)

    @staticmethod
    def _raised(i: int, err: RayError) -> None:
        """Searcher ``i``'s call raised ``err``: bad input met while it started (one line, exit 2, as
        any bad input), or its own exception (with its traceback)."""
        cause = getattr(err, "cause", None)
        if isinstance(cause, CouldNotStart):  # (an engine that cannot start, a model it cannot load)
            raise type(cause.error)(f"searcher {i} could not start: {cause.error}") from None
        raise SearcherFailed(f"a searcher failed (searcher {i}); the run stops.\n{err}") from None

    def _died(self, i: int, err: RayActorError) -> None:
        if err.actor_init_failed:
            raise SearcherFailed(f"a searcher failed (searcher {i}, while starting); the run stops.\n{err}")
        now, deaths = self.clock(), self.deaths[i]
        while deaths and now - deaths[0] > self.window_s:
            deaths.popleft()
        deaths.append(now)
        if len(deaths) > self.max_restarts:
            raise SearcherFailed(
                f"a searcher failed: searcher {i} died {len(deaths)} times within {self.window_s:g} s, more than "
                f"runtime.max_searcher_restarts={self.max_restarts} allows; the run stops. Its last failure:\n{err}\n"
                "Look for its cause (memory, a native crash) in the lines above, or raise "
                "runtime.max_searcher_restarts / lower runtime.restart_window_s to tolerate more."
            )
        self.restarts += 1
        self.runs[i] = None
        self.waiting[i] = (now, None, -_POLL_S)
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        self.log(f"searcher {i} died ({first}); restarting it (restart {self.restarts} of this run)")

    def _poll(self, i: int) -> None:
        died_at, ready, polled = self.waiting[i]
        now = self.clock()
        if ready is not None and ray.wait([ready], timeout=0)[0]:
            try:
                ray.get(ready)
            except RayActorError as err:
                if err.actor_init_failed:
                    raise SearcherFailed(
                        f"a searcher failed (searcher {i}, while restarting); the run stops.\n{err}"
                    ) from None
                ready = None  # still restarting: ask again later
            else:
                del self.waiting[i]
                self.runs[i] = self.actors[i].run.remote()
                self.log(f"searcher {i} is back after {now - died_at:.1f} s")
                return
        if now - died_at > self.window_s:
            raise SearcherFailed(
                f"a searcher failed: searcher {i} has not come back {self.window_s:g} s after it died; the run "
                "stops. Its process may be dying while it loads its models: look for the cause in the lines above."
            )
        if ready is None and now - polled >= _POLL_S:
            ready, polled = self.actors[i].__ray_ready__.remote(), now
        self.waiting[i] = (died_at, ready, polled)

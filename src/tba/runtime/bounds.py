"""Bounds on replay and staleness in the asynchronous runtime: the trainer waits instead of
overtraining on old data when searchers fall behind (a loaded machine, a slow reward, a searcher
restarting), so that a run's result is a property of its config rather than of the machine's load.

**Replay** (``trainer.max_replay_ratio`` R, over ``trainer.replay_window`` W steps): before each
step, the samples the last W steps trained (this one included: W·B, or fewer steps at the start)
may be at most R times the samples that arrived from searchers since the first of those steps
began (from the start of the run while fewer than W steps are done, so the initial fill counts).
A step that would exceed it waits for new groups.

**Staleness** (``runtime.max_lag`` L, AReaL's rule): the trainer, at version v, takes the step to
v + 1 only if v + 1 − u ≤ L, u the oldest weight version a live searcher can still send a group
from, by its latest report (``searcher/oldest_version``). For a batch searcher that is the version
of its latest batch: its batch in progress started from weights at least as new. A streaming
searcher's groups finish out of order, so a group sent later can be older than its latest ones;
it reports the oldest version among its prompts in flight. Either way a group arrives while the
trainer is at most at u + L: every batch is trained first at most L versions
after the weights that generated it (``train/lag_fresh`` ≤ L); replayed data grows older in the
buffer, which the replay bound limits. A searcher that is restarting is left out of u while it
restarts, and one that has not delivered a batch yet is not counted (after a restart, it counts
again from its first new batch, which uses the newest weights); if every searcher is restarting,
only the replay bound holds the trainer, and the restart limits end the run if none comes back.
L must be at least ``trainer.sync_interval`` k: weights reach searchers every k steps, so a
smaller L would wait for weights the trainer has not published.

The gate is plain bookkeeping, with no clock and no Ray: the runtime asks :meth:`StepGate.blocked`
before each step, waits (draining the inbox) while it returns a reason, and reports each step and
each arrival.
"""

from __future__ import annotations

from collections import deque


class StepGate:
    def __init__(self, batch_samples: int, max_replay_ratio: float | None, window: int, max_lag: int | None):
        if batch_samples < 1 or window < 1:
            raise ValueError(f"batch_samples and window must be positive, got {batch_samples} and {window}")
        self.batch_samples = batch_samples
        self.max_replay_ratio = max_replay_ratio
        self.max_lag = max_lag
        self.arrived = 0  # samples delivered by searchers since the start
        self.trained = 0  # samples trained on since the start
        # arrivals counted when each of the window's steps began waiting; the first is 0 (the fill counts)
        self.bases: deque[int] = deque([0], maxlen=window)

    def add_arrivals(self, samples: int) -> None:
        self.arrived += samples

    def replay_ratio(self) -> float:
        """Samples the window's steps train (the next one included) per sample that arrived since
        the window began; inf when nothing did."""
        arrived = self.arrived - self.bases[0]
        trained = len(self.bases) * self.batch_samples
        return trained / arrived if arrived else float("inf")

    def blocked(self, version: int, searcher_versions: list[int]) -> str | None:
        """Why the trainer at ``version`` must wait before its next step (``"replay"`` or ``"lag"``),
        or None. ``searcher_versions``: the weight versions of the live searchers' latest batches."""
        if self.max_replay_ratio is not None and self.replay_ratio() > self.max_replay_ratio:
            return "replay"
        if self.max_lag is not None and searcher_versions and version + 1 - min(searcher_versions) > self.max_lag:
            return "lag"
        return None

    def stepped(self) -> None:
        """The step was taken; the next one's window entry begins now."""
        self.trained += self.batch_samples
        self.bases.append(self.arrived)


class Starvation:
    """Notices a trainer that waits for data the searchers keep failing to deliver: after it has
    waited ``after_s`` seconds while the searchers generated completions and none arrived (every
    group dropped: empty completions, failed rewards), :meth:`check` returns a message, once per
    wait. Without it such a run sits at the bounds with no word why. Plain bookkeeping: the
    caller passes the clock and the counts."""

    def __init__(self, after_s: float = 60.0):
        self.after_s = after_s
        self.start = self.arrived = self.generated = 0.0
        self.said = False

    def begin(self, now: float, arrived: float, generated: float) -> None:
        """A wait starts: ``arrived`` samples delivered so far, ``generated`` completions made so far."""
        self.start, self.arrived, self.generated, self.said = now, arrived, generated, False

    def check(self, now: float, arrived: float, generated: float) -> str | None:
        if self.said or now - self.start < self.after_s or arrived > self.arrived or generated <= self.generated:
            return None
        self.said = True
        return (
            f"the trainer has waited {now - self.start:.0f} s for data: the searchers generated "
            f"{generated - self.generated:.0f} completions meanwhile and dropped every one (see "
            "searcher/empty_completions and searcher/reward_errors; reward tracebacks in errors.log). "
            "A reward function that fails on every sample, or a policy that only answers with the end "
            "token, gives the trainer nothing to train on: stop the run (what was written is kept) and "
            "fix the reward, or start again with a smaller trainer.lr"
        )

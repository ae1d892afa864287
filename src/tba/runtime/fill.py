"""The initial fill, watched: before its first step the trainer waits until the replay buffer can
draw a batch (``buffer.min_groups`` groups, at least ``trainer.batch_prompts`` prompts with
``buffer.min_completions`` distinct completions each). A run whose searchers deliver nothing the
buffer can take would wait there forever: every completion empty, unfinished and unscored, a reward
function that fails on each one, groups cut below two completions, duplicates only.

:class:`Fill` counts the prompts the searchers have drawn since the buffer last gained a prompt it
can sample (each delivered group is one prompt, each dropped group one more). After
:data:`NOTICE_BATCHES` generation batches' worth of prompts with no gain it says once what the
searchers delivered and why none of it could train; after ``buffer.fill_patience`` batches' worth it
stops the run with that line (:class:`NothingToTrain`: ``tba train`` exits 2). Plain bookkeeping,
with no clock: the verdict depends on what was drawn, never on how fast.
"""

from __future__ import annotations

from collections.abc import Callable

from tba.buffer import ReplayBuffer
from tba.errors import UserError

NOTICE_BATCHES = 4  # batches' worth of prompts with nothing sampleable before the notice

# the searchers' counters of completions that could not train, as the line names them
REASONS = (
    ("searcher/empty_completions", "empty (only end tokens)"),
    ("searcher/unfinished", "unfinished (cut at generation.max_new_tokens)"),
    ("searcher/reward_errors", "failed in a reward function"),
    ("searcher/reward_timeouts", "past task.reward_timeout"),
    ("searcher/reward_non_finite", "given a reward that is not finite"),
    ("searcher/no_reward", "scored by no reward function"),
    ("searcher/environment_errors", "lost to an environment's error"),
)


class NothingToTrain(UserError, RuntimeError):
    """The searchers delivered nothing the replay buffer could sample within ``buffer.fill_patience``."""


class Fill:
    def __init__(
        self,
        buffer: ReplayBuffer,
        batch_prompts: int,
        min_groups: int,
        prompts_per_batch: int,
        patience: int | None,
        say: Callable[[str], None],
        min_completions: int = 2,
    ) -> None:
        self.buffer = buffer
        self.batch_prompts, self.min_groups = batch_prompts, min_groups
        self.prompts_per_batch = max(1, prompts_per_batch)
        self.patience = patience  # batches' worth of prompts; None: wait as long as it takes
        self.say = say
        self.min_completions = min_completions
        self.best = int(buffer.stats()["buffer/eligible_prompts"])  # (a resumed run's buffer has some)
        self.stalled = 0  # prompts drawn since the buffer last gained a sampleable prompt
        self.prompts = self.groups = 0  # drawn and delivered during the fill
        self.said = False

    def ready(self) -> bool:
        return self.buffer.num_prompts >= self.min_groups and self.buffer.can_sample(self.batch_prompts)

    def observe(self, groups: int, dropped: int, counters: dict[str, float]) -> None:
        """A delivery: ``groups`` groups taken into the buffer, ``dropped`` prompts the searchers
        dropped, and their cumulative ``counters`` (``searcher/*``). Says the line once after the
        notice, and raises :class:`NothingToTrain` with it after the patience."""
        self.prompts += groups + dropped
        self.groups += groups
        eligible = int(self.buffer.stats()["buffer/eligible_prompts"])
        if eligible > self.best:
            self.best, self.stalled = eligible, 0
            return
        self.stalled += groups + dropped
        if self.ready():
            return
        if self.patience is not None and self.stalled >= self.patience * self.prompts_per_batch:
            raise NothingToTrain(self.line(counters) + self.stop_advice())
        if not self.said and self.stalled >= NOTICE_BATCHES * self.prompts_per_batch:
            self.said = True
            self.say(self.line(counters) + "; the run stops " + self.when())

    def when(self) -> str:
        if self.patience is None:
            return "never for this (buffer.fill_patience=null)"
        return f"after {self.patience} batches' worth of prompts with nothing to train on (buffer.fill_patience)"

    def line(self, counters: dict[str, float]) -> str:
        """What the searchers delivered and why the buffer cannot draw a batch from it."""
        made = int(counters.get("searcher/completions", 0))
        why = [f"{int(counters[k])} {label}" for k, label in REASONS if counters.get(k)]
        b = self.buffer.stats()
        line = (
            f"initial fill: {self.prompts} prompts drawn, nothing to train on yet: the searchers generated "
            f"{made} completions" + (f", of which {', '.join(why)}" if why else "")
        )
        line += f"; {self.groups} groups reached the trainer"
        if counters.get("searcher/dropped_groups"):
            line += f" ({int(counters['searcher/dropped_groups'])} dropped with fewer than two usable completions)"
        line += (
            f"; the buffer holds {int(b['buffer/prompts'])} prompts, {int(b['buffer/eligible_prompts'])} with "
            f"buffer.min_completions={self.min_completions} distinct completions "
            f"({int(b['buffer/duplicates'])} duplicates), and a batch needs {max(self.batch_prompts, self.min_groups)}"
        )
        return line

    @staticmethod
    def stop_advice() -> str:
        return (
            ". Look at a few completions (errors.log holds the reward functions' tracebacks): a policy that "
            "answers only with its end token, a reward function that fails on every reply, or a token budget "
            "too small for an answer (raise generation.max_new_tokens, or set generation.unfinished_reward) "
            "gives the trainer nothing; buffer.fill_patience sets how long the fill may try"
        )

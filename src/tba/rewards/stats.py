"""What reward functions did over a run: failures counted per function, first tracebacks kept for errors.log."""

from __future__ import annotations

from dataclasses import dataclass, field

from tba.rewards.base import RewardFn

# --------------------------------------------------------------------------------------------
# During a run


@dataclass
class _Failure:
    what: str  # "raised on completion 3 of 8", "returned nan for completion 3 of 8", ...
    details: str = ""  # traceback text, for exceptions
    non_finite: bool = False


@dataclass
class RewardStats:
    """Cumulative reward counters of one searcher."""

    errors: int = 0  # failed (function, sample) evaluations of any kind
    non_finite: int = 0  # the subset that returned NaN or inf
    no_reward: int = 0  # samples every function answered None for (dropped, not given 0)
    last_means: dict[str, float] = field(default_factory=dict)  # per function, over the latest batch
    reported: set[str] = field(default_factory=set, repr=False)  # functions whose first failure is recorded
    # (function, its first failure) not yet taken
    unreported: list[tuple[str, str]] = field(default_factory=list, repr=False)

    def _record(self, rf: RewardFn, failure: _Failure) -> None:
        self.errors += 1
        self.non_finite += failure.non_finite
        if rf.name not in self.reported:  # later failures of a function are only counted
            self.reported.add(rf.name)
            details = f"\n{failure.details}" if failure.details else ""
            self.unreported.append((rf.name, f"reward function {rf.label} {failure.what}{details}"))

    def metrics(self) -> dict[str, float]:
        out = {
            "searcher/reward_errors": float(self.errors),
            "searcher/reward_non_finite": float(self.non_finite),
            "searcher/no_reward": float(self.no_reward),
        }
        out.update({f"reward/{name}_mean": mean for name, mean in self.last_means.items()})
        return out

    def take_new_errors(self) -> list[str]:
        """The first failure of each function (header line + traceback), each returned once."""
        out, self.unreported = self.unreported, []
        return [text for _, text in out]

    def fork(self) -> RewardStats:
        """Empty counters for one call on a scoring thread, knowing which functions have already
        reported their first failure; :meth:`merge` adds them back."""
        return RewardStats(reported=set(self.reported))

    def merge(self, other: RewardStats) -> None:
        """Add the counts of a :meth:`fork`; a first failure two calls both saw is kept once."""
        self.errors += other.errors
        self.non_finite += other.non_finite
        self.no_reward += other.no_reward
        if other.last_means:
            self.last_means = dict(other.last_means)
        for name, text in other.unreported:
            if name not in self.reported:
                self.reported.add(name)
                self.unreported.append((name, text))

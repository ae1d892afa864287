"""What a searcher keeps between two processes: its full state for a checkpoint of the sync
runtime (:meth:`Resumable.state_dict`), and its place in its prompts for the ray runtime
(:meth:`Resumable.place`), so that a restarted or resumed searcher draws what it would have drawn next."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from tba.generation.explore import ExploringGenerator
from tba.generation.turns import TurnCounts
from tba.types import SearcherReport


@dataclass
class SearcherStats:
    completions: int = 0
    tokens: int = 0
    empty: int = 0
    unfinished: int = 0
    dropped_groups: int = 0
    weight_updates: int = 0
    reward_timeouts: int = 0  # samples whose reward call ran past task.reward_timeout (dropped)
    turns: int = 0  # multi-turn: the model's replies
    tool_calls: int = 0
    tool_errors: int = 0  # calls that could not be read, or raised
    tool_timeouts: int = 0  # calls past task.tool_timeout
    environment_errors: int = 0  # conversations dropped because their environment raised

    def add_turns(self, counts: TurnCounts) -> None:
        """A batch of conversations' counts (multi-turn rollouts)."""
        self.turns += counts.turns
        self.tool_calls += counts.tool_calls
        self.tool_errors += counts.tool_errors
        self.tool_timeouts += counts.tool_timeouts
        self.environment_errors += counts.environment_errors


class Resumable:
    """:class:`tba.searcher.base.Searcher`'s state, as plain data."""

    def in_flight(self) -> int:
        """Prompts drawn and neither sent nor dropped yet: none between two batches."""
        return 0

    def place(self) -> dict:
        """Where the searcher is in its prompts (plain data): the prompt sampler's random state, the
        task's place in its order, the prompts drawn so far, and those of them still in flight. The
        ray runtime keeps each searcher's latest place with its groups: a searcher started again from
        it (after its process died, or in a resumed run) draws the prompts this one would have drawn
        next, instead of its epoch again from the start. Prompts in flight are not drawn again
        (counted as lost); a batch searcher has none between batches, so what a killed one was
        generating is drawn again."""
        return {
            "rng": list(self.rng.getstate()),
            "task": self.task.sampler_state(),
            "drawn": self.drawn,
            "in_flight": self.in_flight(),
        }

    def report(self) -> SearcherReport:
        """What the trainer's side takes from each batch besides its groups: the counters, the
        :meth:`place` after it and the draws dropped since the last report (taken), for the prompt
        ledger (:mod:`tba.runtime.ledger`), and the oldest version it sends from now on."""
        dropped, self.dropped_draws = self.dropped_draws, []
        return SearcherReport(
            self.searcher_id, self.metrics(), self.place(), dropped, oldest_version=self.oldest_version()
        )

    def resume_place(self, place: dict) -> None:
        """Continue from a :meth:`place` of this searcher's earlier process (or of a checkpoint)."""
        version, internal, gauss = place["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.task.load_sampler_state(place["task"])
        self.drawn = place["drawn"]

    def state_dict(self) -> dict:
        """What a resumed run needs to continue as if never stopped: the weight version, the random
        states (prompt sampling, exploration), the task's place in its prompt order, the counters,
        and the reference where TBA′ moved it (its weights: older policies are gone by then)."""
        state = {
            "searcher_id": self.searcher_id,
            "version": self.version,
            "rng": list(self.rng.getstate()),
            "task": self.task.sampler_state(),
            "drawn": self.drawn,
            "ref_epoch": self.ref_epoch,
            "stats": asdict(self.stats),
            "reward_stats": {
                "errors": self.reward_stats.errors,
                "non_finite": self.reward_stats.non_finite,
                "no_reward": self.reward_stats.no_reward,
                "reported": sorted(self.reward_stats.reported),
            },
        }
        if isinstance(self.generator, ExploringGenerator):  # its draws
            state["generator"] = {"rng": list(self.generator.rng.getstate()), "explored": self.generator.explored}
        if self.ref_epoch > 0:
            state["reference"] = self.reference.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. The sampler's weights are not part of it: the runtime
        republishes the weights of ``state["version"]`` (or newer), which :meth:`pull_weights` loads."""
        if state["searcher_id"] != self.searcher_id:
            raise ValueError(f"state of searcher {state['searcher_id']} given to searcher {self.searcher_id}")
        self.version = state["version"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.task.load_sampler_state(state["task"])
        self.drawn = state.get("drawn", 0)
        self.ref_epoch = state["ref_epoch"]
        if "reference" in state:
            self.reference.load_state_dict(state["reference"])
        self.stats = SearcherStats(**state["stats"])
        r = state["reward_stats"]
        self.reward_stats.errors, self.reward_stats.non_finite = r["errors"], r["non_finite"]
        self.reward_stats.no_reward, self.reward_stats.reported = r["no_reward"], set(r["reported"])
        if "generator" in state:
            version, internal, gauss = state["generator"]["rng"]
            self.generator.rng.setstate((version, tuple(internal), gauss))
            self.generator.explored = state["generator"]["explored"]

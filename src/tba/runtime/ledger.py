"""The trainer's account of every prompt the searchers drew: delivered (in the buffer, to be
trained), dropped (a group without two usable completions, counted by the searcher), in flight
(a stream's, at its latest report), or none of these (lost with a process that died, or a gap
that should not happen). Each group carries its draw (:attr:`tba.types.RolloutGroup.draw`: the
prompt's place among those its searcher drew, continued across restarts and resumes by the
searcher's place), so a prompt drawn twice shows as delivered twice and a prompt skipped as a gap.

It is saved in checkpoints (``extra["prompts"]``) and restored on resume, so that it describes the
run as it continues. It keeps each searcher's latest place as of the groups taken in, which is
where a resumed run's searchers go on from: what a killed trainer had received after its last
checkpoint is drawn again, and counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tba.types import SearcherReport


def _ranges(values: set[int]) -> list[list[int]]:
    """``values`` as sorted [start, end) ranges (the checkpoint's form: short for contiguous draws)."""
    out: list[list[int]] = []
    for v in sorted(values):
        if out and out[-1][1] == v:
            out[-1][1] = v + 1
        else:
            out.append([v, v + 1])
    return out


def _values(ranges: list[list[int]]) -> set[int]:
    return {v for start, end in ranges for v in range(start, end)}


@dataclass
class SearcherAccount:
    delivered: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)
    twice: int = 0
    """Draws that arrived again after they had been delivered or dropped."""
    place: dict | None = None
    """The searcher's place at its latest report the trainer took in (:meth:`Searcher.place`)."""

    @property
    def drawn(self) -> int:
        return self.place["drawn"] if self.place else 0

    @property
    def in_flight(self) -> int:
        return self.place.get("in_flight", 0) if self.place else 0

    @property
    def unaccounted(self) -> int:
        """Drawn, and neither delivered, dropped nor in flight: lost with a process that died."""
        return self.drawn - len(self.delivered) - len(self.dropped) - self.in_flight

    def note(self, draw: int, into: set[int]) -> None:
        if draw in self.delivered or draw in self.dropped:
            self.twice += 1
        into.add(draw)


class PromptLedger:
    def __init__(self) -> None:
        self.accounts: dict[int, SearcherAccount] = {}

    def record(self, groups: list, reports: dict[int, SearcherReport]) -> None:
        """What arrived: ``groups`` (any searcher's), and each searcher's report as the inbox hands
        it over: the draws it dropped since its previous report, and its place after them
        (:meth:`tba.searcher.base.Searcher.place`)."""
        for g in groups:
            if g.draw is not None:
                a = self.accounts.setdefault(g.searcher_id, SearcherAccount())
                a.note(g.draw, a.delivered)
        for i, report in reports.items():
            a = self.accounts.setdefault(i, SearcherAccount())
            for draw in report.dropped_draws:
                a.note(draw, a.dropped)
            if report.place is not None:
                a.place = report.place

    def places(self) -> dict[int, dict]:
        """Each searcher's latest place: where a resumed run's searchers go on from."""
        return {i: a.place for i, a in self.accounts.items() if a.place is not None}

    def metrics(self) -> dict[str, float]:
        """The run's totals, logged with each step (``prompts/...``)."""
        accounts = self.accounts.values()
        return {
            "prompts/drawn": float(sum(a.drawn for a in accounts)),
            "prompts/delivered": float(sum(len(a.delivered) for a in accounts)),
            "prompts/dropped": float(sum(len(a.dropped) for a in accounts)),
            "prompts/in_flight": float(sum(a.in_flight for a in accounts)),
            "prompts/unaccounted": float(sum(a.unaccounted for a in accounts)),
            "prompts/twice": float(sum(a.twice for a in accounts)),
        }

    def summary(self) -> dict[str, dict]:
        """Per searcher, for ``summary.json``: the counts, and the draws missing below the latest."""
        out = {}
        for i, a in sorted(self.accounts.items()):
            seen = a.delivered | a.dropped
            top = max(seen, default=-1) + 1
            out[str(i)] = {
                "drawn": a.drawn,
                "delivered": len(a.delivered),
                "dropped": len(a.dropped),
                "in_flight": a.in_flight,
                "unaccounted": a.unaccounted,
                "twice": a.twice,
                "gaps": _ranges(set(range(top)) - seen),
            }
        return out

    def state_dict(self) -> dict:
        return {
            str(i): {
                "delivered": _ranges(a.delivered),
                "dropped": _ranges(a.dropped),
                "twice": a.twice,
                "place": a.place,
            }
            for i, a in self.accounts.items()
        }

    def load_state_dict(self, state: dict) -> None:
        self.accounts = {
            int(i): SearcherAccount(_values(s["delivered"]), _values(s["dropped"]), s["twice"], s["place"])
            for i, s in state.items()
        }

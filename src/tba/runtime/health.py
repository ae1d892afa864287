"""A run that falls below where it started: noticed at the evaluation that shows it, logged as
``eval/gain`` (each evaluation minus the first) and ``eval/below_start``, and said on the console
and in ``errors.log`` with what the trainer saw since the previous evaluation (the lag of new data,
flat groups, gradient norm, log Z, KL, dropped terms) beside the same signals over the run's first
interval, while the run goes on."""

from __future__ import annotations

import dataclasses
import math
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from tba.metrics import read_metrics
from tba.objectives.needs import needs

if TYPE_CHECKING:
    from tba.hardware import Hardware

# the training signals that preceded a fall, as (metric, label, how the interval is summarised)
SIGNALS = (
    ("train/lag_fresh", "lag of new data", "mean"),
    ("buffer/arrival_lag_max", "arrival lag max", "max"),
    ("train/flat_groups", "flat groups", "mean"),
    ("train/grad_norm", "grad norm", "median"),
    ("train/log_z", "log Z", "last"),
    ("train/kl", "KL", "mean"),
    ("train/tb_dropped", "dropped", "mean"),
)
RATES = ("eval/accuracy", "eval/win_rate", "eval/attack_success_rate")
LOWER_LR = "A lower trainer.lr steadies a run that swings."
BAND = (
    "The sequence band (objective.tb_trust_region=0.5 on the sequence log-ratio, the ray runtime's default) "
    "steadied trajectory balance where plain TB fell (docs/runtimes.md, 'What staleness costs trajectory balance'); "
    "so does a lower trainer.lr."
)


def remedy(objective: str, trust_region: float | None) -> str:
    """What to suggest after a fall: the sequence band for plain trajectory balance (``objective``:
    the plan's objective; ``trust_region``: the plan's band)."""
    return BAND if needs(objective).balance and trust_region is None else LOWER_LR


def _summarise(values: list[float], how: str) -> float:
    if how == "max":
        return max(values)
    if how == "median":
        return statistics.median(values)
    if how == "last":
        return values[-1]
    return statistics.fmean(values)


class FallWatch:
    """Watches the logged records of one run for evaluations below the first one.

    ``observe`` takes every record as it is logged (training steps and evaluations, in step order
    or, with evaluation in the background, an evaluation after the steps that followed it) and
    returns a message when an evaluation falls below the start by more than its noise: one
    standard error of the start for a rate over ``eval/problems`` problems (a problem or two of
    256 is not a fall), any drop for other metrics. It speaks once per fall: again only after an
    evaluation has come back above the line."""

    def __init__(
        self, key: str, initial: float | None = None, problems: float | None = None, advice: str = LOWER_LR
    ) -> None:
        self.key, self.advice = key, advice
        self.initial = initial
        self.margin = 0.0
        if initial is not None:
            self._set_margin(initial, problems)
        self.window: dict[str, list[float]] = {}  # signals since the previous evaluation
        self.first: dict[str, float] | None = None  # the same over the run's first interval
        self.below = False

    def _set_margin(self, initial: float, problems: float | None) -> None:
        if self.key in RATES and problems:
            self.margin = math.sqrt(max(initial * (1 - initial), 0.0) / problems)

    @classmethod
    def start(cls, key: str, initial: dict, run_dir: Path, advice: str = LOWER_LR) -> FallWatch:
        """The watch of a run that begins with the evaluation ``initial`` (empty when it comes
        later from the evaluation actor, or when a resumed run reads its start from ``metrics.jsonl``)."""
        if initial.get(key) is not None:
            return cls(key, float(initial[key]), initial.get("eval/problems"), advice)
        path = run_dir / "metrics.jsonl"
        return cls.from_history(key, read_metrics(path) if path.is_file() else [], advice)

    @classmethod
    def from_history(cls, key: str, history: list[dict], advice: str = LOWER_LR) -> FallWatch:
        """A resumed run's watch: the start is the first evaluation in ``metrics.jsonl``."""
        evals = [r for r in history if r.get(key) is not None]
        if not evals:
            return cls(key, advice=advice)
        return cls(key, evals[0][key], evals[0].get("eval/problems"), advice)

    def observe(self, step: int, record: dict) -> str | None:
        """Note ``record`` (logged at ``step``); add ``eval/gain`` and ``eval/below_start`` to an
        evaluation's record; return what to say if it shows a fall."""
        for key, _, _ in SIGNALS:
            if record.get(key) is not None:
                self.window.setdefault(key, []).append(float(record[key]))
        value = record.get(self.key)
        if value is None:
            return None
        if self.initial is None:  # the first evaluation is the start
            self.initial = float(value)
            self._set_margin(self.initial, record.get("eval/problems"))
            return None
        signals = {key: _summarise(v, how) for key, _, how in SIGNALS if (v := self.window.get(key))}
        self.window = {}
        if self.first is None:
            self.first = signals
        gain = float(value) - self.initial
        below = gain < -self.margin
        record["eval/gain"] = gain
        record["eval/below_start"] = float(below)
        said, self.below = self.below, below
        if not below or said:
            return None
        name = self.key.split("/", 1)[1]
        rate = self.key in RATES
        show = (lambda x: f"{x:.1%}") if rate else (lambda x: f"{x:.3f}")
        parts = []
        for key, label, _ in SIGNALS:
            if key in signals:
                then = (
                    f" (first interval {self.first[key]:.3g})"
                    if key in self.first and self.first is not signals
                    else ""
                )
                parts.append(f"{label} {signals[key]:.3g}{then}")
        preceded = f"; since the previous evaluation: {', '.join(parts)}" if parts else ""
        return (
            f"step {step}: {name} {show(float(value))} is below the start ({show(self.initial)}){preceded}. "
            f"The run goes on. {self.advice}"
        )


class SlowdownWatch:
    """Watches the pace of a run's steps (generation and training; in the ray runtime a step and its
    wait for data) for the moment they become several times slower than at the start, which on a
    CPU is most often another process taking the cores that the run's threads were planned on (the
    plan leaves alone those busy at the start: :func:`tba.plan.placement.planned_threads`). Then it
    asks how busy the cores are (``measure``: the cores' worth that other processes keep busy,
    :func:`tba.machine.busy_cores`); if other processes hold a core, it says so once, with the
    setting that leaves it to them. If none does (longer completions, a slower task: the run's own
    business), it says nothing and asks again only after ``start`` more steps. ``hardware``: the
    plan's (its cores; the busy ones are counted whole as there: :attr:`tba.hardware.Hardware.busy_cpus`).
    ``factor`` 2: a busy core slows every-core threads several times more than the plan's threads
    (``benchmarks/results/load/README.md`` has the figures)."""

    def __init__(
        self,
        hardware: Hardware,
        threads: int | None,
        measure,
        factor: float = 2.0,
        start: int = 20,
        recent: int = 5,
        side_by_side: bool = False,
    ):
        """``threads``: the run's on this machine (None: torch's default); ``side_by_side``: they
        are the ray runtime's trainer and searchers, one process each, which ``--run.threads`` does
        not bring under one thread each."""
        self.hardware, self.threads, self.measure, self.side_by_side = hardware, threads, measure, side_by_side
        self.factor, self.start, self.recent = factor, start, recent
        self.times: list[float] = []
        self.said = False
        self.quiet_until = 0  # no measurement before this many steps (after one that found no load)

    def observe(self, seconds: float) -> str | None:
        """``seconds``: one step's; a message the first time the median of the last ``recent`` steps
        is ``factor`` times that of the first ``start`` (after three to warm up) while other
        processes keep a core busy, else None."""
        if self.said:
            return None
        self.times.append(seconds)
        first = self.times[3 : 3 + self.start]
        if len(self.times) < max(3 + self.start + self.recent, self.quiet_until):
            return None
        then, now = statistics.median(first), statistics.median(self.times[-self.recent :])
        if not then > 0 or now < self.factor * then:
            return None
        now_busy = dataclasses.replace(self.hardware, busy=self.measure())
        busy, cpus = now_busy.busy_cpus, now_busy.cpus
        if not busy:
            self.quiet_until = len(self.times) + self.start
            return None
        self.said = True
        threads = "torch's default threads" if self.threads is None else f"{self.threads} thread(s)"
        free = max(1, cpus - busy)
        if self.threads is not None and self.threads <= free:
            advice = f"Its {threads} fit the free core(s); freeing the busy ones brings back the pace."
        elif self.side_by_side:
            advice = (
                f"Its trainer and searchers, side by side, run {threads} on {free} free core(s) and wait on "
                "each other: free the cores (on a machine that stays this busy, the sync runtime takes "
                "turns on one thread: --runtime.type=sync)."
            )
        else:
            advice = (
                "Threads that share a core with another process wait on each other: stop the run and "
                f"continue it with --run.resume=true --run.threads={free}, or free the cores."
            )
        return (
            f"steps take {now / then:.1f}x as long as at the start ({now:.2f} s against {then:.2f} s). {busy} of "
            f"this machine's {cpus} core(s) are busy with other processes now, and the run planned {threads} "
            f"at the start. {advice}"
        )

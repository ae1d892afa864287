"""The cost model held to every run: the run measures its parts as it trains, predicts its own pace
from its first steps, and says at the end how far the rest of the run was from that prediction and
what its parts predict for the other layouts.

The parts (:class:`tba.plan.cost.StepParts`) come from each step's record and the loop's
:class:`~tba.runtime.loop.StepClock`:

- ``train_s``: the trainer's optimizer step (``train/step_s``);
- ``publish_s``: a publication's seconds on the trainer's path (``train/publish_s``), per publication;
- ``load_s``: a searcher's load of one publication (``weights/load_s``, the slowest searcher's latest);
- ``generate_s``: a searcher's batch as the searcher's own calls measure it, a load left out (the
  sync runtime: ``searcher/generate_s`` each step; the ray runtime: the searchers' seconds a
  completion, their pauses under ``runtime.max_ahead`` left out, ``searcher/active_s_per_completion``,
  times a batch's completions);
- ``generate_cpu_s`` and ``train_cpu_s``: the same in CPU seconds (below);
- ``overhead_s``: the rest of a step's active time (draining the inbox, the buffer, the ledger):
  the step less the wait for data (ray) or the generation (sync), the optimizer and the publication.

Evaluation and checkpoint pauses are the observers' time (``pause_s`` a step), kept apart from the
step, as the step clock keeps them out of the trainer's busy fraction.

The first step is left out of both windows (its allocations and first calls are not the run's
pace). The next :func:`early_steps` steps measure the parts that predict the rest of the run; that
prediction is printed when they are done and held to the steps after them, which it never saw.
At the end the whole run's parts (the first step left out) predict the sync runtime and the ray
runtime with 1, 2 and 4 searchers, on the devices this run had. On a machine without GPUs the
processes share its cores: the trainer's CPU seconds a step (the process's, every thread's, in
the loop's active time; the sync runtime's generation left out) and a searcher's a batch (the
sync runtime's: ``searcher/generate_cpu_s``; the ray runtime's: ``searcher/cpu_per_completion_s``)
say how many cores each keeps busy (:mod:`tba.plan.cost`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from tba.config import GenerationConfig, TrainerConfig
from tba.errors import UserError
from tba.machine import usable_cores
from tba.plan.cost import Layout, Prediction, StepParts, cores_left, predict

ALTERNATIVE_SEARCHERS = (1, 2, 4)


def early_steps(steps: int) -> int:
    """Steps whose parts predict the rest: a tenth of the run, 5 to 50; 0 (no held-out
    prediction) when the run leaves fewer than as many steps after them."""
    n = min(50, max(5, steps // 10))
    return n if steps - 1 >= 2 * n else 0


@dataclass
class Window:
    """Sums over a window of steps."""

    steps: int = 0
    active_s: float = 0.0  # the loop's time, the observers' pauses left out
    paused_s: float = 0.0
    wait_s: float = 0.0
    generate_s: float = 0.0  # the sync runtime's generation on the loop's path
    train_s: float = 0.0
    publish_s: float = 0.0
    publications: int = 0
    load_s: float = 0.0
    lag: float = 0.0
    lag_steps: int = 0
    per_completion: float | None = None  # searcher/active_s_per_completion, its latest (run-long)
    cpu_s: float = 0.0  # the trainer process's CPU seconds in the loop's active time
    generate_cpu_s: float = 0.0  # the sync runtime's generation, in CPU seconds
    cpu_per_completion: float | None = None  # the searchers' (ray), their latest run-long figure

    def add(self, record: dict, active_s: float, paused_s: float, published: bool, cpu_s: float = 0.0) -> None:
        self.steps += 1
        self.active_s += active_s
        self.cpu_s += cpu_s
        self.generate_cpu_s += record.get("searcher/generate_cpu_s", 0.0)
        self.cpu_per_completion = record.get("searcher/cpu_per_completion_s", self.cpu_per_completion)
        self.paused_s += paused_s
        self.wait_s += record.get("trainer/wait_s", 0.0)
        self.generate_s += record.get("searcher/generate_s", 0.0)
        self.train_s += record.get("train/step_s", 0.0)
        self.publish_s += record.get("train/publish_s", 0.0)
        self.publications += published
        self.load_s += record.get("weights/load_s", 0.0)
        if record.get("train/lag_fresh") is not None:  # new data's, as the model predicts it (not replay's)
            self.lag += record["train/lag_fresh"]
            self.lag_steps += 1
        self.per_completion = record.get("searcher/active_s_per_completion", self.per_completion)

    def parts(self, layout: Layout) -> StepParts:
        n = max(self.steps, 1)
        k = layout.sync_interval
        load = self.load_s / n
        publish = self.publish_s / max(self.publications, 1)
        train = self.train_s / n
        if layout.runtime == "sync":  # a batch a step, its load (every k steps) inside it
            generate = self.generate_s / n - load / k
            overhead = (self.active_s - self.generate_s - self.train_s - self.publish_s) / n
            generate_cpu, train_cpu = self.generate_cpu_s / n, (self.cpu_s - self.generate_cpu_s) / n
        else:  # each searcher's batch: its seconds a completion (not paused) times a batch's
            batch = (self.per_completion or 0.0) * layout.completions_per_batch
            step = self.active_s / n
            generate = batch - load * min(1.0, batch / (k * step)) if step else batch
            overhead = (self.active_s - self.wait_s - self.train_s - self.publish_s) / n
            generate_cpu = (self.cpu_per_completion or 0.0) * layout.completions_per_batch
            train_cpu = self.cpu_s / n
            generate = _uncrowded(generate, generate_cpu, train_cpu / max(train + overhead, 1e-9), layout)
        train_threads = layout.trainer_threads or 0  # the sync runtime generates on the trainer's threads
        generate_threads = train_threads if layout.runtime == "sync" else layout.searcher_threads or 0
        return StepParts(
            max(generate, 0.0),
            train,
            load,
            publish,
            max(overhead, 0.0),
            generate_cpu_s=max(generate_cpu, 0.0),
            train_cpu_s=max(train_cpu, 0.0),
            generate_threads=generate_threads,
            train_threads=train_threads,
        )

    def measured(self) -> dict:
        n = max(self.steps, 1)
        return {
            "step_s": self.active_s / n,
            "trainer_busy": 1.0 - self.wait_s / self.active_s if self.active_s else None,
            "lag_mean": self.lag / self.lag_steps if self.lag_steps else None,
            "pause_s": self.paused_s / n,
            "steps": self.steps,
        }


def _uncrowded(batch_s: float, cpu_s: float, trainer_cores: float, layout: Layout) -> float:
    """A ray searcher's batch alone, from its seconds measured beside the trainer: where the
    searchers' threads ask for more of the cores than the trainer leaves them (it keeps what it
    uses: :mod:`tba.plan.cost`), their batches waited for a core, and alone each thread computes
    on one, at its CPU seconds over its threads."""
    threads = layout.searcher_threads or 1
    if not layout.cores or not cpu_s or layout.searchers * threads <= cores_left(layout.cores, trainer_cores):
        return batch_s
    return min(batch_s, cpu_s / threads)


def run_layout(t: TrainerConfig, g: GenerationConfig, plan, searchers: int) -> Layout:
    """A run's layout as the cost model (:mod:`tba.plan.cost`) sees it; ``searchers``:
    ``runtime.num_searchers`` resolved (the sync runtime has one). On a machine without GPUs its
    processes share this machine's cores, with the plan's threads."""
    cores = usable_cores() if plan.device == "cpu" and not plan.searcher_gpus else None
    return Layout(
        plan.runtime,
        t.batch_prompts * g.group_size,
        g.prompts_per_batch * plan.samples_per_prompt,
        searchers if plan.runtime == "ray" else 1,
        t.num_ranks,
        plan.shares_gpu,
        t.sync_interval,
        plan.lag_bound,
        cores=cores,
        trainer_threads=(plan.trainer_threads or cores) if cores else None,
        searcher_threads=plan.searcher_threads if cores else None,
    )


def alternatives(parts: StepParts, layout: Layout) -> dict[str, Prediction]:
    """What ``parts`` predict for the sync runtime and the ray runtime with 1, 2 and 4 searchers."""
    out = {"sync": predict(parts, _with(layout, "sync", 1))}
    for s in ALTERNATIVE_SEARCHERS:
        out[f"ray_{s}"] = predict(parts, _with(layout, "ray", s))
    return out


def _with(layout: Layout, runtime: str, searchers: int) -> Layout:
    """``layout`` in ``runtime`` with ``searchers`` (the sync runtime shares no GPU and has no lag
    bound). On shared cores, the threads the plan would give: the sync runtime's process every
    core, the ray runtime's trainer the cores its searchers leave (:func:`tba.plan.placement.trainer_threads`)."""
    ray = runtime == "ray"
    threads = layout.trainer_threads
    if layout.cores:
        threads = max(1, layout.cores - searchers * (layout.searcher_threads or 1)) if ray else layout.cores
    return replace(
        layout,
        runtime=runtime,
        searchers=searchers,
        shared=layout.shared and ray,
        lag_bound=layout.lag_bound if ray else None,
        trainer_threads=threads,
    )


def _name(key: str) -> str:
    return "the sync runtime" if key == "sync" else f"ray with {key.split('_')[1]} searcher(s)"


@dataclass
class PaceMeter:
    """An observer of the loop's steps (the first, before the observers that pause it): the parts of
    the early window and of the whole run, the prediction, and the ``predicted`` / ``measured`` /
    ``alternatives`` sections of ``summary.json`` (:meth:`summary`)."""

    layout: Layout
    clock: object  # the loop's StepClock: active_s(), paused_s
    steps: int  # the run's last step
    first: int = 0  # the version the loop started from (a resumed run's)
    log: Callable[[str], None] = print
    early: int = field(init=False)
    window: Window = field(default_factory=Window)  # the early window, then the held-out one
    whole: Window = field(default_factory=Window)
    prediction: Prediction | None = None
    predicted_from: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.early = early_steps(self.steps - self.first)
        self._active = self._paused = self._cpu = None

    def announce(self) -> None:
        """Say at the start which steps will predict the rest."""
        if self.early:
            a, b = self.first + 2, self.first + 1 + self.early
            self.log(f"pace: steps {a}-{b} will predict the rest (tba train --parts-from=RUN predicts before a run)")

    def after_step(self, step: int, record: dict) -> None:
        active, paused, cpu = self.clock.active_s(), self.clock.paused_s, self.clock.active_cpu_s()
        if self._active is None:  # the first step (first + 1): the clock starts after it
            self._active, self._paused, self._cpu = active, paused, cpu
            return
        d_active, d_paused, d_cpu = active - self._active, paused - self._paused, cpu - self._cpu
        self._active, self._paused, self._cpu = active, paused, cpu
        published = step % self.layout.sync_interval == 0
        self.window.add(record, d_active, d_paused, published, d_cpu)
        self.whole.add(record, d_active, d_paused, published, d_cpu)
        if self.early and self.prediction is None and self.window.steps == self.early:
            self.prediction = predict(self.window.parts(self.layout), self.layout)
            self.predicted_from = (step - self.early + 1, step)
            self.window = Window()
            self.log(f"pace: steps {self.predicted_from[0]}-{step} predict {self.prediction.describe()} for the rest")

    def summary(self) -> dict:
        """``predicted`` (from the early window; None when the run was too short to hold steps out),
        ``measured`` (over the steps after it, with the whole run's parts), ``error`` (measured over
        predicted seconds a step, less 1) and ``alternatives``."""
        if not self.whole.steps:
            return {}
        parts = self.whole.parts(self.layout)
        held_out = self.prediction is not None and self.window.steps > 0
        measured = {**(self.window if held_out else self.whole).measured(), "parts": asdict(parts)}
        predicted = None
        error = None
        if held_out:
            predicted = {**_prediction(self.prediction), "from_steps": list(self.predicted_from)}
            error = measured["step_s"] / self.prediction.step_s - 1.0
        return {
            "predicted": predicted,
            "measured": measured,
            "error": error,
            "alternatives": {k: _prediction(p) for k, p in alternatives(parts, self.layout).items()},
        }


def _prediction(p: Prediction) -> dict:
    return {"step_s": p.step_s, "trainer_busy": p.trainer_busy, "lag_mean": p.lag_mean, "bound": p.bound}


def pace_line(summary: dict) -> str | None:
    """The run's pace in one line, from :meth:`PaceMeter.summary`'s sections of ``summary`` (a
    run's ``summary.json``, its ``runtime`` included)."""
    measured = summary.get("measured")
    if not measured:
        return None
    head = f"pace: {measured['step_s']:.3g} s a step"
    if summary.get("predicted"):
        p = summary["predicted"]
        a, b = p["from_steps"]
        head += f" against {p['step_s']:.3g} predicted from steps {a}-{b} ({summary['error']:+.0%}), {p['bound']}-bound"
    others = [(k, v) for k, v in summary["alternatives"].items() if not (k == "sync" and summary["runtime"] == "sync")]
    said = ", ".join(f"{_name(k)} {v['step_s']:.3g} s ({v['bound']}-bound)" for k, v in others)
    machine = summary.get("environment") or {}
    cores = machine.get("cores", "?") if machine and not machine.get("gpus") else None
    note = cores_note(measured["parts"], cores)
    return f"{head}; this run's parts predict {said}" + (f" ({note})" if note else "")


def cores_note(parts: dict, cores) -> str:
    """What the ray runtime's figures assume on ``cores`` that every process shares (None: a
    machine with GPUs, nothing to say), from ``parts`` (a run's measured parts)."""
    if not cores:
        return ""
    if parts.get("generate_cpu_s") and parts.get("train_cpu_s"):
        return f"ray's figures share the {cores} cores by each part's CPU seconds; Ray's own processes not counted"
    return f"ray's figures give searchers cores of their own; on {cores} cores they share the trainer's"


def parts_of_run(run_dir: Path) -> tuple[StepParts, str]:
    """The parts a finished run measured (its ``summary.json``) and where (the run and its machine)."""
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
        parts = StepParts(**summary["measured"]["parts"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(
            f"--parts-from {run_dir}: no measured parts in {path} ({type(err).__name__}: {err}); "
            "give the folder of a run that finished with this version of tba"
        ) from None
    machine = summary.get("environment", {})
    where = f"{machine.get('cpu', 'an unnamed CPU')}, {machine.get('cores', '?')} cores"
    if machine.get("gpus"):
        where += f", {len(machine['gpus'])} x {machine['gpus'][0]['name']}"
    return parts, f"{run_dir} ({summary.get('runtime', '?')} runtime, {where})"


def foreseen(parts: StepParts, layout: Layout, source: str) -> list[str]:
    """What ``parts`` (measured by ``source``) predict for ``layout`` and its alternatives: the
    lines ``--parts-from`` prints before a run, with what the ray runtime's figures assume on
    shared cores."""
    searchers = f" with {layout.searchers} searcher(s)" if layout.runtime == "ray" else ""
    lines = [
        f"pace from the parts of {source}:",
        f"  this run ({layout.runtime}{searchers}): {predict(parts, layout).describe()}",
    ]
    for key, p in alternatives(parts, layout).items():
        lines.append(f"  {_name(key)}: {p.describe()}")
    note = cores_note(asdict(parts), layout.cores)
    if note:
        lines.append(f"  ({note})")
    return lines

"""Curves of runs from their ``metrics.jsonl``: ``tba plot RUN [RUN ...]``, and every run's own
``plots/training.png``.

One trainer step's metrics come from one batch of a few dozen completions and are noisy, so every
per-step quantity is drawn twice: the raw values faint, and an exponential moving average (EMA)
bold. The EMA is debiased as Adam's moments are: ``m_t = d·m_{t-1} + (1 - d)·x_t`` from
``m_0 = 0``, divided by ``1 - d^t``, so that its first points sit at the data's level instead of
being pulled toward 0. Evaluations are sparse and each already averages many prompts: markers,
raw, no EMA.

Progress shows in the reward of freshly sampled completions (``searcher/reward_mean``); the
training batch's reward (``train/reward_mean``) mixes in replayed data and is not drawn.

Each quantity gets one figure, one panel per metric key, against trainer steps; evaluation and
sampled reward also against wall-clock (``time_s``), the axis on which an asynchronous run is
compared with a synchronous one. ``overview.png`` is a grid of the first panel of every figure.
A quantity that no run logged gets no figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Literal

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from tba.errors import UserError, report
from tba.metrics import read_metrics

XChoice = Literal["step", "time", "both"]
HEADLINE_EVALS = ("eval/accuracy", "eval/win_rate", "eval/attack_success_rate", "eval/reward")
EVAL_COUNTS = {"eval/problems", "eval/unscored", "eval/attacks", "eval/empty_attacks"}  # bookkeeping
THROUGHPUT = "derived/completions_per_s"  # computed here from every run's counts, see _derive_throughput
DPI = 100


@dataclass(frozen=True)
class Run:
    """One run's records, and what the figures need to know about them."""

    name: str  # the legend entry
    records: list[dict]
    eval_key: str | None  # its headline evaluation metric: eval/accuracy, eval/win_rate, ...


@dataclass(frozen=True)
class Panel:
    """One axes: a metric key against trainer steps or wall-clock, a line or markers per run."""

    key: str
    title: str
    x: Literal["step", "time"] = "step"
    ylabel: str = ""  # the key when empty
    sparse: bool = False  # evaluations: markers, no EMA
    smooth: bool = True  # an EMA over the raw values; False for a size or a running average


@dataclass(frozen=True)
class Quantity:
    """One figure: its file name without ``.png`` and its panels."""

    name: str
    panels: tuple[Panel, ...]


def load_run(run_dir: Path | str, name: str | None = None, eval_key: str | None = None) -> Run:
    """Read ``<run_dir>/metrics.jsonl``; a :class:`UserError` if it is not a run directory or has no
    records. The headline eval metric is ``eval_key``, else the one ``summary.json`` reports, else
    the first of :data:`HEADLINE_EVALS` that was logged."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory; give the directory that `tba train` printed")
    if not path.is_file():
        raise UserError(f"{run_dir} is not a run directory: it has no metrics.jsonl")
    records = [r for r in read_metrics(path) if isinstance(r, dict) and "step" in r]
    if not records:
        raise UserError(f"{path} has no records yet; plot the run once it has logged a step")
    _derive_throughput(records)
    return Run(name or run_dir.resolve().name, records, eval_key or _headline(run_dir, records))


def _headline(run_dir: Path, records: list[dict]) -> str | None:
    summary = run_dir / "summary.json"
    if summary.is_file():
        for key in json.loads(summary.read_text()):
            if key.startswith("eval/") and key.endswith("_initial"):
                return key[: -len("_initial")]
    logged = {k for r in records for k in r if k.startswith("eval/")}
    return next((k for k in HEADLINE_EVALS if k in logged), None)


def _derive_throughput(records: list[dict]) -> None:
    """Set :data:`THROUGHPUT` (in place): the completions generated between two records over the
    wall-clock between them, evaluations and checkpoints included. Both runtimes log the cumulative
    ``searcher/completions``; only the ray runtime logs a rate (``searcher/completions_per_s``, an
    average since the searcher started), so this one compares the two runtimes on one definition.
    A count that goes down (a searcher restarted) gives no point."""
    counted = [r for r in records if r.get("searcher/completions") is not None and r.get("time_s") is not None]
    for prev, r in pairwise(counted):
        if r["time_s"] > prev["time_s"] and r["searcher/completions"] >= prev["searcher/completions"]:
            r[THROUGHPUT] = (r["searcher/completions"] - prev["searcher/completions"]) / (r["time_s"] - prev["time_s"])


def ema(values: Sequence[float], decay: float) -> list[float]:
    """Debiased exponential moving average: ``m_t / (1 - decay^t)`` with ``m_t = decay·m_{t-1} +
    (1 - decay)·x_t`` and ``m_0 = 0``; ``decay = 0`` returns the values."""
    out, m = [], 0.0
    for t, value in enumerate(values, start=1):
        m = decay * m + (1 - decay) * value
        out.append(m / (1 - decay**t))
    return out


def quantities(runs: Sequence[Run], x: XChoice = "both") -> list[Quantity]:
    """The figures to draw, each with only the panels that some run has data for. ``x="both"``:
    every quantity against steps, and evaluation and sampled reward also against wall-clock
    (``<name>_vs_time``); ``"step"`` or ``"time"``: every quantity against that axis alone."""
    logged = {k for run in runs for r in run.records for k, v in r.items() if v is not None}
    headlines = [run.eval_key for run in runs if run.eval_key]
    evals = sorted(k for k in logged if k.startswith("eval/") and k not in EVAL_COUNTS and k != "eval/kl")
    evals.sort(key=lambda k: headlines.index(k) if k in headlines else len(headlines))  # headline first
    catalogue = [  # name, panels, also against wall-clock when x="both"
        ("eval", [Panel(k, f"eval {k.split('/', 1)[1]}", sparse=True) for k in evals], True),
        ("sampled_reward", [Panel("searcher/reward_mean", "reward of sampled completions")], True),
        ("loss", [Panel("train/loss", "training loss")], False),
        ("log_z", [Panel("train/log_z", "log Z (batch mean)")], False),
        (
            "kl",
            [
                Panel("train/kl", "KL to reference, train batch (per sequence)"),
                Panel("eval/kl", "KL to reference, evaluation", sparse=True),
            ],
            False,
        ),
        (
            "lag",
            [
                Panel("train/lag_mean", "lag of trained rollouts, mean (steps)"),
                Panel("train/lag_max", "lag of trained rollouts, max (steps)"),
                Panel("train/lag_fresh", "lag of newly arrived rollouts, mean (steps)"),
            ],
            False,
        ),
        ("buffer", [Panel("buffer/size", "replay buffer size (completions)", smooth=False)], False),
        (
            "throughput",
            [
                Panel(THROUGHPUT, "generated completions per second", ylabel="Δ searcher/completions / Δ time_s"),
                Panel(
                    "searcher/completions_per_s", "generated completions per second, since searcher start", smooth=False
                ),
                Panel("trainer/samples_per_s", "trained samples per second, since training started", smooth=False),
            ],
            False,
        ),
    ]
    out = []
    for name, panels, timed in catalogue:
        for axis in ("step", "time"):
            if x == axis or (x == "both" and (axis == "step" or timed)):
                kept = tuple(dataclasses.replace(p, x=axis) for p in panels if p.key in logged)
                if kept:
                    out.append(Quantity(name if axis == "step" else f"{name}_vs_time", kept))
    return out


def figures(runs: Sequence[Run], ema_decay: float = 0.9, x: XChoice = "both") -> dict[str, Figure]:
    """One figure per quantity with data, by file name without ``.png``, and ``overview``: the
    first panel of each. Each axes holds, per run that has its key, one faint raw line and one bold
    EMA line labelled with the run's name; evaluations, the buffer size, running averages, and every
    quantity with ``ema_decay = 0`` get one line per run (with markers for evaluations)."""
    found = quantities(runs, x)
    out = {q.name: draw(runs, q.panels, ema_decay) for q in found}
    if found:
        out["overview"] = draw(runs, tuple(q.panels[0] for q in found), ema_decay, ncols=4)
    return out


def draw(runs: Sequence[Run], panels: Sequence[Panel], ema_decay: float, ncols: int = 3) -> Figure:
    """A grid of ``panels``, ``ncols`` wide, on the Agg canvas (no pyplot state to close)."""
    ncols = min(ncols, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(4.6 * ncols, 3.4 * nrows), layout="constrained")  # laid out when saved
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(nrows, ncols, squeeze=False).flat)
    unit = _time_unit(runs)
    for ax, panel in zip(axes, panels, strict=False):
        _draw_panel(ax, panel, runs, ema_decay, unit)
    for ax in axes[len(panels) :]:  # the grid's empty cells
        ax.remove()
    return fig


def _draw_panel(ax: Axes, panel: Panel, runs: Sequence[Run], ema_decay: float, unit: tuple[float, str]) -> None:
    for i, run in enumerate(runs):
        xs, ys = series(run, panel.key, panel.x, unit[0])
        if not ys:
            continue
        color = f"C{i % 10}"
        if panel.sparse:
            ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.2, color=color, label=run.name)
        elif ema_decay > 0 and panel.smooth:
            ax.plot(xs, ys, linewidth=0.8, alpha=0.25, color=color, label="_nolegend_")
            ax.plot(xs, ema(ys, ema_decay), linewidth=1.8, color=color, label=run.name)
        else:
            ax.plot(xs, ys, linewidth=1.2, color=color, label=run.name)
    ax.set_title(panel.title, fontsize="medium")
    ax.set_ylabel(panel.ylabel or panel.key, fontsize="small")
    ax.set_xlabel("trainer step" if panel.x == "step" else f"wall-clock ({unit[1]})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def series(
    run: Run, key: str, x: Literal["step", "time"] = "step", time_unit_s: float = 1.0
) -> tuple[list[float], list[float]]:
    """The run's logged (x, value) points of ``key``, in file order; null (non-finite) values skipped."""
    points = [
        (r["step"] if x == "step" else r["time_s"] / time_unit_s, r[key])
        for r in run.records
        if r.get(key) is not None and (x == "step" or r.get("time_s") is not None)
    ]
    return [p[0] for p in points], [p[1] for p in points]


def _time_unit(runs: Sequence[Run]) -> tuple[float, str]:
    longest = max((r.get("time_s") or 0.0 for run in runs for r in run.records), default=0.0)
    if longest >= 2 * 3600:
        return 3600.0, "h"
    if longest >= 600:
        return 60.0, "min"
    return 1.0, "s"


def load_runs(run_dirs: Sequence[Path | str], names: Sequence[str] | None = None) -> list[Run]:
    """The runs, named by ``names`` or by their directories (``parent/name`` where two share a name)."""
    if names is not None and len(names) != len(run_dirs):
        raise UserError(f"--names gives {len(names)} names for {len(run_dirs)} runs; give one name per run")
    dirs = [Path(d) for d in run_dirs]
    if names is None:
        short = [d.resolve().name for d in dirs]
        names = [
            "/".join(d.resolve().parts[-2:]) if short.count(s) > 1 else s for d, s in zip(dirs, short, strict=True)
        ]
    return [load_run(d, n) for d, n in zip(dirs, names, strict=True)]


def save(figs: dict[str, Figure], out_dir: Path) -> list[Path]:
    """Write each figure to ``<out_dir>/<name>.png``; the paths."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot write plots to {out_dir}: {err.strerror}; choose another directory with -o") from err
    paths = []
    for name, fig in figs.items():
        paths.append(out_dir / f"{name}.png")
        fig.savefig(paths[-1], dpi=DPI)
    return paths


def plot_runs(
    run_dirs: Sequence[Path | str],
    out_dir: Path | str,
    names: Sequence[str] | None = None,
    ema: float = 0.9,
    x: XChoice = "both",
) -> list[Path]:
    """Compare runs: one PNG per quantity and ``overview.png`` in ``out_dir``; the paths written.
    A :class:`UserError` for a path that is not a run, runs with nothing to plot, or ``ema`` out of
    range."""
    if not 0 <= ema < 1:
        raise UserError(f"--ema {ema} is not in [0, 1); 0.9 averages over about the last 10 steps")
    runs = load_runs(run_dirs, names)
    figs = figures(runs, ema, x)
    if not figs:
        raise UserError(f"no metric that tba plots is logged in {', '.join(map(str, run_dirs))}")
    return save(figs, Path(out_dir))


def plot_run(run_dir: Path | str, eval_key: str = "eval/accuracy") -> Path | None:
    """The end of every run: the overview grid of this one run to ``<run>/plots/training.png``;
    its path, or None when the run logged nothing to draw (a finished run does not fail on it)."""
    if not read_metrics(Path(run_dir) / "metrics.jsonl"):
        return None
    figs = figures([load_run(run_dir, eval_key=eval_key)])
    if "overview" not in figs:
        return None
    path = Path(run_dir) / "plots" / "training.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    figs["overview"].savefig(path, dpi=DPI)
    return path


USAGE = "tba plot RUN [RUN ...] [-o OUT] [--names NAME ...] [--ema 0.9] [--x step|time|both]"
EPILOG = """Writes one PNG per quantity that some run logged: eval.png, sampled_reward.png, loss.png,
log_z.png, kl.png, lag.png, buffer.png, throughput.png (against trainer steps), eval_vs_time.png and
sampled_reward_vs_time.png (against wall-clock), and overview.png, a grid of all of them; with
--x time every quantity against wall-clock (<name>_vs_time.png), with --x step against steps only.
OUT is RUN/plots/ for one run and ./tba-plots/ for several.

examples:
  tba plot runs/demo
  tba plot runs/sync runs/async --names sync async -o compare/
"""


def build_parser() -> argparse.ArgumentParser:
    """``tba plot``'s arguments."""
    parser = argparse.ArgumentParser(
        prog="tba plot",
        usage=USAGE,
        description="Plot a run's curves, or compare several runs, from their metrics.jsonl.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("-o", "--out", type=Path, help="output directory (default: RUN/plots/ or ./tba-plots/)")
    parser.add_argument(
        "--names", nargs="+", metavar="NAME", help="legend names, one per run (default: the directories' names)"
    )
    parser.add_argument(
        "--ema", type=float, default=0.9, help="decay of the bold moving average, in [0, 1); 0: raw only (0.9)"
    )
    parser.add_argument(
        "--x", choices=("step", "time", "both"), default="both", help="x axis: trainer steps, wall-clock, or both"
    )
    return parser


def cli_main(argv: list[str]) -> int:
    """``tba plot``: the paths written on stdout; bad input on one stderr line, exit status 2."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # usage errors and --help: argparse has printed them
        return int(exit_.code or 0)
    out = args.out or (args.runs[0] / "plots" if len(args.runs) == 1 else Path("tba-plots"))
    try:
        paths = plot_runs(args.runs, out, args.names, args.ema, args.x)
    except UserError as err:
        return report(err)
    for path in paths:
        print(path)
    return 0

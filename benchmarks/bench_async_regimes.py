"""Asynchronous TB against sync in four regimes: what staleness costs, and what each remedy buys.

    python benchmarks/bench_async_regimes.py run                          # every setting and arm, seeds 0 1 2
    python benchmarks/bench_async_regimes.py run --settings small --arms sync ray ray_seq
    python benchmarks/bench_async_regimes.py run --settings small -- --trainer.steps=100   # overrides for every run
    python benchmarks/bench_async_regimes.py report                       # the tables and regimes.png

Each run is the real command line (``tba train`` with the setting's and the arm's overrides and
``--run.seed``) in its own process, one after another so that runs do not share the cores. Results
accumulate in ``--out``/results.json after each run, with the machine; a rerun skips what is there
(``--fresh`` starts over), so a grid can stop and go on in a later session.

Settings (``SETTINGS``):

- ``demo``: ``tba train`` as it is (600 steps, 16 prompts × 8, cosine schedule);
- ``small``: the demo model on addition alone with small batches and a constant learning rate
  (8 prompts × 8, lr 1e-4 constant, 200 steps, temperature 1, 5 new tokens), where two steps of
  staleness first showed;
- ``chains``: worked chains (5 one-digit operands, ``task.show_work``: 20-30 token completions),
  300 steps;
- ``real``: SmolLM2-135M-Instruct on the short chat word problems of ``benchmarks/word_problems``
  (40 steps; needs ``benchmarks/real_model.py`` and ``make_problems.py`` once, as
  ``bench_real_model.py`` says). ``--real-backend vllm`` generates with vLLM.

Arms (``ARMS``): ``sync`` and ``ray``, plain trajectory balance (``objective.tb_trust_region=null``:
the defaults this study started from) with each runtime's other defaults; ``ray_lag1``
(``runtime.max_lag=1``: one-step-off-policy); the staleness-aware TB variants in the ray runtime:
``ray_seq`` (the sequence band, ``tb_trust_region=0.5`` on the sequence log-ratio: TB's default
since this study), ``ray_tok`` (the per-token band, 0.2),
``ray_ess`` (each step's learning rate times the effective sample size of the sequence importance
weights π/π_sampler); ``sync_seq`` (the sequence band in sync); ``sync_lag2`` and
``sync_lag2_seq`` (sync with the searcher's weights exactly 2 steps old, ``runtime.extra_lag=2``:
the ray runtime's typical lag without its timing, plain and with the band); ``ray_flat1`` (the
ray runtime drawing recent groups uniformly, as sync does, where its default draws groups with
reward contrast first); ``ray_seq_flat1`` and ``ray_seq_lag1`` (the band with that uniform draw,
or with the lag bound of 1).

Runs measured before with the same command are read rather than run again (``--no-import`` runs
them): the demo's sync and ray arms from ``bench_headline.py`` and the word problems' sync and ray
arms from ``bench_real_model.py`` (40 steps), each marked with its ``source``.

Per run: the greedy evaluation before and after (``eval/accuracy``, ``eval/reward`` for ``real``),
the gain, the gain per wall-clock minute of the whole command (start-up included), the lag of newly
arrived data (``train/lag_fresh``) and of everything trained (``train/lag_mean``, replays included),
and what preceded the end: the lowest evaluation, gradient norm, KL, log Z, flat groups, dropped
terms. A run that ends below its start is marked.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from harness import (
    ROOT,
    load_results,
    machine_line,
    mean_std,
    metrics,
    outcome,
    parse_with_overrides,
    print_machine,
    results_folder,
    spread,
)
from harness.settings import REAL_MODEL, SETTINGS
from harness.study import SEEDS, Arm, Column, Results, Trial, run_study, setting_arms, table

# the sequence band (what tb_trust_region auto means for tb) and plain trajectory balance, both named
SEQUENCE_BAND = ["--objective.tb_trust_region=0.5", "--objective.tb_trust_region_sequence=true"]
PLAIN = ["--objective.tb_trust_region=null"]
ARMS: dict[str, tuple[str, list[str]]] = {  # name -> (runtime.type, other overrides)
    "sync": ("sync", PLAIN),
    "ray": ("ray", PLAIN),
    "ray_lag1": ("ray", ["--runtime.max_lag=1", *PLAIN]),
    "ray_seq": ("ray", SEQUENCE_BAND),
    "ray_tok": ("ray", ["--objective.tb_trust_region=0.2", "--objective.tb_trust_region_sequence=false"]),
    "ray_ess": ("ray", ["--objective.tb_ess_lr=true", *PLAIN]),
    "sync_seq": ("sync", SEQUENCE_BAND),
    # the ray runtime drawing the recent groups uniformly (its buffer.flat_weight auto is 0: contrast first)
    "ray_flat1": ("ray", ["--buffer.flat_weight=1", *PLAIN]),
    # the sequence band with each of the ray runtime's other differences from sync taken away
    "ray_seq_flat1": ("ray", ["--buffer.flat_weight=1", *SEQUENCE_BAND]),
    "ray_seq_lag1": ("ray", ["--runtime.max_lag=1", *SEQUENCE_BAND]),
    # sync with the searcher's weights exactly 2 steps old: the ray runtime's lag without its timing
    "sync_lag2": ("sync", ["--runtime.extra_lag=2", *PLAIN]),
    "sync_lag2_seq": ("sync", ["--runtime.extra_lag=2", *SEQUENCE_BAND]),
}
DEFAULT_ARMS = ["sync", "ray", "ray_lag1", "ray_seq", "ray_tok", "ray_ess"]


def _mean(rows: list[dict], key: str, tail: float = 1.0) -> float | None:
    """Mean of ``key`` over the rows that have it; ``tail`` < 1: over that last share of them."""
    values = [r[key] for r in rows if key in r and r[key] is not None]
    if tail < 1.0:
        values = values[-max(1, int(len(values) * tail)) :]
    return statistics.mean(values) if values else None


def diagnose(run_dir: Path, metric: str) -> dict:
    """What the run's metrics say about its course: the curve and the signals that precede a fall."""
    rows = metrics(run_dir)
    curve = [(r["step"], r[metric]) for r in rows if metric in r]
    grad = sorted(r["train/grad_norm"] for r in rows if "train/grad_norm" in r)
    return {
        "curve": curve,
        "lowest": min(v for _, v in curve) if curve else None,
        "lag_fresh": _mean(rows, "train/lag_fresh"),
        "arrival_lag_max": max(
            (r["buffer/arrival_lag_max"] for r in rows if "buffer/arrival_lag_max" in r), default=None
        ),
        "grad_norm_median": grad[len(grad) // 2] if grad else None,
        "kl_last": _mean(rows, "train/kl", 0.1),
        "log_z_last": _mean(rows, "train/log_z", 0.1),
        "flat_groups": _mean(rows, "train/flat_groups"),
        "tb_dropped": _mean(rows, "train/tb_dropped"),
        "tb_ess": _mean(rows, "train/tb_ess"),
        "sampled_reward_last": _mean(rows, "searcher/reward_mean", 0.1),
    }


def arms(setting: str, names: list[str], seeds: list[int]) -> list[Arm]:
    """``names`` of :data:`ARMS` in ``setting`` (:data:`harness.settings.SETTINGS`)."""
    return setting_arms(setting, ARMS, names, seeds)


def run(trial: Trial, out: Path, extra: list[str]) -> dict:
    setting, arm = trial.arm.fields["setting"], trial.arm.fields["arm"]
    if setting == "real" and not (REAL_MODEL / "config.json").is_file():
        raise SystemExit(f"{REAL_MODEL} is missing: build it as bench_real_model.py says")
    metric = "eval/reward" if setting == "real" else "eval/accuracy"
    done = trial.train(out, ["--logging.progress=false", *extra], cwd=ROOT, clear=True)
    summary = done.summary()
    config = [str(trial.arm.config)] if trial.arm.config else []
    args = [*config, *trial.args, "--logging.progress=false", f"--run.output_dir={out}", f"--run.name={trial.name}"]
    return {
        "setting": setting,
        "arm": arm,
        "seed": trial.seed,
        **outcome(summary, metric),
        "replay_ratio": summary.get("replay_ratio"),
        "wall_clock_s": round(done.wall_s, 1),
        "run_wall_clock_s": summary.get("wall_clock_s"),
        **diagnose(done.run_dir, metric),
        "command": " ".join(["tba train", *args, *extra]),
    }


def import_headline(rows: list[dict], seeds: list[int]) -> list[dict]:
    """The demo's sync and ray runs of ``bench_headline.py``: the same command, run on this machine."""
    path = ROOT / "benchmarks" / "results" / "headline" / "results.json"
    if not path.is_file():
        return []
    found = []
    for r in json.loads(path.read_text())["runs"]:
        # plain TB only (rows without tb_trust_region ran before the band became TB's default)
        if r["figure"] != "demo" or r["seed"] not in seeds or r.get("tb_trust_region", "none") != "none":
            continue
        if any(x["setting"] == "demo" and x["arm"] == r["runtime"] and x["seed"] == r["seed"] for x in rows):
            continue
        run_dir = ROOT / "benchmarks" / "results" / "headline" / "runs" / f"demo-{r['runtime']}-seed{r['seed']}"
        found.append(
            {
                **{k: r[k] for k in ("seed", "metric", "initial", "final", "gain", "below_start", "lag_mean")},
                "setting": "demo",
                "arm": r["runtime"],
                "wall_clock_s": r["wall_clock_s"],
                **(diagnose(run_dir, r["metric"]) if run_dir.is_dir() else {}),
                "command": r["command"],
                "source": "bench_headline.py",
            }
        )
    return found


# bench_real_model.py's configs that are this study's arms on ``real`` (its sync_tb draws uniformly,
# as sync's buffer.flat_weight auto does; ray_tb_flat0 is the ray runtime's defaults)
REAL_MODEL_ARMS = {"sync_tb": "sync", "ray_tb_flat0": "ray"}


def import_real_model(rows: list[dict], seeds: list[int]) -> list[dict]:
    """The word problems' 40-step runs of ``bench_real_model.py`` that are this study's arms there:
    the same settings, run one at a time on this study's kind of machine (2-core AMD EPYC)."""
    path = ROOT / "benchmarks" / "results" / "real_model" / "results.json"
    if not path.is_file():
        return []
    found = []
    for r in json.loads(path.read_text()):
        arm = REAL_MODEL_ARMS.get(r.get("config"))
        if arm is None or r["steps"] != 40 or r["seed"] not in seeds or "error" in r:
            continue
        if any(x["setting"] == "real" and x["arm"] == arm and x["seed"] == r["seed"] for x in rows + found):
            continue
        found.append(
            {
                "setting": "real",
                "arm": arm,
                "seed": r["seed"],
                "metric": "eval/reward",
                "initial": r["eval_initial"],
                "final": r["eval_final"],
                "gain": r["eval_final"] - r["eval_initial"],
                "below_start": r["eval_final"] < r["eval_initial"],
                "lag_mean": r["lag_mean"],
                "replay_ratio": r["replay_ratio"],
                "wall_clock_s": r["wall_s"],
                "curve": r["evals"],
                "kl_last": r["kl_last5"],
                "flat_groups": r["flat_groups"],
                "sampled_reward_last": r["sampled_last10"],
                "command": f"benchmarks/bench_real_model.py run --configs {r['config']} --seeds {r['seed']} --steps 40",
                "source": "bench_real_model.py",
            }
        )
    return found


def each_final(r: dict) -> str:
    """A run's final evaluation, marked where it ended below its start."""
    return f"{r['final']:.3f}{' **below start**' if r['below_start'] else ''}"


def last3(r: dict) -> float | None:
    """The mean of the run's last three evaluations."""
    return statistics.mean(v for _, v in r["curve"][-3:]) if r.get("curve") else None


def table_of(rows: list[dict], setting: str) -> str:
    """One setting: a row per arm, gains against sync's."""
    mine = sorted((r for r in rows if r["setting"] == setting), key=lambda r: (list(ARMS).index(r["arm"]), r["seed"]))
    if not mine:
        return ""
    sync = [r["gain"] for r in mine if r["arm"] == "sync"]
    sync_mean = statistics.mean(sync) if sync else None
    sync_std = statistics.stdev(sync) if len(sync) > 1 else None

    def verdict(rs: list[dict]) -> str:
        """The arm's mean gain less sync's, and whether it is within one of sync's standard deviations."""
        if rs[0]["arm"] == "sync" or sync_mean is None or sync_std is None:
            return "-"
        gap = statistics.mean(r["gain"] for r in rs) - sync_mean
        return f"{gap:+.3f} ({'within' if gap >= -sync_std else 'below'} 1 std)"

    columns = [
        Column("arm", "arm", "first", ""),
        SEEDS,
        Column("start", "initial", "mean"),
        Column("final", "final", "std"),
        Column("gain", "gain", "std"),
        Column("vs sync", cell=verdict),
        Column("each final", each_final, "each", ""),
        Column("last 3 evaluations", last3, "std"),
        Column("sampled reward, last 10%", "sampled_reward_last", "std"),
        Column("gain / min", lambda r: 60 * r["gain"] / r["wall_clock_s"], "std", ".4f"),
        Column("lag (new data)", "lag_fresh", "mean", ".2f"),
        Column("lag (all trained)", "lag_mean", "mean", ".1f"),
        Column("wall, s", "wall_clock_s", "mean", ".0f"),
    ]
    return table(mine, ("arm",), columns)


COMPACT = ["sync", "sync_lag2", "sync_lag2_seq", "sync_seq", "ray", "ray_lag1", "ray_seq", "ray_tok", "ray_ess"]


def compact_table(rows: list[dict]) -> str:
    """Gain by setting and arm (the docs' table): mean ± std, seeds, and the runs that ended below
    their start."""
    arms = [a for a in COMPACT if any(r["arm"] == a for r in rows)]
    lines = ["| setting | " + " | ".join(f"`{a}`" for a in arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for setting in SETTINGS:
        cells = []
        for arm in arms:
            gains = [r["gain"] for r in rows if r["setting"] == setting and r["arm"] == arm]
            below = sum(r["below_start"] for r in rows if r["setting"] == setting and r["arm"] == arm)
            fell = f", {below} below start" if below else ""
            cells.append(f"{spread(gains, always_std=True)} ({len(gains)}{fell})" if gains else "")
        if any(cells):
            lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s for s in SETTINGS if any(r["setting"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(settings), figsize=(4.2 * len(settings), 3.6), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        arms = [a for a in ARMS if any(r["setting"] == setting and r["arm"] == a for r in rows)]
        for i, arm in enumerate(arms):
            gains = [r["gain"] for r in rows if r["setting"] == setting and r["arm"] == arm]
            mean, std = mean_std(gains)
            ax.bar(i, mean, yerr=std, color="tab:gray" if arm.startswith("sync") else "tab:blue")
            ax.plot([i] * len(gains), gains, "k.", ms=4)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_xticks(range(len(arms)), arms, rotation=40, ha="right")
        ax.set_title(setting)
        ax.set_ylabel("gain in greedy evaluation")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(rows: list[dict], environment: dict | None, out: Path) -> None:
    if environment:
        print(f"measured on: {machine_line(environment)}")
    print(f"\n### gain by setting and arm (seeds)\n\n{compact_table(rows)}")
    for setting in SETTINGS:
        text = table_of(rows, setting)
        if text:
            print(f"\n### {setting}\n\n{text}")
    if rows:
        plot(rows, out / "regimes.png")
        print(f"\nplot: {out / 'regimes.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--arms", nargs="+", default=DEFAULT_ARMS, choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "async_regimes")
    parser.add_argument("--real-backend", choices=["hf", "vllm"], default="hf")
    parser.add_argument(
        "--no-import",
        action="store_true",
        help="run the arms that bench_headline.py (demo) and bench_real_model.py (real) measured, not read them",
    )
    parser.add_argument("--fresh", action="store_true", help="forget the runs already in results.json")
    a, extra = parse_with_overrides(parser)
    results_path = results_folder(a.out, "the run directories: only results.json and the plot are kept")
    results = Results(results_path, ("setting", "arm", "seed"), fresh=a.fresh)
    environment = load_results(results_path, a.fresh).get("environment")
    if a.command == "run":
        environment = results.head["environment"] = print_machine()
        if "demo" in a.settings and not a.no_import:
            results.rows += import_headline(results.rows, a.seeds)
        if "real" in a.settings and not a.no_import:
            results.rows += import_real_model(results.rows, a.seeds)
        for setting in a.settings:
            backend = (
                [f"--generation.backend={a.real_backend}"] if setting == "real" and a.real_backend == "vllm" else []
            )
            run_study(
                arms(setting, a.arms, a.seeds),
                lambda t, backend=backend: run(t, a.out / "runs", [*backend, *extra]),
                results,
                echo=lambda row: json.dumps({k: v for k, v in row.items() if k != "curve"}),
            )
        results.save()
    rows = results.rows
    report(rows, environment, a.out)


if __name__ == "__main__":
    main()

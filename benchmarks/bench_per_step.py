"""Trajectory balance against GRPO at equal trainer steps: the mean and the spread over seeds.

    .venv/bin/python benchmarks/bench_per_step.py run                        # every setting, every arm, 5 seeds
    .venv/bin/python benchmarks/bench_per_step.py run --settings adder --arms tb grpo --seeds 0 1
    .venv/bin/python benchmarks/bench_per_step.py run --settings adder --arms tb_clip1 tb_band   # candidates
    .venv/bin/python benchmarks/bench_per_step.py report                     # the tables, from the rows kept

Three settings, each run in the sync runtime (every rollout on-policy up to the replay buffer, and
the result independent of the machine's load; ``--run.threads=2`` fixes how sums round):

- ``demo``: the built-in demo as shipped (2-digit sums and differences, 600 steps, 16 prompts x 8);
- ``tools``: the tool demo (``configs/tools.yaml``: 3-digit products through a calculator call,
  200 steps) in the sync runtime;
- ``adder``: a second tiny model built here (:func:`harness.models.ensure_adder`: the demo's shape,
  warm-started on 2-digit sums to a greedy accuracy of about 0.43), 200 steps of 8 prompts x 8 at a
  constant lr 1e-4 and temperature 1 (``harness.settings``' ``small``).

Arms: ``tb`` (trajectory balance with the shipped defaults), ``grpo`` and ``dr_grpo`` (tba's, with
their defaults: clipped ratio, gradient clip 1), ``trl`` (TRL's ``GRPOTrainer`` on the same model,
prompts, reward, batch and steps, beta 0, gradient clip 1; needs ``pip install trl==1.16.0``, the
``peers`` extra; single-turn settings only), and candidate changes to TB's defaults (``CANDIDATES``).
A run's figure is its greedy accuracy on the task's 256 evaluation problems after the last step
(``final``) and the mean of its last three evaluations (``last3``). Rows go to
``benchmarks/results/per_step/results.json`` as each run ends; a run whose row is kept is not run
again, so the study resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from harness import describe_machine, print_machine
from harness.models import ensure_adder
from harness.runs import metrics, summary, train
from harness.settings import SETTINGS
from harness.study import SEEDS, Arm, Column, Results, run_study, table

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "per_step"
RUNS = ROOT / "runs" / "bench-per-step"
COMMON = ["--runtime.type=sync", "--run.threads=2", "--logging.progress=false", "--trainer.checkpoint_every=null"]
OBJECTIVES = {
    "tb": ["--objective.type=tb"],
    "grpo": ["--objective.type=grpo"],
    "dr_grpo": ["--objective.type=dr_grpo"],
}
CANDIDATES = {
    "tb_clip1": ["--objective.type=tb", "--trainer.grad_clip=1.0"],
    "tb_band": ["--objective.type=tb", "--objective.tb_trust_region=0.5"],
    "tb_lr5e-5": ["--objective.type=tb", "--trainer.lr=5e-5"],
    "tb_beta0.1": ["--objective.type=tb", "--objective.beta=0.1"],
    "tb_huber": ["--objective.type=tb", "--objective.tb_huber=1.0"],
    "tb_clip400": ["--objective.type=tb", "--trainer.grad_clip=400"],
    "grpo_lr5e-5": ["--objective.type=grpo", "--trainer.lr=5e-5"],
}
ARMS = [*OBJECTIVES, "trl"]
SETTING_NAMES = ["demo", "tools", "adder"]
SINGLE_TURN = {"demo", "adder"}


def setting_args(name: str) -> tuple[str | None, list[str]]:
    """(config file, overrides) of a setting."""
    if name == "demo":
        return None, []
    if name == "tools":
        return str(ROOT / "configs" / "tools.yaml"), []
    if name == "adder":
        return None, [f"--model.policy={ensure_adder()}", *SETTINGS["small"]]
    raise SystemExit(f"unknown setting {name!r}: one of {', '.join(SETTING_NAMES)}")


def row_of(run_dir: Path) -> dict:
    """A finished run's figures."""
    records = metrics(run_dir)
    evals = [(r["step"], r["eval/accuracy"]) for r in records if r.get("eval/accuracy") is not None]
    steps = [r for r in records if r.get("train/grad_norm") is not None]
    norms = [r["train/grad_norm"] for r in steps]
    notices = run_dir / "errors.log"
    return {
        "initial": evals[0][1],
        "final": evals[-1][1],
        "last3": statistics.mean(a for _, a in evals[-3:]),
        "evals": evals,
        "grad_norm_median": statistics.median(norms) if norms else None,
        "grad_norm_max": max(norms) if norms else None,
        "below_start": sum("below the start" in line for line in notices.read_text().splitlines())
        if notices.is_file()
        else 0,
        "wall_s": summary(run_dir)["wall_clock_s"],
    }


def run_tba(trial, setting: str) -> dict:
    out = RUNS / setting
    done = train([*COMMON, *trial.args], out, trial.name, config=trial.arm.config, check=False, clear=True)
    if not done.ok:
        return {"error": done.error(1500)}
    return row_of(out / trial.name)


def run_trl(trial, setting: str) -> dict:
    """TRL's GRPOTrainer on the setting, in a process of its own (``harness.trl_peer``)."""
    import subprocess

    _, overrides = setting_args(setting)
    if setting not in SINGLE_TURN:
        return {"error": f"trl: {setting} is multi-turn; the peer runs single-turn settings only"}
    out = RUNS / setting / trial.name
    cmd = [sys.executable, "-m", "harness.trl_peer", str(out), str(trial.seed), *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT / "benchmarks")
    if proc.returncode != 0:
        return {"error": proc.stderr[-1500:]}
    return json.loads((out / "peer.json").read_text())


def arms(settings: list[str], names: list[str], seeds: list[int]) -> list[Arm]:
    table_args = {**OBJECTIVES, **CANDIDATES, "trl": []}
    out = []
    for s in settings:
        for n in names:
            if n not in table_args:
                raise SystemExit(f"unknown arm {n!r}: one of {', '.join(table_args)}")
            if n == "trl" and s not in SINGLE_TURN:
                continue
            config, overrides = setting_args(s)
            out.append(
                Arm(
                    n,
                    overrides=[*overrides, *table_args[n]],
                    config=config,
                    seeds=seeds,
                    fields={"setting": s, "arm": n},
                )
            )
    return out


COLUMNS = [
    Column("setting", "setting", "first", "s"),
    Column("arm", "arm", "first", "s"),
    SEEDS,
    Column("start", "initial", "first", ".3f", align="r"),
    Column("final accuracy", "final", align="r"),
    Column("last 3 evaluations", "last3", align="r"),
    Column("each final", "final", "each", ".3f"),
    Column("grad norm (median)", "grad_norm_median", "mean", ".3g", align="r"),
    Column("fell below start", "below_start", "mean", ".1f", align="r"),
    Column("wall s", "wall_s", "mean", ".0f", align="r"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("part", choices=["run", "report"])
    p.add_argument("--settings", nargs="+", default=SETTING_NAMES)
    p.add_argument("--arms", nargs="+", default=ARMS)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    a = p.parse_args()
    results = Results(OUT / "results.json", key=("setting", "arm", "seed"), head={"machine": describe_machine()})
    if a.part == "run":
        print_machine()
        for arm in arms(a.settings, a.arms, a.seeds):
            setting = arm.fields["setting"]
            runner = run_trl if arm.name == "trl" else run_tba
            run_study([arm], lambda t, s=setting, f=runner: f(t, s), results)
    rows = sorted(results.rows, key=lambda r: (SETTING_NAMES.index(r["setting"]), r["arm"], r["seed"]))
    print(table(rows, ("setting", "arm"), COLUMNS))


if __name__ == "__main__":
    main()

"""The off-policy study: does each objective hold up as its training data gets staler?

    .venv/bin/python benchmarks/bench_off_policy.py sweep --jobs 2       # part 1: learning rates, on-policy
    .venv/bin/python benchmarks/bench_off_policy.py main --jobs 2        # part 2: staleness x clipping x 3 seeds
    .venv/bin/python benchmarks/bench_off_policy.py hard --jobs 2        # part 3: the same on 3-digit problems
    .venv/bin/python benchmarks/bench_off_policy.py anneal --jobs 2      # part 4: tb against rloo with β annealed
    .venv/bin/python benchmarks/bench_off_policy.py ablations --jobs 2   # part 5: the buffer's sampling settings
    .venv/bin/python benchmarks/bench_off_policy.py lr --lr 3e-5 --objectives tb --clips off --staleness 0 16 64
                                                                         # part 6: main at another learning rate
    .venv/bin/python benchmarks/bench_off_policy.py variants --jobs 2    # part 7: trajectory balance's variants
    .venv/bin/python benchmarks/bench_off_policy.py variants_long --jobs 2   # part 8: the same on worked chains
    .venv/bin/python benchmarks/bench_off_policy.py replay --jobs 2      # part 9: the same with the replay buffer
    .venv/bin/python benchmarks/bench_off_policy.py replay_long --jobs 2
    .venv/bin/python benchmarks/bench_off_policy.py trust_tau --jobs 2   # part 10: the sequence band's width
    .venv/bin/python benchmarks/bench_off_policy.py report               # tables and plots of what has run

Every run is the real CLI in the ``sync`` runtime, where staleness is exact and independent of
machine load: ``buffer.fresh_only=true`` trains each step on exactly the groups generated for it
(no replay), and ``runtime.extra_lag=D`` has the searcher sample with the weights published D
steps before the newest, so every rollout of a step is exactly D steps old (``D = 0`` is
on-policy; the first D steps see the initial weights). Parts:

- ``sweep``: each objective at learning rates ``--lrs``, with gradient clipping at 1.0 and
  without, on-policy, one seed; the best learning rate per objective and clipping setting is the
  one with the highest mean of the last three evaluations (less noisy than the last alone).
- ``main``: each objective at its best learning rate, staleness ``--staleness``, clipping on and
  off, seeds ``--seeds``.
- ``hard``: ``main`` on the harder variant (``task.digits=3``: 3-digit operands, answers of 1 to
  4 characters plus the end token, against 1 to 3 on the demo), with the demo's learning rates.
- ``anneal``: ``tb`` and plain ``rloo``, on-policy, clipping off, with β annealed linearly from
  0.05 to 0.005 over 300 steps (``ANNEAL``): the one setting where their updates should part,
  since TB's gradient on the reward grows as 1/β and RLOO's does not.
- ``ablations``: trajectory balance with the replay buffer (not fresh-only) in the sync runtime,
  varying one setting at a time from the demo's defaults: recency ``buffer.recent_prob`` (m),
  ``buffer.reward_inv_temp``, and the group size K.
- ``lr``: ``main`` with every objective at the learning rate ``--lr`` instead of its on-policy
  best, to see whether an objective that suffers from stale data does better with smaller steps.
- ``variants``: the settings of ``tb`` meant for stale data (``VARIANTS``: a trust region on the
  residual, with the band on the per-token or the sequence log-ratio, M2PO's second-moment mask, a
  Huber residual, an ESS-scaled step) against plain ``tb``
  and ``rloo_proximal`` (the best clipped objective at D = 64 in ``main``) at staleness
  ``--staleness`` (default 0, 16, 64 here), clipping on, the on-policy best learning rates, seeds
  ``--seeds``. (Run here rather than taken from ``main``: the demo model has been rebuilt since.)
- ``variants_long``: the same on ``LONG``, chains of 5 one-digit operands whose completions
  show each step (``task.show_work``: 20-30 tokens against the demo's 2-4).
- ``replay`` / ``replay_long``: the paper's regime, where staleness comes from the replay buffer
  (the demo's defaults: recency sampling m = 0.95, several uses of each completion) rather than from
  ``fresh_only``, plus a searcher lag ``runtime.extra_lag`` D (default 0 and 16: the lag an
  asynchronous run's searchers build up on a busy machine). Objectives ``REPLAY_COMPARED`` (plain
  ``tb``, the two trust regions, ``rloo_proximal``) on the demo, ``REPLAY_LONG_COMPARED`` (the
  same less the token band) on ``LONG``.
- ``trust_tau``: the sequence trust region (``tb_trust_seq``) on ``LONG`` at staleness
  ``--staleness`` (default 64) with band widths ``--taus`` (default 0.05 to 2; 0.2 is part 8's
  ``tb_trust_seq``, copied from it): whether a wider band keeps more of the stale data's signal.

Finished runs are kept (``summary.json`` in the run directory under ``--runs``,
``runs/bench-off-policy``) and not run again, so a part can be stopped and resumed, and parts can
run in separate sessions. Each part's results go to ``--out``/PART/results.json
(``benchmarks/results/off_policy``, kept in the repository; the machine in ``environment.json``
beside it), updated after every run and merged with earlier invocations (``main --seeds 0``, then
``main --seeds 1 2``: one table); ``report`` prints markdown tables from them and writes
``sweep.png``, ``staleness_main.png`` / ``staleness_hard.png`` (accuracy against D) and
``curves_main.png`` / ``curves_hard.png`` (accuracy against the step, clipping off) there.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harness import describe_machine, mean_std, metrics, print_machine, spread, summary, train

OBJECTIVES = ["tb", "rloo", "rloo_proximal", "ppo", "grpo", "dr_grpo", "online_dpo"]
HARD = ["--task.digits=3"]
OBJECTIVE_ARGS = {name: [f"--objective.type={name}"] for name in OBJECTIVES}
# ``tb`` is plain trajectory balance (its default became the sequence band: tb_trust_region auto)
OBJECTIVE_ARGS["tb"] = ["--objective.type=tb", "--objective.tb_trust_region=null"]
OBJECTIVE_ARGS["rloo_proximal"] = ["--objective.type=rloo", "--objective.rloo_proximal=true"]
# trajectory balance's settings for stale data, each at a typical value (see objective.tb_* in the config)
VARIANTS = {
    "tb_trust": [
        "--objective.type=tb",
        "--objective.tb_trust_region=0.2",
        "--objective.tb_trust_region_sequence=false",
    ],
    "tb_trust_seq": [
        "--objective.type=tb",
        "--objective.tb_trust_region=0.2",
        "--objective.tb_trust_region_sequence=true",
    ],
    "tb_m2": ["--objective.type=tb", "--objective.tb_m2_threshold=0.04", "--objective.tb_trust_region=null"],
    "tb_huber": ["--objective.type=tb", "--objective.tb_huber=1.0", "--objective.tb_trust_region=null"],
    "tb_ess": ["--objective.type=tb", "--objective.tb_ess_lr=true", "--objective.tb_trust_region=null"],
}
OBJECTIVE_ARGS.update(VARIANTS)
# the variants that only mask terms: on-policy (ratio 1 up to rounding, far inside any band) the mask
# keeps every term and the loss is plain TB's; part 7's and part 8's first runs agreed with tb
# evaluation for evaluation, so their on-policy runs are copies of tb's
MASKS = ("tb_trust", "tb_trust_seq", "tb_m2")
COMPARED = ["tb", *VARIANTS, "rloo_proximal"]  # the variants parts' rows
REPLAY_COMPARED = ["tb", "tb_trust", "tb_trust_seq", "rloo_proximal"]  # the replay parts' rows
# on worked chains the token band trailed the sequence band at every D in part 8 (47.4 / 40.2 against
# 58.1 / 55.0 at D = 16 / 64): replay_long leaves it out, 6 runs (~40 min) better spent elsewhere
REPLAY_LONG_COMPARED = ["tb", "tb_trust_seq", "rloo_proximal"]
LONG = ["--task.terms=5", "--task.digits=1", "--task.show_work=true", "--generation.max_new_tokens=40"]
VARIANT_PARTS = {  # part: (task arguments, with the replay buffer, what the report calls the task)
    "variants": ([], False, "the demo (2-digit sums, 2-4 token answers)"),
    "variants_long": (LONG, False, "worked chains"),
    "replay": ([], True, "the demo with the replay buffer"),
    "replay_long": (LONG, True, "worked chains with the replay buffer"),
}
TAUS = [0.05, 0.1, 0.2, 0.5, 1.0, 2.0]  # trust_tau's band widths on the sequence log-ratio
TAU_DEFAULT = 0.2  # VARIANTS' tb_trust_seq
CLIP = {"on": "--trainer.grad_clip=1.0", "off": "--trainer.grad_clip=null"}
# β annealed linearly (beta, beta_final, steps), as the paper does on GSM8K (0.014 -> 0.004) and TL;DR
ANNEAL = (0.05, 0.005, 300)
ABLATION_DEFAULTS = {"recent_prob": 0.95, "reward_inv_temp": 0.0, "group_size": 8}
# the variants' own metrics (train/...), kept per run as their mean over steps: the share of
# completions dropped, the share of residuals in Huber's linear part, the batch's normalised ESS
ACTED = {"tb_dropped": "{:.1%} dropped", "tb_huber_fraction": "{:.0%} linear", "tb_ess": "mean ESS {:.2f}"}
# What a run's accuracy is in the tables and plots: the mean of its last three greedy evaluations
# (steps 300, 350 and 400 by default), less noisy than the last one alone.
METRIC = "acc_last3"


def run_name(part: str, objective: str, staleness: int, clip: str, lr: float, seed: int, extra: str = "") -> str:
    return f"{part}/{objective}-D{staleness}-clip{clip}-lr{lr:g}-s{seed}{extra}"


def run_one(out: Path, name: str, args: list[str], meta: dict, same_as: str | None = None) -> dict:
    """Train one run with ``tba train`` (or read it back if it finished before). ``same_as``
    names an earlier run with exactly the same arguments: its directory is copied instead."""
    run_dir = out / name
    if same_as and not (run_dir / "summary.json").is_file() and (out / same_as / "summary.json").is_file():
        if run_dir.exists():
            shutil.rmtree(run_dir)
        shutil.copytree(out / same_as, run_dir)
    if not (run_dir / "summary.json").is_file():
        if run_dir.exists():  # an interrupted run: start it again
            shutil.rmtree(run_dir)
        overrides = [
            "--runtime.type=sync",
            "--logging.progress=false",
            "--trainer.checkpoint_every=null",
            "--trainer.keep_checkpoints=1",
            *args,
        ]
        done = train(overrides, run_dir.parent, run_dir.name, check=False)
        if not done.ok:
            return {**meta, "name": name, "error": done.error(2000)}
        ckpts = run_dir / "checkpoints"
        if ckpts.is_dir():  # the study needs the metrics, not the weights
            shutil.rmtree(ckpts)
    run_summary, records = summary(run_dir), metrics(run_dir)
    evals = [r["eval/accuracy"] for r in records if r.get("eval/accuracy") is not None]
    steps = [r for r in records if "train/loss" in r]
    acted = {  # how much a variant of tb acted, the mean over steps
        key: statistics.mean(values)
        for key in ACTED
        if (values := [r[f"train/{key}"] for r in steps if r.get(f"train/{key}") is not None])
    }
    return {
        **meta,
        "name": name,
        "acc_initial": evals[0],
        "acc_final": evals[-1],
        "acc_last3": statistics.mean(evals[-3:]),
        "evals": evals,
        "wall_s": run_summary["wall_clock_s"],
        "lag_mean": statistics.mean(r["train/lag_mean"] for r in steps),
        "lag_max": max(r["train/lag_max"] for r in steps),
        "grad_norm_median": statistics.median(r["train/grad_norm"] for r in steps if r["train/grad_norm"] is not None),
        "non_finite_losses": sum(1 for r in steps if r["train/loss"] is None),
        "completion_len": statistics.mean(r["train/completion_len"] for r in steps),
        **acted,
    }


def common_args(a, staleness: int, seed: int, replay: bool = False) -> list[str]:
    return [
        f"--buffer.fresh_only={str(not replay).lower()}",
        f"--runtime.extra_lag={staleness}",
        f"--trainer.steps={a.steps}",
        f"--eval.every={a.eval_every}",
        f"--run.seed={seed}",
    ]


def grid(a) -> list[tuple[str, list[str], dict, str | None]]:
    """(run name, CLI arguments, metadata, earlier run with the same arguments) of every run of
    part ``a.part``. The main part's on-policy seed-0 runs are the sweep's runs at the chosen
    learning rate (same arguments, in the same order), and on-policy ``rloo_proximal`` is the same
    computation as ``rloo`` (a ratio of 1), so those are copied rather than run again."""
    jobs = []
    if a.part == "sweep":
        for objective in a.objectives:
            for clip in a.clips:
                for lr in a.lrs:
                    meta = {"part": "sweep", "objective": objective, "staleness": 0, "clip": clip, "lr": lr, "seed": 0}
                    args = [*common_args(a, 0, 0), *OBJECTIVE_ARGS[objective], f"--trainer.lr={lr}", CLIP[clip]]
                    jobs.append((run_name("sweep", objective, 0, clip, lr, 0), args, meta, None))
    elif a.part in ("main", "hard", "lr"):
        best = best_lrs(a.out)
        if a.part == "lr" and a.lr is None:
            sys.exit("the lr part trains at the learning rate --lr: give one")
        for seed in a.seeds:
            for staleness in a.staleness:
                for objective in a.objectives:
                    for clip in a.clips:
                        lr = a.lr if a.part == "lr" else best.get((objective, clip))
                        if lr is None:
                            sys.exit(f"no learning rate for {objective} clip {clip}: run the sweep part first")
                        meta = {"part": a.part, "objective": objective, "staleness": staleness, "clip": clip}
                        meta |= {"lr": lr, "seed": seed}
                        args = [*common_args(a, staleness, seed), *OBJECTIVE_ARGS[objective]]
                        args += [f"--trainer.lr={lr}", CLIP[clip], *(HARD if a.part == "hard" else [])]
                        same_as = None
                        if staleness == 0 and seed == 0 and a.part in ("main", "lr"):
                            same_as = run_name("sweep", objective, 0, clip, lr, 0)
                        elif staleness == 0 and objective == "rloo_proximal" and best.get(("rloo", clip)) == lr:
                            # on-policy the sequence ratio is exactly 1: the sweep's rloo and
                            # rloo_proximal runs agree evaluation for evaluation at every lr
                            same_as = run_name(a.part, "rloo", 0, clip, lr, seed)
                        jobs.append((run_name(a.part, objective, staleness, clip, lr, seed), args, meta, same_as))
    elif a.part in VARIANT_PARTS:
        task, replay, _ = VARIANT_PARTS[a.part]
        best = best_lrs(a.out)
        for seed in a.seeds:
            for staleness in a.staleness:
                for objective in a.objectives:
                    base = "rloo_proximal" if objective == "rloo_proximal" else "tb"
                    lr = best.get((base, "on"))
                    if lr is None:
                        sys.exit(f"no learning rate for {base} clip on: run the sweep part first")
                    meta = {"part": a.part, "objective": objective, "staleness": staleness, "clip": "on"}
                    meta |= {"lr": lr, "seed": seed}
                    args = [*common_args(a, staleness, seed, replay), *OBJECTIVE_ARGS[objective]]
                    args += [f"--trainer.lr={lr}", CLIP["on"], *task]
                    same_as = None
                    if staleness == 0 and objective in MASKS and not replay:
                        same_as = run_name(a.part, "tb", 0, "on", lr, seed)
                    jobs.append((run_name(a.part, objective, staleness, "on", lr, seed), args, meta, same_as))
    elif a.part == "trust_tau":
        lr = best_lrs(a.out).get(("tb", "on"))
        if lr is None:
            sys.exit("no learning rate for tb clip on: run the sweep part first")
        for seed in a.seeds:
            for staleness in a.staleness:
                for tau in a.taus:
                    meta = {"part": a.part, "objective": "tb_trust_seq", "tau": tau, "staleness": staleness}
                    meta |= {"clip": "on", "lr": lr, "seed": seed}
                    band = [  # VARIANTS' tb_trust_seq with this width
                        f"--objective.tb_trust_region={tau}" if arg.startswith("--objective.tb_trust_region=") else arg
                        for arg in VARIANTS["tb_trust_seq"]
                    ]
                    args = [*common_args(a, staleness, seed), *band, f"--trainer.lr={lr}", CLIP["on"], *LONG]
                    same_as = None
                    if tau == TAU_DEFAULT:  # exactly part 8's tb_trust_seq (variants_long's arguments, in order)
                        same_as = run_name("variants_long", "tb_trust_seq", staleness, "on", lr, seed)
                    name = run_name(a.part, "tb_trust_seq", staleness, "on", lr, seed, f"-tau{tau:g}")
                    jobs.append((name, args, meta, same_as))
    elif a.part == "anneal":
        for seed in a.seeds:
            for objective in ("tb", "rloo"):
                meta = {"part": "anneal", "objective": objective, "staleness": 0, "clip": "off", "lr": 1e-4}
                meta |= {"seed": seed, "beta": f"{ANNEAL[0]} -> {ANNEAL[1]} over {ANNEAL[2]} steps"}
                args = [*common_args(a, 0, seed), *OBJECTIVE_ARGS[objective], "--trainer.lr=0.0001", CLIP["off"]]
                args += [f"--objective.beta={ANNEAL[0]}", f"--objective.beta_final={ANNEAL[1]}"]
                args += [f"--objective.beta_anneal_steps={ANNEAL[2]}"]
                jobs.append((f"anneal/{objective}-clipoff-s{seed}", args, meta, None))
    elif a.part == "ablations":
        # The demo's defaults (m 0.95, inverse temperature 0, K 8) are one run per seed, shared by
        # the three settings' rows; each other value changes one setting from it.
        settings = [("default", 0, None)]
        settings += [("recent_prob", m, f"--buffer.recent_prob={m}") for m in (0.5, 1.0)]
        settings += [("reward_inv_temp", 1.0, "--buffer.reward_inv_temp=1.0")]
        settings += [("group_size", k, f"--generation.group_size={k}") for k in (4, 16)]
        for seed in a.seeds:
            for key, value, flag in settings:
                meta = {"part": "ablations", "setting": key, "value": value, "seed": seed, "objective": "tb"}
                args = [f"--trainer.steps={a.steps}", f"--eval.every={a.eval_every}", f"--run.seed={seed}"]
                name = f"ablations/{key}-s{seed}" if flag is None else f"ablations/{key}-{value:g}-s{seed}"
                jobs.append((name, args + ([flag] if flag else []), meta, None))
    return jobs


def best_lrs(out: Path) -> dict[tuple[str, str], float]:
    """Per (objective, clip): the sweep's learning rate with the highest mean of the last 3 evaluations."""
    path = out / "sweep" / "results.json"
    if not path.is_file():
        return {}
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for r in json.loads(path.read_text()):
        if "error" in r:
            continue
        key = (r["objective"], r["clip"])
        if key not in best or r["acc_last3"] > best[key][1]:
            best[key] = (r["lr"], r["acc_last3"])
    return {k: v[0] for k, v in best.items()}


def run_part(a) -> None:
    print_machine()
    jobs = grid(a)
    extra = [f"--run.threads={max(1, (os.cpu_count() or 1) // a.jobs)}"] if a.jobs > 1 else []
    build_models(a.part)
    path = a.out / a.part / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / "environment.json").write_text(json.dumps(describe_machine(), indent=2))
    # earlier invocations' results (other seeds, other objectives) stay; a run again replaces its own
    results = {r["name"]: r for r in (json.loads(path.read_text()) if path.is_file() else [])}
    start = time.time()
    print(f"part {a.part}: {len(jobs)} runs, {a.jobs} at a time", flush=True)
    # copies last, each after the run it copies (which this invocation may be running)
    jobs.sort(key=lambda job: job[3] is not None)
    submitted = {}

    def run_after(name, args, meta, same):
        if same in submitted:
            submitted[same].result()
        return run_one(a.runs, name, [*args, *extra], meta, same)

    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        for name, args, meta, same in jobs:
            submitted[name] = pool.submit(run_after, name, args, meta, same)
        for future in list(submitted.values()):
            r = future.result()
            results[r["name"]] = r
            path.write_text(json.dumps(list(results.values()), indent=2))  # after each run: nothing lost
            status = r.get("error", "").strip().splitlines()[-1:] or [
                f"{r['acc_initial']:.1%} -> {r['acc_final']:.1%} (last 3: {r['acc_last3']:.1%}) in {r['wall_s']:.0f} s"
            ]
            print(f"[{time.time() - start:6.0f} s] {r['name']}: {status[0]}", flush=True)
    report(a)


def build_models(part: str) -> None:
    """Build (or find cached) the warm-started model every run of the part starts from, once,
    before runs that would otherwise race to build it."""
    from tba.config import load_config
    from tba.plan import make_plan
    from tba.runtime.preflight import check_models

    tasks = {"hard": HARD, "trust_tau": LONG, **{name: task for name, (task, _, _) in VARIANT_PARTS.items()}}
    cfg = load_config(None, tasks.get(part, []))
    check_models(cfg.model, cfg.generation, cfg.task, make_plan(cfg), log=lambda msg: print(msg, flush=True))


def cell(values: list[float]) -> str:
    return spread(values, ".1%")


def staleness_cells(runs: list[dict], levels: list[int]) -> tuple[str, str]:
    """A table row's cells: accuracy at each staleness level (mean ± std over the runs there), and
    the loss from the first level to the last."""
    by = {d: [r[METRIC] for r in runs if r["staleness"] == d] for d in levels}
    first, last = by[levels[0]], by[levels[-1]]
    gap = f"{(statistics.mean(first) - statistics.mean(last)) * 100:+.1f} pts" if first and last else "-"
    return " | ".join(cell(by[d]) for d in levels), gap


def load(out: Path, part: str) -> list[dict]:
    path = out / part / "results.json"
    return [r for r in json.loads(path.read_text()) if "error" not in r] if path.is_file() else []


def report(a) -> None:
    """Markdown tables of every part that has results, and the plots."""
    sweep = load(a.out, "sweep")
    if sweep:
        lrs = sorted({r["lr"] for r in sweep})
        print("\n### Learning-rate sweep (on-policy, seed 0; mean of the last 3 evaluations)\n")
        print("| objective | clip | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best |")
        print("|---|---|" + "---:|" * (len(lrs) + 1))
        best = best_lrs(a.out)
        for objective in OBJECTIVES:
            for clip in ("on", "off"):
                rows = {r["lr"]: r for r in sweep if r["objective"] == objective and r["clip"] == clip}
                if rows:
                    cells = [f"{rows[lr]['acc_last3']:.1%}" if lr in rows else "-" for lr in lrs]
                    print(f"| {objective} | {clip} | " + " | ".join(cells) + f" | {best[(objective, clip)]:g} |")
        plot_sweep(sweep, a.out / "sweep.png")
    for part in ("main", "hard"):
        rows = load(a.out, part)
        if not rows:
            continue
        levels = sorted({r["staleness"] for r in rows})
        seeds = sorted({r["seed"] for r in rows})
        print(
            f"\n### {part}: accuracy (mean of the last 3 evaluations) by staleness D, mean ± std over seeds {seeds}\n"
        )
        print("| objective | clip | lr | " + " | ".join(f"D={d}" for d in levels) + " | D=0 minus D=max |")
        print("|---|---|---:|" + "---:|" * (len(levels) + 1))
        for objective in OBJECTIVES:
            for clip in ("on", "off"):
                mine = [r for r in rows if r["objective"] == objective and r["clip"] == clip]
                if not mine:
                    continue
                cells, gap = staleness_cells(mine, levels)
                print(f"| {objective} | {clip} | {mine[0]['lr']:g} | {cells} | {gap} |")
        initial = statistics.mean(r["acc_initial"] for r in rows)
        bad = sum(1 for r in rows if r["non_finite_losses"])
        length = statistics.mean(r["completion_len"] for r in rows)
        print(f"\ninitial accuracy {initial:.1%}; {len(rows)} runs; runs with a non-finite loss: {bad}; ", end="")
        print(f"completions of {length:.2f} tokens on average (end token included)")
        plot_staleness(rows, a.out / f"staleness_{part}.png", part)
        plot_curves(rows, a.out / f"curves_{part}.png", part, a.eval_every)
    report_lr(a)
    report_variants(a)
    report_tau(a)
    anneal = load(a.out, "anneal")
    if anneal:
        constant = [r for r in load(a.out, "main") if r["staleness"] == 0 and r["clip"] == "off"]
        print(f"\n### tb against rloo, on-policy, clipping off: β {ANNEAL[0]} constant or annealed to {ANNEAL[1]}\n")
        print("| objective | β constant | β annealed | median gradient norm (annealed) |")
        print("|---|---:|---:|---:|")
        for objective in ("tb", "rloo"):
            flat = [r[METRIC] for r in constant if r["objective"] == objective]
            mine = [r for r in anneal if r["objective"] == objective]
            norms = statistics.median(r["grad_norm_median"] for r in mine)
            print(f"| {objective} | {cell(flat)} | {cell([r[METRIC] for r in mine])} | {norms:.3g} |")
    ablations = load(a.out, "ablations")
    if ablations:
        print("\n### Sampling ablations (tb, replay buffer, sync runtime; accuracy, mean ± std over seeds)\n")
        print("| setting | value | accuracy | mean lag of trained rollouts | runs |")
        print("|---|---:|---:|---:|---:|")
        default = [r for r in ablations if r["setting"] == "default"]
        for key in ABLATION_DEFAULTS:
            mine = [r for r in ablations if r["setting"] == key] + [
                {**r, "value": ABLATION_DEFAULTS[key]} for r in default
            ]
            for value in sorted({r["value"] for r in mine}):
                accs = [r[METRIC] for r in mine if r["value"] == value]
                lags = [r["lag_mean"] for r in mine if r["value"] == value]
                mark = " (default)" if value == ABLATION_DEFAULTS[key] else ""
                print(f"| {key} | {value:g}{mark} | {cell(accs)} | {statistics.mean(lags):.1f} | {len(accs)} |")


def report_variants(a) -> None:
    for part, (_, replay, task) in VARIANT_PARTS.items():
        rows = load(a.out, part)
        if not rows:
            continue
        levels = sorted({r["staleness"] for r in rows})
        seeds = sorted({r["seed"] for r in rows})
        print(f"\n### {part}: trajectory balance's variants on {task}; accuracy by staleness D, ", end="")
        print(f"mean ± std over seeds {seeds}\n")
        header = " | ".join(f"D={d}" for d in levels)
        print(f"| objective | lr | {header} | D=0 minus D=max | acted at D={levels[-1]} | runs |")
        print("|---|---:|" + "---:|" * (len(levels) + 3))
        for objective in COMPARED:
            mine = [r for r in rows if r["objective"] == objective]
            if not mine:
                continue
            cells, gap = staleness_cells(mine, levels)
            last = [r for r in mine if r["staleness"] == levels[-1]]
            acted = [
                fmt.format(statistics.mean(r[key] for r in last))
                for key, fmt in ACTED.items()
                if last and all(key in r for r in last)
            ]
            print(f"| {objective} | {mine[0]['lr']:g} | {cells} | {gap} | {', '.join(acted)} | {len(mine)} |")
        initial = statistics.mean(r["acc_initial"] for r in rows)
        length = statistics.mean(r["completion_len"] for r in rows)
        print(f"\ninitial accuracy {initial:.1%}; completions of {length:.1f} tokens on average (end token included)")
        if replay:  # the buffer adds its own staleness to D
            lags = {d: statistics.mean(r["lag_mean"] for r in rows if r["staleness"] == d) for d in levels}
            print("mean age of trained data: " + ", ".join(f"{lag:.1f} steps at D = {d}" for d, lag in lags.items()))
        plot_staleness(rows, a.out / f"staleness_{part}.png", part, COMPARED, clips=("on",))
        plot_curves(rows, a.out / f"curves_{part}.png", part, a.eval_every, clip="on", objectives=COMPARED)


def report_tau(a) -> None:
    """The sequence band's width against accuracy on worked chains, with part 8's references."""
    rows = load(a.out, "trust_tau")
    if not rows:
        return
    levels = sorted({r["staleness"] for r in rows})
    taus = sorted({r["tau"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    print("\n### trust_tau: the sequence trust region's width τ on worked chains; accuracy by staleness D, ", end="")
    print(f"mean ± std over seeds {seeds}\n")
    print("| τ | " + " | ".join(f"D={d}" for d in levels) + f" | dropped at D={levels[-1]} | runs |")
    print("|---|" + "---:|" * (len(levels) + 2))
    for tau in taus:
        mine = [r for r in rows if r["tau"] == tau]
        cells, _ = staleness_cells(mine, levels)
        last = [r["tb_dropped"] for r in mine if r["staleness"] == levels[-1] and "tb_dropped" in r]
        dropped = f"{statistics.mean(last):.1%}" if last else "-"
        print(f"| {tau:g} | {cells} | {dropped} | {len(mine)} |")
    long = load(a.out, "variants_long")
    refs = {}  # label: accuracies (part 8's runs, the same seeds)
    for objective, d in [("tb", 0), *((o, d) for o in ("tb", "rloo_proximal") for d in levels)]:
        accs = [r[METRIC] for r in long if r["objective"] == objective and r["staleness"] == d and r["seed"] in seeds]
        if accs:
            refs[f"{objective}, D = {d}"] = accs
    if refs:
        print("\npart 8's runs for reference: " + "; ".join(f"{k}: {cell(v)}" for k, v in refs.items()))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for d in levels:
        points = [
            (t, *mean_std(accs))
            for t in taus
            if (accs := [r[METRIC] for r in rows if r["tau"] == t and r["staleness"] == d])
        ]
        xs, ms, ss = zip(*points, strict=True)
        ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=f"tb_trust_seq, D = {d}")
    styles = ["-", "--", ":", "-."]
    for i, (label, accs) in enumerate(refs.items()):
        ax.axhline(statistics.mean(accs), color="gray", linestyle=styles[i % 4], linewidth=1, label=label)
    ax.set_xscale("log")
    ax.set_xlabel("τ, the band on the sequence log-ratio to the sampler")
    ax.set_ylabel("accuracy (last 3 evaluations)")
    ax.set_title("trust_tau: worked chains")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out / "trust_tau.png", dpi=110)


def clip_panels(clips=("on", "off")):
    """A figure with one panel per clipping setting: (figure, [(axes, clip), ...])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(clips), figsize=(5.5 * len(clips), 4), sharey=True, squeeze=False)
    return fig, list(zip(axes[0], clips, strict=True))


def save_panels(fig, ylabel: str, path: Path) -> None:
    axes = fig.axes
    axes[0].set_ylabel(ylabel)
    axes[-1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report_lr(a) -> None:
    """The lr part's runs next to the main part's at the on-policy best learning rate."""
    rows = load(a.out, "lr")
    if not rows:
        return
    main_rows = load(a.out, "main")
    levels = sorted({r["staleness"] for r in rows})
    seeds = sorted({r["seed"] for r in rows})
    print(f"\n### main at another learning rate: accuracy by staleness D, mean ± std over seeds {seeds}\n")
    print("| objective | clip | lr | " + " | ".join(f"D={d}" for d in levels) + " |")
    print("|---|---|---:|" + "---:|" * len(levels))
    for objective in OBJECTIVES:
        for clip in ("on", "off"):
            mine = [r for r in rows if r["objective"] == objective and r["clip"] == clip]
            if not mine:
                continue
            for source, label in ((main_rows, " (on-policy best)"), (mine, "")):
                runs = [r for r in source if r["objective"] == objective and r["clip"] == clip and r["seed"] in seeds]
                for lr in sorted({r["lr"] for r in runs}, reverse=True):
                    cells = [cell([r[METRIC] for r in runs if r["lr"] == lr and r["staleness"] == d]) for d in levels]
                    print(f"| {objective} | {clip} | {lr:g}{label} | " + " | ".join(cells) + " |")


def plot_sweep(rows: list[dict], path: Path) -> None:
    fig, panels = clip_panels()
    for ax, clip in panels:
        for objective in OBJECTIVES:
            pts = sorted((r["lr"], r["acc_last3"]) for r in rows if r["objective"] == objective and r["clip"] == clip)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=objective)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_title(f"on-policy, gradient clipping {clip}")
        ax.grid(alpha=0.3)
    save_panels(fig, "accuracy, mean of the last 3 evaluations", path)


def plot_staleness(rows: list[dict], path: Path, part: str, objectives=OBJECTIVES, clips=("on", "off")) -> None:
    levels = sorted({r["staleness"] for r in rows})
    fig, panels = clip_panels(clips)
    for ax, clip in panels:
        for objective in objectives:
            xs, ms, ss = [], [], []
            for i, d in enumerate(levels):
                accs = [
                    r[METRIC] for r in rows if r["objective"] == objective and r["clip"] == clip and r["staleness"] == d
                ]
                if accs:
                    m, s = mean_std(accs)
                    xs.append(i)
                    ms.append(m)
                    ss.append(s)
            if xs:
                ax.errorbar(xs, ms, yerr=ss, marker="o", capsize=3, label=objective)
        initial = statistics.mean(r["acc_initial"] for r in rows)
        ax.axhline(initial, color="gray", linestyle="--", linewidth=1, label="before training")
        ax.set_xticks(range(len(levels)), [str(d) for d in levels])
        ax.set_xlabel("staleness D (steps between the sampling weights and the trained ones)")
        ax.set_title(f"{part}: gradient clipping {clip}")
        ax.grid(alpha=0.3)
    save_panels(fig, "accuracy (last 3 evaluations)", path)


def plot_curves(
    rows: list[dict], path: Path, part: str, eval_every: int, clip: str = "off", objectives=OBJECTIVES
) -> None:
    """Greedy accuracy against the trainer step, one panel per staleness D, one line per objective
    (mean over seeds): whether each run plateaued, and how the stale ones get there (or do not)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = sorted({r["staleness"] for r in rows})
    fig, axes = plt.subplots(1, len(levels), figsize=(4 * len(levels), 3.6), sharey=True, squeeze=False)
    for ax, d in zip(axes[0], levels, strict=True):
        for objective in objectives:
            runs = [
                r["evals"] for r in rows if r["objective"] == objective and r["clip"] == clip and r["staleness"] == d
            ]
            if runs:
                n = min(len(e) for e in runs)
                mean = [statistics.mean(e[i] for e in runs) for i in range(n)]
                ax.plot([i * eval_every for i in range(n)], mean, marker=".", label=objective)
        ax.set_title(f"{part}, D = {d}, clipping {clip}")
        ax.set_xlabel("trainer step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("greedy accuracy (mean over seeds)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = ["sweep", "main", "hard", "anneal", "ablations", "lr", *VARIANT_PARTS, "trust_tau", "report"]
    parser.add_argument("part", choices=parts)
    parser.add_argument("--objectives", nargs="+", choices=[*OBJECTIVES, *VARIANTS], help="default: the part's")
    parser.add_argument("--lrs", type=float, nargs="+", default=[3e-5, 1e-4, 3e-4, 1e-3])
    parser.add_argument("--lr", type=float, help="the lr part's learning rate, for every objective")
    parser.add_argument("--staleness", type=int, nargs="+", help="default: 0 4 16 64 (variants: 0 16 64; replay: 0 16)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--taus", type=float, nargs="+", default=TAUS, help="trust_tau's band widths")
    parser.add_argument("--clips", nargs="+", choices=["on", "off"], default=["on", "off"], help="gradient clipping")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--runs", type=Path, default=Path("runs/bench-off-policy"), help="run directories")
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/off_policy"), help="results.json per part, plots"
    )
    parser.add_argument("--jobs", type=int, default=1, help="runs side by side; each gets cores/jobs torch threads")
    a = parser.parse_args()
    if a.objectives is None:
        defaults = {"variants": COMPARED, "replay": REPLAY_COMPARED, "replay_long": REPLAY_LONG_COMPARED}
        a.objectives = defaults.get(a.part, defaults.get(a.part.removesuffix("_long"), OBJECTIVES))
    if a.staleness is None:
        defaults = {"variants": [0, 16, 64], "replay": [0, 16], "trust_tau": [64]}
        a.staleness = defaults.get(a.part.removesuffix("_long"), [0, 4, 16, 64])
    a.out.mkdir(parents=True, exist_ok=True)
    a.runs.mkdir(parents=True, exist_ok=True)
    if a.part == "report":
        report(a)
    else:
        run_part(a)


if __name__ == "__main__":
    main()

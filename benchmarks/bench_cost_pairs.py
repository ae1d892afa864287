"""The cost model held to pairs of runs: the parts one layout's run measured predict another
layout's run, which is then run (2 cores; every run is the real ``tba train``).

    .venv/bin/python benchmarks/bench_cost_pairs.py run                 # every pair (~25 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_cost_pairs.py run --pairs demo    # one setting's runs
    .venv/bin/python benchmarks/bench_cost_pairs.py report              # the table, from what is stored

Each run measures its own parts and writes what they predict for the sync runtime and for the ray
runtime with 1, 2 and 4 searchers (``summary.json``'s ``measured`` and ``alternatives``:
``tba.runtime.pace``). A pair is a run of layout A and a run of layout B of the same setting: A's
prediction for B against B's measured seconds a step (over its steps after its first tenth), and the
other way round. The ranking is right when the prediction says which of A and B is faster as the
two runs did. A miss names the part that moved most between the two runs, in seconds (the trainer's step, a
searcher's batch, the runtime's own cost a step): what the model took as fixed across layouts and
was not.

The settings: the demo (HF generation, 300 steps), the tool demo (``configs/tools.yaml``, 40 steps),
reasoning-gym's demo config (``configs/reasoning_gym_demo.yaml``, 40 steps) and the word problems
with SmolLM2-135M-Instruct through vLLM (``benchmarks/word_problems/run.yaml``, 12 steps: set up by
``benchmarks/real_model.py`` and ``word_problems/make_problems.py``); the demo also in the ray
runtime with 2 and 4 searchers. Finished runs are kept (``--runs``) and not run again.
Results: ``results/cost_model/results.json`` and the table in its README.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness import ROOT, print_machine, row, rule
from harness.models import default_dest
from harness.runs import train

OUT = ROOT / "benchmarks" / "results" / "cost_model"
RUNS = Path("/tmp/tba-cost-pairs")
SMOLLM2 = default_dest()

# setting -> (config, overrides every run of it takes)
SETTINGS: dict[str, tuple[str | None, list[str]]] = {
    "demo": (None, ["--trainer.steps=300", "--eval.every=1000"]),
    "tools": ("configs/tools.yaml", ["--trainer.steps=40", "--eval.every=1000"]),
    "reasoning_gym": ("configs/reasoning_gym_demo.yaml", ["--trainer.steps=40", "--eval.every=1000"]),
    "word_problems": (
        "benchmarks/word_problems/run.yaml",
        [f"--model.policy={SMOLLM2}", "--generation.backend=vllm", "--trainer.steps=12", "--eval.every=1000"],
    ),
}
# layout -> overrides; the key is the alternative's name in summary.json (tba.runtime.pace)
LAYOUTS = {
    "sync": ["--runtime.type=sync"],
    "ray_1": ["--runtime.type=ray", "--runtime.num_searchers=1"],
    "ray_2": ["--runtime.type=ray", "--runtime.num_searchers=2"],
    "ray_4": ["--runtime.type=ray", "--runtime.num_searchers=4"],
    # the sync runtime on one thread: its parts measured with the threads of ray_1's trainer and searcher
    "sync_1thread": ["--runtime.type=sync", "--run.threads=1"],
}
# the pairs: (setting, layout A, layout B); each predicts the other
PAIRS = [
    ("demo", "sync", "ray_1"),
    ("tools", "sync", "ray_1"),
    ("reasoning_gym", "sync", "ray_1"),
    ("word_problems", "sync", "ray_1"),
    ("demo", "ray_1", "ray_2"),
    ("demo", "ray_1", "ray_4"),
    ("demo", "ray_2", "ray_4"),
    ("demo", "sync_1thread", "ray_1"),  # one way: the alternatives have no one-thread sync runtime
]
PART_NAMES = {
    "generate_s": "a searcher's batch",
    "train_s": "the trainer's step",
    "overhead_s": "the runtime's own cost a step",
    "load_s": "a searcher's load",
    "publish_s": "a publication",
}


def run_name(setting: str, layout: str) -> str:
    return f"{setting}-{layout}"


def run(settings: list[str], runs: Path, fresh: bool) -> None:
    machine = print_machine()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "environment.json").write_text(json.dumps(machine, indent=1) + "\n")
    wanted = sorted({(s, layout) for s, a, b in PAIRS if s in settings for layout in (a, b)})
    for setting, layout in wanted:
        name = run_name(setting, layout)
        if (runs / name / "summary.json").is_file() and not fresh:
            print(f"{name}: kept", flush=True)
            continue
        config, overrides = SETTINGS[setting]
        args = [*overrides, *LAYOUTS[layout], "--logging.progress=false", "--run.seed=0"]
        print(f"{name}: tba train {config or ''} {' '.join(args)}", flush=True)
        done = train(args, runs, name, config=ROOT / config if config else None, clear=True, cwd=ROOT)
        print(f"{name}: {done.wall_s:.0f} s", flush=True)
    report(runs)


def summary_of(runs: Path, setting: str, layout: str) -> dict | None:
    path = runs / run_name(setting, layout) / "summary.json"
    return json.loads(path.read_text()) if path.is_file() else None


def threads_of(summary: dict, part: str) -> int:
    """The threads a run's part was measured with (its ``parts``; 0: not known)."""
    return summary["measured"]["parts"].get(f"{part}_threads", 0)


def miss_part(a: dict, b: dict, predicted: dict) -> str:
    """What the model got wrong predicting run ``b`` from run ``a``'s parts: the lag bound where it
    set the predicted pace, the trainer's wait where it was predicted to wait for nothing, else
    the part whose seconds in ``b`` are furthest from ``a``'s at ``b``'s threads (the model scales
    a part by the ratio of its threads)."""
    if predicted["bound"] == "lag":
        return f"the lag bound: it set the predicted pace; {b['runtime']} measured lag {b['measured']['lag_mean']:.2g}"
    pa, pb = a["measured"]["parts"], b["measured"]["parts"]
    moved = {}
    for key, part in (("generate_s", "generate"), ("train_s", "train"), ("overhead_s", None)):
        ta, tb = (threads_of(a, part), threads_of(b, part)) if part else (0, 0)
        expected = pa[key] * ta / tb if ta and tb else pa[key]
        moved[key] = (abs(pb[key] - expected), expected, ta, tb)
    key = max(moved, key=lambda k: moved[k][0])
    gap, expected, ta, tb = moved[key]
    busy = b["measured"]["trainer_busy"] or 1.0
    if predicted["bound"] == "trainer" and busy < 0.95 and gap < 0.1 * b["measured"]["step_s"]:
        return f"the trainer's wait: busy {busy:.2f} in {b['runtime']}, where the parts say it never waits"
    threads = f" ({ta} -> {tb} threads: expected {expected:.3g} s)" if ta != tb and ta and tb else ""
    return f"{PART_NAMES[key]}: {pa[key]:.3g} s in {a['runtime']}, {pb[key]:.3g} s in {b['runtime']}{threads}"


def pair_rows(runs: Path) -> list[dict]:
    rows = []
    for setting, a, b in PAIRS:
        sa, sb = summary_of(runs, setting, a), summary_of(runs, setting, b)
        if sa is None or sb is None:
            continue
        measured = {a: sa["measured"]["step_s"], b: sb["measured"]["step_s"]}
        for source, target, s_src, s_tgt in ((a, b, sa, sb), (b, a, sb, sa)):
            if target not in s_src["alternatives"]:
                continue
            predicted_target = s_src["alternatives"][target]["step_s"]
            # the same parts, its own layout (a layout that is no alternative: as it ran)
            predicted_source = (s_src["alternatives"].get(source) or s_src["measured"])["step_s"]
            error = predicted_target / measured[target] - 1
            ranking = (predicted_target < predicted_source) == (measured[target] < measured[source])
            ok = abs(error) <= 0.15 and ranking
            rows.append(
                {
                    "setting": setting,
                    "from": source,
                    "predicts": target,
                    "predicted_s": round(predicted_target, 4),
                    "measured_s": round(measured[target], 4),
                    "error": round(error, 3),
                    "bound": s_src["alternatives"][target]["bound"],
                    "ranking_right": ranking,
                    "miss": None if ok else miss_part(s_src, s_tgt, s_src["alternatives"][target]),
                }
            )
    return rows


def report(runs: Path) -> None:
    rows = pair_rows(runs)
    stored = {"rows": rows, "runs": {}}
    for setting, a, b in PAIRS:
        for layout in (a, b):
            s = summary_of(runs, setting, layout)
            if s is not None:
                stored["runs"][run_name(setting, layout)] = {
                    k: s.get(k) for k in ("predicted", "measured", "error", "alternatives", "wall_clock_s")
                }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(stored, indent=1) + "\n")
    head = ["setting", "parts of", "predict", "predicted s/step", "measured s/step", "error", "bound", "ranking"]
    print(row([*head, "miss: the part that moved"]))
    print(rule("lllrrrlll"))
    for r in rows:
        cells = [r["setting"], r["from"], r["predicts"], f"{r['predicted_s']:.3g}", f"{r['measured_s']:.3g}"]
        cells += [f"{r['error']:+.0%}", r["bound"], "right" if r["ranking_right"] else "WRONG", r["miss"] or ""]
        print(row(cells))
    within = sum(r["miss"] is None for r in rows)
    print(f"\n{within} of {len(rows)} predictions within 15% with the ranking right")
    print_parts(stored["runs"])


def cores(cpu_s: float, wall_s: float) -> str:
    return f"{cpu_s / wall_s:.2f}" if cpu_s and wall_s else "-"


def print_parts(runs: dict[str, dict]) -> None:
    """Each run's measured parts: seconds, and the cores each kept busy (CPU over wall seconds)."""
    print()
    head = ["run", "s/step", "batch s", "batch cores", "trainer step s", "trainer cores", "own cost s"]
    print(row(head))
    print(rule("lrrrrrr"))
    for name, s in runs.items():
        p = s["measured"]["parts"]
        trainer = p["train_s"] + p["overhead_s"] + p["publish_s"]
        cells = [name, f"{s['measured']['step_s']:.3g}", f"{p['generate_s']:.3g}"]
        cells += [cores(p.get("generate_cpu_s", 0.0), p["generate_s"]), f"{p['train_s']:.3g}"]
        cells += [cores(p.get("train_cpu_s", 0.0), trainer), f"{p['overhead_s']:.3g}"]
        print(row(cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["run", "report"])
    parser.add_argument("--pairs", nargs="+", default=list(SETTINGS), choices=list(SETTINGS), help="settings to run")
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--fresh", action="store_true", help="run again what has run")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.pairs, args.runs, args.fresh)
    else:
        report(args.runs)


if __name__ == "__main__":
    sys.exit(main())

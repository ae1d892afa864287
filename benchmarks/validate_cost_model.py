"""The cost model (tba.plan.cost) against every layout measured: predicted against measured, with the error.

    .venv/bin/python benchmarks/validate_cost_model.py run      # the 2-core layouts, fresh (~15 minutes)
    .venv/bin/python benchmarks/validate_cost_model.py report   # the table, from what is stored
    .venv/bin/python benchmarks/validate_cost_model.py project  # docs/scaling.md's projections

The parts come from part measurements, never from the rows checked: on CPUs from
``benchmarks/bench_parts.py`` (``results/parts/results.json``, this machine's CPU), on GPUs from
``src/tba/plan/parts.json``. The rows:

- the 2-core layouts of ``results/layouts`` (``run``: sync, ray and ray with ``runtime.max_ahead=1``,
  on the word problems with SmolLM2 and vLLM and on the demo), rerun on this machine (the stored
  runs were on another CPU and kept only the trainer's step), each the real ``tba train``: seconds a
  step as the median gap between logged steps (steps after an evaluation left out);
- the H100 runs of ``results/gpu_vllm`` and the H200 runs of ``results/gpu``;
- the stand-in runs of ``results/scale`` (``bench_scale.py``).

A row is ``held out`` when no part was taken from the run itself; its ``parts from`` column says
where they came from (a row whose parts are its own run's checks that the parts add up). Writes
``results/scale/validation.json``; the table goes to ``results/scale/README.md`` by hand.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

from harness import print_machine, row, rule
from harness.models import SHAPES as MODEL_SHAPES
from harness.runs import train
from harness.settings import SETTINGS

from tba.plan.cost import Layout, StepParts, Workload, gpu_parts, parts, predict

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
OUT = RESULTS / "scale" / "validation.json"
RUNS = Path("/tmp/tba-validate")

# the 2-core layouts run fresh: (setting, backend, runtime, steps, overrides); 12 steps of the word
# problems, 300 of the demo; ``ahead1``: the searchers capped at a step ahead (runtime.max_ahead=1)
CPU_LAYOUTS = {
    "real-sync": ("real", "vllm", "sync", 12, []),
    "real-ray": ("real", "vllm", "ray", 12, []),
    "real-ray-ahead1": ("real", "vllm", "ray", 12, ["--runtime.max_ahead=1"]),
    "demo-sync": ("demo", "hf", "sync", 300, []),
    "demo-ray": ("demo", "hf", "ray", 300, []),
    "demo-ray-ahead1": ("demo", "hf", "ray", 300, ["--runtime.max_ahead=1"]),
}


def loop_step(records: list[dict], every: int) -> float:
    """The median gap between logged trainer steps, leaving out the first two and each step that
    follows an evaluation."""
    steps = [r for r in records if "train/loss" in r and r.get("time_s") is not None]
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(steps, steps[1:], strict=False) if a["step"] > 2]
    keep = [g for (a, g) in zip(steps, gaps, strict=False) if a["step"] % every != 0]
    return statistics.median(keep or gaps)


def run_layouts(names: list[str]) -> None:
    stored = json.loads(OUT.read_text()) if OUT.is_file() else {}
    environment = print_machine()
    measured = stored.setdefault("cpu_runs", {})
    for name in names:
        setting, backend, runtime, steps, extra = CPU_LAYOUTS[name]
        args = [*SETTINGS[setting], *extra]
        config = args.pop(0) if args and args[0].endswith(".yaml") else None
        every = max(steps // 3, 1)
        overrides = [*args, f"--runtime.type={runtime}", f"--trainer.steps={steps}", f"--eval.every={every}"]
        overrides += ["--logging.progress=false", "--run.seed=0"]
        if backend == "vllm":
            overrides.append("--generation.backend=vllm")
        print(f"{name}: tba train {' '.join(overrides)}", flush=True)
        done = train(overrides, RUNS, name, config=config, clear=True)
        records, summary = done.metrics(), done.summary()
        train_records = [r for r in records if "train/loss" in r]
        lags = [r["train/lag_mean"] for r in train_records if r.get("train/lag_mean") is not None]
        measured[name] = {
            "cpu": environment["cpu"],
            "commit": environment.get("commit"),
            "step_s": round(loop_step(records, every), 4),
            "trainer_step_s": round(statistics.median(r["train/step_s"] for r in train_records[2:]), 4),
            "trainer_busy": summary.get("trainer_busy_fraction"),
            "lag_mean": round(statistics.mean(lags), 3) if lags else None,
            "wall_s": round(done.wall_s, 1),
        }
        print(json.dumps(measured[name]), flush=True)
        OUT.write_text(json.dumps(stored, indent=1) + "\n")


def cpu_parts(setting: str, backend: str, threads: int, cpu: str | None = None) -> dict:
    """The parts measured for ``setting`` on ``threads`` (on ``cpu``; None: on any)."""
    found = json.loads((RESULTS / "parts" / "results.json").read_text())["rows"]
    for r in found:
        if (r["setting"], r["backend"], r["threads"]) == (setting, backend, threads) and cpu in (None, r["cpu"]):
            return r
    raise SystemExit(f"no parts for {setting} {backend} {threads} thread(s) on {cpu}: run bench_parts.py")


def cpu_rows(stored: dict) -> list[dict]:
    """The fresh 2-core layouts: sync on 2 threads; ray with the searcher on one and the trainer on
    the other (the plan's split of 2 cores)."""
    out = []
    per_completion = parts()["runtime"]["trainer_s_per_completion"]
    for name, m in stored.get("cpu_runs", {}).items():
        setting, backend, runtime, _, _ = CPU_LAYOUTS[name]
        threads = 2 if runtime == "sync" else 1
        p = cpu_parts(setting, backend, threads, m["cpu"])
        overhead = per_completion * p["completions_per_step"] if runtime == "ray" else 0.0
        sp = StepParts(p["batch_s"], p["train_s"], p["load_s"], p["publish_s"], overhead)
        layout = Layout(runtime, p["completions_per_step"], p["completions_per_batch"])
        source = "bench_parts.py on this CPU, apart" + (
            "; the runtime's cost a completion: stand-ins' 32" if runtime == "ray" else ""
        )
        out.append(compare(f"2 cores: {name} (this machine)", predict(sp, layout), m, source, held_out=True))
    return out


def gpu_rows() -> list[dict]:
    """``results/gpu_vllm`` (H100, vLLM) and ``results/gpu`` (H200, HF): Qwen2.5-0.5B's shape, 8
    prompts x 8 completions of 128 tokens; the arithmetic task's prompts, about 10 tokens."""
    out = []
    w = Workload(494032768, 24, 10, 128, 64, 64, "vllm")
    h100 = {
        r["name"]: r
        for f in sorted((RESULTS / "gpu_vllm").glob("results-*.json"))
        for r in json.loads(f.read_text())["runs"]
    }
    for name, transport, runtime in (
        ("sync-bf16-mixed-128tok-vllm", "in_process", "sync"),
        ("ray-bf16-mixed-128tok-vllm-ipc", "ipc", "ray"),
        ("ray-bf16-mixed-128tok-vllm-os", "object_store", "ray"),
    ):
        m = h100.get(name)
        if not m:
            continue
        pred = predict(gpu_parts("h100", w, transport), Layout(runtime, 64, 64, shared=runtime == "ray"))
        # the decode point and the trainer's step are the sync run's own phases; the shared-GPU factors the ray runs'
        source = (
            "this run's own phases (parts add up)"
            if runtime == "sync"
            else "sync run's phases; its own shared-GPU factors"
        )
        measured = {"step_s": m["loop_step_s"], "trainer_busy": m.get("busy"), "lag_mean": m.get("lag_mean")}
        out.append(compare(f"H100: {name}", pred, measured, source, held_out=False))
    h200_vllm = [
        r for f in sorted((RESULTS / "gpu_h200_vllm").glob("results-*.json")) for r in json.loads(f.read_text())["runs"]
    ]
    for m in h200_vllm:
        transport = m.get("transport") or "in_process"
        pred = predict(gpu_parts("h200", w, transport), Layout(m["runtime"], 64, 64, shared=m["runtime"] == "ray"))
        source = "H100's vLLM decode point and shared-GPU factors, the H200 HF run's trainer step, datasheets"
        measured = {"step_s": m["loop_step_s"], "trainer_busy": m.get("busy"), "lag_mean": m.get("lag_mean")}
        out.append(compare(f"H200: {m['name']}", pred, measured, source, held_out=True))
    hf = Workload(494032768, 24, 10, 128, 64, 64, "hf")
    h200 = json.loads((RESULTS / "gpu" / "results-bf16-mixed.json").read_text())["runs"]
    for m in h200:
        if m["runtime"] == "sync":
            p = gpu_parts("h200", hf, "in_process")
            sp = StepParts(p.generate_s, p.train_s, m["publish_s"], 0.0, p.overhead_s)  # HF's in-process copy
            pred = predict(sp, Layout("sync", 64, 64))
            source, held = "this run's own phases and publish_s as its load (parts add up)", False
        else:  # before publication left the trainer's path: the parts of bench_gpu.py --publish 4, alone
            p = gpu_parts("h200", hf, "object_store")
            sp = StepParts(p.generate_s, p.train_s, 0.942 + 0.153, 0.005 + 0.538 + 1.707, p.overhead_s)
            pred = predict(sp, Layout("ray", 64, 64, shared=True))
            source, held = "the sync run's phases, bench_gpu.py --publish 4 alone, H100 shared-GPU factors", True
        measured = {"step_s": m["loop_step_s"], "trainer_busy": m.get("busy"), "lag_mean": m.get("lag_mean")}
        out.append(compare(f"H200: {m['name']}", pred, measured, source, held_out=held))
    return out


def scale_rows() -> list[dict]:
    """``results/scale``: the stand-ins' set times (4 s a batch, 0.125 s a step, 0.2 s a load, a
    1-GB publication every 8 steps, its fetch in place) and the runtime's measured cost a completion."""
    data = json.loads((RESULTS / "scale" / "results.json").read_text())
    s = data["settings"]
    per_completion = parts()["runtime"]["trainer_s_per_completion"]
    c_step, c_batch = s["batch_prompts"] * 8, s["prompts_per_batch"] * 8
    sp = StepParts(s["batch_s"], s["step_s"], s["load_s"], 0.0, per_completion * c_step)
    out = []
    for r in data["rows"]:
        layout = Layout("ray", c_step, c_batch, searchers=r["searchers"], sync_interval=s["sync_interval"])
        measured = {"step_s": 1 / r["steps_per_s"], "trainer_busy": r["trainer_busy_fraction"], "lag_mean": None}
        own = r["searchers"] == 32  # the runtime's cost a completion is this row's figure
        source = "set stand-in times; the runtime's cost a completion: " + ("this row's own" if own else "the 32 row's")
        name = f"stand-ins: {r['searchers']} searcher(s)"
        out.append(compare(name, predict(sp, layout), measured, source, held_out=not own))
    return out


def compare(name: str, pred, measured: dict, source: str, held_out: bool) -> dict:
    """One row; ``source``: where its parts came from; ``held_out``: none of them from the run checked
    (else the row checks that the parts add up)."""
    return {
        "layout": name,
        "parts_from": source,
        "predicted_s": round(pred.step_s, 3),
        "measured_s": round(measured["step_s"], 3),
        "error": round(pred.step_s / measured["step_s"] - 1, 3),
        "bound": pred.bound,
        "busy_predicted": round(pred.trainer_busy, 2),
        "busy_measured": measured.get("trainer_busy"),
        "lag_predicted": round(pred.lag_mean, 2),
        "lag_measured": measured.get("lag_mean"),
        "held_out": held_out,
    }


VLLM = ("vllm", "vllm-ipc", "vllm-os")


def ray_against_sync(rows: list[dict]) -> tuple[float, float] | None:
    """(predicted, measured) speed of the fastest ray row over the sync row: above 1, ray is faster."""
    sync = [r for r in rows if "sync" in r["layout"]]
    ray = [r for r in rows if "ray" in r["layout"]]
    if not sync or not ray:
        return None
    best = min(ray, key=lambda r: r["measured_s"])
    return sync[0]["predicted_s"] / best["predicted_s"], sync[0]["measured_s"] / best["measured_s"]


def either(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def report() -> None:
    stored = json.loads(OUT.read_text()) if OUT.is_file() else {}
    rows = cpu_rows(stored) + gpu_rows() + scale_rows()
    head = ["layout", "predicted s/step", "measured s/step", "error", "bound", "busy pred / meas", "lag pred / meas"]
    print(row([*head, "held out", "parts from"]))
    print(rule("lrrrlrrll"))
    for r in rows:
        busy = f"{r.get('busy_predicted', '-')} / {either(r.get('busy_measured'))}"
        lag = f"{r.get('lag_predicted', '-')} / {either(r.get('lag_measured'))}"
        print(
            row(
                [
                    r["layout"],
                    f"{r['predicted_s']:.3g}",
                    f"{r['measured_s']:.3g}",
                    f"{100 * r['error']:+.0f}%",
                    r.get("bound", "-"),
                    busy,
                    lag,
                    "yes" if r["held_out"] else "no",
                    r["parts_from"],
                ]
            )
        )
    within = [r for r in rows if abs(r["error"]) <= 0.15]
    held = [r for r in rows if r["held_out"]]
    held_within = sum(abs(r["error"]) <= 0.15 for r in held)
    print(f"\n{len(within)} of {len(rows)} rows within 15%; held out: {held_within} of {len(held)}")
    for gpu in ("H100", "H200"):  # with vLLM on both
        ratio = ray_against_sync([r for r in rows if r["layout"].startswith(gpu) and r["layout"].endswith(VLLM)])
        if ratio:
            print(f"{gpu}: ray against sync, predicted {ratio[0]:.2f}x, measured {ratio[1]:.2f}x")
    stored["rows"] = rows
    OUT.write_text(json.dumps(stored, indent=1) + "\n")


SHAPES = {  # published config.json shapes (0.5B and 1.5B: those bench_gpu.py builds)
    "Qwen2.5-0.5B": {**MODEL_SHAPES["0.5b"], "tie_word_embeddings": True},
    "Qwen2.5-1.5B": {**MODEL_SHAPES["1.5b"], "tie_word_embeddings": True},
    "Qwen2.5-7B": dict(hidden_size=3584, num_hidden_layers=28, vocab_size=152064, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, tie_word_embeddings=False),
    "Rho-1B": dict(hidden_size=2048, num_hidden_layers=22, vocab_size=32000, num_attention_heads=32,
                   num_key_value_heads=4, intermediate_size=5632, tie_word_embeddings=False),
}  # fmt: skip

# (name, model, machine, tba train overrides)
GSM8K = ["--trainer.batch_prompts=7", "--generation.prompts_per_batch=7", "--generation.group_size=20",
         "--trainer.sync_interval=2"]  # fmt: skip
PAPER = ["--trainer.num_ranks=1", "--runtime.num_searchers=3"]

PROJECTIONS = [
    ("GSM8K (the paper): 7 prompts x 20, k = 2, 512 tokens", "Rho-1B", "4xa100",
     [*GSM8K, "--generation.max_new_tokens=512"]),
    ("the same, the paper's split", "Rho-1B", "4xa100", [*GSM8K, *PAPER, "--generation.max_new_tokens=512"]),
    ("the same, 200 tokens on average", "Rho-1B", "4xa100", [*GSM8K, *PAPER, "--generation.max_new_tokens=200"]),
    *[(f"{m}: 16 prompts x 8, 512 tokens", m, "8xh100", ["--generation.max_new_tokens=512"])
      for m in ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B")],
    *[(f"{m}: the same, max_lag 16", m, "8xh100", ["--generation.max_new_tokens=512", "--runtime.max_lag=16"])
      for m in ("Qwen2.5-0.5B", "Qwen2.5-7B")],
    ("Qwen2.5-7B: 64 prompts x 8, 512 tokens, max_lag 16", "Qwen2.5-7B", "8x8xh100",
     ["--generation.max_new_tokens=512", "--trainer.batch_prompts=64", "--runtime.max_lag=16"]),
]  # fmt: skip


def project() -> None:
    """The projections of docs/scaling.md: the split auto takes, its predicted step and the runner-up,
    against sync on the same machine."""
    import tempfile

    from tba.config import load_config
    from tba.plan.machines import described
    from tba.plan.shape import model_shape

    head = ["setting", "machine", "split (auto)", "s/step", "bound", "busy", "runner-up", "sync s/step", "vs sync"]
    print(row([*head, "vs sync if decode floor x2 / trainer efficiency /2 / network /2"]))
    print(rule("lllrlrlrrl"))
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, machine, overrides in PROJECTIONS:
            folder = Path(tmp) / model
            folder.mkdir(exist_ok=True)
            (folder / "config.json").write_text(json.dumps(SHAPES[model]))
            hw = described(machine)
            args = [f"--model.policy={folder}", "--generation.backend=vllm", "--runtime.type=ray", *overrides]
            cfg = load_config(None, args)
            shape = model_shape(str(folder))
            kind = machine.split("x")[-1]

            found, sync = projected(cfg, hw, shape, kind)
            best, runner = found[0], found[1] if len(found) > 1 else None
            split = f"{best.ranks} + {best.searchers}" + (f", {best.per_gpu} a GPU" if best.per_gpu > 1 else "")
            other = f"{runner.ranks} + {runner.searchers}: {runner.prediction.step_s:.3g} s" if runner else "-"
            p = best.prediction
            sensitivity = []
            for assumption in ASSUMPTIONS:
                with assumed(assumption):
                    found_off, sync_off = projected(cfg, hw, shape, kind)
                sensitivity.append(f"{sync_off.step_s / found_off[0].prediction.step_s:.2f}x")
            print(row([name, machine, split, f"{p.step_s:.3g}", p.bound, f"{p.trainer_busy:.2f}", other,
                       f"{sync.step_s:.3g}", f"{sync.step_s / p.step_s:.2f}x", " / ".join(sensitivity)]))  # fmt: skip


def projected(cfg, hw, shape, kind):
    """The split's candidates, fastest first, and the sync runtime's prediction."""
    from tba.plan.layout import candidates, sync_prediction

    return candidates(cfg, hw, "object_store", shape, kind), sync_prediction(cfg, hw, shape, kind)


ASSUMPTIONS = ("decode floor x2", "trainer efficiency /2", "network /2")


@contextmanager
def assumed(assumption: str):
    """The parts file with one assumption off by 2x, for the projections' sensitivity column: the
    decode floor (the measured decode points at half their rate), the trainer's efficiency (the
    measured steps twice as long, the published efficiency at scale halved), the network's bandwidth
    halved. The file itself is restored after."""
    table = parts()
    saved = copy.deepcopy(table)
    if assumption == "decode floor x2":
        for e in table["decode"]:
            e["tokens_per_s"] /= 2
    elif assumption == "trainer efficiency /2":
        for e in table["train"]:
            e["step_s"] *= 2
        table["train_at_scale"]["mfu"] /= 2
    else:
        table["weights"]["network_gb_s"]["value"] /= 2
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the 2-core layouts")
    run.add_argument("--layouts", nargs="+", choices=list(CPU_LAYOUTS), default=list(CPU_LAYOUTS))
    sub.add_parser("report", help="print the table")
    sub.add_parser("project", help="print docs/scaling.md's projections")
    args = parser.parse_args()
    if args.command == "project":
        return project()
    if args.command == "run":
        run_layouts(args.layouts)
    report()


if __name__ == "__main__":
    sys.exit(main())

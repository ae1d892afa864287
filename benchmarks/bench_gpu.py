"""Sync against ray at a realistic model size on one GPU: seconds per step, speedup, trainer busy
fraction, generation tokens/s, weight-publish seconds and peak GPU memory, per trainer precision.

    python benchmarks/bench_gpu.py --out runs/bench-gpu                       # Qwen2.5-0.5B's shape, 128 new tokens
    python benchmarks/bench_gpu.py --out runs/bench-gpu --new-tokens 256 --precisions bf16-mixed fp32
    python benchmarks/bench_gpu.py --out runs/bench-gpu --shape 1.5b          # Qwen2.5-1.5B's shape (1.54B parameters)
    python benchmarks/bench_gpu.py --out /tmp/b --device cpu --shape tiny --steps 3   # a smoke run on a CPU
    python benchmarks/bench_gpu.py --out runs/bench-gpu --publish 4    # the parts of a weight publication

Model: random weights in Qwen2.5-0.5B's shape (hidden 896, intermediate 4864, 24 layers, 14 heads,
2 KV heads, vocabulary 151,936, tied embeddings; 494 M parameters), built once into ``<out>/model``
with a character tokenizer padded to the full vocabulary (so every sampled id decodes). Random
weights are enough for time and memory: every completion is generated to ``--new-tokens``
(``generation.min_new_tokens`` = ``max_new_tokens``), so both runtimes do the same work per step.
Task: the built-in arithmetic task (its rewards are all 0 here; the figures are about speed).

Each run is the real CLI (``tba train``) at equal trainer steps and batch, only ``runtime.type`` and
``trainer.precision`` changed; the first ``--warmup`` steps (CUDA kernels' first calls, the
allocator's growth) are left out of the per-step figures. ``--deadline`` (seconds from the start)
skips the runs that would start after it and stops a run that outlasts it, so the script fits a
lease of device time; skipped and failed runs are listed, not hidden.

Printed: a markdown table; written after each run: ``<out>/results-<precisions>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from harness import describe_machine, fmt, print_machine, train
from harness.models import SHAPES, build_model
from harness.study import Arm, Column, Results, Trial, run_study, table


def publish_breakdown(model_dir: Path, device: str, repeats: int) -> list[dict]:
    """Time each part of one weight publication in the ray runtime, the way the trainer and a
    searcher do it (``Trainer.published_state`` -> ``to_host`` -> ``ray.put``; the searcher's
    ``ray.get`` -> ``load_published_state``), with bf16 published weights and the searcher a Ray
    actor on the same device; plus the host copy into pinned memory, for comparison."""
    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from tba.models.lora import load_published_state, published_state
    from tba.models.precision import cast_floats
    from tba.weights import map_shared, to_host

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    @ray.remote
    class Loader:
        def __init__(self, path: str, device: str) -> None:
            self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)

        def load(self, boxed: list) -> dict:
            t0 = time.perf_counter()
            state = ray.get(boxed[0])
            t1 = time.perf_counter()
            load_published_state(self.model, state)
            sync()
            return {"fetch_s": t1 - t0, "load_s": time.perf_counter() - t1}

    ray.init(num_cpus=4, num_gpus=1 if device.startswith("cuda") else 0, include_dashboard=False, log_to_driver=False)
    gpus = 0.5 if device.startswith("cuda") else 0
    loader = Loader.options(num_gpus=gpus).remote(str(model_dir), device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    rows = []
    for _ in range(repeats):
        row = {}
        sync()
        t = time.perf_counter()
        state = cast_floats(published_state(model), torch.bfloat16)
        sync()
        row["cast_s"] = time.perf_counter() - t
        t = time.perf_counter()
        host = to_host(state)
        row["to_host_s"] = time.perf_counter() - t
        t = time.perf_counter()  # a pinned buffer per distinct tensor, as to_host copies each once
        pinned = map_shared(state, lambda v: torch.empty(v.shape, dtype=v.dtype, pin_memory=device.startswith("cuda")))
        row["pin_alloc_s"] = time.perf_counter() - t
        t = time.perf_counter()
        for buffer, v in {id(b): (b, state[k]) for k, b in pinned.items()}.values():
            buffer.copy_(v, non_blocking=True)
        sync()
        row["to_pinned_s"] = time.perf_counter() - t
        t = time.perf_counter()
        ref = ray.put(host)
        row["ray_put_s"] = time.perf_counter() - t
        t = time.perf_counter()
        row.update(ray.get(loader.load.remote([ref])))
        row["searcher_total_s"] = time.perf_counter() - t
        row["state_mb"] = sum(v.numel() * v.element_size() for v in host.values()) / 2**20  # every entry
        row["sent_mb"] = sum(v.numel() * v.element_size() for v in {id(v): v for v in host.values()}.values()) / 2**20
        rows.append(row)
        print(json.dumps({k: round(v, 3) for k, v in row.items()}), flush=True)
        del state, host, pinned, ref
    ray.shutdown()
    return rows


def run(args, model: Path, runtime: str, precision: str, time_left: float) -> dict:
    name = f"{runtime}-{precision}-{args.new_tokens}tok{args.tag}"
    overrides = [
        f"--model.policy={model}",
        f"--run.device={args.device}",
        f"--runtime.type={runtime}",
        f"--trainer.precision={precision}",
        f"--trainer.steps={args.steps}",
        f"--trainer.batch_prompts={args.prompts}",
        f"--generation.prompts_per_batch={args.prompts}",
        f"--generation.group_size={args.group_size}",
        f"--generation.max_new_tokens={args.new_tokens}",
        f"--generation.min_new_tokens={args.new_tokens}",
        "--eval.every=100000",
        "--eval.limit=16",
        "--eval.max_new_tokens=8",
        "--logging.progress=false",
        *args.extra,
    ]
    timeout = max(time_left, 1) if time_left < 1e8 else None
    done = train(overrides, args.out / "runs", name, timeout=timeout, log=args.out / f"{name}.log", check=False)
    if done.returncode is None:
        return {"name": name, "error": f"stopped at the deadline after {done.wall_s:.0f} s", "stderr": done.error(1500)}
    if not done.ok:
        return {"name": name, "error": f"exit {done.returncode}", "stderr": done.error()}
    run_dir = done.run_dir
    summary, train_records = done.summary(), done.steps()
    timed = [r for r in train_records if r["step"] > args.warmup] or train_records
    step_s = statistics.median(r["train/step_s"] for r in timed)
    # seconds per step of the whole loop (generation included): time between logged steps
    gaps = [b["time_s"] - a["time_s"] for a, b in zip(timed, timed[1:], strict=False)]
    loop_step_s = statistics.median(gaps) if gaps else None
    tokens_per_step = args.prompts * args.group_size * args.new_tokens
    if runtime == "sync":
        gen_s = statistics.median(r["searcher/generate_s"] for r in timed)
        tokens_per_s = tokens_per_step / gen_s
    else:
        gen_s = None
        rates = [r["searcher/tokens_per_s"] for r in timed if r.get("searcher/tokens_per_s")]
        tokens_per_s = statistics.median(rates) if rates else None
    publish = [r["train/publish_s"] for r in timed if r.get("train/publish_s") is not None]

    def median_of(key: str) -> float | None:  # a weights/ metric of the ray runtime, over the timed steps
        values = [r[key] for r in timed if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {
        "name": name,
        "runtime": runtime,
        "precision": precision,
        "wall_s": done.wall_s,
        "loop_step_s": loop_step_s,
        "train_step_s": step_s,
        "generate_s": gen_s,
        "tokens_per_s": tokens_per_s,
        "publish_s": statistics.median(publish) if publish else None,
        "publish_background_s": median_of("weights/publish_background_s"),
        "fetch_s": median_of("weights/fetch_s"),
        "load_s": median_of("weights/load_s"),
        "transport": json.loads((run_dir / "plan.json").read_text()).get("transport"),  # as the run resolved it
        "busy": summary.get("trainer_busy_fraction"),
        "peak_memory_gb": summary.get("peak_memory_gb"),
        "lag_mean": summary.get("lag_mean"),
        "steps": len(train_records),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/bench-gpu"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--precisions", nargs="+", default=["bf16-mixed", "fp32"])
    parser.add_argument("--runtimes", nargs="+", default=["sync", "ray"])
    parser.add_argument("--steps", type=int, default=10, help="trainer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the per-step figures")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per batch")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (K)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--deadline", type=float, default=None, help="seconds from start: no run starts or lasts past it"
    )
    parser.add_argument("--build-only", action="store_true", help="build the model folder and stop")
    parser.add_argument(
        "--publish", type=int, default=0, metavar="N", help="time the parts of N weight publications (ray), then stop"
    )
    parser.add_argument("--tag", default="", help="appended to the run names (runs with --extra overrides)")
    args, args.extra = parser.parse_known_args()  # anything else goes to every run: --trainer.sync_interval=4
    start = time.time()
    print_machine()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.time()
    parameters = build_model(args.out / "model", args.shape)
    print(f"model: {args.shape}, {parameters / 1e6:.0f} M parameters, ready in {time.time() - t0:.0f} s", flush=True)
    if args.build_only:
        return
    if args.publish:
        rows = publish_breakdown(args.out / "model", args.device, args.publish)
        (args.out / "publish.json").write_text(json.dumps({"environment": describe_machine(), "rows": rows}, indent=1))
        keys = [k for k in rows[0] if k.endswith("_s")]
        print("| " + " | ".join(keys) + " | MB in the state dict | MB sent |")
        print("|" + "---:|" * (len(keys) + 2))
        med = {k: statistics.median(r[k] for r in rows[1:] or rows) for k in rows[0]}
        print("| " + " | ".join(f"{med[k]:.3f}" for k in keys) + f" | {med['state_mb']:.0f} | {med['sent_mb']:.0f} |")
        return
    info = {"parameters": parameters, "shape": SHAPES[args.shape], "args": {k: str(v) for k, v in vars(args).items()}}

    def one(trial: Trial) -> dict:
        runtime, precision = trial.arm.runtime, trial.arm.fields["precision"]
        left = args.deadline - (time.time() - start) if args.deadline else 1e9
        if left < 30:
            return {"name": f"{runtime}-{precision}", "error": "skipped: no time left before the deadline"}
        return run(args, args.out / "model", runtime, precision, left)

    def echo(r: dict) -> str:
        skipped = r.get("error", "").startswith("skipped")
        return f"{r['runtime']} {r['precision']}: skipped (deadline)" if skipped else json.dumps(r)

    arms = [
        Arm(f"{runtime}-{precision}", runtime, fields={"runtime": runtime, "precision": precision})
        for precision in args.precisions
        for runtime in args.runtimes
    ]
    path = args.out / f"results-{'-'.join(args.precisions)}{args.tag}.json"
    kept = Results(path, ("runtime", "precision"), head={"info": info, "environment": describe_machine()}, fresh=True)
    results = run_study(arms, one, kept, echo=echo)
    try:  # after the runs: this process holds no CUDA context while they run
        import torch

        info["device_name"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        info["torch"] = torch.__version__
    except Exception as e:  # noqa: BLE001 - the figures matter more than the label
        info["device_name"] = f"unknown ({e})"
    kept.save()
    print()
    print(
        f"{info['device_name']}, {parameters / 1e6:.0f} M parameters, {args.prompts} prompts x {args.group_size}, "
        f"{args.new_tokens} new tokens, {args.steps} steps (first {args.warmup} not timed)"
    )
    print(table(results, ("runtime", "precision"), COLUMNS))
    for precision in args.precisions:
        s = next((r for r in results if r.get("runtime") == "sync" and r.get("precision") == precision), None)
        a = next((r for r in results if r.get("runtime") == "ray" and r.get("precision") == precision), None)
        if s and a and s.get("loop_step_s") and a.get("loop_step_s"):
            print(f"{precision}: ray speedup {s['loop_step_s'] / a['loop_step_s']:.2f}x per step")


def runtime_label(r: dict) -> str:
    """The runtime, and for ray the weight transport its run resolved."""
    runtime = r.get("runtime", r["name"])
    return runtime + (f" ({r['transport']})" if runtime == "ray" and r.get("transport") else "")


COLUMNS = [
    Column("runtime", runtime_label, "first", ""),
    Column("precision", "precision", "first", ""),
    *(
        Column(header, lambda r, key=key, spec=spec: fmt(r.get(key), spec), "first", "", align="r")
        for header, key, spec in [
            ("s per step (loop)", "loop_step_s", ".2f"),
            ("trainer step s", "train_step_s", ".2f"),
            ("sync generate s", "generate_s", ".2f"),
            ("tokens/s", "tokens_per_s", ".0f"),
            ("publish s", "publish_s", ".3f"),
            ("background s", "publish_background_s", ".3f"),
            ("fetch s", "fetch_s", ".3f"),
            ("load s", "load_s", ".3f"),
            ("trainer busy", "busy", ".2f"),
            ("peak GiB", "peak_memory_gb", ".2f"),
            ("lag", "lag_mean", ".2f"),
            ("wall s", "wall_s", ".0f"),
        ]
    ),
]
"""One row per run: its figures over the timed steps."""


if __name__ == "__main__":
    main()

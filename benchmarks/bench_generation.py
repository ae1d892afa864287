"""Hugging Face ``generate`` against vLLM as a searcher uses them: the same random model, prompts and
lengths, side by side in one run. Per backend: start-up (loading the model, or starting the
engine), sampling throughput, and the seconds to take new weights (as after a publication).

    .venv/bin/python benchmarks/bench_generation.py                      # CPU, a small random Llama
    .venv/bin/python benchmarks/bench_generation.py --lora 16            # a rank-16 LoRA policy, 3 ways
    python benchmarks/bench_generation.py --device cuda --hidden 896 --layers 24 --heads 14 --vocab 151936
    python benchmarks/bench_generation.py --device cuda --dtype bfloat16 --backends vllm --enforce-eager \
        --model runs/bench-gpu/model --k 8 --new-tokens 128 --in-flight 8 32 128 512   # a sweep, one engine

Each backend runs in a fresh process (an in-process vLLM engine changes the process it lives in)
through the backends' own classes (``HFGenerator``, ``VLLMGenerator``). Completions are held to
exactly ``--new-tokens`` tokens (``min_new_tokens`` = ``max_new_tokens``), so both backends
generate the same number of tokens; tokens/s counts completion tokens. Each figure is the best of
``--repeats`` after one warm-up batch. Results: a table on stdout and ``--out``/results.json.

``--in-flight N ...`` sweeps the number of sequences generated at once (``N / --k`` prompts of
``--k`` samples each, every sequence of the batch in flight together): each backend's process
builds its engine once, with room for the largest N (vLLM's ``max_num_seqs``), and measures every
point on it, smallest first, each after its own warm-up batch. ``--model PATH`` measures a model
folder that exists already (e.g. ``bench_gpu.py --build-only``'s Qwen2.5-0.5B shape) instead of the
random Llama; ``--backends`` picks the backends (e.g. ``vllm`` alone); ``--enforce-eager`` runs vLLM
without CUDA graphs (its default on a CPU; on a GPU it compiles them at start-up).

``--lora R`` compares the ways to sample from a LoRA policy (rank R on every linear layer, random
trained-looking adapter): HF ``generate`` through the PEFT model, vLLM with the adapter merged into
the engine's weights (``MergedLoraGenerator``, what searchers do), and vLLM's own LoRA support
(``enable_lora``, the adapter saved to a folder and loaded in place at each publication). Its
"update s" is handing over a new adapter and finishing a one-token request, since vLLM's LoRA
loads lazily on the next request.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness.measure import fresh_row

from tba.machine import describe_machine, machine_line


def build_model(a: argparse.Namespace, path: Path) -> None:
    """A random Llama with the demo's character tokenizer widened to ``--vocab`` ids, saved to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tba.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=max(a.vocab, len(tokenizer)),
        hidden_size=a.hidden,
        intermediate_size=a.hidden * 3,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.heads,
        max_position_embeddings=a.prompt_len + a.new_tokens + 8,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def measure(backend: str, path: str, a: argparse.Namespace) -> dict:
    """One backend, in this process: start-up, throughput, weight update."""
    from transformers import AutoModelForCausalLM

    from tba.generation.base import SamplingParams
    from tba.models.loading import resolve_dtype

    torch.set_num_threads(a.threads)  # before an engine makes it a no-op
    device = torch.device(a.device)
    dtype = resolve_dtype(a.dtype, device)
    eos, pad, vocab = model_ids(path, a)
    start = time.perf_counter()
    adapter = None
    if backend == "hf":
        from tba.generation.hf import HFGenerator

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        if a.lora:
            model = adapter = with_adapter(model, a)
        generator = HFGenerator(model, pad_id=pad, eos_ids=eos, batch_size=max([512, *a.in_flight]))
    elif backend == "vllm-lora-native":
        generator = NativeLoraGenerator(path, eos, device, dtype, a)
        adapter = generator.adapter
    else:
        from tba.generation.vllm_backend import MergedLoraGenerator, VLLMGenerator

        if a.in_flight:  # room for the largest point in one engine: vLLM's LLM with max_num_seqs set
            from tba.generation.vllm_backend import import_vllm

            vllm = import_vllm()
            cpu = device.type == "cpu"
            llm = vllm.LLM(
                model=path,
                dtype=dtype,
                seed=0,
                enforce_eager=cpu or a.enforce_eager,
                logprobs_mode="raw_logprobs",
                max_num_seqs=max(a.in_flight),
                max_model_len=a.prompt_len + a.new_tokens + 8,
                **(
                    {"kv_cache_memory_bytes": int(a.kv_cache_gb * 2**30)}
                    if cpu
                    else {"gpu_memory_utilization": a.gpu_memory_utilization}
                ),
            )
            generator = VLLMGenerator.over(vllm, llm, eos)
        else:
            generator = VLLMGenerator(
                path,
                eos,
                device,
                dtype,
                kv_cache_gb=a.kv_cache_gb,
                gpu_memory_utilization=a.gpu_memory_utilization,
                enforce_eager=True if a.enforce_eager else None,
            )
        if a.lora:
            adapter = with_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval(), a)
            generator = MergedLoraGenerator(generator, adapter)
            generator.load_weights(published_state(adapter), 0)
    start_s = time.perf_counter() - start

    rng = random.Random(0)

    def prompts_of(count: int) -> list[list[int]]:  # new ones each batch: no prefix-cache hits across batches
        return [[1] + [rng.randrange(3, vocab) for _ in range(a.prompt_len - 1)] for _ in range(count)]

    def timed(count: int, k: int, warm: int) -> tuple[float, int]:
        """Best seconds of --repeats batches of ``count`` prompts x ``k`` samples, and their tokens."""
        params = SamplingParams(
            n=k, temperature=1.0, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, logprobs=a.logprobs
        )
        generator.generate(prompts_of(warm), params)  # warm-up
        seconds, tokens = [], 0
        for _ in range(a.repeats):
            batch = prompts_of(count)
            t0 = time.perf_counter()
            out = generator.generate(batch, params)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
            tokens = sum(len(c.token_ids) for group in out for c in group)
        return min(seconds), tokens

    sweep = []
    for n in sorted(a.in_flight):
        k = min(a.k, n)
        best, n_tokens = timed(n // k, k, n // k)
        sweep.append({"in_flight": n // k * k, "generate_s": best, "tokens": n_tokens, "tokens_per_s": n_tokens / best})
        print(json.dumps({"backend": backend, **sweep[-1]}), file=sys.stderr, flush=True)
    if sweep:
        seconds, tokens = [sweep[-1]["generate_s"]], sweep[-1]["tokens"]
    else:
        best, tokens = timed(a.prompts, a.k, 2)
        seconds = [best]

    if adapter is not None:
        state = {k: v.clone() for k, v in published_state(adapter).items()}
    else:
        state = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).state_dict()  # what a publication brings
    one_token = SamplingParams(n=1, max_new_tokens=1, greedy=True)
    updates = []
    for version in range(1, a.repeats + 1):
        t0 = time.perf_counter()
        generator.load_weights(state, version)
        if a.lora:
            generator.generate(prompts_of(1), one_token)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        updates.append(time.perf_counter() - t0)
    return {
        "backend": backend,
        "start_s": start_s,
        "generate_s": min(seconds),
        "tokens": tokens,
        "tokens_per_s": tokens / min(seconds),
        "load_weights_s": min(updates),
        "sweep": sweep,
    }


def model_ids(path: str, a: argparse.Namespace) -> tuple[set[int], int, int]:
    """End ids, pad id and vocabulary size: the random Llama's (2, 0, ``--vocab``), or a
    ``--model`` folder's own (its config's)."""
    if a.model is None:
        return {2}, 0, a.vocab
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    eos = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return {e for e in eos if e is not None} or {2}, pad, config.vocab_size


def with_adapter(model, a: argparse.Namespace):
    """``model`` with a rank ``--lora`` adapter on every linear layer, its B filled as if trained."""
    from tba.config import LoraConfig
    from tba.models.lora import add_adapter

    model = add_adapter(model, LoraConfig(r=a.lora, alpha=2 * a.lora, target_modules="all-linear")).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return model


def published_state(model) -> dict:
    from tba.models.lora import published_state as state

    return state(model)


class NativeLoraGenerator:
    """vLLM's own LoRA: the engine holds the base model and applies the adapter per request; a
    publication saves the adapter in PEFT's format and loads it in place under the same id."""

    def __init__(self, path: str, eos: set[int], device, dtype, a: argparse.Namespace):
        from transformers import AutoModelForCausalLM

        from tba.generation.vllm_backend import VLLMGenerator, import_vllm

        vllm = import_vllm()
        self.folder = Path(tempfile.mkdtemp())
        self.adapter = with_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=dtype), a)
        self.adapter.save_pretrained(self.folder)
        llm = vllm.LLM(
            model=path,
            dtype=dtype,
            seed=0,
            enforce_eager=device.type == "cpu",
            logprobs_mode="raw_logprobs",
            enable_lora=True,
            max_lora_rank=a.lora,
            max_loras=1,
            **({"kv_cache_memory_bytes": int(a.kv_cache_gb * 2**30)} if device.type == "cpu" else {}),
        )
        self.engine = VLLMGenerator.over(vllm, llm, eos)
        self.request = vllm.lora.request.LoRARequest("policy", 1, str(self.folder), load_inplace=True)
        generate = self.engine.llm.generate
        self.engine.llm.generate = lambda *args, **kw: generate(*args, lora_request=self.request, **kw)

    def generate(self, prompts, params):
        return self.engine.generate(prompts, params)

    def load_weights(self, state: dict, version: int) -> None:
        from tba.models.lora import load_published_state

        load_published_state(self.adapter, state)
        self.adapter.save_pretrained(self.folder)


def run_one(backend: str, path: Path, a: argparse.Namespace) -> dict:
    args = [sys.executable, __file__, "--one", backend, str(path)]
    for key in ("device", "dtype", "threads", "prompts", "k", "prompt_len", "new_tokens", "repeats", "vocab"):
        args += [f"--{key.replace('_', '-')}", str(getattr(a, key))]
    args += ["--kv-cache-gb", str(a.kv_cache_gb), "--lora", str(a.lora)] + (["--logprobs"] if a.logprobs else [])
    args += ["--gpu-memory-utilization", str(a.gpu_memory_utilization)] + (
        ["--enforce-eager"] if a.enforce_eager else []
    )
    args += ["--in-flight", *map(str, a.in_flight)] if a.in_flight else []
    args += ["--model", str(a.model)] if a.model else []
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine in the measured process itself
    return fresh_row(args, backend, env=env, show_stderr=a.verbose)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="model.dtype: auto (fp32 on CPU, bf16 on GPU), float32, ...")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads of each measured process")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument(
        "--heads", type=int, default=4, help="attention heads (vLLM's CPU kernels take head sizes 32, 64, ...)"
    )
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch")
    p.add_argument("--k", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="vLLM's KV cache on a CPU")
    p.add_argument("--logprobs", action="store_true", help="also return sampled-token log-probs (ratio objectives)")
    p.add_argument("--lora", type=int, default=0, help="rank of a LoRA policy: compare merging with vLLM's LoRA")
    p.add_argument("--backends", nargs="+", default=None, help="default: hf vllm (with --lora: its three ways)")
    p.add_argument(
        "--in-flight", type=int, nargs="+", default=[], metavar="N", help="sweep: N sequences at once (N / --k prompts)"
    )
    p.add_argument("--model", type=Path, default=None, help="an existing model folder instead of the random Llama")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs on a GPU too")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="vLLM's share of the GPU")
    p.add_argument("--verbose", action="store_true", help="show each backend's stderr as it runs (sweep points)")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/generation[_lora]")
    p.add_argument("--one", nargs=2, metavar=("BACKEND", "MODEL"), help=argparse.SUPPRESS)
    return p.parse_args()


def main() -> None:
    a = parse_args()
    if a.one:
        print(json.dumps(measure(a.one[0], a.one[1], a)))
        return
    print(f"machine: {machine_line()}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if a.model is None:
            build_model(a, Path(tmp))
        backends = a.backends or (("hf", "vllm-lora-merged", "vllm-lora-native") if a.lora else ("hf", "vllm"))
        rows = [run_one(backend, a.model or Path(tmp), a) for backend in backends]
    a.out = a.out or Path("benchmarks/results/generation" + ("_lora" if a.lora else ""))
    first = rows[0]
    shape = f"{a.prompts} prompts x {a.k} samples, {a.prompt_len} + {a.new_tokens} tokens"
    lora = f", LoRA rank {a.lora} on every linear layer" if a.lora else ""
    model = f"model {a.model}" if a.model else f"hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}"
    eager = ", vLLM eager" if a.enforce_eager else ""
    print(f"{shape}, {model}, {a.device}, {a.dtype}, {a.threads} threads{lora}{eager}")
    update = "update s (new adapter + 1 token)" if a.lora else "load weights s"
    print(f"| backend | start-up s | batch s | tokens/s | tokens/s vs {first['backend']} | {update} |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['start_s']:.2f} | {r['generate_s']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / first['tokens_per_s']:.2f} | {r['load_weights_s']:.3f} |"
        )
    if a.in_flight:
        print(f"\n{a.prompt_len} + {a.new_tokens} tokens, {a.k} samples a prompt; best of {a.repeats}")
        print("| backend | sequences in flight | batch s | tokens | tokens/s |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            for point in r["sweep"]:
                print(
                    f"| {r['backend']} | {point['in_flight']} | {point['generate_s']:.2f} | {point['tokens']:,} "
                    f"| {point['tokens_per_s']:,.0f} |"
                )
    a.out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": shlex.join([".venv/bin/python", "benchmarks/bench_generation.py", *sys.argv[1:]]),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.machine(), "torch": torch.__version__},
        "environment": describe_machine(),
        "settings": {k: str(v) for k, v in vars(a).items()},
        "rows": rows,
    }
    (a.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()

"""What a weight publication costs with a LoRA policy against full weights.

    .venv/bin/python benchmarks/bench_lora_publish.py                 # demo model and a ~110M Llama
    .venv/bin/python benchmarks/bench_lora_publish.py --repeats 9 --no-ray

For each model (the built-in demo, 0.86 M parameters; a randomly initialised Llama of about 110 M
parameters, float32 on the CPU) and each mode (full weights; a LoRA adapter of rank 32, alpha 16
on every linear layer, the red-teaming paper's attacker setting), the script publishes the
trainer's weights the way the trainer does (``tba.models.lora.published_state``) and loads them
into a sampler the way a searcher does (``HFGenerator.load_weights``). Printed per row: tensors and
megabytes published, and the median seconds of

- ``local publish`` / ``local load``: ``LocalWeightStore`` (the sync runtime): the detached copy
  made at publication, then fetch + load into a sampler in the same process;
- ``ray publish`` / ``ray load``: ``ObjectStoreSender`` (the ray runtime): ``ray.put`` and the board
  update, then fetch + load in a searcher-like actor in another process.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from harness import print_machine
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from tba.config import ArithmeticTaskConfig, LoraConfig
from tba.demo import ensure_tiny_model
from tba.models.lora import add_adapter, copy_sharing_frozen, load_published_state, published_state
from tba.weights import LocalWeightStore

LARGE = LlamaConfig(  # about 110 M parameters with tied embeddings
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    tie_word_embeddings=True,
)
ADAPTER = LoraConfig(r=32, alpha=16)


def build(source: str | LlamaConfig, lora: bool) -> torch.nn.Module:
    """A policy as the trainer holds it: the model, with a LoRA adapter if asked."""
    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    if isinstance(source, str):
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        model = LlamaForCausalLM(source)
    if lora:
        model = add_adapter(model, ADAPTER)
        with torch.no_grad():  # a trained adapter: B is no longer zero
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.01)
    return model


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def median_s(samples: list[float]) -> float:
    return statistics.median(samples)


def bench_local(policy: torch.nn.Module, repeats: int) -> tuple[float, float]:
    sampler = copy_sharing_frozen(policy).eval().requires_grad_(False)
    store, publish, load = LocalWeightStore(), [], []
    for version in range(repeats):
        t0 = time.perf_counter()
        store.publish(published_state(policy), version)
        t1 = time.perf_counter()
        _, state = store.fetch(version - 1)
        load_published_state(sampler, state)
        publish.append(t1 - t0)
        load.append(time.perf_counter() - t1)
    return median_s(publish), median_s(load)


def bench_ray(policy: torch.nn.Module, source: str | LlamaConfig, lora: bool, repeats: int) -> tuple[float, float]:
    import ray

    from tba.weights.ray.board import ObjectStoreReceiver, ObjectStoreSender
    from tba.weights.ray.boards import WeightBoard

    @ray.remote(num_cpus=1)
    class Loader:
        """A searcher stand-in: its own copy of the model, loading what the trainer publishes."""

        def __init__(self, source, lora: bool) -> None:
            torch.set_num_threads(1)
            self.sampler = build(source, lora).eval().requires_grad_(False)

        def pull(self, board, newer_than: int) -> float:
            start = time.perf_counter()
            _, state = ObjectStoreReceiver(board).fetch(newer_than)
            load_published_state(self.sampler, state)
            return time.perf_counter() - start

    board = WeightBoard.remote()
    store, loader = ObjectStoreSender(board), Loader.remote(source, lora)
    publish, load = [], []
    for version in range(repeats):
        t0 = time.perf_counter()
        store.publish(published_state(policy), version)
        publish.append(time.perf_counter() - t0)
        load.append(ray.get(loader.pull.remote(board, version - 1)))
    ray.kill(loader)
    ray.kill(board)
    return median_s(publish), median_s(load)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="publications per row (the median is printed)")
    parser.add_argument("--no-ray", action="store_true", help="skip the Ray weight store")
    parser.add_argument("--no-large", action="store_true", help="skip the ~110M Llama")
    parser.add_argument("--cache-dir", default=None, help="demo model cache (default $TBA_CACHE or ~/.cache/tba)")
    args = parser.parse_args()
    print_machine()

    models: list[tuple[str, str | LlamaConfig]] = [
        ("demo", str(ensure_tiny_model(ArithmeticTaskConfig(), args.cache_dir, log=print)))
    ]
    if not args.no_large:
        models.append(("llama-110M", LARGE))
    if not args.no_ray:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False)
    torch.set_num_threads(1)
    header = f"{'model':<11} {'params':>8} {'mode':<5} {'tensors':>7} {'MB':>8} {'local publish':>14}"
    header += f" {'local load':>11}"
    if not args.no_ray:
        header += f" {'ray publish':>12} {'ray load':>9}"
    rows = [header, "-" * len(header)]
    for name, source in models:
        for lora in (False, True):
            policy = build(source, lora)
            params = sum(p.numel() for p in policy.parameters())
            state = published_state(policy)
            publish, load = bench_local(policy, args.repeats)
            row = (
                f"{name:<11} {params / 1e6:>7.2f}M {'lora' if lora else 'full':<5} {len(state):>7} "
                f"{nbytes(state) / 1e6:>8.2f} {publish * 1e3:>11.2f} ms {load * 1e3:>8.2f} ms"
            )
            if not args.no_ray:
                publish, load = bench_ray(policy, source, lora, args.repeats)
                row += f" {publish * 1e3:>9.2f} ms {load * 1e3:>6.2f} ms"
            rows.append(row)
            print(row, flush=True)
    print("\n" + "\n".join(rows))


if __name__ == "__main__":
    main()

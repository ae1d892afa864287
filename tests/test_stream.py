"""Continuous generation (``tba.generation.stream``): the HF stream here; the vLLM stream's checks
run in their own process (``tests/vllm_checks.py --stream``, from ``tests/test_vllm.py``)."""

from __future__ import annotations

import pytest
import torch

from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.generation.stream import HFStream


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in ("1+2=", "50-7=", "3=", "12+12=", "9-9=")]


def test_hf_stream_generates_waiting_prompts_in_refill_batches_each_once(tiny_model, tokenizer):
    torch.manual_seed(0)
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    gen.version = 4
    stream = HFStream(gen, SamplingParams(n=3, temperature=1.0, max_new_tokens=8), refill=2)
    for key, ids in enumerate(_prompts(tokenizer)):
        stream.submit(key, ids)
    assert stream.in_flight() == 5
    sizes, keys = [], []
    while stream.in_flight():
        finished = stream.advance()
        sizes.append(len(finished))
        keys += [f.key for f in finished]
        for f in finished:
            assert len(f.completions) == 3 and (f.oldest_version, f.newest_version) == (4, 4)
            assert all(1 <= len(c.token_ids) <= 8 for c in f.completions)
    assert sizes == [2, 2, 1] and keys == [0, 1, 2, 3, 4]
    assert stream.advance() == []


def test_hf_stream_set_lengths_and_greedy_prefix(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {eos})
    prompts = _prompts(tokenizer)[:3]
    stream = HFStream(gen, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True), refill=3)
    for key, (ids, length) in enumerate(zip(prompts, (5, 2, 9), strict=True)):
        stream.submit(key, ids, length=length)
    finished = stream.advance()
    assert [[len(c.token_ids) for c in f.completions] for f in finished] == [[5, 5], [2, 2], [9, 9]]
    # run to a set length, not to an end token: unfinished, one log-prob per token, no EOS inside
    for f in finished:
        for c in f.completions:
            assert not c.finished and len(c.token_logps) == len(c.token_ids) and eos not in c.token_ids


def test_hf_stream_loads_weights_for_what_waits_and_abort_returns_the_keys(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    gen.version = 1
    greedy_like = SamplingParams(n=1, temperature=1e-4, max_new_tokens=6)  # a stream samples; this one as greedy
    stream = HFStream(gen, greedy_like, refill=1)
    prompts = _prompts(tokenizer)
    for key, ids in enumerate(prompts[:3]):
        stream.submit(key, ids)
    torch.manual_seed(0)
    (first,) = stream.advance()
    other = type(tiny_model)(tiny_model.config).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p, q in zip(other.parameters(), tiny_model.parameters(), strict=True):
            p.copy_(q + 0.5 * torch.randn_like(q))
    for mode in ("drain", "in_flight"):  # nothing is half generated here: both load at once
        assert stream.load_weights(other.state_dict(), version=2, mode=mode) == []
    (second,) = stream.advance()
    assert (first.oldest_version, second.oldest_version, second.newest_version) == (1, 2, 2)
    expected = HFGenerator(other, tokenizer.pad_token_id, {tokenizer.eos_token_id}).generate(
        [prompts[1]], SamplingParams(n=1, greedy=True, max_new_tokens=6)
    )
    assert second.completions[0].token_ids == expected[0][0].token_ids  # the new weights generated it
    assert stream.abort() == [2] and stream.in_flight() == 0 and stream.advance() == []


def test_hf_stream_refuses_an_empty_refill(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    with pytest.raises(ValueError, match="refill"):
        HFStream(gen, SamplingParams(), refill=0)

"""Sequence log-probs, model/tokenizer loading, and the HF generation backend on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close, model_terms, padded_positions
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.models.loading import encode_prompts, eos_ids, generation_config_of, load_causal_lm, load_tokenizer
from tba.models.logprobs import pack, plan_micro_batches, token_logprobs, truncate_at_eos
from tba.models.packing import Passes


def naive_logprob(model, prompt: list[int], completion: list[int], eos: int) -> float:
    """One sequence at a time, no padding: sum of log p(y_t | x, y_<t) up to and including the first EOS."""
    if eos in completion:
        completion = completion[: completion.index(eos) + 1]
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    return sum(logp[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(completion))


def _cases(tokenizer):
    enc = lambda s: tokenizer(s)["input_ids"]  # noqa: E731  (BOS + characters)
    chars = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = tokenizer.eos_token_id
    prompts = [enc("7+5="), enc("37+85="), enc("1="), enc("99-12=")]
    completions = [
        chars("12") + [eos],  # finished
        chars("122") + [eos] + chars("9") + [eos, eos],  # junk after the first EOS must not count
        chars("1"),  # unfinished, no EOS
        [eos],  # only EOS
    ]
    return prompts, completions


def test_truncate_at_eos():
    assert truncate_at_eos([5, 6, 2, 7, 2], 2) == [5, 6, 2]
    assert truncate_at_eos([5, 6], {2, 3}) == [5, 6]
    assert truncate_at_eos([3, 2], {2, 3}) == [3]
    assert truncate_at_eos([5, 2], None) == [5, 2]


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_sequence_logprobs_match_naive_loop(tiny_model, tokenizer, pad_is_eos):
    prompts, completions = _cases(tokenizer)
    eos = tokenizer.eos_token_id
    pad = eos if pad_is_eos else tokenizer.pad_token_id
    with torch.no_grad():
        batched = Passes().sequence_logprobs(tiny_model, prompts, completions, pad, eos).double()
    expected = torch.tensor(
        [naive_logprob(tiny_model, p, c, eos) for p, c in zip(prompts, completions, strict=True)], dtype=torch.float64
    )
    # padded rows against one sequence at a time: every sum of the model in another order
    terms = model_terms(tiny_model.config, padded_positions(prompts, completions))
    assert_reordered_close(batched, expected, terms=terms)
    # the EOS token is counted once: the "only EOS" completion has a real, negative log-prob
    assert batched[3] < -1e-3


def test_token_logprobs_mask_and_micro_batches(tiny_model, tokenizer):
    prompts, completions = _cases(tokenizer)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        logp, mask = token_logprobs(tiny_model, prompts, completions, eos, eos)
        split = Passes().sequence_logprobs(tiny_model, prompts, completions, eos, eos, micro_batch=3)
    assert mask.sum(-1).tolist() == [3.0, 4.0, 1.0, 1.0]  # lengths up to and including the first EOS
    assert (logp[mask == 0] == 0).all() and (logp[mask == 1] < 0).all()
    terms = model_terms(tiny_model.config, padded_positions(prompts, completions))
    assert_reordered_close(split, logp.sum(-1), terms=terms)


def test_a_token_budget_cuts_the_passes_shortest_first_and_keeps_the_order(tiny_model, tokenizer):
    prompts, completions = _cases(tokenizer)
    sizes = [(len(p), len(c)) for p, c in zip(prompts, completions, strict=True)]
    budget = 2 * max(p + c for p, c in sizes)
    chunks = plan_micro_batches(sizes, 1, max_tokens=budget)
    assert sorted(i for c in chunks for i in c) == list(range(len(prompts)))
    assert all(len(c) * (max(sizes[i][0] for i in c) + max(sizes[i][1] for i in c)) <= budget for c in chunks)
    assert [sum(sizes[i]) for c in chunks for i in c] == sorted(map(sum, sizes))  # like lengths share a pass
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        whole = Passes().sequence_logprobs(tiny_model, prompts, completions, eos, eos)
        cut = Passes().sequence_logprobs(tiny_model, prompts, completions, eos, eos, max_tokens=budget)
    assert_reordered_close(cut, whole, terms=model_terms(tiny_model.config, padded_positions(prompts, completions)))


def test_sequence_logprobs_are_differentiable(tiny_model, tokenizer):
    prompts, completions = _cases(tokenizer)
    out = Passes().sequence_logprobs(tiny_model, prompts, completions, tokenizer.pad_token_id, tokenizer.eos_token_id)
    out.sum().backward()
    grads = [p.grad for p in tiny_model.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)


def test_pack_layout():
    ids, attn, comp_mask, p_len = pack([[1, 5], [1]], [[7, 2], [8]], pad_id=0)
    assert p_len == 2
    assert ids.tolist() == [[1, 5, 7, 2], [0, 1, 8, 0]]
    assert attn.tolist() == [[1, 1, 1, 1], [0, 1, 1, 0]]
    assert comp_mask.tolist() == [[1, 1], [1, 0]]
    with pytest.raises(ValueError, match="empty prompt"):
        pack([[]], [[1]], 0)


def test_tokenizer_round_trips_through_auto_tokenizer(tiny_checkpoint, tokenizer):
    loaded = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = loaded("37+85=")["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == 1 + len("37+85=")
    assert ids == tokenizer("37+85=")["input_ids"]
    assert loaded.decode(ids[1:]) == "37+85="
    tok = load_tokenizer(str(tiny_checkpoint))
    assert tok.padding_side == "left" and tok.pad_token_id == tokenizer.pad_token_id


def test_a_padded_char_tokenizer_encodes_alike_and_decodes_every_id(tokenizer):
    from tba.models.tiny import build_char_tokenizer

    padded = build_char_tokenizer(vocab_size=64)
    assert len(padded) == 64 and len(tokenizer) < 64
    assert padded("37+85=")["input_ids"] == tokenizer("37+85=")["input_ids"]
    assert padded.decode([len(tokenizer), 63]) == f"<t0><t{63 - len(tokenizer)}>"


def test_load_tokenizer_falls_back_to_eos_for_padding(tmp_path, tokenizer):
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<bos>", eos_token="<eos>")
    no_pad.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok.pad_token_id == tok.eos_token_id == tokenizer.eos_token_id


def test_eos_ids_from_the_generation_config_alone_equal_the_loaded_models(tiny_checkpoint, tokenizer, tmp_path):
    """The run plan learns the EOS ids before the policy's weights load (the searchers start meanwhile)."""
    model = load_causal_lm(str(tiny_checkpoint), torch.device("cpu"))
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, 7]  # a second end token, as chat models have
    model.save_pretrained(tmp_path / "two")
    tokenizer.save_pretrained(tmp_path / "two")
    for path in (tiny_checkpoint, tmp_path / "two"):
        loaded = eos_ids(tokenizer, load_causal_lm(str(path), torch.device("cpu")))
        assert eos_ids(tokenizer, None, generation_config=generation_config_of(str(path))) == loaded
    assert loaded == {tokenizer.eos_token_id, 7}
    (tmp_path / "two" / "generation_config.json").unlink()  # transformers derives one from the config
    derived = generation_config_of(str(tmp_path / "two"))
    assert eos_ids(tokenizer, None, generation_config=derived) == eos_ids(
        tokenizer, load_causal_lm(str(tmp_path / "two"), torch.device("cpu"))
    )


def test_load_causal_lm(tiny_checkpoint, tokenizer):
    policy = load_causal_lm(str(tiny_checkpoint), torch.device("cpu"))
    ref = load_causal_lm(str(tiny_checkpoint), torch.device("cpu"), trainable=False)
    assert policy.training and not ref.training
    assert all(p.requires_grad for p in policy.parameters())
    assert not any(p.requires_grad for p in ref.parameters())
    assert next(policy.parameters()).dtype == torch.float32
    assert eos_ids(tokenizer, policy) == {tokenizer.eos_token_id}


def test_encode_prompts_with_and_without_chat_template(tokenizer):
    plain = encode_prompts(tokenizer, ["1+1="])
    assert plain == [tokenizer("1+1=")["input_ids"]]
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompts(tokenizer, ["1+1="], chat_template=True)
    chat = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, bos_token="<bos>", eos_token="<eos>")
    chat.chat_template = (
        "{% for m in messages %}({{ m['content'] }}){% endfor %}{% if add_generation_prompt %}={% endif %}"
    )
    wrapped = encode_prompts(chat, ["1+1"])  # the template is used by default when present
    assert chat.decode(wrapped[0], skip_special_tokens=True) == "(1+1)="
    assert encode_prompts(chat, ["1+1"], chat_template=False)[0] == chat("1+1")["input_ids"]


def test_hf_generator_greedy_matches_argmax_loop(tiny_model, tokenizer):
    prompts = [tokenizer("5=")["input_ids"], tokenizer("37+85=")["input_ids"]]  # different lengths: left padding
    eos = tokenizer.eos_token_id
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {eos})
    outs = gen.generate(prompts, SamplingParams(n=1, greedy=True, max_new_tokens=6))
    for prompt, (out,) in zip(prompts, outs, strict=True):
        ids, expected = list(prompt), []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(tiny_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                expected.append(nxt)
                ids.append(nxt)
                if nxt == eos:
                    break
        assert out.token_ids == expected
        assert out.finished == (expected[-1] == eos)


def test_hf_generator_sampling_shapes_and_eos(tiny_model, tokenizer):
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("50-7=")["input_ids"], tokenizer("3=")["input_ids"]]
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {eos}, batch_size=5)  # forces several generate calls
    params = SamplingParams(n=8, temperature=1.5, max_new_tokens=30)
    outs = gen.generate(prompts, params)
    assert [len(o) for o in outs] == [8, 8, 8]
    flat = [c for group in outs for c in group]
    for c in flat:
        assert 1 <= len(c.token_ids) <= 30
        assert eos not in c.token_ids[:-1]  # nothing after the first EOS
        assert c.finished == (c.token_ids[-1] == eos)
        if not c.finished:
            assert len(c.token_ids) == 30
    assert any(c.finished for c in flat) and len({tuple(c.token_ids) for c in flat}) > 3


def test_hf_generator_load_weights(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    state = {k: torch.zeros_like(v) for k, v in tiny_model.state_dict().items()}
    gen.load_weights(state, version=7)
    assert gen.version == 7
    assert all((p == 0).all() for p in tiny_model.parameters())


def test_min_new_tokens_masks_every_eos_until_then(tiny_model, tokenizer):
    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    other = tokenizer.convert_tokens_to_ids("=")  # a second end token, as a chat end-of-turn
    # bias the model towards ending at once, so that only the mask keeps completions going
    with torch.no_grad():
        tiny_model.lm_head.weight[eos] += 5.0
        tiny_model.lm_head.weight[other] += 5.0
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {eos, other})
    prompts = [tokenizer("1+2=")["input_ids"], tokenizer("3+4=")["input_ids"]]
    free = gen.generate(prompts, SamplingParams(n=8, max_new_tokens=12, temperature=1.0))
    assert min(len(c.token_ids) for g in free for c in g) < 5  # without the mask, some end early
    held = gen.generate(prompts, SamplingParams(n=8, max_new_tokens=12, min_new_tokens=5, temperature=1.0))
    for c in (c for g in held for c in g):
        assert len(c.token_ids) >= 5 and not {eos, other} & set(c.token_ids[:4])

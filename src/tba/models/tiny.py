"""Tiny models for the demo and the tests: a character-level tokenizer (digits, operators, four
special tokens) and a small Llama over it (:class:`TinySpec`: its shape, and the warm start's
settings). Warm-starting it into the demo's model is :mod:`tba.demo`'s job."""

from __future__ import annotations

import re

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from tba.models.builtin import DEFAULT_SPEC, TinySpec

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = list("0123456789+-*/=() ")


def build_char_tokenizer(vocab_size: int | None = None) -> PreTrainedTokenizerFast:
    """One token per character of the arithmetic task. ``vocab_size``: filler tokens ``<tN>`` pad the
    vocabulary to that size, for a model with a realistic output head (benchmarks); every id decodes."""
    base = SPECIALS + CHARS
    filler = [f"<t{i}>" for i in range(max(0, (vocab_size or 0) - len(base)))]
    return _word_tokenizer(base + filler, ".")  # one token per character


def _word_tokenizer(tokens: list[str], pattern: str, chat_template: str | None = None) -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are ``tokens`` (the first four: :data:`SPECIALS`), split off the text
    by the regex ``pattern``, ``<bos>`` first."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        **({"chat_template": chat_template} if chat_template else {}),
    )


CALL_OPEN = '{"name": "calculator", "arguments": {"expression": "'
CALL_CLOSE = '"}}'
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<tools>", CALL_OPEN, CALL_CLOSE]
"""The tool demo's tokens besides the characters: the hermes format's tags, and the boilerplate of
a calculator call's JSON as one token each (a tiny model need not learn to spell JSON)."""

TOOL_TEMPLATE = (
    "{#- tiny hermes-like template: calls are <tool_call>{json}</tool_call>, results <tool_response> -#}"
    "{{ bos_token }}{% if tools %}<tools>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}{{ m.content }}"
    "{% elif m.role == 'assistant' %}{{ m.content }}<eos>"
    "{% elif m.role == 'tool' %}<tool_response>{{ m.content }}</tool_response>"
    "{% endif %}{% endfor %}"
)
"""The tool demo's chat template: tools (when given) show as one ``<tools>`` token, a user turn is
its text (``123*456=``), a reply ends with ``<eos>``, a tool's answer is wrapped in
``<tool_response>`` tags; the next reply follows at once."""


def build_tool_tokenizer() -> PreTrainedTokenizerFast:
    """The character tokenizer of :func:`build_char_tokenizer` plus :data:`TOOL_TOKENS`, with the
    hermes-like :data:`TOOL_TEMPLATE`: for the tool-use demo (a calculator the model calls)."""
    words = "|".join(re.escape(t) for t in sorted(TOOL_TOKENS, key=len, reverse=True))
    return _word_tokenizer(SPECIALS + CHARS + TOOL_TOKENS, f"{words}|.", TOOL_TEMPLATE)


def build_tiny_llama(tokenizer: PreTrainedTokenizerFast, spec: TinySpec = DEFAULT_SPEC) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads,
        max_position_embeddings=spec.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(spec.seed)
    return LlamaForCausalLM(config)

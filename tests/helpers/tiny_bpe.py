"""A tiny causal LM shaped like a real checkpoint: a byte-level BPE tokenizer trained here with
``tokenizers``, a ChatML chat template whose end-of-turn token (``<|im_end|>``) is not the
tokenizer's EOS (``<|endoftext|>``), no pad token (or pad == EOS), and a random Qwen2 model."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

EOS, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for m in messages %}" + IM_START + "{{ m['role'] }}\n{{ m['content'] }}" + IM_END + "\n{% endfor %}"
    "{% if add_generation_prompt %}" + IM_START + "assistant\n{% endif %}"
)
CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May? The answer is 72.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "[MATH TASK] Problem:\nWhat is 3 + 4?\n\nSolution:\n3 + 4 = 7\n#### 7",
    "Betty has only half of the money she needs; her parents give her $15 and her grandparents 2,000.",
    "user assistant system Solve the problem and give the number. 0 1 2 3 4 5 6 7 8 9 10 100 1000",
]


def build_bpe_tokenizer(pad: str = "none") -> PreTrainedTokenizerFast:
    """``pad``: ``none`` (no pad token, as many base models), ``eos`` (pad == EOS)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=[EOS, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS if pad == "eos" else None)
    fast.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    fast.chat_template = CHATML
    return fast


TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def build_bpe_chat_model(path: Path, pad: str = "none", seed: int = 0, shape: dict | None = None) -> Path:
    """Save tokenizer and a random 2-layer Qwen2 to ``path``; the model's generation config names
    only ``<|endoftext|>`` as EOS, so ``<|im_end|>`` must be found through the chat template.
    ``shape`` overrides the tiny widths and depth (Qwen2Config keys), e.g. for benchmarks."""
    tokenizer = build_bpe_tokenizer(pad)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        **{**TINY, **(shape or {})},
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def build_reward_model(path: Path, num_labels: int = 1, seed: int = 1, shape: dict | None = None) -> Path:
    """A random Qwen2 sequence classifier (one label: a reward model) with the BPE tokenizer, which
    has no pad token: the scorer must cope."""
    tok = build_bpe_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok),
        **{**TINY, **(shape or {})},
        max_position_embeddings=1024,
        num_labels=num_labels,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(seed)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)

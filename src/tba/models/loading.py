"""Load Hugging Face causal LMs and tokenizers by id or local path, and encode prompts."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"run.device={name} but no CUDA device is visible; use run.device=cpu")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def load_tokenizer(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer ready for batched generation: left padding, and a pad token (EOS if none)."""
    tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer {name_or_path!r} has no EOS token; completions could never end")
    if tok.pad_token_id is None:
        # Safe here: log-prob masks come from completion lengths, not from pad ids.
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_causal_lm(
    name_or_path: str,
    device: torch.device,
    dtype: str = "auto",
    trust_remote_code: bool = False,
    trainable: bool = True,
) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code
    )
    model.to(device)
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    # Dropout would make teacher-forced log-probs disagree with the sampler's; turn it off.
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model


def eos_ids(tokenizer: PreTrainedTokenizerBase, model: torch.nn.Module | None = None) -> set[int]:
    """Every token id that ends a completion (the tokenizer's EOS and the model's, if they differ)."""
    ids = {tokenizer.eos_token_id}
    if model is not None:
        extra = getattr(model.generation_config, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
    return ids


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of each prompt; wrapped as one user turn of the chat template when asked for
    (or, with ``chat_template=None``, when the tokenizer has one)."""
    use_chat = bool(tokenizer.chat_template) if chat_template is None else chat_template
    if use_chat and not tokenizer.chat_template:
        raise ValueError("model.chat_template=true but the tokenizer has no chat template")
    if use_chat:
        out = []
        for t in texts:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding, 4.x a list of ids
                ids = ids["input_ids"]
            out.append(list(ids))
        return out
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]

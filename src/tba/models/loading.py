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


def eos_ids(
    tokenizer: PreTrainedTokenizerBase,
    model: torch.nn.Module | None = None,
    extra_tokens: list[str] | tuple[str, ...] = (),
    chat_template: bool | None = None,
) -> set[int]:
    """Every token id that ends a completion: the tokenizer's EOS, the model's generation-config
    EOS, the chat template's end-of-turn token when prompts use the template (Qwen's
    ``<|im_end|>`` is not its tokenizer's EOS), and ``extra_tokens`` (``model.eos_tokens``)."""
    ids = {tokenizer.eos_token_id}
    if model is not None:
        extra = getattr(model.generation_config, "eos_token_id", None)
        if isinstance(extra, int):
            ids.add(extra)
        elif extra:
            ids.update(extra)
    if tokenizer.chat_template and chat_template is not False:
        end = end_of_turn_id(tokenizer)
        if end is not None:
            ids.add(end)
    for token in extra_tokens:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tid == tokenizer.unk_token_id:
            raise ValueError(f"model.eos_tokens: {token!r} is not a token of the tokenizer")
        ids.add(tid)
    return ids


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The special token the chat template puts right after an assistant message, if any: render
    a short conversation and look at what follows the assistant's text."""
    marker = "0 1 2"
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}], tokenize=True
        )
    except Exception:  # templates that reject this conversation shape: nothing found, not an error
        return None
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    ids = list(ids)
    content = tokenizer(marker, add_special_tokens=False)["input_ids"]
    for start in range(len(ids) - len(content), -1, -1):
        if ids[start : start + len(content)] == content:
            special = set(tokenizer.all_special_ids) | {
                i for i, t in tokenizer.added_tokens_decoder.items() if t.special
            }
            after = ids[start + len(content) :]
            return next((t for t in after if t in special), None)
    return None


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: list, chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of each prompt: a string, or a task ``Prompt`` (text, or chat messages).

    Message lists always go through the chat template. Plain text is wrapped as one user turn when
    ``chat_template`` is true, or, with ``chat_template=None``, when the tokenizer has a template.
    """
    has_template = bool(tokenizer.chat_template)
    use_chat = has_template if chat_template is None else chat_template
    conversations, plain = {}, {}
    for i, p in enumerate(prompts):
        messages = getattr(p, "messages", None)
        text = p if isinstance(p, str) else p.text
        if messages is not None:
            conversations[i] = [dict(m) for m in messages]
        elif use_chat:
            conversations[i] = [{"role": "user", "content": text}]
        else:
            plain[i] = text
    if conversations and not has_template:
        raise ValueError(
            "the tokenizer has no chat template, but "
            + ("model.chat_template=true" if use_chat else "the dataset's prompts are chat messages")
            + "; set model.tokenizer to one that has a template, or give plain-text prompts"
        )
    out: dict[int, list[int]] = {}
    for i, messages in conversations.items():
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding, 4.x a list of ids
            ids = ids["input_ids"]
        out[i] = list(ids)
    if plain:
        encoded = tokenizer(list(plain.values()), add_special_tokens=True)["input_ids"]
        out.update(zip(plain, (list(ids) for ids in encoded), strict=True))
    return [out[i] for i in range(len(prompts))]

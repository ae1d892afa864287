"""Load Hugging Face causal LMs and tokenizers by id or local path, and encode prompts.

What users get wrong here fails with one :class:`~tba.errors.ModelLoadError` line, not the hub
client's traceback: a local path that does not exist, a hub id that cannot be fetched (when the
hub is unreachable, models load from the local hub cache at once instead of after ~30 s of
retries), a folder without tokenizer files, a checkpoint that is not a causal LM (a reward model,
a bare encoder), a tokenizer without an EOS token.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from urllib.parse import urlparse

import torch
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from tba.config import ConfigError
from tba.errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


# --------------------------------------------------------------------------------------------
# Finding models: local folders and hub ids


def looks_local(name: str) -> bool:
    """A path rather than a hub id (``org/name``): it exists, or it is written like a path."""
    return Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


@functools.cache
def _hub_unreachable() -> bool:
    """The hub's host cannot be reached within 3 s (no network). Behind a proxy we cannot tell: False."""
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=3).close()
    except OSError:
        return True
    return False


def load_pretrained(load: Callable, name: str, what: str, **kwargs):
    """``load(name, **kwargs)`` (a ``from_pretrained``) with the usual failures as one ModelLoadError line.
    A hub id without network comes from the local hub cache, at once, or fails saying so."""
    if looks_local(name) and not Path(name).expanduser().exists():
        raise ModelLoadError(
            f"{what} {name} does not exist; give a folder holding a saved model (config.json, weights and "
            "tokenizer files), or a Hugging Face hub id such as Qwen/Qwen2.5-0.5B-Instruct"
        )
    offline = not looks_local(name) and (_hub_offline() or _hub_unreachable())
    try:
        return load(name, **({"local_files_only": True} if offline else {}), **kwargs)
    except (OSError, SafetensorError) as err:  # missing files, the hub, an unreadable weights file
        first = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        if looks_local(name):
            raise ModelLoadError(
                f"cannot load {what} {name}: {first}; check that the folder holds a saved model"
            ) from err
        if offline:
            why = "HF_HUB_OFFLINE is set" if _hub_offline() else "the Hugging Face hub cannot be reached"
            raise ModelLoadError(
                f"{what} {name!r} is not in the local Hugging Face cache and {why}; download it where there "
                f"is network (hf download {name}) or give the path of a local copy"
            ) from err
        raise ModelLoadError(
            f"cannot load {what} {name!r} from the Hugging Face hub: {first}; check the id "
            "(and, for a gated model, that you have access: hf auth login)"
        ) from err


def check_causal_lm(name_or_path: str, trust_remote_code: bool = False, what: str = "model"):
    """Read the checkpoint's config (no weights) and reject what ``AutoModelForCausalLM`` would load
    wrongly or not at all: a model whose saved architecture is not a causal LM (a reward model or
    classifier, a bare encoder such as ``BertModel``) would get a randomly initialised LM head."""
    local = Path(name_or_path).expanduser()
    if (local / "adapter_config.json").is_file() and not (local / "config.json").is_file():
        return None  # a PEFT adapter folder: its base model is checked when it loads
    config = load_pretrained(AutoConfig.from_pretrained, name_or_path, what, trust_remote_code=trust_remote_code)
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = list(getattr(config, "architectures", None) or [])
    is_causal = any(a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    known_type = config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or "AutoModelForCausalLM" in (
        getattr(config, "auto_map", None) or {}
    )
    if (archs and not is_causal) or (not archs and not known_type):
        kind = archs[0] if archs else f"{config.model_type} model"
        raise ModelLoadError(
            f"{what} {name_or_path} is a {kind}, not a causal language model (a ...ForCausalLM checkpoint); "
            "give a causal LM here (a reward model belongs in task.reward_model)"
        )
    return config


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype setting (``auto``, ``float32``, ...) as a torch dtype for ``device``, by the run plan's
    rule (:func:`tba.hardware.resolve_dtype_name`): ``auto`` is bfloat16 on a GPU that has it."""
    from tba.hardware import DTYPES, Hardware, resolve_dtype_name

    return DTYPES[resolve_dtype_name(name, str(device), Hardware.of_device(device))]


def load_tokenizer(
    name_or_path: str, trust_remote_code: bool = False, what: str = "tokenizer"
) -> PreTrainedTokenizerBase:
    """A tokenizer ready for batched generation: left padding, and a pad token (EOS if none).
    ``what`` names the setting in error messages (``model.tokenizer``)."""
    local = Path(name_or_path).expanduser()
    if local.is_dir() and not any((local / f).is_file() for f in TOKENIZER_FILES):
        # transformers would build an empty tokenizer from config.json alone
        raise ModelLoadError(
            f"{what} {name_or_path} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); save the "
            "tokenizer there (tokenizer.save_pretrained), or set model.tokenizer to one"
        )
    tok = load_pretrained(AutoTokenizer.from_pretrained, name_or_path, what, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ModelLoadError(
            f"{what} {name_or_path} has no EOS token, so completions could never end; set eos_token in its "
            "tokenizer_config.json, or set model.tokenizer to a tokenizer that has one"
        )
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
    what: str = "model",
) -> torch.nn.Module:
    model = load_pretrained(
        AutoModelForCausalLM.from_pretrained,
        name_or_path,
        what,
        dtype=resolve_dtype(dtype, device),
        trust_remote_code=trust_remote_code,
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
    generation_config=None,
) -> set[int]:
    """Every token id that ends a completion: the tokenizer's EOS, the model's generation-config
    EOS (``generation_config``: the model's, read without loading it), the chat template's
    end-of-turn token when prompts use the template (Qwen's ``<|im_end|>`` is not its tokenizer's
    EOS), and ``extra_tokens`` (``model.eos_tokens``)."""
    ids = {tokenizer.eos_token_id}
    generation_config = model.generation_config if model is not None else generation_config
    if generation_config is not None:
        extra = getattr(generation_config, "eos_token_id", None)
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
            raise ConfigError(f"model.eos_tokens: {token!r} is not a token of the tokenizer; fix or remove it")
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


def chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list, tools: list | None = None) -> list[int]:
    """The token ids of ``messages`` (and ``tools``' schemas) through the chat template, ending with
    the generation prompt."""
    ids = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding, 4.x a list of ids
        ids = ids["input_ids"]
    return list(ids)


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
        raise ConfigError(
            "the tokenizer has no chat template, but "
            + ("model.chat_template=true" if use_chat else "the dataset's prompts are chat messages")
            + "; set model.tokenizer to one that has a template, or give plain-text prompts"
        )
    out: dict[int, list[int]] = {}
    for i, messages in conversations.items():
        out[i] = chat_ids(tokenizer, messages)
    if plain:
        encoded = tokenizer(list(plain.values()), add_special_tokens=True)["input_ids"]
        out.update(zip(plain, (list(ids) for ids in encoded), strict=True))
    return [out[i] for i in range(len(prompts))]


def generation_config_of(name_or_path: str, trust_remote_code: bool = False):
    """The generation config a model loaded from ``name_or_path`` gets, without loading its weights:
    its ``generation_config.json``, else the one transformers derives from its config."""
    from transformers import AutoConfig, GenerationConfig

    try:
        return GenerationConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return GenerationConfig.from_model_config(
            AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        )

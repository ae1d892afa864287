"""A model's size and depth, read from its ``config.json`` (a folder, or a hub id already in the
Hugging Face cache) without loading anything: what the cost model prices (:mod:`tba.plan.cost`)."""

from __future__ import annotations

import json
from pathlib import Path


def model_shape(path: str) -> tuple[float, int] | None:
    """(parameters, layers) of the model at ``path`` from its ``config.json`` (a folder, or a hub
    id already in the Hugging Face cache), computed from the shapes; None where there is none."""
    config = Path(path).expanduser() / "config.json"
    if not config.is_file():
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except (ValueError, OSError):  # not a hub id (HFValidationError is a ValueError), or no cache
            cached = None
        if not isinstance(cached, str):
            return None
        config = Path(cached)
    c = json.loads(config.read_text())
    c = c.get("text_config", c)
    try:
        hidden, layers, vocab = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    except KeyError:
        return None
    heads = c.get("num_attention_heads", 1)
    kv = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or hidden // heads
    inner = c.get("intermediate_size", 4 * hidden)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    per_layer = attention + 3 * hidden * inner
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings", False) else 2)
    return float(layers * per_layer + embeddings), int(layers)


def size(params: float) -> str:
    return f"{params / 1e9:.2g}B" if params >= 1e9 else f"{params / 1e6:.3g}M"

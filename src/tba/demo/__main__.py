"""``python -m tba.demo`` (``make demo-models``): warm-start the shipped demo models afresh and write
them with their index."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from tba.demo.builtin import ensure_tiny_model, ensure_tiny_tool_model
from tba.demo.index import SHIPPED_DIR, SHIPPED_INDEX, SHIPPED_SETTINGS, file_sha256, shipped_accuracy


def build_shipped(out: Path = SHIPPED_DIR, cache_dir: str | None = None, log=print) -> dict:
    """Warm-start the shipped models afresh (or take them from ``cache_dir``, a cache that holds
    builds of this code) and write them to ``out`` with their index (``shipped.json``)."""
    from tba.config import ArithmeticTaskConfig
    from tba.machine import describe_machine

    out.mkdir(parents=True, exist_ok=True)
    cache = cache_dir or tempfile.mkdtemp(prefix="tba-demo-models-")
    index = {}
    for kind, setting in SHIPPED_SETTINGS.items():
        task_cfg = ArithmeticTaskConfig(**setting)
        ensure = ensure_tiny_tool_model if kind == "tiny-tools" else ensure_tiny_model
        built = ensure(task_cfg, cache, log=log, use_shipped=False)
        target = out / built.name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(built, target)
        index[built.name] = {
            "sha256": file_sha256(target / "model.safetensors"),
            "eval_accuracy": shipped_accuracy(kind, target, task_cfg),
            "warm_start": json.loads((target / "warm_start.json").read_text()),
            "built_on": describe_machine(),
        }
        log(f"{kind}: {target.name}, greedy accuracy {index[built.name]['eval_accuracy']:.1%} on held-out problems")
    for stale in out.iterdir():  # the folders of settings or recipes no longer shipped
        if stale.is_dir() and stale.name not in index:
            shutil.rmtree(stale)
    (out / SHIPPED_INDEX.name).write_text(json.dumps(index, indent=2) + "\n")
    return index


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tba.demo",
        description="Rebuild the demo models the package ships (src/tba/demo_models) and their hashes.",
    )
    parser.add_argument("--out", type=Path, default=SHIPPED_DIR, help="where to write them (default: the package's)")
    parser.add_argument("--cache-dir", help="a model cache whose builds of this code to take instead of rebuilding")
    args = parser.parse_args(argv)
    build_shipped(args.out, args.cache_dir)


if __name__ == "__main__":
    main()

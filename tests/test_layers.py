"""The layering rule of DESIGN.md: a module imports only from its own layer or below."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tba"

LAYERS = {  # module prefix (relative to tba) -> layer; the longest matching prefix wins
    "types": 0,
    "config": 0,
    "errors": 0,
    "allocator": 0,
    "objectives": 1,
    "buffer": 1,
    "rewards": 1,
    "grading": 1,
    "eval_metrics": 1,
    "tasks": 2,
    "schedules": 1,
    "models": 2,
    "generation": 2,
    "weights": 2,
    "checkpoint": 2,
    "metrics": 2,
    "plots": 2,
    "console": 2,
    "searcher": 3,
    "trainer": 3,
    "evaluation": 3,
    "runtime": 4,
    "cli": 5,
    "eval_command": 5,
    "__main__": 5,
    "__init__": 0,
}
THIRD_PARTY = {  # the lowest layer that may import each heavy or process-level dependency
    "torch": 1,
    "transformers": 2,
    "tokenizers": 2,
    "safetensors": 2,
    "matplotlib": 2,
    "rich": 2,
    "peft": 2,
    "sentence_transformers": 2,
    "ray": 4,
    "vllm": 2,  # the generation backend only
}
STDLIB_ONLY_FOR_L0 = {"pydantic", "numpy", "yaml"}


def layer_of(module: str) -> int:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(f"module tba.{module} has no layer in tests/test_layers.py: add it")


def modules():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        name = ".".join(p for p in rel.parts if p != "__init__") or "__init__"
        yield name, path


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
    return found


@pytest.mark.parametrize("name,path", list(modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_module_respects_layers(name, path):
    own = layer_of(name)
    for imported in imports(path):
        root = imported.split(".")[0]
        if root == "tba":
            target = imported.split(".", 1)[1] if "." in imported else "__init__"
            assert layer_of(target) <= own, f"tba.{name} (L{own}) imports {imported} (L{layer_of(target)})"
        elif root in THIRD_PARTY:
            assert own >= THIRD_PARTY[root], f"tba.{name} (L{own}) imports {root}"
        elif root == "vllm":
            assert name.startswith("generation."), f"tba.{name} imports vllm outside its generation backend"
        elif own == 0:
            assert root in sys.stdlib_module_names or root in STDLIB_ONLY_FOR_L0, f"tba.{name} imports {root}"


def test_searcher_and_trainer_do_not_import_each_other():
    assert not any(m.startswith("tba.trainer") for m in imports(SRC / "searcher.py"))
    assert not any(m.startswith("tba.searcher") for m in imports(SRC / "trainer.py"))


def test_layer_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from tba.runtime.sync import run_sync\nimport ray\n")
    assert layer_of("objectives") < layer_of("runtime.sync")
    assert imports(bad) == ["tba.runtime.sync", "ray"]

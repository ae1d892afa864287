"""The package's layering rule: every module of ``tba`` has a layer (``LAYERS``: records, config and
errors at 0; objectives, the buffer and reward plumbing at 1; models, generation, tasks and weights
at 2; the searcher, trainer, evaluator and run plan at 3; the runtimes at 4; the command line at 5)
and imports only from its own layer or below, with heavy dependencies no lower than ``THIRD_PARTY``
says. So the objectives never reach for the runtime, and the layer-0 records stay picklable by any
process. A new module must be given a layer here."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "tba"

LAYERS = {  # module prefix (relative to tba) -> layer; the longest matching prefix wins
    "types": 0,
    "config": 0,
    "config_reference": 0,
    "errors": 0,
    "allocator": 0,
    "machine": 0,
    "user_code": 0,
    "hardware": 1,
    "objectives": 1,
    "buffer": 1,
    "rewards": 1,
    "scoring": 1,
    "tools": 2,
    "environments": 2,
    "openenv": 2,  # an environment over an OpenEnv server
    "endpoint": 2,  # the searcher's OpenAI-compatible endpoint, over a generator
    "grading": 1,
    "eval_metrics": 1,
    "tasks": 2,
    "schedules": 1,
    "models": 2,
    "models.builtin": 1,  # the built-in models by name and folder: the plan reads it
    "generation": 2,
    "weights": 2,
    "weights.transports": 0,  # the registry: the config's checks read it
    "weights.ray": 4,  # the transports between processes, over Ray
    "checkpoint": 2,
    "metrics": 2,
    "plots": 2,
    "console": 2,
    "searcher": 3,
    "demo": 3,
    "trainer": 3,
    "evaluation": 3,
    "plan": 3,
    "conversations": 3,  # the registry of conversation sources, above the packages that hold them
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


@pytest.mark.parametrize("name,path", list(modules()), ids=lambda x: str(x) if isinstance(x, str) else "")
def test_every_module_says_its_job(name, path):
    assert ast.get_docstring(ast.parse(path.read_text())), f"tba.{name} has no docstring"


def test_no_module_holds_more_than_one_idea_worth_of_lines():
    sizes = {str(p.relative_to(SRC)): len(p.read_text().splitlines()) for p in SRC.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > 400}
    assert long == {}, f"split these by idea: {long}"


MODEL_CODE = ("tba.demo", "tba.models", "tba.generation", "tba.trainer", "tba.searcher", "transformers", "vllm")
"""What the run plan never imports: it decides before any model loads (the built-in models' names
and folders come from :mod:`tba.models.builtin`, which loads nothing)."""


@pytest.mark.parametrize("name,path", [(n, p) for n, p in modules() if n.startswith("plan")], ids=str)
def test_the_plan_imports_no_model_code(name, path):
    for imported in imports(path):  # inside functions too
        if imported == "tba.models.builtin":
            continue
        assert not imported.startswith(MODEL_CODE), f"tba.{name} imports {imported}"


def test_the_builtin_models_names_load_nothing():
    found = imports(SRC / "models" / "builtin.py")
    assert [m for m in found if m.split(".")[0] in ("torch", "transformers", "tba")] == []


def package_imports() -> dict[str, set[str]]:
    """Each top-level part of ``tba`` (a package or a module) and the other parts it imports, at
    the top of a module or inside a function alike."""
    edges: dict[str, set[str]] = {}
    for name, path in modules():
        part = name.split(".")[0]
        edges.setdefault(part, set())
        for imported in imports(path):  # (ast.walk: imports inside functions too)
            if imported.startswith("tba.") and (target := imported.split(".")[1]) != part:
                edges[part].add(target)
    return {part: {t for t in targets if t in edges} for part, targets in edges.items()}


def test_no_package_imports_another_that_imports_it_back_not_even_inside_a_function():
    """Packages of one layer import each other one way only: a lazy import that closes a circle
    between two packages (generation importing the endpoint, which imports generation) is a layer in
    disguise, even where no module imports itself."""
    assert cycles(package_imports()) == []


def test_searcher_and_trainer_do_not_import_each_other():
    for path in (SRC / "searcher").glob("*.py"):
        assert not any(m.startswith("tba.trainer") for m in imports(path)), path
    for path in (SRC / "trainer").glob("*.py"):
        assert not any(m.startswith("tba.searcher") for m in imports(path)), path


def test_layer_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from tba.runtime.sync_loop import run_sync\nimport ray\n")
    assert layer_of("objectives") < layer_of("runtime.sync_loop")
    assert imports(bad) == ["tba.runtime.sync_loop", "ray"]


def import_graph() -> dict[str, set[str]]:
    """Each module of the package and the package modules it imports, anywhere in its file (imports
    inside functions too): ``from tba.x import y`` counts as importing ``tba.x.y`` when that is a
    module, else ``tba.x``."""
    names = {"tba." + name if name != "__init__" else "tba" for name, _ in modules()}
    graph = {}
    for name, path in modules():
        module = "tba." + name if name != "__init__" else "tba"
        targets = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for target in found:
                while target not in names and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in names and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_no_module_imports_itself_through_others():
    """No import cycle in the package, counting imports placed inside functions (they hide a cycle
    from Python, not from a reader)."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"generation": {"endpoint"}, "endpoint": {"generation"}}) == [["endpoint", "generation"]]
    assert cycles({"a": {"b"}, "b": set()}) == []

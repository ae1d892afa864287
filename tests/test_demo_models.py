"""The shipped demo models: every machine starts the demo, the custom-task example and the tool demo
from the same weights (checked by sha256), which evaluate at the figure recorded beside them; a
damaged copy is refused in one line; and the warm start stops on a smoothed accuracy, not a spike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tba import demo
from tba.config import load_config
from tba.demo.warm_start import reached
from tba.models import builtin as index
from tba.models.tiny import DEFAULT_SPEC, TinySpec
from tba.plan import make_plan
from tba.runtime.preflight import check_models

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

CONFIGS = {None: "tiny-arithmetic", "configs/custom_task.yaml": "tiny-arithmetic", "configs/tools.yaml": "tiny-tools"}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_demos_start_from_the_shipped_weights(config, tmp_path):
    cfg = load_config(config, [f"--model.cache_dir={tmp_path}"])
    path = make_plan(cfg).policy
    check_models(cfg.model, cfg.generation, cfg.task, make_plan(cfg), log=lambda m: pytest.fail(f"built a model: {m}"))
    entry = demo.shipped_index()[Path(path).name]
    assert Path(path).parent == demo.SHIPPED_DIR and Path(path).name.startswith(CONFIGS[config])
    assert demo.file_sha256(Path(path) / "model.safetensors") == entry["sha256"]
    assert not any(tmp_path.iterdir())  # nothing built, nothing cached


def test_the_index_lists_exactly_the_shipped_folders():
    folders = {p.name for p in demo.SHIPPED_DIR.iterdir() if p.is_dir()}
    assert folders == set(demo.shipped_index()) and len(folders) == len(demo.SHIPPED_SETTINGS)
    for name, entry in demo.shipped_index().items():
        assert json.loads((demo.SHIPPED_DIR / name / "warm_start.json").read_text()) == entry["warm_start"]
        assert entry["warm_start"]["validation_accuracy_smoothed"] >= 0.3  # the warm start's target


@pytest.mark.parametrize("kind", list(demo.SHIPPED_SETTINGS))
def test_a_shipped_model_evaluates_at_its_recorded_accuracy(kind):
    from tba.config import ArithmeticTaskConfig

    task_cfg = ArithmeticTaskConfig(**demo.SHIPPED_SETTINGS[kind])
    (name,) = [n for n in demo.shipped_index() if n.startswith(kind + "-")]
    got = demo.shipped_accuracy(kind, demo.SHIPPED_DIR / name, task_cfg)
    # greedy decoding of the same weights: another CPU's kernels round differently, which can flip
    # an argmax where two tokens' logits tie to within float error; allow two of the 256 problems
    assert got == pytest.approx(demo.shipped_index()[name]["eval_accuracy"], abs=2 / task_cfg.eval_size)


def test_a_damaged_shipped_model_is_refused(tmp_path, monkeypatch):
    copy = tmp_path / "demo_models"
    shutil.copytree(demo.SHIPPED_DIR, copy)
    monkeypatch.setattr(index, "SHIPPED_DIR", copy)
    monkeypatch.setattr(index, "SHIPPED_INDEX", copy / index.SHIPPED_INDEX.name)
    cfg = load_config(None, [f"--model.cache_dir={tmp_path / 'cache'}"])
    assert Path(make_plan(cfg).policy).parent == copy  # intact: taken
    (weights,) = copy.glob("tiny-arithmetic-*/model.safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="missing or damaged .*`make demo-models`"):
        make_plan(cfg)  # the plan checks a shipped model's hash when it names it


def test_another_setting_is_not_shipped_and_would_be_built(tmp_path):
    cfg = load_config(None, ["--task.digits=1"])
    assert demo.shipped(demo.tiny_model_path(cfg.task, str(tmp_path)).name) is None


@pytest.mark.parametrize(
    ("checks", "stops"),
    [
        ([0.203, 0.184, 0.234, 0.203, 0.332], False),  # one spike over the target: not enough
        ([0.285, 0.324], False),  # fewer checks than the window
        ([0.148, 0.184, 0.203, 0.285, 0.324, 0.344], True),  # the window's mean 0.318
        ([0.5, 0.3, 0.0], False),  # a drop to 0 weighs as much as a spike
    ],
)
def test_the_warm_start_stops_on_the_mean_of_the_last_checks(checks, stops):
    assert reached(checks, DEFAULT_SPEC) is stops
    assert reached(checks[-1:], TinySpec(smooth_checks=1)) is (checks[-1] >= 0.3)

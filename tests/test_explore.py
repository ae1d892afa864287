"""Exploration across searchers: per-searcher sampling settings and exploring batches."""

from __future__ import annotations

import dataclasses

import pytest

from tba.config import ConfigError, load_config
from tba.generation.base import Completion, SamplingParams
from tba.generation.explore import ExploringGenerator
from tba.generation.hf import HFGenerator


class Recorder:
    """A backend that records the settings of each call (the wrapper is what is under test)."""

    def __init__(self):
        self.calls: list[SamplingParams] = []
        self.loaded = None
        self.version = -1

    def generate(self, prompts, params):
        self.calls.append(params)
        return [[Completion([1], True)] * params.n for _ in prompts]

    def load_weights(self, state_dict, version):
        self.loaded = self.version = version


def test_exploring_batches_draw_settings_from_the_ranges():
    inner = Recorder()
    gen = ExploringGenerator(inner, prob=0.3, temperature=(0.7, 1.1), top_p=(0.7, 1.0), seed=1)
    base = SamplingParams(n=2, temperature=0.7, top_p=1.0)
    for _ in range(1000):
        gen.generate([[5]], base)
    explored = [p for p in inner.calls if p != base]
    assert 0.25 < len(explored) / 1000 < 0.35 and gen.explored == len(explored)
    assert all(0.7 <= p.temperature <= 1.1 and 0.7 <= p.top_p <= 1.0 for p in explored)
    assert min(p.temperature for p in explored) < 0.75 and max(p.temperature for p in explored) > 1.05
    assert all(p.n == 2 for p in inner.calls)  # only temperature and top-p change
    greedy = SamplingParams(n=1, greedy=True)
    always = ExploringGenerator(inner, prob=1.0, temperature=(2.0, 3.0), top_p=(0.5, 0.6))
    always.generate([[5]], greedy)
    assert inner.calls[-1] is greedy  # evaluation is never perturbed
    always.load_weights({}, 7)
    assert inner.loaded == 7


def test_each_searcher_gets_its_own_settings(tiny_checkpoint):
    from tests.conftest import components

    from tba.config import with_values
    from tba.plan import make_plan
    from tba.runtime.build import make_searcher
    from tba.runtime.components import SearcherSections

    cfg = load_config(
        None,
        [
            f"--model.policy={tiny_checkpoint}",
            "--task.digits=1",
            "--task.eval_size=10",
            "--generation.searcher_temperatures=[0.5, 1.0]",
            "--generation.searcher_top_ps=[0.9]",
            "--generation.explore_prob=0.5",
        ],
    )
    c = components(cfg, log=lambda m: None)
    s = c.searcher
    # the ray runtime's three searchers, as its plan gives them their settings (and prints them)
    ray = make_plan(with_values(cfg, {"runtime.type": "ray", "runtime.num_searchers": 3}))
    assert "searcher 1: temperature 1, top-p 0.9; exploring 50% of batches at 1-1.57" in "\n".join(ray.lines())
    plan = dataclasses.replace(c.plan, sampling=ray.sampling)
    sections = SearcherSections(cfg.generation, cfg.trainer, cfg.model, cfg.task, cfg.run.seed)
    made = [
        make_searcher(sections, plan, c.task, c.tokenizer, s.generator.model, s.reference, s.weights, i)
        for i in range(3)
    ]
    assert [m.params.temperature for m in made] == [0.5, 1.0, 0.5]
    assert all(m.params.top_p == 0.9 for m in made)
    assert isinstance(made[1].generator, ExploringGenerator) and made[1].generator.temperature == (1.0, 1.1 / 0.7)
    assert isinstance(made[1].generator.inner, HFGenerator)
    c.trainer.publish()
    groups = made[1].step()  # the real backend behind the wrapper
    assert groups and made[1].generator.last is not None


def test_bad_exploration_settings_are_rejected():
    with pytest.raises(ConfigError, match="explore_temperature"):
        load_config(None, ["--generation.explore_temperature=[1.2, 0.8]"])
    with pytest.raises(ConfigError, match="explore_top_p"):
        load_config(None, ["--generation.explore_top_p=[0.5, 1.5]"])
    with pytest.raises(ConfigError, match="searcher_temperatures"):
        load_config(None, ["--generation.searcher_temperatures=[]"])

"""``generation.vllm.sleep``: when an engine that shares the trainer's GPU gives its memory back and
takes it again, shown on an engine that records the calls it gets (vLLM's sleep mode itself needs
CUDA: ``tests/test_gpu.py`` runs it there). No vLLM needed."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tba.config import ConfigError, VLLMSettings, load_config
from tba.generation import vllm_backend
from tba.generation.base import SamplingParams
from tba.generation.vllm_backend import VLLMGenerator
from tba.plan.auto import engine_sleeps


class RecordingEngine:
    """What a ``vllm.LLM`` is asked to do, in order; generation returns token 5 then the end id."""

    def __init__(self, fail_generate: bool = False):
        self.calls: list[str] = []
        self.fail_generate = fail_generate

    def sleep(self, level: int = 1) -> None:
        self.calls.append(f"sleep({level})")

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up({','.join(tags) if tags else 'all'})")

    def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        names = [name for name, _ in kwargs["weights_iterator"]]
        self.calls.append(f"{method}({','.join(names)})")

    def generate(self, requests, sampling, use_tqdm=False):
        self.calls.append(f"generate({len(requests)})")
        if self.fail_generate:
            raise RuntimeError("out of memory")
        out = SimpleNamespace(token_ids=[5, 2], logprobs=None)
        return [SimpleNamespace(outputs=[out] * sampling["n"]) for _ in requests]


FAKE_VLLM = SimpleNamespace(
    SamplingParams=lambda **kw: kw,
    inputs=SimpleNamespace(TokensPrompt=lambda prompt_token_ids: prompt_token_ids),
)
PARAMS = SamplingParams(n=2, max_new_tokens=4)
WEIGHTS = {"a": torch.zeros(2), "b": torch.ones(2)}


def generator(sleep: bool, **kw) -> tuple[VLLMGenerator, RecordingEngine]:
    engine = RecordingEngine(**kw)
    release = lambda: engine.calls.append("release")  # noqa: E731  (torch.cuda.empty_cache on a GPU)
    return VLLMGenerator.over(FAKE_VLLM, engine, {2}, sleep=sleep, release=release), engine


def test_a_sleeping_engine_sleeps_from_the_start_and_after_each_generation():
    gen, engine = generator(sleep=True)
    assert engine.calls == ["sleep(1)"]  # the trainer may need the memory before the first batch
    engine.calls.clear()

    gen.load_weights(WEIGHTS, version=1)  # weights first, the KV cache only when it generates
    # the trainer's cached, unused blocks go back to the device first: vLLM allocates outside that cache
    assert engine.calls == ["release", "wake_up(weights)", "reload_weights(a,b)", "reset_prefix_cache"]
    assert gen.version == 1
    engine.calls.clear()

    groups = gen.generate([[1, 3], [1, 4]], PARAMS)
    assert [[c.token_ids for c in g] for g in groups] == [[[5, 2]] * 2] * 2
    # the KV cache comes back empty: the prefix cache, which pointed into the old one, is reset
    assert engine.calls == ["release", "wake_up(kv_cache)", "reset_prefix_cache", "generate(2)", "sleep(1)"]
    engine.calls.clear()

    gen.generate([[1, 3]], PARAMS)  # no new weights since (sync_interval > 1, an evaluation)
    assert engine.calls == [
        "release",
        "wake_up(weights)",
        "release",
        "wake_up(kv_cache)",
        "reset_prefix_cache",
        "generate(1)",
        "sleep(1)",
    ]


def test_a_failed_generation_still_gives_the_memory_back():
    gen, engine = generator(sleep=True, fail_generate=True)
    engine.calls.clear()
    with pytest.raises(RuntimeError, match="out of memory"):
        gen.generate([[1, 3]], PARAMS)
    assert engine.calls[-2:] == ["generate(1)", "sleep(1)"]


def test_two_loads_in_a_row_wake_the_weights_once():
    gen, engine = generator(sleep=True)
    gen.load_weights(WEIGHTS, version=1)
    gen.load_weights(WEIGHTS, version=2)
    assert engine.calls.count("wake_up(weights)") == 1
    assert "wake_up(kv_cache)" not in engine.calls


def test_an_engine_without_sleep_never_sleeps_or_wakes():
    gen, engine = generator(sleep=False)
    gen.load_weights(WEIGHTS, version=1)
    gen.generate([[1, 3]], PARAMS)
    assert engine.calls == ["reload_weights(a,b)", "reset_prefix_cache", "generate(1)"]


@pytest.mark.parametrize(
    ("setting", "device", "share", "expected"),
    [
        (None, "cuda", None, True),  # the sync runtime's engine, beside the trainer
        (None, "cuda", 0.5, False),  # a searcher actor: it generates while the trainer trains
        (None, "cuda", 0.0, False),  # an evaluation actor
        (None, "cpu", None, False),
        (False, "cuda", None, False),
        (True, "cuda", 0.5, True),
    ],
)
def test_sleep_is_on_by_default_only_for_an_engine_in_the_trainers_process_on_cuda(setting, device, share, expected):
    assert engine_sleeps(VLLMSettings(sleep=setting), device, share) is expected


def test_sleep_on_a_cpu_is_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"generation.vllm.sleep=true needs a CUDA GPU.*sleep=false"):
        vllm_backend.check_vllm_backend(None, torch.device("cpu"), sleep=True)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):  # and by the engine itself, before vLLM loads
        VLLMGenerator("unused", {2}, torch.device("cpu"), torch.float32, sleep=True)


def test_a_multiprocess_engine_asked_for_by_the_environment_is_overridden_with_a_warning(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    with pytest.warns(UserWarning, match="cannot send"):
        vllm_backend.in_process_engines()  # what import_vllm does before it imports vLLM
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_sleep_is_a_config_key_that_takes_a_bool_or_nothing():
    cfg = load_config(None, ["--generation.vllm.sleep=true"])
    assert cfg.generation.vllm.sleep is True
    assert load_config(None, []).generation.vllm.sleep is None
    with pytest.raises(ConfigError, match="sleep"):
        load_config(None, ["--generation.vllm.sleep=sometimes"])

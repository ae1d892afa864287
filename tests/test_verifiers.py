"""verifiers environments (``task.name: verifiers``) with the real ``verifiers`` package: a
single-turn environment and a multi-turn one with a tool, written here, trained on the tool demo's
model through the searcher's endpoint (the ray runtime's searchers run the same rollouts:
tests/test_agents.py trains an agent there), their rubrics' rewards in the metrics; a rubric that raises
costs its rollout (counted), never the run; bad names are one line."""

from __future__ import annotations

import sys

import pytest
from tests.conftest import stored_rollouts
from tests.helpers.sources import THREE_STEPS, trained_three_steps

from tba.config import ConfigError, load_config
from tba.demo.index import SHIPPED_DIR
from tba.generation.base import SamplingParams
from tba.runtime.sync_loop import run_sync

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

MODEL = next(SHIPPED_DIR.glob("tiny-tools-*"))  # a chat model that calls tools in the Hermes format

ENVIRONMENTS = """
import verifiers as vf
from datasets import Dataset

from tba.tasks.calculator import calculator


def rows(n):
    pairs = [(11 + 7 * i, 23 + 3 * i) for i in range(n)]
    return [{"prompt": [{"role": "user", "content": f"{a}*{b}="}], "answer": str(a * b)} for a, b in pairs]


def exact(completion, answer, **kwargs) -> float:
    return float((completion[-1]["content"] or "").strip() == answer)


def length(completion, **kwargs) -> float:
    return len(completion[-1]["content"] or "") / 10


def picky(completion, answer, **kwargs) -> float:
    if answer.endswith("3"):
        raise ValueError("picky cannot score answers ending in 3")
    return 1.0


def single_turn(n: int = 40, raising: bool = False):
    funcs = [exact, length, picky] if raising else [exact, length]
    rubric = vf.Rubric(funcs=funcs, weights=[1.0] + [0.0] * (len(funcs) - 1))
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows(n)), rubric=rubric)


def with_calculator(n: int = 40):
    rubric = vf.Rubric(funcs=[exact])
    return vf.ToolEnv(dataset=Dataset.from_list(rows(n)), tools=[calculator], rubric=rubric, max_turns=3)
"""


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    path = tmp_path_factory.mktemp("vf") / "envs.py"
    path.write_text(ENVIRONMENTS)
    return path


def args(envs, tmp_path, runtime: str, env: str, *extra: str) -> list[str]:
    return [
        f"--runtime.type={runtime}",
        f"--model.policy={MODEL}",
        "--task.name=verifiers",
        f"--task.env={envs}:{env}",
        "--task.eval_size=8",
        "--task.max_turns=4",
        "--generation.max_new_tokens=16",
        *THREE_STEPS,
        f"--run.output_dir={tmp_path}",
        "--run.name=v",
        *extra,
    ]


def test_a_single_turn_environment_trains_with_its_rubrics_rewards_in_the_metrics(envs, tmp_path, monkeypatch):
    """Loaded by its id, as an installed environment is (``vf.load_environment``: the module
    ``vf_tba_single`` and its ``load_environment``)."""
    (tmp_path / "vf_tba_single.py").write_text("from envs import single_turn as load_environment\n")
    monkeypatch.syspath_prepend(str(envs.parent))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, args(envs, tmp_path, "sync", "single_turn", "--task.env=vf-tba-single"))
    run_dir, summary = run_sync(cfg)
    assert summary["task"] == "verifiers"
    _, train = trained_three_steps(run_dir, summary)
    # (an empty reply ends its rollout with verifiers' EmptyModelResponseError: dropped, counted)
    assert train[-1]["searcher/environment_errors"] < train[-1]["searcher/completions"] / 4
    # each rubric function's mean over the latest batch: length (weight 0) is never 0 for a reply
    assert all(r["reward/length_mean"] > 0 and 0 <= r["reward/exact_mean"] <= 1 for r in train)
    assert all(r["searcher/turns_per_conversation"] == 1 for r in train)
    rollouts = stored_rollouts(run_dir, 3)
    assert rollouts and all(r.reward in (0.0, 1.0) for r in rollouts)  # the rubric's weighted sum: exact's


def test_a_multi_turn_environment_with_a_tool_trains(envs, tmp_path):
    """(In the sync runtime: the ray runtime's searchers run the same rollouts,
    tests/test_agents.py's ray run.)"""
    run_dir, summary = run_sync(load_config(None, args(envs, tmp_path, "sync", "with_calculator")))
    _, train = trained_three_steps(run_dir, summary)
    # a reply with neither text nor a call ends its rollout with verifiers' EmptyModelResponseError:
    # dropped and counted (an empty completion), the others trained on
    assert train[-1]["searcher/environment_errors"] < train[-1]["searcher/completions"] / 4
    # the model calls the calculator (its tool_calls read from its Hermes format), verifiers runs it
    assert max(r["reward/calculator_calls_mean"] for r in train) > 0
    assert max(r["searcher/turns_per_conversation"] for r in train) > 1
    rollouts = stored_rollouts(run_dir, 3)
    calls = [r for r in rollouts if r.action_mask is not None and 0 in r.action_mask]
    assert calls, "a rollout with the tool's answer between the model's replies"
    for r in calls:  # the reply with the call, the tool's answer (marked 0), the next reply
        mask = list(r.action_mask)
        assert mask[0] == 1 and mask[-1] == 1 and r.completion[mask.index(0) - 1] in r_eos(run_dir)


def r_eos(run_dir) -> set[int]:
    from tba.runtime.preflight import prepare_task

    cfg = load_config(run_dir / "config.yaml")
    tok = prepare_task(cfg.model, cfg.task, cfg.objective, log=lambda _: None)[1]
    return {tok.eos_token_id, *(tok.convert_tokens_to_ids(t) for t in ("<|im_end|>",) if t in tok.get_vocab())}


def test_a_rubric_that_raises_costs_its_rollouts_counted_never_the_batch(envs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.conversations import make_conversations
    from tba.generation.hf import HFGenerator
    from tba.tasks import build_task

    cfg = load_config(None, args(envs, envs.parent, "sync", "single_turn", "--task.env_args={raising: true}"))
    tok = AutoTokenizer.from_pretrained(MODEL)
    task = build_task(cfg.task, tok)
    convs = make_conversations(cfg.task, tok, {tok.eos_token_id})
    prompts = task.eval_prompts()
    try:
        generator = HFGenerator(AutoModelForCausalLM.from_pretrained(MODEL), tok.pad_token_id, {tok.eos_token_id})
        generator.version = 0
        _, groups = convs.rollout(generator, prompts, SamplingParams(n=1, max_new_tokens=12, greedy=True))
    finally:
        convs.close()
    raising = [p.answer.endswith("3") for p in prompts]
    assert any(raising) and not all(raising)
    for p, group in zip(prompts, groups, strict=True):
        assert all(t.failed == p.answer.endswith("3") for t in group), p.answer
        assert all(t.failed or t.reward is not None for t in group)
    assert convs.take_counts().environment_errors == sum(raising)
    (error,) = convs.take_new_errors()
    assert "rubric function picky raised: ValueError: picky cannot score answers ending in 3" in error


def test_bad_names_are_one_line_before_the_run(envs, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"task.env: no verifiers environment 'vf-no-such-env' is installed"):
        run_sync(load_config(None, args(envs, tmp_path, "sync", "single_turn", "--task.env=vf-no-such-env")))
    with pytest.raises(ConfigError, match=r"task.env .*has no attribute 'nope'"):
        run_sync(load_config(None, args(envs, tmp_path, "sync", "nope")))
    with pytest.raises(ConfigError, match=r"task.name=verifiers with task.tools"):
        load_config(None, args(envs, tmp_path, "sync", "single_turn", "--task.tools=[tba.tasks.calculator:calculator]"))
    assert not (tmp_path / "v").exists()
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ConfigError, match=r"needs the verifiers package .*pip install 'tba\[verifiers\]'"):
        run_sync(load_config(None, args(envs, tmp_path, "sync", "single_turn", "--task.env_args={n: 12}")))

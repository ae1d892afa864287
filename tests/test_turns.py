"""Multi-turn rollouts (tba.generation.turns) through the searcher, the trainer and evaluation.

The conversations here are driven by a scripted policy (a generator that answers from the
context, as a model that learned the task would): what is tested is the turn loop, the tokens and
masks it builds, and what the searcher, the reference pass and the trainer do with them."""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from tests.conftest import SMALL, assert_reports_declared
from tests.helpers.numerics import assert_reordered_close, model_terms

from tba.buffer import ReplayBuffer
from tba.config import ConfigError, load_config
from tba.conversations import make_conversations
from tba.demo import tool_trace
from tba.environments import ToolEnvironment
from tba.evaluation import evaluate
from tba.generation.base import Completion, SamplingParams
from tba.generation.turns import Conversations, TurnCounts
from tba.models.logprobs import token_logprobs
from tba.models.tiny import CALL_CLOSE, CALL_OPEN, build_tiny_llama, build_tool_tokenizer
from tba.searcher import Searcher
from tba.tasks.arithmetic import ArithmeticTask
from tba.tasks.calculator import calculator
from tba.tools import ToolError, load_tools
from tba.types import EvalSettings
from tba.weights import LocalWeightStore

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

TOOLS = ["tba.tasks.calculator:calculator"]


@pytest.fixture(scope="module")
def tok():
    return build_tool_tokenizer()


class ScriptedPolicy:
    """Replies from the context: a call of the calculator on the prompt's expression, then the number
    the tool answered. ``mistakes``: prompts (texts) whose final answer is off by one; ``always_call``:
    never answers, calls again; ``expression``: what to compute instead of the prompt's; ``vary``:
    the j-th completion of a prompt calls the tool on its product plus j (a wrong answer)."""

    def __init__(self, tok, mistakes=(), always_call=False, expression=None, vary=False):
        self.tok, self.mistakes, self.always_call, self.expression = tok, set(mistakes), always_call, expression
        self.vary = vary
        self.calls = []  # (contexts, params) of each generate call
        self.version = -1

    def generate(self, prompts, params):
        self.calls.append((len(prompts), params.n, params.max_new_tokens))
        out = []
        for ids in prompts:
            text = self.tok.decode(ids, skip_special_tokens=False)
            problem = text.split("<tools>")[-1].split("<eos>")[0].split("<tool_call>")[0]
            if "<tool_response>" in text and not self.always_call:
                answer = text.rsplit("<tool_response>", 1)[1].split("</tool_response>")[0]
                if problem in self.mistakes:
                    answer = str(int(answer) + 1)
                reply = answer
            else:
                reply = f"<tool_call>{CALL_OPEN}{self.expression or problem.rstrip('=')}{CALL_CLOSE}</tool_call>"
            replies = [reply] * params.n
            if self.vary and "<tool_response>" not in text:  # the j-th sample computes a product plus j
                replies = [reply.replace(CALL_CLOSE, f"+{j}{CALL_CLOSE}") if j else reply for j in range(params.n)]
            out.append([self._completion(r, params.max_new_tokens) for r in replies])
        return out

    def _completion(self, reply, max_new_tokens):
        tokens = self.tok.encode(reply, add_special_tokens=False)
        finished = len(tokens) < max_new_tokens  # room for the end token
        tokens = tokens + [self.tok.eos_token_id] if finished else tokens[:max_new_tokens]
        return Completion(tokens, finished, [-0.5] * len(tokens))

    def load_weights(self, state, version):
        self.version = version


def _conversations(tok, max_turns=3, max_tokens=None, make_env=None, tools=TOOLS):
    loaded = load_tools(tools)
    make_env = make_env or (lambda: ToolEnvironment(loaded, "hermes"))
    return Conversations(tok, make_env, {tok.eos_token_id}, max_turns, max_tokens, loaded, workers=4)


def _prompts(n, seed=0):
    return ArithmeticTask(3, "*", 16, 1234).sample_prompts(n, random.Random(seed))


def test_a_conversation_is_the_models_tokens_and_the_tools_answers_masked(tok):
    prompts = _prompts(3)
    turns = _conversations(tok)
    policy = ScriptedPolicy(tok)
    prompt_ids, groups = turns.rollout(policy, prompts, SamplingParams(n=2, max_new_tokens=16, logprobs=True))
    for p, ids, group in zip(prompts, prompt_ids, groups, strict=True):
        expected_prompt, expected, mask = tool_trace(tok, p, load_tools(TOOLS))  # built by hand, not by the loop
        assert ids == expected_prompt and len(group) == 2
        for t in group:
            assert t.token_ids == expected and t.action_mask == mask
            assert t.finished and t.turns == 2 and t.text == p.answer and t.reward is None
            assert t.token_logps == [-0.5 if m else 0.0 for m in mask]  # the tool's tokens carry no log-prob
            assert t.messages[-2] == {"role": "tool", "name": "calculator", "content": calculator(p.text[:-1])}
    # one batched generate per turn: the openings with n=2, then every conversation alone
    assert policy.calls == [(3, 2, 16), (6, 1, 16)]
    assert turns.take_counts() == TurnCounts(turns=12, tool_calls=6)


def test_turn_and_token_limits_leave_conversations_unfinished(tok):
    (p,) = _prompts(1)
    params = SamplingParams(n=1, max_new_tokens=16)
    _, [[t]] = _conversations(tok, max_turns=2).rollout(ScriptedPolicy(tok, always_call=True), [p], params)
    assert not t.finished and t.turns == 2 and t.action_mask[-1] == 1  # the second call was the last reply
    # the tool's answer would leave no room: it is not appended, and the conversation ends there
    _, [[t]] = _conversations(tok, max_tokens=16).rollout(ScriptedPolicy(tok), [p], params)
    assert not t.finished and t.turns == 1 and all(t.action_mask) and len(t.token_ids) <= 16
    # a reply cut at max_new_tokens ends its conversation too
    _, [[t]] = _conversations(tok).rollout(ScriptedPolicy(tok), [p], SamplingParams(n=1, max_new_tokens=5))
    assert not t.finished and t.turns == 1 and len(t.token_ids) == 5


class Broken:
    """An environment whose step raises on one prompt's conversations."""

    def reset(self, prompt):
        self.bad = prompt.text.startswith("9")
        return [{"role": "user", "content": prompt.text}]

    def step(self, messages):
        if self.bad:
            raise RuntimeError("the game crashed")
        return [], 1.0, True


def test_a_failing_environment_drops_its_conversation_and_tool_errors_are_answers(tok):
    drawn = _prompts(40)
    prompts = [p for p in drawn if p.text.startswith("9")][:1] + [p for p in drawn if not p.text.startswith("9")][:2]
    turns = _conversations(tok, make_env=Broken)
    _, groups = turns.rollout(ScriptedPolicy(tok), prompts, SamplingParams(n=2, max_new_tokens=16))
    assert [t.failed for t in groups[0]] == [True, True] and not any(t.failed for g in groups[1:] for t in g)
    assert all(t.reward == 1.0 and t.finished for g in groups[1:] for t in g)  # the environment's own reward
    assert turns.take_counts().environment_errors == 2
    # an expression the calculator refuses: the error is the tool's answer, and the model goes on
    turns = _conversations(tok)
    _, [[t]] = turns.rollout(ScriptedPolicy(tok, expression="2**8"), prompts[1:2], SamplingParams(max_new_tokens=16))
    assert "error: " in t.messages[2]["content"] and t.turns == 2 and not t.finished  # answered the error text
    assert turns.take_counts().tool_errors == 1


class Shuffled:
    def reset(self, prompt):
        return [{"role": "user", "content": random.choice(["1*2=", "3*4="])}]

    def step(self, messages):
        return [], None, True


def test_an_environment_must_open_a_prompts_conversations_alike(tok):
    random.seed(1)
    with pytest.raises(ToolError, match="two different openings"):
        _conversations(tok, make_env=Shuffled).rollout(ScriptedPolicy(tok), _prompts(2), SamplingParams(n=8))


def _searcher(tok, reference):
    cfg = load_config(None, ["--task.digits=3", "--task.operators=*", f"--task.tools={TOOLS}"])
    turns = make_conversations(cfg.task, tok, {tok.eos_token_id})
    task = ArithmeticTask(3, "*", 16, 1234)
    weights = LocalWeightStore()
    weights.publish({}, 0)
    params = SamplingParams(n=2, max_new_tokens=16, logprobs=True)
    return Searcher(
        task, tok, ScriptedPolicy(tok), reference, weights, params, 3, {tok.eos_token_id}, conversations=turns
    )


def test_searcher_groups_are_trajectories_whose_reference_counts_the_models_tokens(tok):
    torch.manual_seed(0)
    reference = build_tiny_llama(tok, SMALL).eval()
    s = _searcher(tok, reference)
    groups = s.step()
    assert len(groups) == 3
    for g in groups:
        assert g.rewards == [1.0, 1.0] and g.finished == [True, True]
        assert all(0 in m and len(m) == len(c) for m, c in zip(g.action_masks, g.completions, strict=True))
        # the reference's sum over the model's tokens, the whole trajectory scored (not cut at the first EOS)
        logp, _ = token_logprobs(reference, [g.prompt_ids] * 2, g.completions, tok.pad_token_id, None)
        masks = torch.tensor(g.action_masks, dtype=logp.dtype)
        expected = (logp * masks).sum(-1)
        terms = model_terms(reference.config, len(g.prompt_ids) + len(g.completions[0]))
        assert_reordered_close(torch.tensor(g.ref_logps), expected, terms=terms)
        assert g.sampler_logps == [-0.5 * sum(m) for m in g.action_masks]
    m = s.metrics()
    assert_reports_declared(m)
    assert m["searcher/tool_calls"] == 6 and m["searcher/turns_per_conversation"] == 2.0
    assert s.stats.tokens == sum(sum(m) for g in groups for m in g.action_masks)  # the model's tokens


@pytest.mark.parametrize("objective", ["tb", "grpo", "dr_grpo", "ppo", "rloo", "online_dpo"])
def test_multi_turn_groups_train(tok, objective):
    from tests.helpers.gradients import step_gradients

    torch.manual_seed(0)
    model = build_tiny_llama(tok, SMALL).eval()
    prompts = _prompts(3)
    s = _searcher(tok, model)
    s.task.sample_prompts = lambda n, rng: prompts
    s.generator.vary = True  # one right and one wrong answer a group
    buffer = ReplayBuffer(seed=0)
    for g in s.step():
        assert g.rewards == [1.0, 0.0]
        buffer.add(g, step=0)
    batch = buffer.sample(3, 2)
    assert all(r.action_mask is not None and 0 in r.action_mask for r in batch.rollouts)
    grads, metrics = step_gradients(model, tok, batch, objective)
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert sum(g.abs().sum().item() for g in grads.values()) > 0
    if objective == "tb":  # the reference is the policy: the two sums run over the same tokens
        assert abs(metrics["train/kl"]) < 1e-4


def test_evaluation_scores_whole_conversations(tok):
    turns = _conversations(tok)
    task = ArithmeticTask(3, "*", 6, 1234)
    mistakes = {task.eval_prompts()[0].text}
    settings = EvalSettings(max_new_tokens=16, log_samples=2)
    result = evaluate(
        task, ScriptedPolicy(tok, mistakes), tok, settings, eos_ids={tok.eos_token_id}, conversations=turns
    )
    assert result.metrics["eval/accuracy"] == pytest.approx(5 / 6) and result.metrics["eval/turns"] == 2.0
    assert result.samples[1]["completion"] == task.eval_prompts()[1].answer
    assert result.samples[1]["conversation"][2]["role"] == "tool"


def test_multi_turn_settings_are_checked():
    with pytest.raises(ConfigError, match="tools are one kind of environment"):
        load_config(None, [f"--task.tools={TOOLS}", "--task.environment=tests.test_turns:Broken"])
    with pytest.raises(ConfigError, match="generation.stream=false"):
        load_config(None, [f"--task.tools={TOOLS}", "--generation.stream=true"])
    with pytest.raises(ConfigError, match="turns are written by the chat template"):
        load_config(None, [f"--task.tools={TOOLS}", "--model.chat_template=false"])
    with pytest.raises(ConfigError, match="without task.environment"):
        load_config(None, ["--task.environment_args={a: 1}"])
    cfg = load_config(None, [f"--task.tools={TOOLS}"])
    from tba.models.tiny import build_char_tokenizer

    with pytest.raises(ToolError, match="no chat template"):  # the demo's plain tokenizer cannot call tools
        make_conversations(cfg.task, build_char_tokenizer(), {2})


def test_a_resumed_tool_run_continues_bit_exact_with_its_trajectories(tmp_path, tool_model):
    from safetensors.torch import load_file
    from tests.conftest import stored_rollouts

    from tba.runtime.sync_loop import run_sync

    def cfg(name, steps, *extra):
        return load_config(
            "configs/tools.yaml",
            [
                "--runtime.type=sync",
                "--logging.progress=false",
                f"--model.policy={tool_model}",
                f"--run.output_dir={tmp_path}",
                f"--run.name={name}",
                f"--trainer.steps={steps}",
                "--trainer.checkpoint_every=2",
                "--trainer.lr_schedule=constant",
                "--generation.group_size=4",
                "--generation.prompts_per_batch=4",
                "--trainer.batch_prompts=4",
                "--eval.every=100",
                "--eval.limit=4",
                *extra,
            ],
        )

    straight, _ = run_sync(cfg("straight", 4))
    # the straight run as it stood after step 2 (its checkpoint of step 4 not written yet), resumed
    shutil.copytree(straight, tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_4")
    resumed, summary = run_sync(cfg("resumed", 4, "--run.resume=true"))
    assert summary["trainer_steps"] == 4
    a, b = (load_file(d / "checkpoints" / "step_4" / "model.safetensors") for d in (straight, resumed))
    assert all(torch.equal(a[k], b[k]) for k in a), "the resumed run's weights differ"
    kept = {d: stored_rollouts(d, 4) for d in (straight, resumed)}
    assert kept[straight] == kept[resumed]  # every trajectory, its tokens and mask, as if never stopped
    with_tool = [r for r in kept[resumed] if r.action_mask is not None and 0 in r.action_mask]
    assert with_tool, "no conversation called the tool"
    for r in with_tool:  # the tool's answer sits between the model's call and its final answer
        first_env = r.action_mask.index(0)
        assert r.completion[first_env - 1] == 2 and r.action_mask[-1] == 1  # after the call's <eos>


class ToolUseTask(ArithmeticTask):
    """Rewards a conversation for the tool answers in it, from the ``conversation`` column."""

    def reward_functions(self):
        from tba.rewards import make_reward_fn

        def tool_answers(prompts, completions, completion_ids, conversation, **_):
            return [float(sum(m["role"] == "tool" for m in c)) for c in conversation]

        return [make_reward_fn("tool_answers", tool_answers)]


def test_reward_functions_can_read_the_whole_conversation(tok):
    torch.manual_seed(0)
    s = _searcher(tok, build_tiny_llama(tok, SMALL).eval())
    s.task = ToolUseTask(3, "*", 16, 1234)
    assert all(g.rewards == [1.0, 1.0] for g in s.step())  # one tool answer in each conversation
    result = evaluate(
        s.task, ScriptedPolicy(tok), tok, EvalSettings(max_new_tokens=16), eos_ids={2}, conversations=s.conversations
    )
    assert result.metrics["eval/accuracy"] == 1.0


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class ChatPolicy:
    """Replies as text, each ended with the template's end-of-turn token: first a call, then the answer."""

    def __init__(self, tok, end_id):
        self.tok, self.end_id, self.version = tok, end_id, -1

    def load_weights(self, state, version):
        self.version = version

    def generate(self, prompts, params):
        out = []
        for ids in prompts:
            answered = "<tool_response>" in self.tok.decode(ids)
            reply = "It is 56088." if answered else '<tool_call>{"name": "multiply", "arguments": {"a": 123, "b": 456}}'
            reply += "" if answered else "</tool_call>"
            tokens = self.tok.encode(reply, add_special_tokens=False) + [self.end_id]
            out.append([Completion(tokens, True) for _ in range(params.n)])
        return out


def test_a_chatml_conversation_is_the_text_the_template_renders():
    """On a byte-level BPE tokenizer with a Qwen-like template (``<|im_end|>`` ends a turn and is not the
    tokenizer's EOS), the prompt and the trajectory decode to exactly the template's rendering of the
    whole conversation: the tokens appended between turns are the template's own separators."""
    from tests.helpers.templates import HERMES_TEMPLATE
    from tests.helpers.tiny_bpe import IM_END, build_bpe_tokenizer

    tok = build_bpe_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    end = tok.convert_tokens_to_ids(IM_END)
    tools = load_tools([multiply])
    turns = Conversations(tok, lambda: ToolEnvironment(tools, "hermes"), {tok.eos_token_id, end}, 3, tools=tools)
    assert turns.end_text == IM_END
    (p,) = _prompts(1)
    [ids], [[t]] = turns.rollout(ChatPolicy(tok, end), [p], SamplingParams(max_new_tokens=64))
    assert t.finished and t.turns == 2 and t.text == "It is 56088."
    assert [m["role"] for m in t.messages] == ["user", "assistant", "tool", "assistant"]
    rendered = tok.apply_chat_template(t.messages, tools=tools, tokenize=False)
    assert tok.decode(ids + t.token_ids) == rendered.removesuffix("\n")  # the last reply ends at its <|im_end|>
    environment = tok.decode([x for x, m in zip(t.token_ids, t.action_mask, strict=True) if not m])
    assert environment == "\n<|im_start|>user\n<tool_response>56088</tool_response><|im_end|>\n<|im_start|>assistant\n"

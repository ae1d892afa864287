"""An agent task (``task.agent``) trains end to end in both runtimes: the searcher serves its
endpoint, an agent drives tool-calling conversations through the ``openai`` client (the tool demo's
model calls the calculator, the agent runs it), and the trainer trains on the endpoint's tokens
(the tool's answers marked 0)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import stored_rollouts
from tests.helpers.sources import THREE_STEPS, trained_three_steps

from tba.config import ConfigError, load_config
from tba.runtime.async_loop import run_ray
from tba.runtime.sync_loop import run_sync

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

AGENT = Path("examples/agents/calculator_agent.py").resolve()


def args(tmp_path, runtime: str, *extra: str) -> list[str]:
    """configs/agent.yaml, small."""
    return [
        f"--runtime.type={runtime}",
        f"--task.agent={AGENT}:calculator_agent",
        "--eval.limit=8",
        *THREE_STEPS,
        f"--run.output_dir={tmp_path}",
        "--run.name=a",
        *extra,
    ]


def test_an_agent_that_cannot_be_loaded_is_refused_before_the_run(tmp_path):
    cfg = load_config("configs/agent.yaml", args(tmp_path, "sync", f"--task.agent={AGENT}:nope"))
    with pytest.raises(Exception, match="task.agent .*has no attribute 'nope'"):
        run_sync(cfg)
    assert not (tmp_path / "a").exists()
    with pytest.raises(ConfigError, match="task.agent with task.tools or task.environment"):
        load_config("configs/agent.yaml", args(tmp_path, "sync", "--task.tools=[tba.tasks.calculator:calculator]"))


def test_the_agents_greedy_conversations_are_the_built_in_tool_loops_token_for_token():
    """The same model, tool and prompts, driven by tba's tool environment (task.tools) or by the
    agent through the endpoint: the same conversations, the same accuracy. Nothing drifts between
    the endpoint's rendering and the environment's."""
    from tba.eval_command import evaluate_target, resolve_target

    common = ["--eval.limit=16", "--eval.log_samples=16", "--run.threads=1"]
    tools = evaluate_target(resolve_target("builtin:tiny-tools", "configs/tools.yaml", common, None))
    agent = evaluate_target(resolve_target("builtin:tiny-tools", "configs/agent.yaml", common, None))
    assert agent["metrics"]["eval/accuracy"] == tools["metrics"]["eval/accuracy"]
    assert agent["metrics"]["eval/turns"] == tools["metrics"]["eval/turns"] > 1.5
    assert [s["completion"] for s in agent["samples"]] == [s["completion"] for s in tools["samples"]]
    print(f"\ngreedy accuracy on 16 problems: {agent['metrics']['eval/accuracy']:.3f} by either path")


LOGGING_AGENT = '''
import json

from transformers.utils import get_json_schema

from tba.tasks.calculator import calculator


def logged(prompt, client, log):
    """The calculator agent, writing each rollout's answers (their token ids) to ``log``."""
    messages, answers = [{"role": "user", "content": prompt.text}], []
    try:  # (a request past the rollout's budget raises: the rollout is kept, unfinished)
        while True:
            answer = client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[get_json_schema(calculator)],
                extra_body={"return_token_ids": True},
            )
            answers.append([answer.prompt_token_ids, answer.choices[0].token_ids])
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                try:
                    result = calculator(**json.loads(call.function.arguments))
                except Exception as e:
                    result = f"error: {e}"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        with open(log, "a") as f:
            f.write(json.dumps(answers) + "\\n")
'''


@pytest.mark.parametrize("runtime", ["sync", "ray"])
def test_a_tool_calling_agent_trains_on_exactly_the_tokens_the_endpoint_answered_with(tmp_path, runtime, request):
    """configs/agent.yaml's agent, writing down each rollout's answers: the run trains, and every
    rollout in the replay buffer is, token for token, one rollout's answers (after its opening,
    the context of its last answer and what that answer generated; each answer's context the
    previous one's plus its reply as generated)."""
    import json

    if runtime == "ray":
        request.getfixturevalue("local_ray")  # joined by the run (tests/conftest.py)
    agent, log = tmp_path / "logged.py", tmp_path / "answers.jsonl"
    agent.write_text(LOGGING_AGENT)
    cfg = load_config(
        "configs/agent.yaml",
        args(tmp_path, runtime, f"--task.agent={agent}:logged", f"--task.agent_args={{log: {log}}}"),
    )
    run_dir, summary = (run_sync if runtime == "sync" else run_ray)(cfg)
    records, train = trained_three_steps(run_dir, summary)
    last = train[-1]
    assert last["searcher/environment_errors"] == 0
    # the warm-started model calls the calculator, then answers: two replies, mostly
    assert 1.2 < last["searcher/turns_per_conversation"] <= 3
    evals = [r for r in records if r.get("eval/accuracy") is not None]
    assert [r["step"] for r in evals] == [0, 3] and evals[0]["eval/turns"] > 1.5

    answered = set()
    for answers in map(json.loads, log.read_text().splitlines()):
        opening = answers[0][0]
        for (before, wrote), (context, _) in zip(answers, answers[1:], strict=False):
            assert context[: len(before) + len(wrote)] == before + wrote
        context, tokens = answers[-1]
        answered.add(tuple(context[len(opening) :] + tokens))
    rollouts = stored_rollouts(run_dir, 3)
    assert rollouts and all(r.completion in answered for r in rollouts)
    two = [r for r in rollouts if 0 in r.action_mask]
    assert two, "a conversation with the tool's answer between the model's replies"
    for r in two:  # the model's call, the tool's answer, the model's answer
        mask = list(r.action_mask)
        first, end = mask.index(0), len(mask) - mask[::-1].index(0)
        assert set(mask[:first]) == {1} and set(mask[first:end]) == {0} and set(mask[end:]) == {1}

"""Multi-turn environments (``tba.environments``): the interface, sync or async, loaded by name,
and tool use as the built-in environment."""

from __future__ import annotations

import pytest
from tests.helpers.tools import multiply, slow

from tba.environments import ToolEnvironment, check_step, load_environment
from tba.tasks.base import Prompt
from tba.tools import ToolError
from tba.user_code import call


class CountingGame:
    """A user simulator: asks for the next number until the model says the target."""

    def __init__(self, target: int = 3):
        self.target = target

    def reset(self, prompt):
        return [{"role": "user", "content": f"count to {self.target}: {prompt.text}"}]

    def step(self, messages):
        said = messages[-1]["content"].strip()
        if said == str(self.target):
            return [], 1.0, True
        return [{"role": "user", "content": "next"}], None, False


class AsyncGame(CountingGame):
    async def reset(self, prompt):
        return super().reset(prompt)

    async def step(self, messages):
        return super().step(messages)


class NoStep:
    def reset(self, prompt):
        return []


def _call(text: str) -> str:
    return f'<tool_call>{{"name": "multiply", "arguments": {text}}}</tool_call>'


def test_tool_environment_runs_calls_until_the_model_answers():
    env = ToolEnvironment([multiply], "hermes", system="You may call tools.")
    messages = env.reset(Prompt(id="p", text="what is 123 * 456?"))
    assert messages == [
        {"role": "system", "content": "You may call tools."},
        {"role": "user", "content": "what is 123 * 456?"},
    ]
    messages.append({"role": "assistant", "content": _call('{"a": 123, "b": 456}')})
    new, reward, done = env.step(messages)
    assert new == [{"role": "tool", "name": "multiply", "content": "56088"}] and reward is None and not done
    messages += [*new, {"role": "assistant", "content": "123 * 456 = 56088"}]
    assert env.step(messages) == ([], None, True)  # no call: the answer, scored by the task's reward
    assert env.counts() == {"calls": 1, "errors": 0, "timeouts": 0}


def test_tool_errors_and_timeouts_are_messages_and_counted():
    env = ToolEnvironment([multiply, slow], "hermes", timeout=0.2)
    messages = [*env.reset(Prompt(id="p", text="q")), {"role": "assistant", "content": _call('{"a": 1}')}]
    new, _, done = env.step(messages)
    assert new[0]["content"].startswith("error: bad arguments for multiply") and not done
    messages += [*new, {"role": "assistant", "content": '<tool_call>{"name": "slow", "arguments": {"seconds": 5}}'}]
    new, _, done = env.step(messages)  # a call cut at the token limit still reads; this one hangs
    assert new == [{"role": "tool", "name": "slow", "content": "error: slow did not answer within 0.2 s"}]
    assert not done  # calls were made: the model goes on (task.max_turns bounds the replies)
    assert env.counts() == {"calls": 2, "errors": 1, "timeouts": 1}


@pytest.mark.parametrize("cls", [CountingGame, AsyncGame])
def test_environments_are_plain_or_async_and_load_by_name(cls):
    env = load_environment(f"tests.test_environments:{cls.__name__}", target=2)
    messages = call(env.reset, Prompt(id="p", text="go"))
    assert messages == [{"role": "user", "content": "count to 2: go"}]
    messages.append({"role": "assistant", "content": "1"})
    assert check_step(call(env.step, messages), env) == ([{"role": "user", "content": "next"}], None, False)
    messages.append({"role": "assistant", "content": "2"})
    assert check_step(call(env.step, messages), env) == ([], 1.0, True)


def test_a_broken_environment_is_said_clearly():
    with pytest.raises(ToolError, match="has no step"):
        load_environment("tests.test_environments:NoStep")
    with pytest.raises(ToolError, match="task.environment 'tests.test_environments.CountingGame' is malformed"):
        load_environment("tests.test_environments.CountingGame")
    with pytest.raises(TypeError, match=r"must return \(new_messages, reward or None, done\)"):
        check_step(([], None), CountingGame())
    with pytest.raises(TypeError, match="must be a list of chat messages"):
        check_step(("hello", None, False), CountingGame())


def test_environment_text_follows_the_models_turn_end_through_the_next_generation_prompt():
    from tests.helpers.templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE, chat_tokenizer

    from tba.environments import environment_text

    conversation = [
        {"role": "user", "content": "what is 123 * 456?"},
        {"role": "assistant", "content": _call('{"a": 123, "b": 456}')},
    ]
    answer = [{"role": "tool", "name": "multiply", "content": "56088"}]
    hermes = environment_text(conversation, answer, chat_tokenizer(HERMES_TEMPLATE), "<|im_end|>", [multiply])
    # the newline after the model's <|im_end|> is the template's, so it opens the environment's text
    assert hermes == "\n<|im_start|>user\n<tool_response>56088</tool_response><|im_end|>\n<|im_start|>assistant\n"
    llama = environment_text(conversation, answer, chat_tokenizer(LLAMA3_TEMPLATE), "<|eot_id|>", [multiply])
    assert llama == (
        "<|start_header_id|>ipython<|end_header_id|>\n56088<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n"
    )
    with pytest.raises(ToolError, match="does not end the model's turn with '<eos>'"):
        environment_text(conversation, answer, chat_tokenizer(HERMES_TEMPLATE), "<eos>", [multiply])
    rewrites = "{% for m in messages %}{{ m.role }}{{ loop.length }}:{{ m.content }}|{% endfor %}{{ tools }}"
    with pytest.raises(ToolError, match="rewrites earlier turns"):
        environment_text(conversation, answer, chat_tokenizer(rewrites), "|", [multiply])

"""Multi-turn environments: what a conversation is, turn by turn, beyond one prompt and one answer.

An environment is any object with two methods, plain or ``async``:

- ``reset(prompt) -> messages``: the conversation's opening messages (chat format: dicts with
  ``role`` and ``content``) for a task prompt (:class:`tba.tasks.base.Prompt`);
- ``step(messages) -> (new_messages, reward, done)``: given the conversation so far, whose last
  message is the model's reply, the messages the environment answers with (tool results, a user
  simulator's next turn, a grader's feedback), a reward (None: the task's reward functions score
  the conversation) and whether it has ended.

An environment may also have ``close()`` (plain or ``async``), called once its conversation has
ended (a session on a server, a sandbox).

Tools are one built-in environment of this kind (:class:`ToolEnvironment`); games, user
simulators and graders that talk back are others, loaded by ``module:Class``
(:func:`load_environment`). The searcher owns the tokens: the model's replies are what it
generated, the environment's messages are rendered by the chat template and appended as
conditioning, never trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tba.tools import ToolError, load_tools, parse_tool_calls, run_tool
from tba.user_code import load_object


def load_environment(spec: str, base: str | Path | None = None, **kwargs) -> Any:
    """An environment from ``"module:Class"`` (or ``"module:factory"``, or ``"file.py:Class"``: the
    forms of :mod:`tba.user_code`, relative to ``base``) called with ``kwargs``, checked to have
    ``reset`` and ``step``. ``"openenv:<url>"``: an OpenEnv server's environment (:mod:`tba.openenv`)."""
    if spec.startswith("openenv:"):
        from tba.openenv import make_openenv

        return make_openenv(spec, **kwargs)
    factory = load_object(spec, "task.environment", ToolError, base)
    try:
        env = factory(**kwargs)
    except TypeError as e:  # arguments it does not take, or not a class or function at all
        raise ToolError(f"task.environment: {spec}(**task.environment_args) failed: {e}") from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise ToolError(
            f"task.environment: {spec} has no {' or '.join(missing)}; an environment needs reset(prompt) -> messages "
            "and step(messages) -> (new_messages, reward or None, done)"
        )
    return env


def check_step(result, env) -> tuple[list[dict], float | None, bool]:
    """An environment's ``step`` result, checked: a clear error for a wrong shape (a bug in the
    environment, said once, with what was returned)."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(
            f"{type(env).__name__}.step must return (new_messages, reward or None, done), got {result!r:.200}"
        )
    messages, reward, done = result
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise TypeError(
            f"{type(env).__name__}.step: new_messages must be a list of chat messages, got {messages!r:.200}"
        )
    if reward is not None:
        reward = float(reward)
    return messages, reward, bool(done)


def environment_text(messages: list[dict], new_messages: list[dict], tokenizer, end_text: str, tools=None) -> str:
    """The text an environment's ``new_messages`` add after the model's last reply, as the chat
    template renders the conversation, through the next reply's generation prompt: what the
    searcher appends, tokenized, to the model's own tokens (which end with its turn-end token,
    ``end_text``, e.g. ``<|im_end|>``). It starts right after that token, so a separator the
    template writes between turns (the newline after ``<|im_end|>``) is the environment's, not
    missing from the trajectory. ``messages``: the conversation through the model's reply."""
    before = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    after = tokenizer.apply_chat_template(
        messages + new_messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    end = before.rfind(end_text)
    if not end_text or end < 0:
        raise ToolError(
            f"the chat template does not end the model's turn with {end_text!r} (its end token): the turns of a "
            "conversation cannot be joined to the tokens the model wrote"
        )
    end += len(end_text)
    if after[:end] != before[:end]:
        raise ToolError(
            "the chat template renders the conversation differently once the environment's messages follow (it "
            "rewrites earlier turns), so they cannot be appended to the tokens the model wrote"
        )
    return after[end:]


class ToolEnvironment:
    """Tool use as an environment: the conversation opens with the prompt (its chat messages, or
    its text as the user's message, after ``system`` if given); each reply of the model is read for
    tool calls (in the chat template's format, ``fmt``), the calls are run (each within ``timeout``
    seconds) and their results come back as ``tool`` messages; a reply that calls nothing ends the
    conversation. How many replies a conversation may have is the caller's bound
    (``task.max_turns``). The reward is left to the task's reward functions (the final answer).
    Counts calls, calls that could not be read or raised (``errors``) and calls past their timeout
    (``timeouts``)."""

    def __init__(self, tools: list, fmt: str, timeout: float | None = 10.0, system: str | None = None):
        self.tools = load_tools(tools)
        self.fmt = fmt
        self.timeout = timeout
        self.system = system
        self.calls = self.errors = self.timeouts = 0

    def reset(self, prompt) -> list[dict]:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        if getattr(prompt, "messages", None) is not None:
            return [*messages, *(dict(m) for m in prompt.messages)]
        return [*messages, {"role": "user", "content": prompt.text}]

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        calls = parse_tool_calls(messages[-1]["content"], self.fmt, self.tools)
        if not calls:
            return [], None, True
        out = []
        for c in calls:
            result = run_tool(c, self.tools, self.timeout)
            self.calls += 1
            self.errors += result.status == "error"
            self.timeouts += result.status == "timeout"
            out.append({"role": "tool", "name": result.name or "unknown", "content": result.content})
        return out, None, False

    def counts(self) -> dict[str, int]:
        """Tool calls so far, and of them those that failed (unreadable or raised) and timed out."""
        return {"calls": self.calls, "errors": self.errors, "timeouts": self.timeouts}

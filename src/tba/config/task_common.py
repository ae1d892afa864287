"""What every task section has: the settings of multi-turn rollouts (tools, an environment, an
agent) and of the reward functions' calls."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from tba.config.section import Section


class TaskSection(Section):
    """What every task has."""

    reward_timeout: float | None = Field(None, gt=0)
    """Seconds one call of the reward functions may take (a batch's, or with ``generation.stream``
    the groups that finished together); a call past it is given up, its samples dropped and counted
    (``searcher/reward_timeouts``). Default: no limit."""
    tools: list[str] = []
    """Tools the model may call, as ``module:function`` or ``path/to/file.py:function`` (plain or async
    Python functions with type hints and an ``Args:`` docstring, rendered into the prompt by the chat
    template): each reply is read for calls in the template's own format, the calls run, and their
    results come back as ``tool`` messages until a reply calls nothing or ``max_turns`` replies were
    made. Needs a chat model with a tool-call template."""
    environment: str | None = None
    """A multi-turn environment, ``module:Class`` or ``path/to/file.py:Class``, with
    ``reset(prompt) -> messages`` and ``step(messages) -> (new_messages, reward or None, done)`` (plain
    or async), built with ``environment_args``: one instance per conversation. Not with ``tools``
    (tools are an environment)."""
    environment_args: dict[str, Any] = {}
    """Keyword arguments of ``environment`` (its class or factory)."""
    max_turns: int = Field(4, ge=1)
    """Replies of the model per conversation with ``tools`` or ``environment``; a conversation still
    going after the last one is unfinished (``generation.unfinished_reward``)."""
    max_trajectory_tokens: int | None = Field(None, ge=1)
    """Tokens of a whole conversation after the prompt (the model's replies and the environment's
    messages); one that reaches it is unfinished. Default: no limit besides ``max_turns`` replies of
    ``generation.max_new_tokens`` each."""
    tool_timeout: float | None = Field(10.0, gt=0)
    """Seconds one tool call may run; a call past it becomes an ``error:`` tool message, counted
    (``searcher/tool_timeouts``). None: no limit."""
    system_prompt: str | None = None
    """With ``tools``: a system message opening every conversation (besides the tools' schemas, which
    the chat template renders)."""
    agent: str | None = None
    """An agent that drives each rollout through an OpenAI-compatible endpoint the searcher serves:
    ``module:function`` or ``path/to/file.py:function``, called as ``agent(prompt, client,
    **agent_args)`` (plain or async) with an ``openai`` client whose base URL belongs to the rollout;
    it returns the reward, or None for the task's reward functions to score the last reply. The
    trajectory is the tokens the endpoint generated for it (docs/agents.md). Not with ``tools`` or
    ``environment``."""
    agent_args: dict[str, Any] = {}
    """Keyword arguments of ``agent``."""
    agent_timeout: float | None = Field(600.0, gt=0)
    """Seconds one rollout of ``agent`` may take; one past it is dropped and counted
    (``searcher/environment_errors``). None: no limit."""
    environment_workers: int = Field(128, ge=1)
    """Threads that run the conversations' environment steps (tool calls) of one turn side by side: a
    tool that waits (a sandbox, a remote service) waits beside the others
    (``benchmarks/results/tools/README.md`` measures a slow tool with few and many)."""

    @model_validator(mode="after")
    def _check_turns(self) -> TaskSection:
        if self.tools and self.environment:
            raise ValueError(
                "task.tools and task.environment: tools are one kind of environment; give the tools to your "
                "environment, or leave task.environment unset"
            )
        if self.agent and (self.tools or self.environment):
            raise ValueError(
                "task.agent with task.tools or task.environment: the agent drives the conversation (its own tools "
                "included); leave task.tools and task.environment unset"
            )
        if self.agent_args and not self.agent:
            raise ValueError("task.agent_args without task.agent: name the agent's module:function")
        if self.environment_args and not self.environment:
            raise ValueError("task.environment_args without task.environment: name the environment's module:Class")
        return self

    @property
    def multi_turn(self) -> bool:
        """Whether conversations have more than the prompt and one reply (tools, an environment or
        an agent)."""
        return self.conversation_source is not None

    @property
    def conversation_source(self) -> str | None:
        """Which conversations the task's rollouts are (:mod:`tba.conversations`): ``tools``,
        ``environment`` or ``agent``; None for a prompt and one reply."""
        return "agent" if self.agent else "tools" if self.tools else "environment" if self.environment else None

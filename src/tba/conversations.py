"""The multi-turn rollouts a task config asks for, by registry: each kind of conversation source
(``task.conversation_source``: tba's tool loop, an environment of the user's or an OpenEnv server's,
an agent's through the endpoint, a verifiers environment's) registers the factory that builds it,
a :class:`~tba.generation.turns.ConversationSource` either way. The searcher and the evaluation ask
:func:`make_conversations` and never which kind they got. This module sits above the sources'
packages (generation, endpoint, tasks), so none of them imports another to reach a sibling."""

from __future__ import annotations

from collections.abc import Callable

from tba.endpoint.agents import AgentConversations
from tba.environments import ToolEnvironment, load_environment
from tba.generation.turns import Conversations, ConversationSource
from tba.tasks.verifiers import load_vf_environment, verifiers_agent
from tba.tools import ToolError, load_tools, tool_call_format
from tba.user_code import load_object

Factory = Callable[[object, object, set[int]], ConversationSource]
SOURCES: dict[str, Factory] = {}


def register(kind: str) -> Callable[[Factory], Factory]:
    """Make ``factory(task_cfg, tokenizer, eos_ids)`` the builder of ``kind``'s conversations."""

    def add(factory: Factory) -> Factory:
        SOURCES[kind] = factory
        return factory

    return add


def make_conversations(task_cfg, tokenizer, eos_ids: set[int]) -> ConversationSource | None:
    """The multi-turn rollouts of ``task_cfg`` (a task config section), checked against the
    tokenizer; None for a single-turn task."""
    kind = task_cfg.conversation_source
    return None if kind is None else SOURCES[kind](task_cfg, tokenizer, eos_ids)


@register("tools")
def _tools(task_cfg, tokenizer, eos_ids: set[int]) -> ConversationSource:
    """tba's tool loop: the chat template renders the tools, a tool environment runs the calls."""
    fmt = tool_call_format(tokenizer)
    tools = load_tools(task_cfg.tools)

    def make_env():
        return ToolEnvironment(tools, fmt, timeout=task_cfg.tool_timeout, system=task_cfg.system_prompt)

    return _conversations(task_cfg, tokenizer, eos_ids, make_env, tools)


@register("environment")
def _environment(task_cfg, tokenizer, eos_ids: set[int]) -> ConversationSource:
    """An environment of the user's (``module:Class``) or an OpenEnv server's (``openenv:<url>``)."""
    spec, kwargs = task_cfg.environment, dict(task_cfg.environment_args)
    load_environment(spec, **kwargs)  # fails now, with what is wrong, not in the first rollout

    def make_env():
        return load_environment(spec, **kwargs)

    return _conversations(task_cfg, tokenizer, eos_ids, make_env, None)


def _conversations(task_cfg, tokenizer, eos_ids, make_env, tools) -> Conversations:
    return Conversations(
        tokenizer,
        make_env,
        eos_ids,
        task_cfg.max_turns,
        task_cfg.max_trajectory_tokens,
        tools,
        task_cfg.environment_workers,
    )


@register("agent")
def _agent(task_cfg, tokenizer, eos_ids: set[int]) -> ConversationSource:
    """An agent of the user's (``task.agent``) that talks to the searcher's endpoint."""
    return _through_endpoint(
        task_cfg, tokenizer, eos_ids, load_object(task_cfg.agent, "task.agent", ToolError), "task.agent"
    )


@register("verifiers")
def _verifiers(task_cfg, tokenizer, eos_ids: set[int]) -> ConversationSource:
    """A verifiers environment's rollouts: its own agent, through the endpoint."""
    agent = verifiers_agent(load_vf_environment(task_cfg.env, task_cfg.env_args))
    return _through_endpoint(task_cfg, tokenizer, eos_ids, agent, "task.env")


def _through_endpoint(task_cfg, tokenizer, eos_ids, agent, name: str) -> AgentConversations:
    return AgentConversations(
        tokenizer,
        agent,
        eos_ids,
        task_cfg.max_turns,
        task_cfg.max_trajectory_tokens,
        task_cfg.agent_timeout,
        task_cfg.agent_args,
        task_cfg.environment_workers,
        name,
    )

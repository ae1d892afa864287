"""The multi-turn rollouts a task config asks for: tba's tool loop, an environment's, an agent's
through the endpoint, or a verifiers environment's (each one :class:`~tba.generation.turns.Conversation`
per rollout, the same trajectories)."""

from __future__ import annotations

from tba.environments import ToolEnvironment, load_environment
from tba.generation.turns import Conversations
from tba.tools import ToolError, load_tools, tool_call_format
from tba.user_code import load_object


def make_conversations(task_cfg, tokenizer, eos_ids: set[int]):
    """The multi-turn rollouts of ``task_cfg`` (a task config section: ``tools``, ``environment``
    or ``agent``), checked against the tokenizer; None for a single-turn task."""
    if not task_cfg.multi_turn:
        return None
    if task_cfg.agent or task_cfg.name == "verifiers":
        from tba.endpoint.agents import AgentConversations

        if task_cfg.name == "verifiers":  # the environment's rollouts are its agent
            from tba.tasks.verifiers import load_vf_environment, verifiers_agent

            agent, name = verifiers_agent(load_vf_environment(task_cfg.env, task_cfg.env_args)), "task.env"
        else:
            agent, name = load_object(task_cfg.agent, "task.agent", ToolError), "task.agent"
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
    tools = None
    if task_cfg.tools:
        fmt = tool_call_format(tokenizer)
        tools = load_tools(task_cfg.tools)

        def make_env():
            return ToolEnvironment(tools, fmt, timeout=task_cfg.tool_timeout, system=task_cfg.system_prompt)
    else:
        spec, kwargs = task_cfg.environment, dict(task_cfg.environment_args)
        load_environment(spec, **kwargs)  # fails now, with what is wrong, not in the first rollout

        def make_env():
            return load_environment(spec, **kwargs)

    return Conversations(
        tokenizer,
        make_env,
        eos_ids,
        task_cfg.max_turns,
        task_cfg.max_trajectory_tokens,
        tools,
        task_cfg.environment_workers,
    )

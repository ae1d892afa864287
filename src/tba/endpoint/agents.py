"""Conversations an agent drives: the searcher calls ``task.agent`` once per rollout with a client
of its endpoint, and trains on the tokens the endpoint generated for it.

An agent is ``agent(prompt, client, **task.agent_args)``, a plain or ``async`` function:
``prompt`` the task's :class:`~tba.tasks.base.Prompt` (``messages`` or ``text``, ``answer``,
``columns``), ``client`` an ``openai.AsyncOpenAI`` (for an ``async`` agent) or ``openai.OpenAI``
whose base URL belongs to this rollout (``client.base_url``: hand it to a harness or a subprocess
as ``OPENAI_BASE_URL``). It returns the rollout's reward, or None for the task's reward functions to
score the last reply. An agent that raises, runs past ``task.agent_timeout`` or makes no request
loses its rollout (counted in ``searcher/environment_errors``, its first traceback in
``errors.log``), never the batch.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from tba.endpoint.book import RolloutBook
from tba.endpoint.queue import GenerationQueue
from tba.endpoint.server import Endpoint, require_extras
from tba.generation.base import Generator, SamplingParams
from tba.generation.turns import ConversationSource, Trajectory, TurnCounts
from tba.user_code import FirstFailures, describe_exception, resolve


class AgentConversations(ConversationSource):
    """The conversations an agent drives, through the endpoint: a
    :class:`~tba.generation.turns.ConversationSource`."""

    def __init__(
        self,
        tokenizer,
        agent: Callable,
        eos_ids: set[int],
        max_turns: int,
        max_tokens: int | None = None,
        timeout: float | None = None,
        agent_args: dict | None = None,
        workers: int = 128,
        name: str = "task.agent",
    ):
        require_extras(name)
        self.agent, self.agent_args, self.timeout, self.name = agent, dict(agent_args or {}), timeout, name
        self.is_async = inspect.iscoroutinefunction(agent)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tba-agent")  # a plain agent's calls, side by side
        self.book = RolloutBook(tokenizer, eos_ids, max_turns, max_tokens)
        self.queue = GenerationQueue(self.book.active)
        self.generator: Generator | None = None
        self.params: SamplingParams | None = None
        self.endpoint: Endpoint | None = None  # started by the first rollout
        self.counts = TurnCounts()
        self.last_metrics: dict[str, float] = {}  # the latest batch's mean of each metric the agent reported
        self.failures = FirstFailures()  # for errors.log

    def start(self) -> Endpoint:
        if self.endpoint is None:
            self.endpoint = Endpoint(
                self.book,
                self.queue,
                params=lambda: self.params,
                version=lambda: self.generator.version if self.generator is not None else -1,
            )
        return self.endpoint

    def rollout(
        self, generator: Generator, prompts: list, params: SamplingParams
    ) -> tuple[list[list[int]], list[list[Trajectory]]]:
        """``params.n`` rollouts of each prompt by the agent, side by side; the prompts' token ids
        (each group's opening as its first request rendered it) and the trajectories, in order."""
        self.generator, self.params, self.queue.generator = generator, params, generator
        self.queue.threads = torch.get_num_threads()  # this thread's, for the generation thread
        endpoint = self.start()
        batch = uuid.uuid4().hex[:12]
        rids = [[f"{batch}-{i}-{j}" for j in range(params.n)] for i in range(len(prompts))]
        for group in rids:
            for rid in group:
                self.book.open(rid)
        flat = [(prompt, rid) for prompt, group in zip(prompts, rids, strict=True) for rid in group]
        results = resolve(self._run_all(endpoint, flat))  # on the process's loop for user code
        self._note_metrics([r for r in results.values() if isinstance(r, tuple)])
        prompt_ids, trajectories = [], []
        for prompt, group in zip(prompts, rids, strict=True):
            outs, opening = [], None
            for rid in group:
                rollout, result = self.book.close(rid), results[rid]
                failed = isinstance(result, BaseException)
                reward = None if failed else result[0]
                traj = self.book.trajectory(rollout, reward, failed, params.logprobs)
                if traj.failed and failed:
                    self._note(describe_exception(result), "".join(traceback.format_exception(result)))
                elif traj.failed and not failed:
                    self._note("the agent returned without a request to the endpoint (use the client it is given)")
                if opening is None and not traj.failed:
                    opening = rollout.opening
                elif not traj.failed and rollout.opening != opening:
                    traj.failed = True  # a group shares its prompt: this agent opened another way
                    self._note(f"{self.name} opened two rollouts of prompt {prompt.id!r} with different messages")
                self.counts.turns += traj.turns
                self.counts.environment_errors += traj.failed
                outs.append(traj)
            prompt_ids.append(opening if opening is not None else [])
            trajectories.append(outs)
        return prompt_ids, trajectories

    async def _run_all(self, endpoint: Endpoint, calls: list[tuple[object, str]]) -> dict[str, object]:
        """Each rollout's reward (float or None), or the exception that ended it, by rollout id."""
        import httpx
        import openai

        # one HTTP connection pool for all of the batch's clients: an async agent's, or a plain one's
        http_cls, client_cls = (
            (httpx.AsyncClient, openai.AsyncOpenAI) if self.is_async else (httpx.Client, openai.OpenAI)
        )
        http = http_cls(timeout=None)
        try:
            outs = await asyncio.gather(
                *(
                    self._one(prompt, client_cls(base_url=endpoint.rollout_url(rid), api_key="tba", http_client=http))
                    for prompt, rid in calls
                )
            )
        finally:
            if self.is_async:
                await http.aclose()
            else:
                http.close()
        return {rid: out for (_, rid), out in zip(calls, outs, strict=True)}

    async def _one(self, prompt, client):
        call = (
            self.agent(prompt, client, **self.agent_args)
            if self.is_async
            else asyncio.get_running_loop().run_in_executor(
                self.pool, functools.partial(self.agent, prompt, client, **self.agent_args)
            )
        )
        try:
            result = await asyncio.wait_for(call, self.timeout)
            if inspect.isawaitable(result):  # a plain function that returned a coroutine
                result = await asyncio.wait_for(result, self.timeout)
            return _reward(result, self.name)
        except Exception as e:  # the rollout's, said in rollout() unless its budget had ended it
            return e

    def _note(self, what: str, detail: str = "") -> None:
        key = what.splitlines()[0] if what else ""
        said = f"{self.name} failed a rollout (counted in searcher/environment_errors): {what}\n{detail}"
        self.failures.note(key, said)

    def _note_metrics(self, results: list[tuple[float | None, dict[str, float]]]) -> None:
        sums: dict[str, list[float]] = {}
        for _, metrics in results:
            for key, value in metrics.items():
                sums.setdefault(key, []).append(value)
        if sums:
            self.last_metrics = {key: sum(v) / len(v) for key, v in sums.items()}

    def reward_means(self) -> dict[str, float]:
        """``reward/<name>_mean`` of each metric the agent reports (a rubric's functions), over the
        latest batch."""
        return {f"reward/{key}_mean": value for key, value in self.last_metrics.items()}

    def take_counts(self) -> TurnCounts:
        out, self.counts = self.counts, TurnCounts()
        return out

    def take_generate_s(self) -> float:
        return self.queue.take_generate_s()

    def take_new_errors(self) -> list[str]:
        return self.failures.take()

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
        self.queue.close()
        self.pool.shutdown(wait=False, cancel_futures=True)


def _reward(result, name: str) -> tuple[float | None, dict[str, float]]:
    """An agent's result as (reward, metrics): a number, None, or ``{"reward": ..., "metrics": {...}}``."""
    metrics: dict[str, float] = {}
    if isinstance(result, dict):
        metrics = {str(k): float(v) for k, v in (result.get("metrics") or {}).items() if _number(v)}
        result = result.get("reward")
    if result is None:
        return None, metrics
    if not _number(result):
        raise TypeError(
            f"{name} returned {result!r}: an agent returns its rollout's reward (a finite number), None, or "
            '{"reward": ..., "metrics": {...}}'
        )
    return float(result), metrics


def _number(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)

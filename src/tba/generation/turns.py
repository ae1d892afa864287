"""Conversations, turn by turn: generate a reply, let the environment answer, generate again.

:class:`Conversations` runs one generation batch of multi-turn rollouts over any
:class:`~tba.generation.base.Generator` (HF ``generate`` or vLLM): every turn is one batched
``generate`` call over the conversations still going, and between turns the environment steps of
all of them run side by side on a thread pool (a slow tool waits beside the others, not after
them).

The tokens are the searcher's: a trajectory is the model's replies as it generated them (each
ending with its end-of-turn token) and, between them, the tokens of the text the chat template
writes for the environment's messages (:func:`tba.environments.environment_text`), marked 0 in
``action_mask``. The trainer and the reference pass sum log-probs over the marked-1 tokens only;
the environment's tokens are conditioning. A conversation that ends by ``max_turns`` replies, by
``max_tokens`` or by a reply cut at ``max_new_tokens`` is unfinished. An environment step that
raises drops its conversation (counted in ``environment_errors``), never the batch.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

from tba.environments import ToolEnvironment, check_step, environment_text
from tba.generation.base import Completion, Generator, SamplingParams
from tba.models.loading import chat_ids, end_of_turn_id
from tba.tools import ToolError
from tba.user_code import FirstFailures, call


@dataclass
class TurnCounts:
    """What a batch of conversations counted: the model's replies, tool calls and their failures,
    environment steps that raised."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    environment_errors: int = 0

    def add_tools(self, env: ToolEnvironment) -> None:
        """A conversation's tool environment's counts (it served that conversation only)."""
        counts = env.counts()
        self.tool_calls += counts["calls"]
        self.tool_errors += counts["errors"]
        self.tool_timeouts += counts["timeouts"]


class ConversationSource(Protocol):
    """Multi-turn rollouts of a batch of prompts, one conversation per completion: tba's tool loop
    and environments (:class:`Conversations`), or an agent's through the endpoint
    (:class:`tba.endpoint.agents.AgentConversations`). :mod:`tba.conversations` builds the one a task
    config asks for."""

    def rollout(self, generator: Generator, prompts: list, params: SamplingParams) -> tuple[list, list]:
        """Each prompt's token ids and its ``params.n`` :class:`Trajectory` completions."""

    def take_counts(self) -> TurnCounts:
        """The counts since the last call."""

    def take_generate_s(self) -> float:
        """Seconds in the generator's calls since the last call."""

    def take_new_errors(self) -> list[str]:
        """The first failure of each kind since the last call (for ``errors.log``)."""

    def reward_means(self) -> dict[str, float]:
        """``reward/<name>_mean`` of what the source scores itself (an agent's rubric)."""

    def close(self) -> None: ...


@dataclass
class Trajectory(Completion):
    """A completion that is a whole conversation after the prompt: ``action_mask`` set (the
    environment's tokens are 0), ``reward`` the environment's last one (None: the task's reward
    functions score ``text``), ``failed`` where the environment raised."""

    text: str = ""  # the model's last reply (what the task's reward functions score)
    turns: int = 0  # replies of the model
    messages: list[dict] = field(default_factory=list)  # the whole conversation, opening included


@dataclass
class Conversation:
    """One conversation's tokens as they are assembled, whoever drives it (:class:`Conversations`
    with an environment, or an agent through :mod:`tba.endpoint`): the model's replies as it
    generated them (mask 1, with their log-probs) and the environment's messages between them
    (mask 0)."""

    env: object
    messages: list[dict]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    done: bool = False
    finished: bool = False
    failed: bool = False
    reward: float | None = None
    turns: int = 0
    last_reply: str = ""
    last_ids: list[int] = field(default_factory=list)  # the last reply's tokens, end tokens left out

    def take_reply(self, out: Completion, tokenizer, eos_ids: set[int]) -> None:
        """The model's next reply, token for token; ``last_reply`` its text with special tokens kept
        (what a tool-call parser reads)."""
        self.ids += out.token_ids
        self.mask += [1] * len(out.token_ids)
        self.logps += out.token_logps if out.token_logps is not None else [0.0] * len(out.token_ids)
        self.turns += 1
        self.last_ids = [t for t in out.token_ids if t not in eos_ids]
        self.last_reply = tokenizer.decode(self.last_ids, skip_special_tokens=False)

    def take_environment(self, new_messages: list[dict], ids: list[int]) -> None:
        """The environment's messages after the last reply, as the tokens of their rendered text."""
        self.messages += new_messages
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logps += [0.0] * len(ids)

    def trajectory(self, tokenizer, logprobs: bool) -> Trajectory:
        return Trajectory(
            token_ids=self.ids,
            finished=self.finished,
            token_logps=self.logps if logprobs else None,
            action_mask=self.mask,
            reward=self.reward,
            text=tokenizer.decode(self.last_ids, skip_special_tokens=True),
            turns=self.turns,
            messages=self.messages,
            failed=self.failed,
        )


class Conversations(ConversationSource):
    """Multi-turn rollouts with the environments that ``make_env()`` builds (one per conversation).

    ``tools``: the tools' functions, rendered into the prompt by the chat template (for tool use;
    None for an environment that brings its own instructions). ``end_text``: the template's
    end-of-turn text after a reply; default: found from the template (:func:`turn_end_text`)."""

    def __init__(
        self,
        tokenizer,
        make_env: Callable[[], object],
        eos_ids: set[int],
        max_turns: int,
        max_tokens: int | None = None,
        tools: list[Callable] | None = None,
        workers: int = 128,
        end_text: str | None = None,
    ):
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.tokenizer = tokenizer
        self.make_env = make_env
        self.eos_ids = set(eos_ids)
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.tools = tools or None
        self.end_text = end_text if end_text is not None else turn_end_text(tokenizer, self.eos_ids)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tba-environment")
        self.counts = TurnCounts()
        self.generate_s = 0.0  # seconds in the generator's calls (not the environment's steps)
        self.failures = FirstFailures()  # for errors.log

    def rollout(
        self, generator: Generator, prompts: list, params: SamplingParams
    ) -> tuple[list[list[int]], list[list[Trajectory]]]:
        """The prompts' token ids (each conversation's opening, rendered with the tools) and
        ``params.n`` trajectories per prompt, in prompt order."""
        n = params.n
        openings = list(self.pool.map(self._open, prompts, [n] * len(prompts)))
        prompt_ids = [ids for ids, _ in openings]
        convs = [c for _, group in openings for c in group]
        self.counts.environment_errors += sum(c.failed for c in convs)  # resets that raised
        opened = [i for i, ids in enumerate(prompt_ids) if ids]  # (a prompt none of whose resets worked: none)
        first = self._generate(generator, [prompt_ids[i] for i in opened], params) if opened else []
        taken = [(out, convs[i * n + j]) for i, group in zip(opened, first, strict=True) for j, out in enumerate(group)]
        self._take([out for out, c in taken if not c.failed], [c for _, c in taken if not c.failed], params)
        for _ in range(1, self.max_turns):
            alive = [i for i, c in enumerate(convs) if not c.done]
            if not alive:
                break
            by_budget: dict[int, list[int]] = {}
            for i in alive:
                budget = self._budget(convs[i], params)
                if budget < 1:  # no room for another reply
                    convs[i].done = True
                else:
                    by_budget.setdefault(budget, []).append(i)
            for budget, idx in by_budget.items():
                contexts = [prompt_ids[i // params.n] + convs[i].ids for i in idx]
                outs = self._generate(generator, contexts, replace(params, n=1, max_new_tokens=budget))
                self._take([o[0] for o in outs], [convs[i] for i in idx], params)
        trajectories = [self._trajectory(c, params) for c in convs]
        return prompt_ids, [trajectories[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _generate(self, generator: Generator, prompts: list[list[int]], params: SamplingParams):
        start = time.perf_counter()
        try:
            return generator.generate(prompts, params)
        finally:
            self.generate_s += time.perf_counter() - start

    def take_generate_s(self) -> float:
        """Seconds in the generator's calls since the last call."""
        out, self.generate_s = self.generate_s, 0.0
        return out

    def _budget(self, conv: Conversation, params: SamplingParams) -> int:
        if self.max_tokens is None:
            return params.max_new_tokens
        return min(params.max_new_tokens, self.max_tokens - len(conv.ids))

    def _open(self, prompt, n: int) -> tuple[list[int], list[Conversation]]:
        """The prompt's opening messages, rendered to token ids, and its ``n`` conversations (each
        with an environment of its own, which must open the same way: a group shares its prompt)."""
        convs, opening = [], None
        for _ in range(n):
            env = self.make_env()
            try:
                messages = list(call(env.reset, prompt))
            except Exception as e:  # a server gone, say: this conversation is lost, counted, not the batch
                self._note(e, "an environment's reset raised; its conversation is dropped (environment_errors)")
                convs.append(Conversation(None, [], done=True, failed=True))
                continue
            if opening is not None and messages != opening:
                raise ToolError(
                    f"{type(env).__name__}.reset gave two different openings for prompt {prompt.id!r}: the "
                    "completions of a group must share their prompt; make reset depend on the prompt only"
                )
            opening = messages
            convs.append(Conversation(env, messages))
        if opening is None:
            return [], convs
        return chat_ids(self.tokenizer, opening, self.tools), convs

    def _take(self, outs: list[Completion], convs: list[Conversation], params: SamplingParams) -> None:
        """Each conversation's new reply; then the environment's answers to the finished replies."""
        stepping = []
        for out, conv in zip(outs, convs, strict=True):
            conv.take_reply(out, self.tokenizer, self.eos_ids)
            self.counts.turns += 1
            if not out.finished:  # cut at max_new_tokens: the conversation cannot go on
                conv.done = True
                continue
            conv.messages.append({"role": "assistant", "content": conv.last_reply})
            stepping.append(conv)
        for conv, result in zip(stepping, self.pool.map(self._step, stepping), strict=True):
            if isinstance(result, Exception):
                conv.done = conv.failed = True
                self.counts.environment_errors += 1
                self._note(result)
                continue
            new_messages, reward, done = result
            if reward is not None:
                conv.reward = reward
            if done:
                conv.done = conv.finished = True
            elif conv.turns >= self.max_turns:
                conv.done = True  # the last reply asked for more: unfinished
            else:
                text = environment_text(conv.messages, new_messages, self.tokenizer, self.end_text, self.tools)
                env_ids = self.tokenizer.encode(text, add_special_tokens=False)
                if self.max_tokens is not None and len(conv.ids) + len(env_ids) >= self.max_tokens:
                    conv.done = True  # no room for the answer and another reply: unfinished
                    continue
                conv.take_environment(new_messages, env_ids)

    def _step(self, conv: Conversation):
        try:
            return check_step(call(conv.env.step, list(conv.messages)), conv.env)
        except Exception as e:  # a per-conversation problem: counted, the conversation dropped
            return e

    def _trajectory(self, conv: Conversation, params: SamplingParams) -> Trajectory:
        if isinstance(conv.env, ToolEnvironment):  # its environment served this conversation only
            self.counts.add_tools(conv.env)
        close = getattr(conv.env, "close", None)  # (optional: an environment's session, e.g. OpenEnv's)
        if callable(close):
            try:
                call(close)
            except Exception as e:  # the conversation is complete: said in errors.log, not dropped
                self._note(e, "an environment's close() raised (its conversation is kept)")
        return conv.trajectory(self.tokenizer, params.logprobs)

    def _note(
        self,
        e: Exception,
        what: str = "an environment step raised; its conversation is dropped (counted in searcher/environment_errors)",
    ) -> None:
        kind = f"{what}{type(e).__name__}: {e}".splitlines()[0]
        self.failures.note(kind, f"{what}: " + "".join(traceback.format_exception(e)))

    def reward_means(self) -> dict[str, float]:
        """(An environment's rewards are the trajectories' own: nothing beyond them.)"""
        return {}

    def take_new_errors(self) -> list[str]:
        """The first failure of each kind of environment step since the last call (for errors.log)."""
        return self.failures.take()

    def take_counts(self) -> TurnCounts:
        """The counts since the last call (turns, tool calls and their errors and timeouts,
        environment steps that raised)."""
        out, self.counts = self.counts, TurnCounts()
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def reply_texts(tokenizer, outs: list[Completion], eos_ids: set[int]) -> list[str]:
    """The text each completion is scored on: a conversation's last reply (:attr:`Trajectory.text`),
    else the completion decoded without its end tokens and special tokens."""
    plain = [i for i, o in enumerate(outs) if not isinstance(o, Trajectory)]
    decoded = tokenizer.batch_decode(
        [[t for t in outs[i].token_ids if t not in eos_ids] for i in plain], skip_special_tokens=True
    )
    texts = [o.text if isinstance(o, Trajectory) else "" for o in outs]
    for i, text in zip(plain, decoded, strict=True):
        texts[i] = text
    return texts


def with_conversation(prompt, out):
    """``prompt`` with the conversation of ``out`` as its ``conversation`` column, when ``out`` is a
    :class:`Trajectory`: reward functions that take a ``conversation`` argument see every message
    (the tools' answers too), not only the last reply."""
    if not isinstance(out, Trajectory):
        return prompt
    return dataclasses.replace(prompt, columns={**prompt.columns, "conversation": out.messages})


def turn_end_text(tokenizer, eos_ids: set[int]) -> str:
    """The end-of-turn token the chat template writes after a reply (``<|im_end|>``): the template's
    end of turn (:func:`tba.models.loading.end_of_turn_id`, the one probe of it), which must be one
    of the end tokens (``eos_ids``) for the model's own replies to end where the template's do."""
    found = end_of_turn_id(tokenizer)
    if found is None or found not in eos_ids:
        ends = [tokenizer.convert_ids_to_tokens(i) for i in sorted(eos_ids)]
        raise ToolError(
            f"the chat template does not end a reply with one of the model's end tokens ({', '.join(map(str, ends))}): "
            "a multi-turn conversation cannot be joined to the tokens the model wrote; add the template's "
            "end-of-turn token to model.eos_tokens"
        )
    return tokenizer.convert_ids_to_tokens(found)

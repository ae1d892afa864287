"""The rollouts an endpoint serves: each one's tokens, assembled from the requests that name it.

A chat rollout opens with its first request's messages, rendered by the chat template (the
rollout's prompt). Every later request must repeat the conversation so far (its messages, then
each reply the endpoint gave, in order) and add the messages that came since: those are rendered
the way an environment's are (:func:`tba.environments.environment_text`, marked 0), and the model's
reply is appended as it was generated. A completions rollout works on text or token ids: each
prompt must extend the previous prompt and its completion. Nothing is re-tokenized: the
trajectory is the tokens the engine saw and wrote.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from tba.environments import environment_text
from tba.generation.base import Completion
from tba.generation.turns import Conversation, Trajectory, turn_end_text
from tba.models.loading import chat_ids
from tba.tools import ToolError


class EndpointError(Exception):
    """A request the endpoint refuses: ``status`` (HTTP) and what is wrong and what to do."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Rollout:
    conv: Conversation
    opening: list[int] | None = None  # the prompt's token ids (the first request's)
    chat: bool = True
    tools: list | None = None
    text: str = ""  # the completions API: the prompt and completions so far, as text
    cut: bool = False  # a request past the rollout's budget (turns or tokens): unfinished, not failed
    serving: bool = False  # a request of it is being served
    undo: tuple | None = None  # what it was before the request being served (restored if that fails)
    answer: dict | None = None  # the last chat answer, and how many messages its request had:
    asked: int = 0  # a client's retry of that request (its answer lost on the way) gets it again


def _text(content) -> str:
    """A message's content as text (OpenAI's content parts joined)."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def _same(known: list[dict], sent: list[dict]) -> bool:
    """Whether ``sent`` repeats ``known``: the same roles, and the same text but in the model's own
    replies (which a client sends back in its own form: tool_calls, content null)."""
    return len(known) == len(sent) and all(
        old["role"] == new.get("role")
        and (old["role"] == "assistant" or _text(old.get("content")) == _text(new.get("content")))
        for old, new in zip(known, sent, strict=True)
    )


class RolloutBook:
    """The open rollouts, by id. ``max_turns`` replies and ``max_tokens`` tokens after the prompt
    bound each one, as they bound an environment's conversations."""

    def __init__(self, tokenizer, eos_ids: set[int], max_turns: int, max_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.rollouts: dict[str, Rollout] = {}
        self.lock = threading.Lock()
        self._end_text: str | None = None

    @property
    def end_text(self) -> str:
        if self._end_text is None:
            self._end_text = turn_end_text(self.tokenizer, self.eos_ids)
        return self._end_text

    def open(self, rid: str) -> None:
        with self.lock:
            self.rollouts[rid] = Rollout(Conversation(env=None, messages=[]))

    def active(self) -> int:
        """Rollouts open and not ended: the requests a batch of generation may wait for."""
        with self.lock:
            return sum(1 for r in self.rollouts.values() if not r.conv.done)

    def close(self, rid: str) -> Rollout:
        with self.lock:
            return self.rollouts.pop(rid)

    def _take(self, rid: str) -> Rollout:
        r = self.rollouts.get(rid)
        if r is None:
            raise EndpointError(
                404,
                f"no open rollout {rid!r}: a rollout is open while the searcher's agent call that it was made for "
                "runs; use the base URL the agent was given",
            )
        if r.serving:
            raise EndpointError(409, f"rollout {rid!r} has a request being served: its requests go one at a time")
        if r.conv.done:
            r.cut = True  # the budget ended it (a reply cut at max_tokens, or max_turns): unfinished
            raise EndpointError(400, f"rollout {rid!r} has ended ({self._why_ended(r)}); the conversation cannot go on")
        c = r.conv
        r.undo = (r.opening, r.tools, r.text, r.chat, list(c.messages), len(c.ids))
        return r

    def _why_ended(self, r: Rollout) -> str:
        if r.conv.turns >= self.max_turns:
            return f"it had its task.max_turns={self.max_turns} replies"
        if r.cut:
            return "no room for another reply within task.max_trajectory_tokens or generation.max_new_tokens"
        return "its last reply was cut at max_tokens"

    def render(self, messages: list[dict], tools: list | None) -> list[int]:
        try:
            return chat_ids(self.tokenizer, messages, tools)
        except Exception as e:  # a template that cannot render these messages: the request's problem
            raise EndpointError(400, f"the chat template cannot render these messages: {e}") from None

    def chat_context(self, rid: str, messages: list[dict], tools: list | None, max_new: int) -> tuple[list[int], int]:
        """The token ids the reply is generated after, and its token budget (``max_new`` or less).
        Marks the rollout as being served until :meth:`record`."""
        with self.lock:
            r = self._take(rid)
            if r.opening is None:
                r.opening, r.tools = self.render(messages, tools), tools
                r.conv.messages = [dict(m) for m in messages]
            else:
                if not r.chat:
                    raise EndpointError(400, f"rollout {rid!r} began on /v1/completions: continue it there")
                new = self._new_messages(rid, r, messages, tools)
                try:
                    text = environment_text(r.conv.messages, new, self.tokenizer, self.end_text, r.tools)
                except ToolError as e:
                    raise EndpointError(400, str(e)) from None
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                max_new = self._budget(r, max_new, len(ids))  # before the environment's tokens join
                r.conv.take_environment(new, ids)
            r.serving = True
            return r.opening + r.conv.ids, self._budget(r, max_new, 0)

    def repeated(self, rid: str, messages: list[dict]) -> dict | None:
        """The answer already given to this very request of rollout ``rid`` (a client that did not
        get it retries), else None."""
        with self.lock:
            r = self.rollouts.get(rid)
            if r is None or r.answer is None or r.serving or len(messages) != r.asked:
                return None
            return r.answer if _same(r.conv.messages[: r.asked], messages) else None

    def remember(self, rid: str, answer: dict, asked: int) -> None:
        with self.lock:
            r = self.rollouts.get(rid)
            if r is not None:
                r.answer, r.asked = answer, asked

    def _new_messages(self, rid: str, r: Rollout, messages: list[dict], tools) -> list[dict]:
        if tools != r.tools:
            raise EndpointError(400, f"rollout {rid!r}: the tools changed mid-conversation; send the same tools")
        known = r.conv.messages
        for i, (old, new) in enumerate(zip(known, messages, strict=False)):
            if not _same([old], [new]):
                raise EndpointError(
                    400,
                    f"rollout {rid!r}: message {i} differs from the conversation so far; a rollout's requests repeat "
                    "its earlier messages and replies unchanged and add new ones after them (start a new rollout "
                    "for another conversation)",
                )
        new = [dict(m) for m in messages[len(known) :]]
        if not new:
            raise EndpointError(400, f"rollout {rid!r}: no new message after the last reply")
        if any(m.get("role") == "assistant" for m in new):
            raise EndpointError(
                400, f"rollout {rid!r}: an assistant message the model did not write; only its own replies count"
            )
        return new

    def _budget(self, r: Rollout, max_new: int, adding: int) -> int:
        left = max_new if self.max_tokens is None else min(max_new, self.max_tokens - len(r.conv.ids) - adding)
        if r.conv.turns >= self.max_turns or left < 1:
            r.conv.done = r.cut = True
            raise EndpointError(400, f"this rollout has ended: {self._why_ended(r)}")
        return left

    def completion_context(self, rid: str, prompt: str | list[int], max_new: int) -> tuple[list[int], int]:
        """:meth:`chat_context` for ``/v1/completions``: ``prompt`` text or token ids."""
        with self.lock:
            r = self._take(rid)
            if r.opening is None:
                r.chat = False
                r.opening = list(prompt) if isinstance(prompt, list) else self.tokenizer(prompt)["input_ids"]
                r.text = prompt if isinstance(prompt, str) else ""
            else:
                if r.chat:
                    raise EndpointError(400, f"rollout {rid!r} began on /v1/chat/completions: continue it there")
                so_far = r.opening + r.conv.ids
                if isinstance(prompt, list):
                    if prompt[: len(so_far)] != so_far:
                        raise EndpointError(400, f"rollout {rid!r}: the prompt does not extend its tokens so far")
                    tail = prompt[len(so_far) :]
                else:
                    if not prompt.startswith(r.text):
                        raise EndpointError(
                            400, f"rollout {rid!r}: the prompt does not extend its prompt and completions so far"
                        )
                    tail = self.tokenizer.encode(prompt[len(r.text) :], add_special_tokens=False)
                    r.text = prompt
                max_new = self._budget(r, max_new, len(tail))
                r.conv.take_environment([], tail)
            r.serving = True
            return r.opening + r.conv.ids, self._budget(r, max_new, 0)

    def record(self, rid: str, out: Completion | None, reply_text: str = "") -> None:
        """The reply generated for the request being served (None: generation failed)."""
        with self.lock:
            r = self.rollouts.get(rid)
            if r is None:
                return
            r.serving = False
            if out is None:  # generation failed: as before the request, which may be sent again
                if r.undo is not None:
                    r.opening, r.tools, r.text, r.chat, r.conv.messages, n = r.undo
                    del r.conv.ids[n:], r.conv.mask[n:], r.conv.logps[n:]
                return
            r.conv.take_reply(out, self.tokenizer, self.eos_ids)
            if r.chat:
                r.conv.messages.append({"role": "assistant", "content": r.conv.last_reply})
                if not out.finished:  # no end-of-turn token: the template cannot join another turn
                    r.conv.done = True
            else:
                r.text += reply_text
            if r.conv.turns >= self.max_turns:
                r.conv.done = True

    def trajectory(self, r: Rollout, reward: float | None, failed: bool, logprobs: bool) -> Trajectory:
        """A closed rollout as the searcher's trajectory: finished when its agent returned and its
        last reply ended with an end token; failed (dropped, counted) when the agent raised or made
        no request, unless the rollout had run out of its budget (then unfinished)."""
        conv = r.conv
        last_finished = bool(conv.ids) and conv.mask[-1] == 1 and conv.ids[-1] in self.eos_ids
        conv.failed = (failed and not r.cut) or r.opening is None or conv.turns == 0
        conv.finished = not failed and not r.cut and last_finished
        conv.reward = reward
        return conv.trajectory(self.tokenizer, logprobs)

"""OpenEnv environments (``task.environment: openenv:<url>``) as tba environments.

An OpenEnv environment is a server (its ``create_app``) that speaks ``reset`` / ``step`` /
``state`` over a WebSocket. Each conversation opens a session of its own on the server
(``openenv.core.GenericEnvClient``, actions and observations as plain dicts), and
:class:`OpenEnvEnvironment` maps the conversation onto it:

- ``reset(prompt)``: ``reset(seed=...)`` on the server, the seed drawn from the prompt's id (the
  conversations of a group open alike), with the prompt's text as ``prompt=`` when
  ``reset_with_prompt``. The opening messages are the prompt's, then the observation's text
  (``observation_field``) as a user message, when it has one.
- ``step(messages)``: the model's last reply as the action (``{action_field: reply}``); the
  observation's text comes back as the next user message until the server says ``done``. The
  conversation's reward is the sum of the steps' rewards (``reward: last`` for the last one).

A server that fails mid-conversation (gone, or an error answered) ends that conversation: dropped
and counted in ``searcher/environment_errors``, never the run. A server that does not answer at
start is refused in one line.
"""

from __future__ import annotations

import hashlib
import urllib.error
import urllib.request
from typing import Any

from tba.tools import ToolError

PREFIX = "openenv:"
INSTALL = "pip install 'tba[openenv]'"
_CHECKED: set[str] = set()
TEXT_FIELDS = ("prompt", "message", "text", "content", "observation", "feedback")


def import_openenv():
    try:
        from openenv.core import GenericEnvClient
    except ImportError as err:
        raise ToolError(f"task.environment openenv:...: needs the openenv-core package ({err}); {INSTALL}") from None
    return GenericEnvClient


def check_server(url: str, timeout_s: float = 5.0) -> None:
    """A :class:`ToolError` in one line unless an OpenEnv server answers ``/health`` at ``url``."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as answer:
            if answer.status == 200:
                return
            why = f"HTTP {answer.status}"
    except urllib.error.HTTPError as e:
        why = f"HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        why = str(getattr(e, "reason", e))
    raise ToolError(
        f"task.environment {PREFIX}{url}: no OpenEnv server answers there ({why}); start the environment's server "
        "(its create_app under uvicorn, or its container) and give its base URL"
    )


class OpenEnvEnvironment:
    """One OpenEnv session: a conversation's environment (see the module docstring)."""

    def __init__(
        self,
        url: str,
        action_field: str = "message",
        observation_field: str | None = None,
        reward: str = "sum",
        reset_with_prompt: bool = False,
        reset_args: dict | None = None,
        timeout_s: float = 60.0,
    ):
        if reward not in ("sum", "last"):
            raise ToolError(f"task.environment_args.reward: 'sum' or 'last', got {reward!r}")
        self.url, self.action_field, self.observation_field = url, action_field, observation_field
        self.reward_mode, self.reset_with_prompt = reward, reset_with_prompt
        self.reset_args = dict(reset_args or {})
        self.timeout_s = timeout_s
        self.client = None
        self.total = 0.0

    async def reset(self, prompt) -> list[dict]:
        client_cls = import_openenv()
        self.client = client_cls(base_url=self.url, message_timeout_s=self.timeout_s)
        seed = int.from_bytes(hashlib.sha256(prompt.id.encode()).digest()[:4], "little")
        args = {"seed": seed, **self.reset_args}
        if self.reset_with_prompt:
            args["prompt"] = prompt.text
        result = await self.client.reset(**args)
        self.total = 0.0
        opening = [dict(m) for m in prompt.messages] if prompt.messages is not None else []
        if not opening and prompt.text:
            opening = [{"role": "user", "content": prompt.text}]
        text = self._text(result.observation)
        if text and text != prompt.text:
            opening.append({"role": "user", "content": text})
        return opening

    async def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        result = await self.client.step({self.action_field: messages[-1]["content"]})
        reward = None
        if result.reward is not None:
            self.total = self.total + float(result.reward) if self.reward_mode == "sum" else float(result.reward)
            reward = self.total
        if result.done:
            await self.close()
            return [], reward, True
        text = self._text(result.observation)
        return ([{"role": "user", "content": text}] if text else []), reward, False

    def _text(self, observation: dict[str, Any]) -> str:
        if self.observation_field is not None:
            value = observation.get(self.observation_field)
            if value is None:
                raise KeyError(
                    f"the OpenEnv observation has no {self.observation_field!r} (task.environment_args."
                    f"observation_field); it has {sorted(observation)}"
                )
            return str(value)
        return next((str(observation[k]) for k in TEXT_FIELDS if isinstance(observation.get(k), str)), "")

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()


def make_openenv(spec: str, **kwargs) -> OpenEnvEnvironment:
    """The environment ``openenv:<url>`` names, its server checked."""
    import_openenv()
    url = spec[len(PREFIX) :]
    if not url.startswith(("http://", "https://")):
        raise ToolError(f"task.environment {spec!r}: give the server's base URL, openenv:http://host:port")
    if url not in _CHECKED:  # once per process, not once per conversation
        check_server(url)
        _CHECKED.add(url)
    try:
        return OpenEnvEnvironment(url, **kwargs)
    except TypeError as e:
        raise ToolError(f"task.environment_args for {spec}: {e}") from None

"""The HTTP side: an OpenAI-compatible app over a :class:`~tba.endpoint.book.RolloutBook` and a
:class:`~tba.endpoint.queue.GenerationQueue`, served by uvicorn on a thread of the searcher.

vLLM's own OpenAI server (``OpenAIServingChat``) needs an asynchronous engine client; a searcher
holds vLLM's offline ``LLM`` engine (and HF ``generate`` has none), so both backends are served by
this one thin app over the searcher's :class:`~tba.generation.base.Generator`: one engine, its
batches shared by every request that waits together."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from tba.endpoint.book import EndpointError, RolloutBook
from tba.endpoint.queue import GenerationQueue
from tba.errors import MissingDependency
from tba.generation.base import Completion, SamplingParams
from tba.tools import FORMATS, ToolError, parse_tool_calls, tool_call_format, without_tool_calls

try:  # at module level: the handlers' annotations are resolved in this module's globals
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
except ImportError:  # said when an endpoint is started (Endpoint)
    FastAPI = Request = JSONResponse = None

INSTALL = "pip install 'tba[agents]'"


def require_extras(what: str = "task.agent") -> None:
    """Raise :class:`MissingDependency` naming the extra unless the endpoint's packages import."""
    import importlib

    for module in ("fastapi", "uvicorn", "openai"):
        try:
            importlib.import_module(module)
        except ImportError:
            raise MissingDependency(
                f"{what}: the searcher's OpenAI-compatible endpoint needs {module}, which is not installed; {INSTALL}"
            ) from None


def _field(body: dict, key: str, kind, default=None):
    value = body.get(key, default)
    if value is not None and not isinstance(value, kind):
        raise EndpointError(400, f"{key} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


class Endpoint:
    """``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models`` on ``host`` (a free port),
    for requests to ``queue``'s generator. ``params()``: the rollouts' sampling settings (the run's:
    a request's temperature and top_p are its own only outside a rollout; its max_tokens can lower
    the budget); ``version()``: the weights version the generator holds, reported with each
    answer."""

    def __init__(
        self,
        book: RolloutBook,
        queue: GenerationQueue,
        params: Callable[[], SamplingParams],
        version: Callable[[], int],
        model_name: str = "tba-policy",
        host: str = "127.0.0.1",
    ):
        require_extras()
        import uvicorn

        self.book, self.queue, self.params, self.version = book, queue, params, version
        self.model_name = model_name
        self.tool_format: str | None = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.host, self.port = self.sock.getsockname()[:2]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name="tba-endpoint", daemon=True
        )
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.01)
        if not self.server.started:
            raise RuntimeError(f"the endpoint on {self.host}:{self.port} did not start")

    @property
    def url(self) -> str:
        """The base URL of requests outside any rollout."""
        return f"http://{self.host}:{self.port}/v1"

    def rollout_url(self, rid: str) -> str:
        """The base URL whose requests belong to rollout ``rid``."""
        return f"http://{self.host}:{self.port}/rollouts/{rid}/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def app(self):
        app = FastAPI(title="tba searcher endpoint")

        @app.exception_handler(EndpointError)
        async def refused(_, e: EndpointError):
            kind = "invalid_request_error" if e.status < 500 else "server_error"
            return JSONResponse({"error": {"message": e.message, "type": kind, "code": e.status}}, e.status)

        async def body_of(request: Request) -> dict:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise EndpointError(400, "the request body is not JSON") from None
            if not isinstance(body, dict):
                raise EndpointError(400, "the request body must be a JSON object")
            if body.get("stream"):
                raise EndpointError(400, "streamed answers are not served: set stream=false")
            if body.get("stop"):
                raise EndpointError(400, "stop sequences are not served: a reply ends at the model's end-of-turn token")
            return body

        @app.get("/v1/models")
        @app.get("/rollouts/{rid}/v1/models")
        async def models(rid: str | None = None):
            return {"object": "list", "data": [self._model_card()]}

        @app.post("/v1/chat/completions")
        @app.post("/rollouts/{rid}/v1/chat/completions")
        async def chat(request: Request, rid: str | None = None):
            return await self.chat(await body_of(request), rid)

        @app.post("/v1/completions")
        @app.post("/rollouts/{rid}/v1/completions")
        async def completions(request: Request, rid: str | None = None):
            return await self.completions(await body_of(request), rid)

        return app

    def _model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "owned_by": "tba",
            "created": 0,
            "weights_version": self.version(),
        }

    def _sampling(self, body: dict, rid: str | None) -> SamplingParams:
        run = self.params()
        max_new = _field(body, "max_completion_tokens", int) or _field(body, "max_tokens", int)
        if max_new is not None and max_new < 1:
            raise EndpointError(400, f"max_tokens must be at least 1, got {max_new}")
        n = _field(body, "n", int, 1)
        logprobs = bool(body.get("logprobs"))
        if rid is not None:  # the run's sampling: what the trajectory is trained as
            if n != 1:
                raise EndpointError(400, "a rollout's request takes n=1 (each rollout is one conversation)")
            return replace(
                run,
                n=1,
                max_new_tokens=min(max_new or run.max_new_tokens, run.max_new_tokens),
                logprobs=run.logprobs or logprobs,
            )
        temperature = _field(body, "temperature", (int, float), 1.0)
        return SamplingParams(
            n=n,
            temperature=max(float(temperature), 1e-5),
            top_p=float(_field(body, "top_p", (int, float), 1.0)),
            max_new_tokens=max_new or run.max_new_tokens,
            greedy=temperature == 0,
            logprobs=logprobs,
        )

    async def _generate(self, ids: list[int], params: SamplingParams) -> tuple[list[Completion], int]:
        version = self.version()
        try:
            return await asyncio.wrap_future(self.queue.submit(ids, params)), version
        except Exception as e:
            raise EndpointError(500, f"generation failed: {type(e).__name__}: {e}") from None

    async def chat(self, body: dict, rid: str | None) -> dict:
        rid = rid or _field(body, "rollout_id", str)
        messages = _field(body, "messages", list)
        if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise EndpointError(400, "messages must be a non-empty list of {role, content} objects")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]  # unset fields, as absent
        tools = _field(body, "tools", list) or None
        if rid is not None and (again := self.book.repeated(rid, messages)) is not None:
            return again
        params = self._sampling(body, rid)
        if rid is None:
            ids, budget = self.book.render(messages, tools), params.max_new_tokens
        else:
            ids, budget = self.book.chat_context(rid, messages, tools, params.max_new_tokens)
        outs, version = await self._recorded(rid, ids, replace(params, max_new_tokens=budget))
        choices = []
        for i, out in enumerate(outs):
            text = self._completion_text(out)
            message, finish = {"role": "assistant", "content": text}, "stop" if out.finished else "length"
            calls = self._tool_calls(out, tools) if tools else []
            if calls:
                message["tool_calls"], finish = calls, "tool_calls"
                message["content"] = without_tool_calls(text) or None
            choice = {"index": i, "message": message, "finish_reason": finish}
            if body.get("logprobs"):
                choice["logprobs"] = {"content": self._logprob_list(out)}
            if body.get("return_token_ids"):
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        answer = self._answer("chat.completion", body, ids, outs, choices, version)
        if rid is not None:
            self.book.remember(rid, answer, len(messages))
        return answer

    async def completions(self, body: dict, rid: str | None) -> dict:
        rid = rid or _field(body, "rollout_id", str)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise EndpointError(400, "prompt must be one non-empty string or one list of token ids")
        params = self._sampling(body, rid)
        if rid is None:
            ids = list(prompt) if ok_ids else self.book.tokenizer(prompt)["input_ids"]
            budget = params.max_new_tokens
        else:
            ids, budget = self.book.completion_context(rid, prompt, params.max_new_tokens)
        outs, version = await self._recorded(rid, ids, replace(params, max_new_tokens=budget), chat=False)
        choices = []
        for i, out in enumerate(outs):
            choice = {
                "index": i,
                "text": self._completion_text(out),
                "finish_reason": "stop" if out.finished else "length",
            }
            if body.get("logprobs") is not None and body.get("logprobs") is not False:
                tokens = self._token_texts(out)
                choice["logprobs"] = {
                    "tokens": tokens,
                    "token_logprobs": list(out.token_logps or []),
                    "top_logprobs": [None] * len(tokens),
                    "text_offset": [0, *itertools.accumulate(len(t) for t in tokens[:-1])] if tokens else [],
                }
            if body.get("return_token_ids"):
                choice["prompt_token_ids"], choice["token_ids"] = list(ids), list(out.token_ids)
            choices.append(choice)
        return self._answer("text_completion", body, ids, outs, choices, version)

    def _completion_text(self, out: Completion) -> str:
        return self.book.tokenizer.decode(
            [t for t in out.token_ids if t not in self.book.eos_ids], skip_special_tokens=True
        )

    async def _recorded(self, rid, ids, params, chat: bool = True) -> tuple[list[Completion], int]:
        """The completions of ``ids``; with a rollout, its reply recorded (or its request released)."""
        out = None
        try:
            outs, version = await self._generate(ids, params)
            out = outs[0]
            return outs, version
        finally:
            if rid is not None:
                text = "" if chat or out is None else self._completion_text(out)
                self.book.record(rid, out, text)

    def _answer(self, kind: str, body: dict, ids, outs, choices, version: int) -> dict:
        completion_tokens = sum(len(o.token_ids) for o in outs)
        answer = {
            "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(ids) + completion_tokens,
            },
            "weights_version": version,
        }
        if body.get("return_token_ids") and kind == "chat.completion":
            answer["prompt_token_ids"] = list(ids)
        return answer

    def _token_texts(self, out: Completion) -> list[str]:
        """Each generated token's own text."""
        return [self.book.tokenizer.decode([t]) for t in out.token_ids]

    def _logprob_list(self, out: Completion) -> list[dict]:
        logps = out.token_logps or [0.0] * len(out.token_ids)
        tokens = self._token_texts(out)
        return [
            {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
            for token, lp in zip(tokens, logps, strict=True)
        ]

    def _tool_calls(self, out: Completion, tools: list) -> list[dict]:
        """The reply's tool calls in OpenAI's form, read in the chat template's format (calls that
        cannot be read stay in the content, for the agent to see)."""
        if self.tool_format is None:
            try:
                self.tool_format = tool_call_format(self.book.tokenizer)
            except ToolError:  # a template without a tool-call format tba reads: the calls stay text
                self.tool_format = ""
        if self.tool_format not in FORMATS:
            return []
        text = self.book.tokenizer.decode(
            [t for t in out.token_ids if t not in self.book.eos_ids], skip_special_tokens=False
        )
        calls = parse_tool_calls(text, self.tool_format, None)
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
            if c.error is None
        ]

"""Tools as plain Python functions: loading them, finding a chat template's tool-call format,
reading the calls a completion makes, and running them.

A tool is a function with type hints and a Google-style docstring (``Args:``), the convention of
transformers' ``apply_chat_template(..., tools=[fn])``, which renders its JSON schema into the
prompt in the model's own way. What the model writes back depends on its template:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
  (Qwen2.5, Qwen3, Hermes and the many templates that copied them);
- ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}`` (Llama 3.1-3.3's JSON tool
  calling; an optional ``<|python_tag|>`` before it), one call per message;
- ``mistral``: ``[TOOL_CALLS]`` and a JSON list of ``{"name": ..., "arguments": {...}}``.

:func:`tool_call_format` reads the format from the chat template, and :func:`parse_tool_calls`
reads the calls out of a completion's text. A call that cannot be read
(broken JSON, an unknown tool, arguments the function does not take) becomes a
:class:`ToolCall` with ``error`` set: the searcher answers it with a tool message saying what is
wrong and counts it, as it counts a tool that raises or runs past its timeout
(:func:`run_tool`). Nothing a tool or a model does ends a run. A tool may be ``async def``
(:func:`tba.user_code.call`).
"""

from __future__ import annotations

import inspect
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tba.errors import UserError
from tba.user_code import call as call_user
from tba.user_code import load_object

FORMATS = ("hermes", "llama3", "mistral")
# each format's opening marker, where its calls start in a reply (and in a chat template)
HERMES_OPEN, HERMES_CLOSE, MISTRAL_OPEN, LLAMA3_OPEN = "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"


class ToolError(UserError, ValueError):
    """A tool list or a model that cannot serve tool use, said at start."""


@dataclass
class ToolCall:
    """One call read from a completion: ``name`` and ``arguments``, or ``error`` (what could not be
    read) with whatever of the call was readable."""

    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class ToolResult:
    """What a call returned, as the text of a tool message, and how it went: ``"ok"``,
    ``"error"`` (the call could not be read, or the tool raised) or ``"timeout"``."""

    name: str | None
    content: str
    status: str = "ok"


def load_tools(specs: list[str] | list[Callable], base: str | Path | None = None) -> list[Callable]:
    """The functions ``"module:function"`` or ``"file.py:function"`` names (:mod:`tba.user_code`, relative
    to ``base``), or the functions themselves, each checked to
    have what a chat template needs: type hints for every argument and a docstring that describes
    them (transformers' ``get_json_schema``)."""
    from transformers.utils import get_json_schema

    tools, names = [], set()
    for spec in specs:
        fn = load_object(spec, "task.tools", ToolError, base) if isinstance(spec, str) else spec
        if not callable(fn):
            raise ToolError(f"task.tools: {spec!r} is not a function")
        try:
            get_json_schema(fn)
        except Exception as e:  # transformers raises its own exception types for each missing piece
            raise ToolError(
                f"task.tools: {getattr(fn, '__name__', spec)!r} cannot be described to the model: {e}. A tool needs "
                "type hints on every argument and a docstring with an Args: section describing each one"
            ) from None
        if fn.__name__ in names:
            raise ToolError(f"task.tools: two tools are named {fn.__name__!r}; the model calls tools by name")
        names.add(fn.__name__)
        tools.append(fn)
    return tools


def tool_call_format(tokenizer) -> str:
    """The tool-call format of ``tokenizer``'s chat template (one of :data:`FORMATS`). A template
    that renders no tools, or writes calls in a format not known here, is refused with what to do."""
    template = tokenizer.chat_template if isinstance(getattr(tokenizer, "chat_template", None), str) else None
    if isinstance(getattr(tokenizer, "chat_template", None), dict):
        template = tokenizer.chat_template.get("tool_use") or tokenizer.chat_template.get("default")
    if not template:
        raise ToolError(
            "task.tools: the tokenizer has no chat template, so the model has no way to see tools or call them; "
            "use a chat model whose template supports tools (e.g. Qwen2.5-0.5B-Instruct)"
        )
    if "tools" not in template:
        raise ToolError(
            "task.tools: the model's chat template never renders `tools`, so it has no tool-call format; use a "
            "chat model whose template supports tools (e.g. Qwen2.5-0.5B-Instruct)"
        )
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_OPEN in template:
        return "mistral"
    if LLAMA3_OPEN in template or ('"parameters"' in template and "ipython" in template):
        return "llama3"
    raise ToolError(
        "task.tools: the chat template renders tools, but its tool-call format is not one tba reads "
        f"({', '.join(FORMATS)})"
    )


_HERMES = re.compile(rf"{re.escape(HERMES_OPEN)}\s*(.*?)\s*(?:{re.escape(HERMES_CLOSE)}|$)", re.S)
# the calls' blocks of every format: what a reply's text is without them
_BLOCKS = re.compile(
    rf"{re.escape(HERMES_OPEN)}.*?(?:{re.escape(HERMES_CLOSE)}|$)|{re.escape(MISTRAL_OPEN)}.*|{re.escape(LLAMA3_OPEN)}.*",
    re.S,
)


def without_tool_calls(text: str) -> str:
    """``text`` with the tool calls of any format taken out (a reply's content beside its calls)."""
    return _BLOCKS.sub("", text).strip()


def parse_tool_calls(text: str, fmt: str, tools: list[Callable] | None) -> list[ToolCall]:
    """The calls in ``text`` (a completion, decoded with special tokens kept), in order; none for
    an answer that calls nothing. ``tools``: the functions the model may call, to check names and
    arguments against (None: unchecked, for tools that are only schemas)."""
    if fmt == "hermes":
        raw = [_json_call(block, "arguments") for block in _HERMES.findall(text)]
    elif fmt == "mistral":
        raw = _mistral_calls(text)
    elif fmt == "llama3":
        raw = _llama3_calls(text)
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}: one of {FORMATS}")
    if tools is None:
        return raw
    by_name = {fn.__name__: fn for fn in tools}
    return [_checked(call, by_name) for call in raw]


def _json_call(text: str, key: str) -> ToolCall:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    return _call_from(obj, key)


def _call_from(obj, key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, error='a tool call must be a JSON object with a "name"')
    args = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(obj["name"], error=f"the arguments of {obj['name']} are not a JSON object")
    if not isinstance(args, dict):
        return ToolCall(obj["name"], error=f"the arguments of {obj['name']} are not a JSON object")
    return ToolCall(obj["name"], args)


def _mistral_calls(text: str) -> list[ToolCall]:
    at = text.find(MISTRAL_OPEN)
    if at < 0:
        return []
    body = text[at + len(MISTRAL_OPEN) :].strip()
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return [ToolCall(None, error=f"the tool calls are not valid JSON ({e.msg} at character {e.pos})")]
    return [_call_from(o, "arguments") for o in (obj if isinstance(obj, list) else [obj])]


def _llama3_calls(text: str) -> list[ToolCall]:
    body = text.split(LLAMA3_OPEN, 1)[1] if LLAMA3_OPEN in text else text
    body = body.strip()
    if not body.startswith("{"):
        return []  # prose: an answer, not a call
    try:
        obj, _ = json.JSONDecoder().raw_decode(body)
    except json.JSONDecodeError as e:
        return [ToolCall(None, error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")]
    return [_call_from(obj, "parameters")]


def _checked(call: ToolCall, by_name: dict[str, Callable]) -> ToolCall:
    if call.error is not None:
        return call
    fn = by_name.get(call.name)
    if fn is None:
        return ToolCall(call.name, call.arguments, f"there is no tool {call.name!r}; the tools are {sorted(by_name)}")
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as e:
        return ToolCall(call.name, call.arguments, f"bad arguments for {call.name}: {e}")
    return call


def run_tool(call: ToolCall, tools: list[Callable], timeout: float | None = None) -> ToolResult:
    """Run one call: its result as text (``str()``; JSON for dicts and lists), or, for a call that
    could not be read, a tool that raised or one still running after ``timeout`` seconds, a
    message saying so (status ``"error"`` or ``"timeout"``), which goes back to the model like any
    result. A tool that hangs is left running on its daemon thread: Python cannot stop it."""
    if call.error is not None:
        return ToolResult(call.name, f"error: {call.error}", "error")
    fn = {f.__name__: f for f in tools}[call.name]
    box: dict = {}

    def target():
        try:
            box["value"] = call_user(fn, **call.arguments)
        except Exception as e:  # noqa: BLE001 - a tool's failure is the model's to see, not the run's
            box["error"] = f"{type(e).__name__}: {e}"

    worker = threading.Thread(target=target, name=f"tba-tool-{call.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return ToolResult(call.name, f"error: {call.name} did not answer within {timeout:g} s", "timeout")
    if "error" in box:
        return ToolResult(call.name, f"error: {box['error']}", "error")
    value = box.get("value")
    content = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return ToolResult(call.name, content)

"""Tools as Python functions (``tba.tools``): loading and describing them, reading tool calls in
each chat-template format, running them with errors and timeouts turned into tool messages."""

from __future__ import annotations

import json
import threading

import pytest
from tests.helpers.templates import HERMES_TEMPLATE, LLAMA3_TEMPLATE, chat_tokenizer
from tests.helpers.tools import divide, lookup, multiply, slow

from tba.models.tiny import build_char_tokenizer
from tba.tools import ToolCall, ToolError, load_tools, parse_tool_calls, run_tool, tool_call_format


def undocumented(a: int) -> int:
    return a


TOOLS = [multiply, divide, lookup]


def test_tools_load_by_name_and_need_hints_and_docstrings():
    loaded = load_tools(["tests.helpers.tools:multiply", divide])
    assert [fn.__name__ for fn in loaded] == ["multiply", "divide"] and loaded[0](3, 4) == 12
    with pytest.raises(ToolError, match="'undocumented' cannot be described.*docstring"):
        load_tools([undocumented])
    with pytest.raises(ToolError, match="'tests.helpers.tools.multiply' is malformed; write 'pkg.module:name'"):
        load_tools(["tests.helpers.tools.multiply"])
    with pytest.raises(ToolError, match="task.tools 'no_such_module:f': cannot import module 'no_such_module'"):
        load_tools(["no_such_module:f"])
    with pytest.raises(ToolError, match="has no attribute 'nope'; it defines: .*multiply"):
        load_tools(["tests.helpers.tools:nope"])
    with pytest.raises(ToolError, match="two tools are named 'multiply'"):
        load_tools([multiply, multiply])


@pytest.mark.parametrize("template,fmt", [(HERMES_TEMPLATE, "hermes"), (LLAMA3_TEMPLATE, "llama3")])
def test_the_template_renders_the_tools_and_names_its_format(template, fmt):
    tokenizer = chat_tokenizer(template)
    assert tool_call_format(tokenizer) == fmt
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "what is 123 * 456?"}], tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert '"name": "multiply"' in text and '"description": "the second factor"' in text
    assert text.index("what is 123 * 456?") > text.index('"name": "lookup"')


def test_models_that_cannot_call_tools_are_refused_at_start():
    with pytest.raises(ToolError, match="no chat template"):
        tool_call_format(build_char_tokenizer())
    with pytest.raises(ToolError, match="never renders `tools`"):
        tool_call_format(chat_tokenizer("{% for m in messages %}{{ m.content }}{% endfor %}"))
    with pytest.raises(ToolError, match="not one tba reads"):
        template = "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
        tool_call_format(chat_tokenizer(template))


def test_hermes_calls_are_read_in_order_with_what_is_wrong_said():
    text = (
        'I will compute. <tool_call>\n{"name": "multiply", "arguments": {"a": 123, "b": 456}}\n</tool_call>'
        '<tool_call>{"name": "divide", "arguments": "{\\"a\\": 1, \\"b\\": 4}"}</tool_call>'
    )
    calls = parse_tool_calls(text, "hermes", TOOLS)
    assert calls == [ToolCall("multiply", {"a": 123, "b": 456}), ToolCall("divide", {"a": 1, "b": 4})]
    assert parse_tool_calls("The answer is 56088.", "hermes", TOOLS) == []
    (broken,) = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": {"a": 1,</tool_call>', "hermes", TOOLS)
    assert broken.error.startswith("the tool call is not valid JSON")
    (cut,) = parse_tool_calls('<tool_call>{"name": "multiply"', "hermes", TOOLS)  # cut at the token limit
    assert "not valid JSON" in cut.error
    (unknown,) = parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>', "hermes", TOOLS)
    assert unknown.error == "there is no tool 'add'; the tools are ['divide', 'lookup', 'multiply']"
    (bad,) = parse_tool_calls('<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>', "hermes", TOOLS)
    assert bad.name == "multiply" and "bad arguments for multiply" in bad.error and "'b'" in bad.error


def test_llama3_and_mistral_calls_are_read():
    assert parse_tool_calls('{"name": "multiply", "parameters": {"a": 2, "b": 3}}', "llama3", TOOLS) == [
        ToolCall("multiply", {"a": 2, "b": 3})
    ]
    tagged = '<|python_tag|>{"name": "lookup", "parameters": {"key": "x"}}<|eom_id|>'
    assert parse_tool_calls(tagged, "llama3", TOOLS) == [ToolCall("lookup", {"key": "x"})]
    assert parse_tool_calls("It is 6.", "llama3", TOOLS) == []
    (broken,) = parse_tool_calls('{"name": "multiply", "parameters": {"a": 2', "llama3", TOOLS)
    assert "not valid JSON" in broken.error
    mistral = (
        '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 2, "b": 3}}, '
        '{"name": "lookup", "arguments": {"key": "k"}}]'
    )
    assert parse_tool_calls(mistral, "mistral", TOOLS) == [
        ToolCall("multiply", {"a": 2, "b": 3}),
        ToolCall("lookup", {"key": "k"}),
    ]
    with pytest.raises(ValueError, match="unknown tool-call format"):
        parse_tool_calls("", "xml", TOOLS)


def test_tools_run_and_their_failures_become_tool_messages():
    assert run_tool(ToolCall("multiply", {"a": 123, "b": 456}), TOOLS).content == "56088"
    record = run_tool(ToolCall("lookup", {"key": "abc"}), TOOLS)
    assert json.loads(record.content) == {"key": "abc", "value": 3} and record.status == "ok"
    failed = run_tool(ToolCall("divide", {"a": 1, "b": 0}), TOOLS)
    assert failed.status == "error" and failed.content == "error: ZeroDivisionError: division by zero"
    unread = run_tool(ToolCall(None, error="the tool call is not valid JSON"), TOOLS)
    assert unread.status == "error" and unread.content == "error: the tool call is not valid JSON"
    gate = threading.Event()

    def blocked() -> str:
        """Answer once the test lets it (never within the timeout)."""
        gate.wait(60)  # (a guard against a stuck test only)
        return "done"

    try:
        late = run_tool(ToolCall("blocked", {}), [blocked], timeout=0.2)
        assert late.status == "timeout" and "did not answer within 0.2 s" in late.content
        # given up at the timeout, not waited for: the tool still runs, blocked, on its own thread
        (running,) = [t for t in threading.enumerate() if t.name == "tba-tool-blocked"]
        assert running.is_alive() and running.daemon
    finally:
        gate.set()
    running.join(60)
    assert not running.is_alive()
    assert run_tool(ToolCall("slow", {"seconds": 0.0}), [slow], timeout=60.0).content == "done"

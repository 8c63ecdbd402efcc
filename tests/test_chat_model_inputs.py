"""PatchKVChatModel at its input boundary: a forced tool call cut off at any length is an
``invalid_tool_calls`` entry with ``finish_reason="length"``; malformed tool schemas and ``tool_choice``
values raise a ValueError / TypeError naming the problem; ``json_mode`` works without a schema.

On the tiny random llama and char-level tokenizer of ``tiny_models.chat_engine`` (no downloads).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal

import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import chat_engine  # noqa: E402

from patchkv_agent.langgraph import PatchKVChatModel  # noqa: E402
from patchkv_agent.langgraph.tools import TOOL_CALL_OPEN, parse_tool_calls  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@tool
def paint(color: Literal["red", "blue"]) -> str:
    """Paint the wall."""
    return color


@tool
def lookup(city: str) -> str:
    """Look a city up."""
    return city


@pytest.fixture(scope="module")
def model():
    return PatchKVChatModel(engine=chat_engine(), max_tokens=120)


def test_a_forced_call_cut_at_every_length_is_an_invalid_call(model):
    bound = model.bind_tools([paint], tool_choice="any")
    msgs = [HumanMessage("paint it")]
    full = bound.invoke(msgs)
    assert full.response_metadata["finish_reason"] == "tool_calls" and not full.invalid_tool_calls
    assert [c["name"] for c in full.tool_calls] == ["paint"] and full.tool_calls[0]["args"]["color"] in ("red", "blue")
    n = full.usage_metadata["output_tokens"] - 1  # the call's tokens (one a character), then EOS
    assert n >= len(TOOL_CALL_OPEN) + 10
    at_n = bound.invoke(msgs, max_tokens=n)  # the whole call, no EOS: complete, so a call
    assert at_n.tool_calls[0]["args"] == full.tool_calls[0]["args"] and not at_n.invalid_tool_calls
    for k in range(0, n):  # every cut point of the call: inside the tag, the name, the arguments, the closing tag
        cut = bound.invoke(msgs, max_tokens=k)
        assert cut.usage_metadata["output_tokens"] == k
        assert cut.response_metadata["finish_reason"] == "length", k
        assert cut.tool_calls == [], k
        assert len(cut.invalid_tool_calls) == 1, (k, cut.content, cut.invalid_tool_calls)
        assert "cut off by the token limit" in cut.invalid_tool_calls[0]["error"]
        assert cut.content == "", (k, cut.content)
    # streaming agrees with invoke at a cut inside the opening tag and one inside the arguments
    for k in (5, n - 3):
        chunks = list(bound.stream(msgs, max_tokens=k))
        total = chunks[0]
        for c in chunks[1:]:
            total = total + c
        assert total.response_metadata["finish_reason"] == "length" and total.tool_calls == []
        assert len(total.invalid_tool_calls) == 1 and total.content == ""


def test_a_cut_inside_the_opening_tag_is_an_invalid_call_for_the_parser():
    for k in range(2, len(TOOL_CALL_OPEN)):
        out = parse_tool_calls("Let me check. " + TOOL_CALL_OPEN[:k], ["lookup"], bare=False, truncated=True)
        assert out.content == "Let me check." and out.tool_calls == []
        assert [c["args"] for c in out.invalid_tool_calls] == [TOOL_CALL_OPEN[:k]]
    # not cut off: a "<t" at the end is text
    assert parse_tool_calls("a <t", ["lookup"], bare=False).content == "a <t"


@pytest.mark.parametrize("tools,exc,match", [
    ("lookup", TypeError, r"tools must be a list"),
    ({"type": "function", "function": {"name": "x"}}, TypeError, r"tools must be a list"),
    ([[1, 2]], TypeError, r"tools\[0\] must be a LangChain tool.*list"),
    (["lookup"], TypeError, r"tools\[0\] must be a LangChain tool.*str"),
    ([3], TypeError, r"tools\[0\] must be a LangChain tool.*int"),
    ([{"type": "function", "function": {"name": "x", "parameters": [1, 2]}}], TypeError,
     r"tools\[0\] \(x\): 'parameters' must be a JSON schema dict.*list"),
    ([{"type": "function", "function": {"name": "x", "parameters": "str"}}], TypeError,
     r"'parameters' must be a JSON schema dict.*str"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": [1]}}}],
     TypeError, r"'parameters.properties' must map"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "required": "a"}}}],
     TypeError, r"'parameters.required' must be a list"),
    ([{"type": "function", "function": "x"}], TypeError, r"'function' must be a dict"),
    ([{"type": "function", "function": {"name": 3}}], TypeError, r"tool name must be a string"),
    ([{"type": "function", "function": {"name": " "}}], ValueError, r"tool name is empty"),
])
def test_malformed_tool_schemas_raise_naming_the_problem(model, tools, exc, match):
    with pytest.raises(exc, match=match) as e:
        model.bind_tools(tools)
    assert "\n" not in str(e.value)
    with pytest.raises(exc, match=match):  # the same at call time (tools passed to invoke)
        model.invoke([HumanMessage("hi")], tools=tools, max_tokens=1)


@pytest.mark.parametrize("choice,exc,match", [
    ({"function": 3}, TypeError, r"tool_choice\['function'\] must be a dict.*int"),
    ({"function": "lookup"}, TypeError, r"tool_choice\['function'\] must be a dict.*str"),
    ({"type": "function", "function": {"name": 5}}, TypeError, r"function name must be a string"),
    ({"type": "function"}, ValueError, r"tool_choice dict must name a function"),
    ({}, ValueError, r"tool_choice dict must name a function"),
    ({"type": "tool", "name": "lookup"}, ValueError, r"tool_choice\['type'\] must be 'function'"),
    (3, TypeError, r"tool_choice must be .*got int"),
    (["lookup"], TypeError, r"tool_choice must be .*got list"),
    ("nope", ValueError, r"'nope' is not a bound tool"),
])
def test_bad_tool_choice_raises_naming_the_problem(model, choice, exc, match):
    with pytest.raises(exc, match=match):
        model.bind_tools([lookup], tool_choice=choice)
    with pytest.raises(exc, match=match):
        model.invoke([HumanMessage("hi")], tools=[lookup], tool_choice=choice, max_tokens=1)


def test_good_tool_choice_dicts_still_work(model):
    bound = model.bind_tools([lookup, paint], tool_choice={"type": "function", "function": {"name": "paint"}})
    out = bound.invoke([HumanMessage("go")], max_tokens=120)
    assert [c["name"] for c in out.tool_calls] == ["paint"]


def test_json_mode_without_a_schema_is_a_free_json_object(model):
    out = model.with_structured_output(None, method="json_mode").invoke([HumanMessage("give json")], max_tokens=300)
    assert isinstance(out, dict)
    raw = model.bind(response_format={"type": "json_object"}).invoke([HumanMessage("give json")], max_tokens=300)
    assert raw.response_metadata["patchkv"]["grammar"] == "json_object"
    assert json.loads(raw.content) == out


@pytest.mark.parametrize("schema", ["abc", [1, 2], 3, {}])
def test_structured_output_with_a_malformed_schema_raises_naming_it(model, schema):
    with pytest.raises(TypeError, match="schema must be a pydantic class"):
        model.with_structured_output(schema)

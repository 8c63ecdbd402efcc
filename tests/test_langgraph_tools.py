"""Tool-call protocol, tolerant parser, thread keys and message conversion (no model)."""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from patchkv_agent.langgraph.keys import canonical_ns, thread_key_from_config, thread_key_from_metadata
from patchkv_agent.langgraph.tools import (
    PROTOCOL_FOOTER,
    held_back,
    parse_tool_calls,
    to_trace_messages,
    tool_schemas,
    with_tool_protocol,
)
from patchkv_agent.eval.traces import plain_messages

NAMES = ["search", "lookup"]


def calls(text, names=NAMES):
    p = parse_tool_calls(text, names)
    return p.content, [(c["name"], c["args"]) for c in p.tool_calls], [(c["name"], c["error"]) for c in p.invalid_tool_calls]


@pytest.mark.parametrize("text, content, good", [
    ('<tool_call>{"name": "search", "arguments": {"query": "Paris"}}</tool_call>', "", [("search", {"query": "Paris"})]),
    ('Let me look.\n<tool_call>{"name": "search", "arguments": {"query": "a"}}</tool_call>\n'
     '<tool_call>{"name": "lookup", "args": {"id": 3}}</tool_call>', "Let me look.",
     [("search", {"query": "a"}), ("lookup", {"id": 3})]),
    ('<tool_call>{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>', "", [("search", {"query": "x"})]),
    ('<tool_call>{"function": {"name": "search", "arguments": {"query": "f"}}}</tool_call>', "", [("search", {"query": "f"})]),
    ("<tool_call>{'name': 'search', 'arguments': {'query': 'py'}}</tool_call>", "", [("search", {"query": "py"})]),
    ('<tool_call>{"name": "search", "arguments": {"query": "done"}}', "", [("search", {"query": "done"})]),  # no close tag, EOS
    ('{"name": "search", "arguments": {"query": "bare"}}', "", [("search", {"query": "bare"})]),
    ('Sure: ```json\n{"name": "lookup", "parameters": {"id": 1}}\n```', "Sure:", [("lookup", {"id": 1})]),
    ('<tool_call>[{"name": "search", "arguments": {}}, {"name": "lookup"}]</tool_call>', "",
     [("search", {}), ("lookup", {})]),
])
def test_well_formed_calls(text, content, good):
    got_content, got, bad = calls(text)
    assert (got_content, got, bad) == (content, good, [])


@pytest.mark.parametrize("text, name, error", [
    ("<tool_call>{name: search, query}</tool_call>", None, "not valid JSON"),
    ('<tool_call>{"arguments": {"q": 1}}</tool_call>', None, "without a name"),
    ('<tool_call>{"name": "search", "arguments": [1, 2]}</tool_call>', "search", "must be an object"),
    ('<tool_call>{"name": "search", "arguments": "not json at all {"}</tool_call>', "search", "not JSON"),
])
def test_malformed_calls_become_invalid_tool_calls(text, name, error):
    content, good, bad = calls(text + " tail")
    assert good == [] and content == "tail"
    assert len(bad) == 1 and bad[0][0] == name and error in bad[0][1]


@pytest.mark.parametrize("text", [
    "The answer is Paris.",
    'Config: {"a": 1} is JSON but no call.',
    '{"name": "unknown_tool", "arguments": {}}',  # bare JSON naming no bound tool
    "{ broken",
    "",
])
def test_absent_calls_leave_text_alone(text):
    content, good, bad = calls(text)
    assert good == [] and bad == [] and content == text.strip()


@pytest.mark.parametrize("text", [
    '<tool_call>{"name": "search", "arguments": {"setup": "Why did the cat',
    'Sure. <tool_call>{"name": "search", "arguments": {"query": "x"}}',   # JSON complete, close tag cut off
    '{"name": "search", "arguments": {"setup": "Why did the cat',          # bare
])
def test_truncated_calls_are_invalid_never_repaired(text):
    p = parse_tool_calls(text, NAMES, truncated=True)
    assert p.tool_calls == [] and len(p.invalid_tool_calls) == 1
    bad = p.invalid_tool_calls[0]
    assert bad["name"] == "search" and "cut off by the token limit" in bad["error"] and "search" in bad["args"]
    # not cut off (the model stopped) but unreadable: still never a repaired call
    q = parse_tool_calls('<tool_call>{"name": "search", "arguments": {"q": "Why', NAMES)
    assert q.tool_calls == [] and "not valid JSON" in q.invalid_tool_calls[0]["error"]


def test_only_tagged_calls_when_bare_is_off():
    p = parse_tool_calls('{"name": "search", "arguments": {"query": "bare"}}', NAMES, bare=False)
    assert p.tool_calls == [] and p.content.startswith("{")


def test_non_text_content_blocks_raise_naming_what_is_supported():
    img = HumanMessage(content=[{"type": "text", "text": "what is this?"},
                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    with pytest.raises(ValueError, match="'image_url' content block.*string or a list of strings"):
        to_trace_messages([img])
    ok = AIMessage(content=[{"type": "text", "text": "calling"}, {"type": "tool_use", "id": "c", "name": "search", "input": {}}],
                   tool_calls=[{"name": "search", "args": {}, "id": "c"}])
    assert to_trace_messages([ok])[0]["content"] == "calling"


def test_bare_json_with_any_name_when_no_names_given():
    p = parse_tool_calls('{"name": "x", "args": {}}')
    assert [c["name"] for c in p.tool_calls] == ["x"] and p.tool_calls[0]["id"].startswith("call_")


def test_held_back_stops_at_markers_and_partial_markers():
    assert held_back("abc <tool_call>{", ["<tool_call>"]) == 4
    assert held_back("abc <tool_", ["<tool_call>"]) == 4
    assert held_back("abc", ["<tool_call>", "{"]) == 3
    assert held_back("a {x", ["{"]) == 2


def test_protocol_and_plain_rendering_agree():
    @tool
    def search(query: str) -> str:
        """Search the encyclopedia."""
        return query

    schemas = tool_schemas([search])
    msgs = [SystemMessage("Be brief."), HumanMessage("Q?"),
            AIMessage("", tool_calls=[{"name": "search", "args": {"query": "q"}, "id": "c1"}]),
            ToolMessage("result text", tool_call_id="c1"), AIMessage("done")]
    trace = to_trace_messages(msgs)
    assert trace[2] == {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "name": "search", "args": {"query": "q"}}]}
    assert trace[3] == {"role": "tool", "tool_call_id": "c1", "content": "result text"}
    with_proto = with_tool_protocol(trace, schemas)
    assert with_proto[0]["content"].startswith("Be brief.") and PROTOCOL_FOOTER in with_proto[0]["content"]
    assert json.loads(with_proto[0]["content"].splitlines()[3])["name"] == "search"
    assert with_tool_protocol(trace[1:], schemas)[0]["role"] == "system"
    plain = plain_messages(with_proto)
    # a call written back into the context is a call the parser reads
    p = parse_tool_calls(plain[2]["content"], ["search"])
    assert [(c["name"], c["args"]) for c in p.tool_calls] == [("search", {"query": "q"})]


def test_thread_keys_are_stable_across_tasks_and_savers():
    node = {"configurable": {"thread_id": "t", "checkpoint_ns": "llm:1234", "__pregel_task_id": "1234"}}
    sub = {"configurable": {"thread_id": "t", "checkpoint_ns": "sub:99|inner:77", "__pregel_task_id": "77"}}
    assert thread_key_from_config(node) == ("t", "")
    assert thread_key_from_config(sub) == ("t", "sub")
    assert thread_key_from_config(sub, scope="planner") == ("t", "sub#planner")
    assert canonical_ns("sub:99") == "sub"  # the saver's view of the same subgraph
    assert thread_key_from_config({"configurable": {}}) is None
    assert thread_key_from_config({}, default_thread_id="d") == ("d", "")
    meta = {"thread_id": "t", "langgraph_node": "inner", "langgraph_checkpoint_ns": "sub:99|inner:77"}
    assert thread_key_from_metadata(meta) == ("t", "sub")
    assert thread_key_from_metadata({}, default_thread_id=None) is None


def test_a_grammar_compiler_is_built_once_per_owner_and_goes_with_it():
    import gc

    from patchkv_agent.langgraph.grammar import GrammarCompilers

    class Owner:
        pass

    table, built = GrammarCompilers(), []

    def build():
        built.append(object())
        return built[-1]

    a, b = Owner(), Owner()
    assert table.compiler_for(a, build) is table.compiler_for(a, build) is built[0]
    assert table.compiler_for(b, build) is built[1] and len(built) == 2
    del a
    gc.collect()
    assert list(table._by_owner.values()) == [built[1]]

"""Real LangGraph graphs and LangChain agents over a tiny random llama with a char-level chat tokenizer.

Oracles: a fresh thread (or registry) is exact; the same sequence of versions gives the same outputs
interleaved with other threads, concurrently, async or streamed; recorded traces render to the ids the
model saw.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Annotated, TypedDict

import pytest
import torch
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages
from pydantic import PrivateAttr

from patchkv_agent.langgraph import (
    PatchKVChatModel,
    PatchKVCheckpointSaver,
    PatchKVMiddleware,
    TraceRecorder,
    patchkv_node,
)
from patchkv_agent.eval.traces import version_ids
from patchkv_agent.results import BaseKind, PreparedOutcome, ResumeStats
from patchkv_agent.runtime.threads import ThreadRegistry
from patchkv_agent.eval.workloads import validate_trace
from benchmarks.tiny import CHATML_TOOLS
from tiny_models import chat_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PASSAGE_A = "Paris is the capital and most populous city of France, on the Seine. " * 2
PASSAGE_A2 = "Lyon is the third-largest city of France, where the Rhone meets the Saone. " * 2
PASSAGE_B = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, named after "
             "the engineer Gustave Eiffel, whose company designed and built it for the 1889 World's Fair. ") * 2


ENGINE = chat_engine  # the `engine` fixture (conftest.py)


def cfg(thread_id: str, **extra) -> dict:
    return {"configurable": {"thread_id": thread_id}, **extra}


def episode(prefix: str = "") -> list:
    call = lambda i, q: AIMessage("", tool_calls=[{"name": "search", "args": {"query": q}, "id": f"c{i}"}])  # noqa: E731
    return [SystemMessage("You are a research assistant."), HumanMessage(prefix + "Where is the Eiffel Tower?"),
            call(1, "Paris"), ToolMessage(PASSAGE_A, tool_call_id="c1", id="t1"),
            call(2, "Eiffel Tower"), ToolMessage(PASSAGE_B, tool_call_id="c2", id="t2"),
            HumanMessage("Question: where is it? Answer in a few words.")]


EDIT = [ToolMessage(PASSAGE_A2, tool_call_id="c1", id="t1"), HumanMessage("Again: where is it?")]


class State(TypedDict):
    messages: Annotated[list, add_messages]


def build_graph(model: PatchKVChatModel, saver=None, *, use_async: bool = False):
    if use_async:
        async def llm(state):
            return {"messages": [await model.ainvoke(state["messages"])]}
    else:
        def llm(state):
            return {"messages": [model.invoke(state["messages"])]}
    g = StateGraph(State)
    g.add_node("llm", patchkv_node(llm, model.registry, offload="always"))
    g.add_edge(START, "llm")
    g.add_edge("llm", END)
    return g.compile(checkpointer=saver if saver is not None else PatchKVCheckpointSaver(InMemorySaver(), model.registry))


def chat(engine, **kw) -> PatchKVChatModel:
    return PatchKVChatModel(registry=ThreadRegistry(engine), max_new_tokens=kw.pop("max_new_tokens", 8), **kw)


def stats(state) -> dict:
    return state["messages"][-1].response_metadata["patchkv"]


# ----------------------------------------------------------------------------- graphs


def test_middle_edit_resumes_with_patchkv_in_a_graph(engine):
    model = chat(engine)
    g = build_graph(model)
    s1 = g.invoke({"messages": episode()}, cfg("t"))
    assert stats(s1)["strategy"] == "exact" and stats(s1)["version"] == 1 and stats(s1)["thread_key"] == ["t", ""]
    s2 = g.invoke({"messages": EDIT}, cfg("t"))
    assert [m.content for m in s2["messages"] if m.id == "t1"] == [PASSAGE_A2]  # edited in place
    st = stats(s2)
    assert st["strategy"] == "patchkv" and st["version"] == 2 and st["fallback"] is None
    assert st["prefix_tokens"] > 0 and st["restore_tokens"] > 0 and st["suffix_tokens"] > st["restore_tokens"] > 0
    assert st["recompute_tokens"] < st["prompt_tokens"] - st["prefix_tokens"]
    assert st["base"] == "resident"  # patchkv_node offloaded after turn 1, the resume did not wait for it
    handle = g.get_state(cfg("t")).metadata["patchkv"]["threads"][0]
    assert handle["version"] == 2 and handle["checkpoint_ns"] == ""


def test_threads_never_see_each_others_kv(engine):
    eps = {"A": episode(), "B": episode("Second user. ")}

    def turns(g, tid):
        return [g.invoke({"messages": m}, cfg(tid))["messages"][-1] for m in (eps[tid], EDIT)]

    alone = {tid: turns(build_graph(chat(engine)), tid) for tid in eps}
    g = build_graph(chat(engine))
    inter = {"A": [], "B": []}
    for msgs in (0, 1):
        for tid in ("A", "B"):
            inter[tid].append(g.invoke({"messages": eps[tid] if msgs == 0 else EDIT}, cfg(tid))["messages"][-1])
    for tid in eps:
        assert [m.content for m in inter[tid]] == [m.content for m in alone[tid]]
        assert [m.response_metadata["patchkv"]["strategy"] for m in inter[tid]] == ["exact", "patchkv"]
        assert inter[tid][1].response_metadata["patchkv"]["thread_key"] == [tid, ""]

    # and concurrently, from two OS threads on one registry
    g2, got, errors = build_graph(chat(engine)), {}, []

    def run(tid):
        try:
            got[tid] = [g2.invoke({"messages": m}, cfg(tid))["messages"][-1].content for m in (eps[tid], EDIT)]
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(tid,)) for tid in eps]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors and got == {tid: [m.content for m in alone[tid]] for tid in eps}


def test_state_survives_restart_with_sqlite_and_kv_falls_back(engine, tmp_path):
    from langgraph.checkpoint.sqlite import SqliteSaver

    db = str(tmp_path / "threads.sqlite")
    reg1 = ThreadRegistry(engine)
    with SqliteSaver.from_conn_string(db) as inner:
        g = build_graph(PatchKVChatModel(registry=reg1, max_new_tokens=6), PatchKVCheckpointSaver(inner, reg1))
        s1 = g.invoke({"messages": episode()}, cfg("t"))
        tup = inner.get_tuple(cfg("t"))
        assert tup.metadata["patchkv"]["threads"][0]["version"] == 1
        assert not any(isinstance(v, torch.Tensor) for v in tup.checkpoint["channel_values"].values())
    reg2 = ThreadRegistry(engine)  # "new process": no KV, same database
    with SqliteSaver.from_conn_string(db) as inner:
        g = build_graph(PatchKVChatModel(registry=reg2, max_new_tokens=6), PatchKVCheckpointSaver(inner, reg2))
        s2 = g.invoke({"messages": EDIT}, cfg("t"))
        assert len(s2["messages"]) == len(s1["messages"]) + 2  # graph state restored from SQLite
        st = stats(s2)
        assert st["strategy"] == "exact" and "does not hold" in st["fallback"] and st["version"] == 2
        s3 = g.invoke({"messages": [HumanMessage("One more?")]}, cfg("t"))
        assert stats(s3)["fallback"] is None and stats(s3)["strategy"] == "patchkv" and stats(s3)["version"] == 3
    # the fallback is exact: same answer as a fresh exact run of that context
    ref = PatchKVChatModel(registry=ThreadRegistry(engine), max_new_tokens=6).invoke(s2["messages"][:-1], cfg("x"))
    assert ref.content == s2["messages"][-1].content


def test_async_graph_and_message_streaming_match_sync(engine):
    sync_g = build_graph(chat(engine))
    want = [sync_g.invoke({"messages": m}, cfg("s"))["messages"][-1] for m in (episode(), EDIT)]

    async def run():
        g = build_graph(chat(engine), use_async=True)
        out = [(await g.ainvoke({"messages": episode()}, cfg("s")))["messages"][-1]]
        pieces = []
        async for chunk, meta in g.astream({"messages": EDIT}, cfg("s"), stream_mode="messages"):
            if isinstance(chunk, AIMessage):
                pieces.append(chunk.content)
        out.append((await g.aget_state(cfg("s"))).values["messages"][-1])
        return out, "".join(pieces)

    got, streamed = asyncio.run(run())
    assert [m.content for m in got] == [m.content for m in want]
    assert streamed == got[1].content and got[1].response_metadata["patchkv"]["strategy"] == "patchkv"
    # sync graph streaming (stream_mode="messages" drives the model's _stream)
    g = build_graph(chat(engine))
    g.invoke({"messages": episode()}, cfg("s"))
    pieces = [c.content for c, _ in g.stream({"messages": EDIT}, cfg("s"), stream_mode="messages")]
    assert "".join(pieces) == want[1].content


# ------------------------------------------------------------------------ chat model


def test_chat_model_stream_async_and_stop_agree(engine):
    model = chat(engine, max_new_tokens=10)
    msgs = episode()
    full = model.invoke(msgs, cfg("i"))
    assert full.usage_metadata["output_tokens"] == 10 and full.response_metadata["finish_reason"] == "length"
    chunks = list(model.stream(msgs, cfg("s")))
    assert "".join(c.content for c in chunks) == full.content and len(chunks) > 1
    assert asyncio.run(model.ainvoke(msgs, cfg("a"))).content == full.content

    async def astream():
        return [c.content async for c in model.astream(msgs, cfg("as"))]

    assert "".join(asyncio.run(astream())) == full.content
    alone = model.invoke(msgs)  # no thread named: exact and stateless
    assert alone.content == full.content and alone.response_metadata["patchkv"]["thread_key"] is None
    assert ("default", "") not in model.registry.keys()
    stop = full.content[4:6]
    cut = full.content[:full.content.find(stop)]
    assert model.invoke(msgs, cfg("st"), stop=[stop]).content == cut
    assert "".join(c.content for c in model.stream(msgs, cfg("st2"), stop=[stop])) == cut


@tool
def search(query: str) -> str:
    """Search the encyclopedia for a passage."""
    time.sleep(0.3)
    return PASSAGE_B


class ScriptedChatModel(PatchKVChatModel):
    """Real resume and decode; the reply text is scripted by turn (a random model calls no tools)."""

    script: list[str] = []
    _turn: int = PrivateAttr(default=0)

    def render(self, messages, tools=None, response_format=None):
        self._turn = sum(isinstance(m, AIMessage) for m in messages)
        return super().render(messages, tools, response_format)

    def _decode_text(self, output_ids):
        return self.script[min(self._turn, len(self.script) - 1)]


SCRIPT = ['I will search. <tool_call>{"name": "search", "arguments": {"query": "Eiffel Tower"}}</tool_call>',
          "It is in Paris."]


def test_tools_json_protocol_and_template_protocol(engine):
    model = ScriptedChatModel(registry=ThreadRegistry(engine), script=SCRIPT, max_new_tokens=4)
    bound = model.bind_tools([search])
    msg = bound.invoke([HumanMessage("Where is the Eiffel Tower?")], cfg("j"))
    assert msg.content == "I will search." and msg.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("search", {"query": "Eiffel Tower"})]
    assert msg.response_metadata["patchkv"]["tool_mode"] == "json"
    trace, ids, mode = model.render([HumanMessage("hi")], [{"type": "function", "function": {"name": "search"}}])
    assert mode == "json" and '"name":"search"' in trace[0]["content"]
    agg = None
    for c in bound.stream([HumanMessage("Where is the Eiffel Tower?")], cfg("j2")):
        agg = c if agg is None else agg + c
    assert agg.content == msg.content and [(c["name"], c["args"]) for c in agg.tool_calls] == \
        [(c["name"], c["args"]) for c in msg.tool_calls]
    tmpl = ScriptedChatModel(registry=ThreadRegistry(chat_engine(CHATML_TOOLS)), script=SCRIPT, max_new_tokens=2)
    assert tmpl.template_renders_tools()
    m2 = tmpl.bind_tools([search]).invoke([HumanMessage("q")], cfg("t"))
    assert m2.response_metadata["patchkv"]["tool_mode"] == "template" and m2.tool_calls[0]["name"] == "search"
    assert chat(engine).template_renders_tools() is False


def _agent(engine, registry=None):
    from langchain.agents import create_agent

    reg = registry or ThreadRegistry(engine)
    model = ScriptedChatModel(registry=reg, script=SCRIPT, max_new_tokens=6)
    return create_agent(model, tools=[search], system_prompt="You are a research assistant.",
                        middleware=[PatchKVMiddleware(reg)], checkpointer=PatchKVCheckpointSaver(InMemorySaver(), reg))


def test_create_agent_with_middleware_end_to_end_and_recorder(engine):
    agent = _agent(engine)
    rec = TraceRecorder(include_token_ids=True, answers={"x": ["Paris"]})
    out = agent.invoke({"messages": [HumanMessage("Where is the Eiffel Tower?")]}, cfg("x", callbacks=[rec]))
    kinds = [type(m).__name__ for m in out["messages"]]
    assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    assert out["messages"][2].content == PASSAGE_B and out["messages"][-1].content == "It is in Paris."
    st = out["messages"][-1].response_metadata["patchkv"]
    assert st["strategy"] == "patchkv" and st["version"] == 2 and st["prefix_tokens"] > 0
    # the tool wait (0.3 s) prepared this call's context up to the tool result: only the result was computed
    assert st["base"] == "prepared" and st["prepared"] == "hit" and st["approx_rows"] == 0, st
    assert st["offload_wait_s"] == 0.0 and st["tool_s"] >= 0.3 and st["offload_hidden_share"] == 1.0
    # one JSON form: it reads back as the typed parts, the chat model's and the middleware's fields in the call's
    typed = ResumeStats.from_json(st)
    assert typed.to_json() == st and typed.runtime.base is BaseKind.PREPARED
    assert typed.runtime.prepared is PreparedOutcome.HIT and typed.call.thread_key == ("x", "")
    assert typed.call.tool_s == st["tool_s"] and typed.call.offload_hidden_share == 1.0 and typed.call.output_tokens
    # the recorder saw both versions exactly as the model did
    (trace,) = rec.episodes()
    validate_trace(trace)
    assert trace["id"] == "x" and trace["edit"] == "append" and trace["answers"] == ["Paris"]
    for v in trace["versions"]:
        assert version_ids(engine, {"messages": v["messages"]}) == v["token_ids"] and "stats" in v
    # async agent: same result
    aout = asyncio.run(_agent(engine).ainvoke({"messages": [HumanMessage("Where is the Eiffel Tower?")]}, cfg("y")))
    assert [m.content for m in aout["messages"]] == [m.content for m in out["messages"]]
    assert aout["messages"][-1].response_metadata["patchkv"]["base"] == "prepared"


def test_middleware_rejects_a_model_of_another_registry(engine):
    from langchain.agents import create_agent

    model = ScriptedChatModel(registry=ThreadRegistry(engine), script=SCRIPT, max_new_tokens=2)
    agent = create_agent(model, tools=[search], middleware=[PatchKVMiddleware(ThreadRegistry(engine))])
    with pytest.raises(ValueError, match="different registries"):
        agent.invoke({"messages": [HumanMessage("q")]}, cfg("z"))


def test_recorder_writes_middle_edits_that_replay_reads(engine, tmp_path):
    from patchkv_agent.eval.workloads import read_traces

    model = chat(engine, max_new_tokens=4)
    g = build_graph(model)
    rec = TraceRecorder()
    for msgs in (episode(), EDIT):
        g.invoke({"messages": msgs}, cfg("r", callbacks=[rec]))
    assert rec.write(tmp_path / "live.jsonl") == 1
    (trace,) = read_traces(tmp_path / "live.jsonl")
    assert trace["edit"] == "live" and trace["versions"][1]["edit"] == "edit"
    assert trace["versions"][1]["stats"]["strategy"] == "patchkv"

"""Predictions of the next call's context, checked against LangChain's own installed editors.

The prediction calls the editors themselves; these tests hold it to what the same editors do to the real
next request (the history, the response and the real tool results): the real context starts with the
predicted ids, for ClearToolUsesEdit's options and for SummarizationMiddleware, whose summary call made
during the wait is served to the real call (once) through PreparedCalls.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

from patchkv_agent.langgraph import PatchKVChatModel, PatchKVMiddleware
from patchkv_agent.langgraph.predict import (PendingToolResult, PreparedCalls, known_prefix_ids,
                                             predict_agent_context, recording_calls)
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key
from test_agent_middlewares import SYSTEM, TOPICS, AgentScript, RecordingRegistry
from tiny_models import chat_engine


@tool
def search(query: str) -> str:
    """Search the encyclopedia for a passage."""
    return f"{query}: a passage."


@tool
def fetch(url: str) -> str:
    """Fetch a page."""
    return f"{url}: a page."


def _result(i: int, chars: int = 300) -> str:
    return (f"Passage {i}: " + "the river runs through the old town and past the market. " * 20)[:chars]


def _history(n: int, tools=("search",)) -> list:
    msgs = [HumanMessage("Research the town's history.")]
    for i in range(n):
        name = tools[i % len(tools)]
        call = {"name": name, "args": {"query": f"topic {i}"} if name == "search" else {"url": f"u{i}"},
                "id": f"call_{i}", "type": "tool_call"}
        msgs += [AIMessage("", tool_calls=[call]), ToolMessage(_result(i), tool_call_id=f"call_{i}", name=name)]
    return msgs


def _request(model, messages, tools):
    from langchain.agents.middleware import ModelRequest

    return ModelRequest(model=model, messages=list(messages), system_message=SystemMessage(SYSTEM), tools=tools,
                        tool_choice=None, state={"messages": list(messages)}, runtime=None)


def _real_ids(model, editors, request, messages, tools):
    from langchain.agents.middleware import ModelResponse

    seen = {}

    def capture(req):
        seen["r"] = req
        return ModelResponse(result=[AIMessage("")])

    handler = capture
    for ed in reversed(editors):
        handler = (lambda h, e: (lambda r: e.wrap_model_call(r, h)))(handler, ed)
    handler(request.override(messages=messages))
    req = seen["r"]
    from patchkv_agent.langgraph.tools import tool_schemas

    return model.render([req.system_message] + list(req.messages), tool_schemas(req.tools), None)[1]


@pytest.fixture(scope="module")
def model():
    return PatchKVChatModel(registry=ThreadRegistry(chat_engine()), max_new_tokens=2)


EDITS = [dict(trigger=200, keep=2), dict(trigger=200, keep=0), dict(trigger=200, keep=1, clear_tool_inputs=True),
         dict(trigger=200, keep=1, exclude_tools=("fetch",)), dict(trigger=200, keep=1, clear_at_least=150),
         dict(trigger=100_000, keep=1)]


@pytest.mark.parametrize("edit", EDITS, ids=[",".join(f"{k}={v}" for k, v in e.items()) for e in EDITS])
def test_clear_tool_uses_prediction_is_a_prefix_of_the_real_context(model, edit):
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

    editors = [ContextEditingMiddleware(edits=[ClearToolUsesEdit(**edit)])]
    history = _history(6, tools=("search", "fetch"))
    call = {"name": "search", "args": {"query": "topic 6"}, "id": "call_6", "type": "tool_call"}
    response = AIMessage("", tool_calls=[call])
    req = _request(model, history, [search, fetch])
    pred = predict_agent_context(model, req, response, editors)
    assert pred.token_ids is not None, pred.reason
    assert pred.info["trigger_depends_on_result_size"] is False
    real = history + [response, ToolMessage(_result(6), tool_call_id="call_6", name="search")]
    ids = _real_ids(model, editors, req, real, [search, fetch])
    n = len(pred.token_ids)
    assert n > 0.8 * len(ids) - 200 and np.array_equal(ids[:n], pred.token_ids)
    if edit["trigger"] < 1000:
        assert pred.info["cleared_results"] >= 1


def test_a_trigger_decided_by_the_pending_result_is_reported_and_the_likelier_outcome_predicted(model):
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

    history = _history(3)
    call = {"name": "search", "args": {"query": "topic 3"}, "id": "call_3", "type": "tool_call"}
    response = AIMessage("", tool_calls=[call])
    req = _request(model, history, [search])
    counter = model.get_num_tokens_from_messages
    base = counter([SystemMessage(SYSTEM)] + history + [response], [search])
    # the trigger lies between "no result" and "a result like the earlier ones": the result decides
    editors = [ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=base + 150, keep=1)],
                                        token_count_method="model")]
    pred = predict_agent_context(model, req, response, editors)
    assert pred.info["trigger_depends_on_result_size"] is True and pred.info["cleared_results"] >= 1
    real = history + [response, ToolMessage(_result(3), tool_call_id="call_3", name="search")]
    ids = _real_ids(model, editors, req, real, [search])
    assert np.array_equal(ids[: len(pred.token_ids)], pred.token_ids)  # results of the usual size: a hit


def test_no_prediction_for_structured_output_or_a_response_without_calls(model):
    req = _request(model, _history(1), [search])
    assert predict_agent_context(model, req, AIMessage("done"), []).reason == "the response asks for no tool"
    req = _request(model, _history(1), [search]).override(response_format=object())
    assert "structured" in predict_agent_context(model, req, AIMessage("", tool_calls=[
        {"name": "search", "args": {}, "id": "c", "type": "tool_call"}]), []).reason


def test_prepared_calls_store_only_while_recording_and_serve_once():
    cache = PreparedCalls(max_entries=2)
    cache.update("p", "m", ["gen"])
    assert cache.lookup("p", "m") is None  # not recording: nothing stored
    with recording_calls(("[marker",)):
        for i in range(3):
            cache.update(f"p{i}", "m", [f"g{i}"])
        with pytest.raises(PendingToolResult):
            from patchkv_agent.langgraph.predict import check_not_pending

            check_not_pending([HumanMessage("text [marker 12")])
    assert len(cache) == 2 and cache.lookup("p0", "m") is None  # the oldest was dropped
    assert cache.lookup("p2", "m") == ["g2"] and cache.lookup("p2", "m") is None and cache.hits == 1
    with pytest.raises(ValueError):
        PreparedCalls(max_entries=0)


def test_summaries_made_during_the_tool_wait_are_served_and_calls_hit(one_torch_thread):
    """A create_agent with ClearToolUsesEdit and SummarizationMiddleware whose tool lasts until the
    preparation is over (a tool wait that covers it): every agent call after the first starts from the
    prepared context, and each summary is written once, during a wait."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware, SummarizationMiddleware

    reg = RecordingRegistry(chat_engine())
    llm = AgentScript(registry=reg, max_new_tokens=3)

    @tool("search")
    def slow_search(query: str) -> str:
        """Search the encyclopedia for a passage."""
        reg.wait_prepared(thread_key("t"), timeout=60)  # the tool outlasts the preparation
        return f"{query}: a landmark of Paris. " * 3 + f"Visitors to {query} arrive by metro."

    clear = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=150, keep=2)])
    summ = SummarizationMiddleware(model=llm, trigger=("tokens", 420), keep=("messages", 4))
    mw = PatchKVMiddleware(reg, editors=[clear, summ])
    agent = create_agent(llm, tools=[slow_search], system_prompt=SYSTEM, middleware=[clear, summ, mw])
    out = agent.invoke({"messages": [HumanMessage("Tell me about Paris landmarks.")]},
                       {"configurable": {"thread_id": "t"}, "recursion_limit": 60})
    agent_calls = [c for c in reg.calls if "#" not in c["checkpoint_ns"]]
    summary_calls = [c for c in reg.calls if c["checkpoint_ns"].endswith("#summarization")]
    summaries = sum(1 for c in agent_calls if c["prepared_info"] and "SummarizationMiddleware" in c["prepared_info"])
    assert len(agent_calls) == len(TOPICS) + 1 and summaries >= 1
    assert [c["prepared"] for c in agent_calls[1:]] == ["hit"] * len(TOPICS), [
        (c["prepared"], c["prepared_reason"]) for c in agent_calls]
    assert all(c["approx_rows"] == 0 and c["base"] == "prepared" for c in agent_calls[1:])
    assert mw.prepared_calls.hits == summaries == len(summary_calls)  # each summary decoded once, in a wait
    assert any("summary of the conversation" in str(m.content) for m in out["messages"])


def test_node_predict_next_hook_prepares_the_next_call(one_torch_thread):
    from langgraph.graph import END, START, MessagesState, StateGraph

    from patchkv_agent.langgraph import patchkv_node

    reg = ThreadRegistry(chat_engine())
    llm = PatchKVChatModel(registry=reg, max_new_tokens=2)
    msgs = [SystemMessage(SYSTEM), HumanMessage("Where is the Louvre?")]

    def node(state):
        return {"messages": [llm.invoke(state["messages"])]}

    def predict_next(state, update):
        return known_prefix_ids(llm, list(state["messages"]) + update["messages"])

    g = StateGraph(MessagesState)
    g.add_node("llm", patchkv_node(node, reg, offload="always", predict_next=predict_next))
    g.add_edge(START, "llm")
    g.add_edge("llm", END)
    from langgraph.checkpoint.memory import InMemorySaver

    app = g.compile(checkpointer=InMemorySaver())
    cfg = {"configurable": {"thread_id": "n"}}
    out = app.invoke({"messages": msgs}, cfg)
    reg.wait_prepared(thread_key("n"))
    out = app.invoke({"messages": [HumanMessage("And the Orsay?")]}, cfg)
    st = out["messages"][-1].response_metadata["patchkv"]
    assert st["prepared"] == "hit" and st["base"] == "prepared" and st["approx_rows"] == 0, (st["prepared_reason"], st["prompt_tokens"], st["prefix_tokens"])
    with pytest.raises(ValueError, match="predict_next"):
        patchkv_node(node, reg, predict_next="no")


def test_a_real_call_waits_for_its_twin_in_flight_in_a_prediction():
    cache = PreparedCalls()
    got = {}
    in_prediction, done = threading.Event(), threading.Event()

    def prediction():
        with recording_calls():
            assert cache.lookup("p", "m") is None  # the prediction makes the call
            in_prediction.set()
            done.wait(10)
            cache.update("p", "m", ["summary"])

    t = threading.Thread(target=prediction)
    t.start()
    in_prediction.wait(10)
    r = threading.Thread(target=lambda: got.update(v=cache.lookup("p", "m")))  # the real call, meanwhile
    r.start()
    done.set()
    r.join(10)
    t.join(10)
    assert got["v"] == ["summary"] and cache.hits == 1 and not cache._in_flight
    # a prediction that ends without the response releases its waiter, which then decodes itself
    with recording_calls():
        cache.lookup("q", "m")
        waiter = threading.Thread(target=lambda: got.update(q=cache.lookup("q", "m")))
        waiter.start()
    waiter.join(10)
    assert not waiter.is_alive() and got["q"] is None and not cache._in_flight


def test_a_summary_a_larger_result_would_trigger_is_the_outcome_prepared(model):
    from langchain.agents.middleware import SummarizationMiddleware
    from langchain_core.language_models.fake_chat_models import FakeListChatModel
    from langchain_core.messages.utils import count_tokens_approximately

    from patchkv_agent.langgraph.predict import _apply_update

    history = _history(4)
    history[2] = ToolMessage(_result(0, 1200), tool_call_id="call_0", name="search")  # search has run large
    call = {"name": "search", "args": {"query": "topic 4"}, "id": "call_4", "type": "tool_call"}
    response = AIMessage("", tool_calls=[call])
    base = count_tokens_approximately(history + [response])
    # a result of the usual size (300 characters) stays under the trigger; one as large as the largest crosses it
    summ = SummarizationMiddleware(model=FakeListChatModel(responses=["The town's river and market."] * 4),
                                   trigger=("tokens", base + 200), keep=("messages", 3),
                                   token_counter=count_tokens_approximately)
    req = _request(model, history, [search])
    pred = predict_agent_context(model, req, response, [summ])
    assert pred.info.get("SummarizationMiddleware_depends_on_result_size") is True, pred.info
    real_state = history + [response, ToolMessage(_result(4, 1200), tool_call_id="call_4", name="search")]
    upd = summ.before_model({"messages": real_state}, None)
    assert upd is not None  # the large real result did trigger the summary
    msgs = _apply_update(real_state, upd["messages"])
    from patchkv_agent.langgraph.tools import tool_schemas

    ids = model.render([SystemMessage(SYSTEM)] + msgs, tool_schemas([search]), None)[1]
    assert np.array_equal(ids[: len(pred.token_ids)], pred.token_ids)
    assert "river and market" in model.engine.tokenizer.decode(pred.token_ids)


def _run_cleared_agent(give_editors: bool):
    from langchain.agents import create_agent
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

    reg = RecordingRegistry(chat_engine())
    llm = AgentScript(registry=reg, max_new_tokens=3)

    @tool("search")
    def slow_search(query: str) -> str:
        """Search the encyclopedia for a passage."""
        reg.wait_prepared(thread_key("w"), timeout=60)
        return f"{query}: a landmark of Paris. " * 3

    clear = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=150, keep=2)])
    mws = ([clear, PatchKVMiddleware(reg, editors=[clear])] if give_editors else
           [clear, PatchKVMiddleware(reg)])  # the mistake: the editor given to the agent only
    agent = create_agent(llm, tools=[slow_search], system_prompt=SYSTEM, middleware=mws)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = agent.invoke({"messages": [HumanMessage("Tell me about Paris landmarks.")]},
                           {"configurable": {"thread_id": "w"}, "recursion_limit": 60})
    mine = [w for w in caught if "PatchKVMiddleware: thread" in str(w.message)]
    stats = [m.response_metadata.get("patchkv") or {} for m in out["messages"] if isinstance(m, AIMessage)]
    return mine, stats


def test_an_editor_not_given_to_the_middleware_is_warned_once_naming_the_fix(one_torch_thread):
    mine, stats = _run_cleared_agent(give_editors=False)
    assert len(mine) == 1 and "prepared_middleware" in str(mine[0].message), [str(w.message) for w in mine]
    noted = [s for s in stats if s.get("prepared_unexplained")]
    assert noted and all("not among editors" in s["prepared_unexplained"] for s in noted)
    assert all(s["prepared"] in ("miss", "partial") for s in noted)
    mine, stats = _run_cleared_agent(give_editors=True)
    assert mine == [] and not any(s.get("prepared_unexplained") for s in stats)
    assert [s["prepared"] for s in stats[1:]] == ["hit"] * (len(stats) - 1)

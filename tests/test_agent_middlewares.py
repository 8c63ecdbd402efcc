"""LangChain's own context-editing middlewares over PatchKV: every edited call resumes from its own context.

``create_agent`` + ``ContextEditingMiddleware(ClearToolUsesEdit)`` + ``SummarizationMiddleware`` whose model
is the agent's own ``PatchKVChatModel`` + ``PatchKVMiddleware``, on the tiny random model (real resume and
decode; the reply text is scripted, since a random model calls no tools).
"""

from __future__ import annotations

import threading

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from pydantic import PrivateAttr

from patchkv_agent.langgraph import PatchKVChatModel, PatchKVMiddleware
from patchkv_agent.langgraph.predict import PENDING
from patchkv_agent.runtime.threads import ThreadRegistry
from tiny_models import chat_engine

SYSTEM = "You are a research assistant. Search, then answer in one line."
TOPICS = ["Eiffel Tower", "Louvre", "Seine", "Montmartre", "Versailles", "Notre-Dame", "Orsay", "Pantheon", "Marais"]


@tool
def search(query: str) -> str:
    """Search the encyclopedia for a passage."""
    return (f"{query}: a landmark of Paris. " * 3 + f"Visitors to {query} arrive by metro; opening hours vary. ")


class AgentScript(PatchKVChatModel):
    """Real resume and decode under the thread's key; the reply text is scripted by turn (the agent's n-th
    call). The tool-wait prediction renders the next call in the registry's worker (with placeholder tool
    results): those renders are not calls, and a summary written there is told apart per Python thread."""

    _turn: int = PrivateAttr(default=-1)
    _local: threading.local = PrivateAttr(default_factory=threading.local)

    def render(self, messages, tools=None, response_format=None):
        summarizing = len(messages) == 1 and "summar" in str(messages[0].content).lower()
        self._local.summarizing = summarizing
        predicted = any(PENDING in str(m.content) for m in messages)
        if not summarizing and not predicted:
            self._turn += 1  # the agent's n-th call (render runs once per call)
        return super().render(messages, tools, response_format)

    def _decode_text(self, output_ids):
        if getattr(self._local, "summarizing", False):
            return "Searched Paris landmarks; each is reached by metro."
        if self._turn >= len(TOPICS):
            return "Paris has many landmarks."
        return f'<tool_call>{{"name": "search", "arguments": {{"query": "{TOPICS[self._turn]}"}}}}</tool_call>'


class RecordingRegistry(ThreadRegistry):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls: list[dict] = []

    def stream(self, key, token_ids, **kw):
        s = super().stream(key, token_ids, **kw)
        self.calls.append(s.result.stats)
        return s


def test_create_agent_with_langchain_editors_resumes_each_context_with_a_plan(one_torch_thread):
    from langchain.agents import create_agent
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware, SummarizationMiddleware

    reg = RecordingRegistry(chat_engine())
    llm = AgentScript(registry=reg, max_new_tokens=3)
    agent = create_agent(llm, tools=[search], system_prompt=SYSTEM, middleware=[
        ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=150, keep=2)]),
        SummarizationMiddleware(model=llm, trigger=("tokens", 420), keep=("messages", 4)),
        PatchKVMiddleware(reg, prepare=False)])  # the resume path without the tool-wait preparation
    out = agent.invoke({"messages": [HumanMessage("Tell me about Paris landmarks.")]},
                       {"configurable": {"thread_id": "t"}, "recursion_limit": 60})
    calls = reg.calls
    agent_calls = [c for c in calls if "#" not in c["checkpoint_ns"]]
    summary_calls = [c for c in calls if c["checkpoint_ns"].endswith("#summarization")]
    assert len(summary_calls) >= 1 and len(agent_calls) >= 6
    assert all(c["prepared"] is None for c in calls)
    assert any("summary of the conversation" in str(m.content) for m in out["messages"])
    # the clear-tool-uses editor did clear results in what the model saw (its placeholder is in the context)
    assert any(c["new_tokens"] > 0 and c["restore_tokens"] > 0 for c in agent_calls[1:])
    system_len = len(SYSTEM)
    for c in agent_calls[1:]:
        # every later agent call resumes its own context with a plan: no exact fallback, the shared head
        # is the agent's (system prompt and more), never the 6 tokens it shares with the summarizer's
        assert c["strategy"] == "patchkv" and c["fallback"] is None and c["base"] == "resident", c
        assert c["prefix_tokens"] > system_len, c
    for c in summary_calls[1:]:
        assert c["strategy"] == "patchkv" and c["prefix_tokens"] > 100
    # the agent's context and the summarizer's never share a base: the agent's versions count on
    versions = [c["version"] for c in agent_calls]
    assert versions == list(range(1, len(agent_calls) + 1))


def test_contexts_of_one_key_are_kept_apart_without_marks(one_torch_thread):
    """A second caller on the same key (no lc_source mark) opens its own context; both resume from their own."""
    eng = chat_engine()
    reg = ThreadRegistry(eng)
    from patchkv_agent.runtime.threads import thread_key

    key = thread_key("k")
    tok = eng.tokenizer
    a0 = tok.encode("<|im_start|>system\n" + "Agent rules. " * 20 + "<|im_end|>\n" + "tool output. " * 30)
    b0 = tok.encode("<|im_start|>user\nRoute this request: " + "which tool? " * 25)
    a1 = a0[:100] + tok.encode("EDITED") + a0[110:] + tok.encode(" more output.")
    b1 = b0 + tok.encode(" and this one.")
    r = [reg.generate(key, ids, max_new_tokens=2) for ids in (a0, b0, a1, b1)]
    ctx = [x.stats["context"] for x in r]
    assert ctx[0] == ctx[2] and ctx[1] == ctx[3] and ctx[0] != ctx[1]
    assert r[2].stats["strategy"] == "patchkv" and r[2].stats["prefix_tokens"] == 100
    assert r[3].stats["prefix_tokens"] == len(b0) and r[3].stats["base"] == "resident"
    assert len(b1) <= reg.handle(key)["tokens"] <= len(b1) + 1  # the handle follows the key's last call
    single = ThreadRegistry(eng, contexts=1)
    s = [single.generate(key, ids, max_new_tokens=2) for ids in (a0, b0, a1)]
    assert s[2].stats["prefix_tokens"] < 20  # one context per key: a1 diffs against b0
    with pytest.raises(ValueError, match="contexts"):
        ThreadRegistry(eng, contexts=0)

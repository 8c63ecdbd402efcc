"""Agent workloads made by LangChain's own editing middlewares; the next-action metric; the no-edit floor."""

from __future__ import annotations

import pytest

from tiny_models import chat_engine

from patchkv_agent.eval.agent_workloads import (AGENT_WORKLOADS, ExtractiveSummarizer, build_agent_traces,
                                                public_histories, research_histories)
from patchkv_agent.eval.metrics import next_action, next_action_agree
from patchkv_agent.eval.traces import validate_trace


def _tool_texts(version):
    return [m["content"] for m in version["messages"] if m["role"] == "tool"]


@pytest.mark.parametrize("workload", AGENT_WORKLOADS)
def test_agent_traces_carry_the_middlewares_edits_and_the_unedited_floor(workload):
    traces = build_agent_traces(workload, n=3, histories="research")
    assert len(traces) == 3
    for tr in traces:
        validate_trace(tr)
        vs = tr["versions"]
        assert tr["workload"] == workload and len(vs) >= 2 and tr["meta"]["tokens"][0] >= 2000
        assert any(e != "none" for e in tr["meta"]["edits"][1:])
        for prev, cur in zip(vs, vs[1:]):
            un = cur["unedited"]["messages"]
            assert un[: len(prev["messages"])] == prev["messages"] and len(un) > len(prev["messages"])
        edited = [v for v, e in zip(vs, tr["meta"]["edits"]) if e != "none"]
        if workload.startswith("agent-clear"):
            assert all(any(t == "[cleared]" for t in _tool_texts(v)) for v in edited)
            # the edit sits near the end: the newest results are kept
            last = vs[-1]["messages"]
            assert last[-1]["role"] == "tool" and last[-1]["content"] != "[cleared]"
        elif workload == "agent-offload":
            assert all(any("/large_tool_results/" in t for t in _tool_texts(v)) for v in edited)
        else:
            head = edited[0]["messages"][1]
            assert head["role"] == "user" and head["content"].startswith("Here is a summary of the conversation")
            # a summary persists: later versions only append to it
            for prev, cur in zip(vs[1:], vs[2:]):
                assert cur["messages"][: len(prev["messages"])] == prev["messages"]


def test_extractive_summarizer_is_deterministic_and_extractive():
    from langchain_core.messages import HumanMessage

    prompt = ('<message type="human">Fix the parser. It breaks.</message>\n<message type="ai">\n  <content>'
              'Look first.</content>\n  <tool_call id="c1" name="bash">{"command": "ls"}</tool_call>\n</message>\n'
              '<message type="tool">a.py\nb.py</message>')
    out = ExtractiveSummarizer().invoke([HumanMessage(prompt)]).content
    assert out == ExtractiveSummarizer().invoke([HumanMessage(prompt)]).content
    assert "- human: Fix the parser." in out and 'called bash({"command": "ls"})' in out and "- tool: a.py b.py" in out


def test_histories_have_enough_tool_calls():
    for h in research_histories(3, calls=12) + public_histories():
        calls = sum(len(m.get("tool_calls") or []) for m in h.messages)
        assert calls >= 8, h.id
    with pytest.raises(ValueError, match="calls"):
        research_histories(1, calls=3)


def test_public_histories_give_coding_agent_episodes():
    if not public_histories():
        pytest.skip("no public agent histories packaged")
    traces = build_agent_traces("agent-clear", n=2, histories="public")
    assert traces and all(t["meta"]["source"] in ("mini-swe-agent", "swe-agent") for t in traces)


def test_next_action_compares_the_first_call_and_ignores_what_follows_it():
    call = '<tool_call>{"name": "search", "arguments": {"query": "Paris", "k": 2}}</tool_call>'
    same = '<tool_call>{"name": "search", "arguments": {"k": 2, "query": "Paris"}}</tool_call> more'
    assert next_action(call) == ("call", "search", '{"k": 2, "query": "Paris"}')
    assert next_action_agree(call + " then text", same)
    assert not next_action_agree(call, call.replace("Paris", "Rome"))
    assert not next_action_agree(call, "The answer is Paris.")
    assert next_action_agree(" The answer is Paris. ", "The answer is Paris.")
    assert next_action('<tool_call>{"name": "se')[0] == "call-text"


def test_replay_of_an_agent_trace_reports_next_action_floor_and_heal(one_torch_thread):
    from patchkv_agent.eval.agent_workloads import from_langchain
    from patchkv_agent.eval.replay import replay_episode
    from patchkv_agent.eval.traces import plain_messages

    eng = chat_engine()
    count = lambda msgs: len(eng.encode(plain_messages(from_langchain(msgs))))  # noqa: E731
    from patchkv_agent.eval.agent_workloads import agent_episode

    tr = agent_episode(research_histories(1, calls=12)[0], "agent-summarize", (3500, 2), count_tokens=count,
                       min_tokens=1000, max_tokens=3900, max_versions=3)
    assert tr["meta"]["edits"][1:] == ["summarize", "none"]  # the summary, then an append-only call
    # the shipped head-rewrite rule makes the summary's resume exact: nothing restored, nothing to heal
    gated = [r for r in replay_episode(eng, tr, ["patchkv"], heal=["patchkv"]) if r["strategy"] == "patchkv"]
    assert gated[0]["head_rewrite"] is True and gated[0]["restore_tokens"] == 0 and gated[0]["approx_rows"] == 0
    assert gated[0]["next_action"] is True and gated[0]["first_token_kl"] < 1e-6
    # without it (rewrite_share 1.0) the summary's resume restores its tail: approximate, healed afterwards
    eng.settings = eng.settings.replace(rewrite_share=1.0)
    rows = list(replay_episode(eng, tr, ["exact", "prefix", "patchkv"], heal=["patchkv"]))
    assert len(rows) == 3 * (len(tr["versions"]) - 1)
    for r in rows:
        assert r["floor_ttft_s"] > 0 and len(r["output_ids"]) >= 1
        if r["strategy"] == "prefix":
            assert r["next_action"] is True  # prefix is exact: the same greedy continuation
    pk = [r for r in rows if r["strategy"] == "patchkv"]
    assert pk[0]["restore_tokens"] > 0 and pk[0]["approx_rows"] > 0 and pk[0]["heal_s"] > 0
    assert pk[1]["after_restore"] is True
    # the healed base makes the append-only call after the summary exact again: nothing approximate
    assert pk[1]["approx_rows"] == 0 and pk[1]["next_action"] is True and pk[1]["first_token_kl"] < 1e-6
    unhealed = [r for r in replay_episode(eng, tr, ["patchkv"]) if r["strategy"] == "patchkv"]
    assert unhealed[1]["approx_rows"] > 0  # without healing the summary's approximation is carried forward

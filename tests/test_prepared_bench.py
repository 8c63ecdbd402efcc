"""Long agent histories (``--context``, ``agent-clear-hop``) and the agent loop with the tool-wait preparation.

Oracles: where the recorded calls' edits lie (LangChain's approximate counter, no model); the real next
context (the prediction must be a prefix of it, and must change when the editor's setting changes); a full
prefill of each version (a hit's first-token logits, fp32 tiny model, 1e-4); hand-made rows for the
summary arithmetic; the command line's one-line errors.
"""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest
from langchain_core.messages import SystemMessage
from langchain_core.messages.utils import count_tokens_approximately

from patchkv_agent.eval.agent_workloads import (CLEAR_HOP, CLEAR_HOP_DEPTH, CLEAR_SETTINGS, SUMMARY_SETTINGS, History,
                                                agent_episode, build_agent_loop_episodes, build_agent_traces,
                                                scale_setting, to_langchain)
from benchmarks.prepared_bench import (ToolLatency, markdown_prepared, plot_prepared, prepared_loop_episode,
                                               summarize_prepared)
from patchkv_agent.eval.traces import plain_messages, validate_trace
from tiny_models import chat_engine

TOL = 1e-4


def _approx(trace_messages) -> int:
    """LangChain's approximate count of trace messages (system message included), as the builder counts."""
    return count_tokens_approximately([SystemMessage(m["content"]) if m["role"] == "system" else x
                                       for m, x in zip(trace_messages, to_langchain(trace_messages))])


def _cleared(version) -> int:
    return sum(1 for m in version["messages"] if m["role"] == "tool" and m["content"] == "[cleared]")


def _synthetic(n: int = 40, seed: int = 0) -> History:
    """A research run with short results: many steps fit a tiny model's window."""
    rng = np.random.default_rng(seed)
    words = "river town market bridge old new stone mill harbour road hill tower".split()
    msgs = [{"role": "user", "content": "Research the history of the town."}]
    for i in range(n):
        msgs.append({"role": "assistant", "content": "",
                     "tool_calls": [{"id": f"c{i}", "name": "search", "args": {"query": f"topic {i}"}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}",
                     "content": f"Result {i}: " + " ".join(rng.choice(words, 10 + i % 5))})
    return History(id=f"syn{seed}", source="synthetic", system="You are a research assistant.", messages=tuple(msgs))


ENGINE = chat_engine  # the `engine` fixture (conftest.py)


def _count(engine):
    from patchkv_agent.eval.agent_workloads import from_langchain

    return lambda msgs: len(engine.encode(plain_messages(from_langchain(msgs))))


def _render(engine):
    return lambda msgs: engine.encode_array(plain_messages(msgs))


# ----------------------------------------------------------------------------------- long histories

def test_the_8k_clear_hop_episodes_clear_one_result_per_call_70_to_90_percent_deep():
    traces = build_agent_traces(CLEAR_HOP, n=3, context=8000, max_versions=4)
    assert len(traces) == 3
    lo, hi = CLEAR_HOP_DEPTH
    for tr in traces:
        validate_trace(tr)
        vs, meta = tr["versions"], tr["meta"]
        assert meta["clear_at_least"] == 0 and meta["trigger"] == 6400  # near the 8k budget
        assert all(4000 <= t <= 8000 for t in meta["tokens"])  # from half the budget up to it
        for k in range(1, len(vs)):
            assert meta["edits"][k].startswith("clear") and lo <= meta["depths"][k] <= hi
            assert _cleared(vs[k]) == _cleared(vs[k - 1]) + 1  # the editor re-fires: one more result per hop
            assert _approx(vs[k]["unedited"]["messages"]) <= 8000  # the no-edit floor fits the window too
            assert vs[k]["messages"][-1]["role"] == "tool" and vs[k]["messages"][-1]["content"] != "[cleared]"
            # where the edit sits, measured on the version itself: the first message that differs
            prev, cur = vs[k - 1]["messages"], vs[k]["messages"]
            d = next(i for i, (a, b) in enumerate(zip(prev, cur)) if a != b)
            assert lo <= _approx(cur[:d]) / _approx(cur) <= hi


def test_context_scales_the_settings_and_the_default_keeps_todays_episodes():
    wide = build_agent_traces("agent-summarize", n=2, context=8000, histories="research")
    # scaled x2, capped at 0.8 of the window (a trigger at the window never fires while the twin fits)
    assert [t["meta"]["trigger"] for t in wide] == [min(2 * s[0], 6400) for s in SUMMARY_SETTINGS] == [5000, 6400]
    assert all(max(t["meta"]["tokens"]) <= 8000 and t["meta"]["tokens"][0] >= 4000 for t in wide)
    today = build_agent_traces("agent-summarize", n=2, histories="research")
    assert [t["meta"]["trigger"] for t in today] == [s[0] for s in SUMMARY_SETTINGS]
    with pytest.raises(ValueError, match="context"):
        build_agent_traces("agent-summarize", n=1, context=10)


def test_every_clear_setting_edits_inside_an_8k_window():
    # before the cap, (4000, 2, 1500) scaled to (8000, 2, 3000): its trigger equals the window, so no call whose
    # unedited twin fits it ever cleared, and that setting's histories gave no episode
    assert scale_setting(CLEAR_SETTINGS[1], 8000) == (6400, 2, 3000)
    assert scale_setting(CLEAR_SETTINGS[0], 8000) == (5000, 3, 0)
    assert scale_setting((4000, 2, 3900), 8000) == (6400, 2, 3200)  # clear_at_least stays under the trigger
    assert scale_setting(CLEAR_SETTINGS[1], None) == CLEAR_SETTINGS[1]
    traces = build_agent_traces("agent-clear", n=4, context=8000, histories="research")
    assert sorted({t["meta"]["trigger"] for t in traces}) == [5000, 6400]
    for tr in traces:
        validate_trace(tr)
        assert any(e.startswith("clear") for e in tr["meta"]["edits"][1:])
        assert all(_approx(v["unedited"]["messages"]) <= 8000 for v in tr["versions"][1:])


# ----------------------------------------------------------------------------------- the predictor

def test_the_loop_predicts_with_the_workloads_own_editor_and_never_reads_the_next_version(engine):
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

    render = _render(engine)
    ep = build_agent_loop_episodes(CLEAR_HOP, n=1, context=8000, max_versions=3, histories="research")[0]
    real = [np.asarray(render(v["messages"])) for v in ep.trace["versions"]]
    wait = ep.waits[0]
    pred = wait.predict(render)
    assert pred.token_ids is not None and pred.info["editors"] == ["ContextEditingMiddleware"]
    n = len(pred.token_ids)
    assert np.array_equal(real[1][:n], pred.token_ids)  # a prefix of the real next context
    assert pred.info["cleared_results"] == _cleared(ep.trace["versions"][1])
    assert n > len(real[1]) - 2 * len(render([ep.trace["versions"][1]["messages"][-1]]))  # all but the result
    ep.trace["versions"].clear()  # the predictor holds no version: the same prediction without them
    assert np.array_equal(wait.predict(render).token_ids, pred.token_ids)
    # another setting of the same editor: another prediction (the editor's code runs, nothing is copied)
    edit = wait.middleware.edits[0]
    other = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=edit.trigger, keep=edit.keep + 2)],
                                     token_counter=wait.middleware.token_counter)
    moved = wait.with_middleware(other).predict(render)
    assert moved.info["cleared_results"] == pred.info["cleared_results"] - 2
    assert not np.array_equal(real[1][: len(moved.token_ids)], moved.token_ids)


def test_a_summarizing_editors_prediction_follows_its_setting(engine):
    from langchain.agents.middleware import SummarizationMiddleware

    from patchkv_agent.eval.agent_editors import ExtractiveSummarizer

    render = _render(engine)
    count = _count(engine)
    ep = build_agent_loop_episodes("agent-summarize", n=1, histories="research", count_tokens=count,
                                   max_tokens=3900, min_tokens=1000, max_versions=3, calls=12)[0]
    k = ep.trace["meta"]["edits"].index("summarize")
    wait = ep.waits[k - 1]
    pred = wait.predict(render)
    real = np.asarray(render(ep.trace["versions"][k]["messages"]))
    assert pred.info.get("SummarizationMiddleware") == "applied"
    assert np.array_equal(real[: len(pred.token_ids)], pred.token_ids)
    mw = wait.middleware
    never = SummarizationMiddleware(model=ExtractiveSummarizer(), trigger=("tokens", 10 ** 6),
                                    keep=mw.keep, token_counter=mw.token_counter)
    unsummarized = wait.with_middleware(never).predict(render)
    assert "SummarizationMiddleware" not in unsummarized.info
    assert not np.array_equal(real[: len(unsummarized.token_ids)], unsummarized.token_ids)


# ----------------------------------------------------------------------------------- the loop

@pytest.mark.parametrize("workload,setting", [(CLEAR_HOP, None), ("agent-summarize", (1500, 4))])
def test_prepared_calls_are_hits_whose_first_token_equals_exact(engine, one_torch_thread, workload, setting):
    from patchkv_agent.eval.agent_workloads import _loop_episode

    ep = _loop_episode(_synthetic(), workload, setting, count_tokens=_count(engine), min_tokens=1200, max_tokens=2600,
                       max_versions=3, fit_unedited=True)
    assert ep is not None and len(ep.waits) == 2
    assert any(e != "none" for e in ep.trace["meta"]["edits"][1:])
    # cover: each tool lasts until the preparation is over (no timing in the test)
    rows = prepared_loop_episode(engine, ep, ToolLatency.parse("0"), cover=True, exact_reference=True,
                                 max_new_tokens=4)
    assert len(rows) == 2
    for r in rows:
        assert r["prediction_correct"] is True and r["phase_at_call"] == "prepared"
        assert r["prepared"] == "hit" and r["base_prepared"] == "prepared", r["prepared_reason"]
        assert r["first_token_diff_prepared"] < TOL and r["next_action_prepared"] is True
        assert r["prepared_tokens"] > 0 and r["prepared_wasted"] == 0 and 0 < r["prepared_hidden_share"] <= 1
        # the hit computes only what follows the prediction: the tool result
        assert r["recompute_prepared"] < r["prompt_tokens"] - r["predicted_tokens"] + 8
        for key in ("e2e_prepared_s", "e2e_patchkv_s", "e2e_prefix_s", "e2e_floor_s"):
            assert r[key] > 0
        assert r["base_patchkv"] == "resident" and r["reference"] == "exact" and r["kind"] in ("clear", "summarize",
                                                                                              "append")


def test_a_wrong_prediction_is_no_hit_and_says_why(engine, one_torch_thread):
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware

    from patchkv_agent.eval.agent_workloads import AgentLoopEpisode, _loop_episode

    ep = _loop_episode(_synthetic(), CLEAR_HOP, None, count_tokens=_count(engine), min_tokens=1200, max_tokens=2600,
                       max_versions=2, fit_unedited=True)
    edit = ep.waits[0].middleware.edits[0]
    wrong = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=edit.trigger, keep=edit.keep + 3)],
                                     token_counter=ep.waits[0].middleware.token_counter)
    bad = AgentLoopEpisode(trace=ep.trace, waits=(ep.waits[0].with_middleware(wrong),))
    (r,) = prepared_loop_episode(engine, bad, ToolLatency.parse("0"), cover=True, max_new_tokens=2)
    assert r["prediction_correct"] is False and r["prepared"] in ("miss", "partial")
    assert "differs from the prediction" in r["prepared_reason"] and r["prepared_wasted"] > 0


# ----------------------------------------------------------------------------------- latency, summary

def test_tool_latency_model():
    assert ToolLatency.parse("2").seconds(["search"]) == 2.0 and ToolLatency.parse("2").seconds([]) == 2.0
    per = ToolLatency.parse("search=1.5,bash=4")
    assert per.seconds(["search"]) == 1.5 and per.seconds(["search", "bash"]) == 4.0 and per.seconds(["x"]) == 0.0
    assert ToolLatency.parse("search=1.5,*=2").seconds(["other"]) == 2.0
    assert str(ToolLatency.parse("search=1.5,*=2")) == "search=1.5,*=2"
    for bad in ("", "x", "-1", "search=nan", "search=1,search=2", "=3"):
        with pytest.raises(ValueError):
            ToolLatency.parse(bad)


def _row(workload, prepared, *, a, b, c, f, kind="clear", correct=True, agree=True, hidden=0.5):
    return {"id": f"{workload}/e", "workload": workload, "kind": kind, "prepared": prepared, "prediction_correct": correct,
            "e2e_prepared_s": a, "e2e_patchkv_s": b, "e2e_prefix_s": c, "e2e_floor_s": f, "vs_floor": a / f,
            "vs_prefix": a / c, "vs_patchkv": a / b, "patchkv_vs_floor": b / f, "prefix_vs_floor": c / f,
            "next_action_prepared": agree, "next_action_patchkv": True, "prepared_hidden_share": hidden,
            "prepared_tokens": 100, "prepared_wasted": 0 if prepared == "hit" else 100, "prepare_s": 1.0,
            "tool_s": 2.0, "prompt_tokens": 8000}


def test_summary_arithmetic_markdown_and_plot(tmp_path):
    rows = [_row("w", "hit", a=1.0, b=4.0, c=5.0, f=1.0), _row("w", "hit", a=2.0, b=4.0, c=8.0, f=1.0, kind="append"),
            _row("w", "partial", a=3.0, b=2.0, c=6.0, f=1.0, correct=False, agree=False, hidden=0.0)]
    s = summarize_prepared(rows)
    g = s["by_workload"]["w"]
    assert g["calls"] == 3 and g["hit_rate"] == pytest.approx(2 / 3) and g["outcomes"] == {"hit": 2, "partial": 1}
    assert g["prediction_correct_rate"] == pytest.approx(2 / 3)
    assert g["ttft_hit_s_median"] == pytest.approx(1.5) and g["hit_vs_floor"] == pytest.approx(1.5)
    assert g["prefix_over_hit"] == pytest.approx(4.5)  # medians of 5/1 and 8/2
    assert g["miss_vs_patchkv"] == pytest.approx(1.5) and g["misses"] == 1
    assert g["next_action_prepared"] == pytest.approx(2 / 3) and g["hidden_share_mean"] == pytest.approx(1 / 3)
    assert set(s["by_kind"]["w"]) == {"clear", "append"} and s["by_kind"]["w"]["append"]["calls"] == 1
    # every outcome against prefix: hits 1/5 and 2/8; the partial call 3/6
    assert g["by_outcome"]["hit"] == {"calls": 2, "vs_prefix_median": pytest.approx((0.2 + 0.25) / 2),
                                      "vs_prefix_max": pytest.approx(0.25)}
    assert g["by_outcome"]["partial"]["vs_prefix_max"] == pytest.approx(0.5)
    md = markdown_prepared(dict(s, settings={"tool_latency": "2", "model": "m", "reference": "prefix"}), "cmd --x")
    assert "cmd --x" in md and "| w | all | 3 | 0.67 |" in md and "1.50 (not met)" in md
    assert "| w | partial | 1 | 0.50 | 0.50 |" in md
    plot_prepared(s, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0


# ----------------------------------------------------------------------------------- command line

def test_cli_bench_loop_prepared_smoke(tmp_path, monkeypatch, engine, one_torch_thread):
    from patchkv_agent import cli

    monkeypatch.setattr(cli, "_engine", lambda args: engine)
    argv = ["bench-loop", "--workloads", CLEAR_HOP, "--n", "1", "--versions", "2", "--context", "2500",
            "--tool-latency", "search=0,*=0", "--cover-preparation", "--max-new-tokens", "1", "--out-dir",
            str(tmp_path)]
    assert cli.main(argv) == 0
    s = json.loads((tmp_path / "loop_prepared.json").read_text())
    assert s["command"] == "patchkv-agent " + shlex.join(argv) and s["settings"]["cover"] is True
    assert s["n_calls"] == 1 and s["rows"][0]["workload"] == CLEAR_HOP and s["rows"][0]["tools"] == ["search"]
    assert s["settings"]["max_new_tokens"] == 48  # the next action needs the whole call
    md = (tmp_path / "loop_prepared.md").read_text()
    assert "patchkv-agent bench-loop" in md and (tmp_path / "loop_prepared.png").stat().st_size > 0


def test_bench_and_bench_loop_help_list_every_workload(capsys):
    from patchkv_agent import cli
    from patchkv_agent.eval import workloads as wl
    from patchkv_agent.eval.agent_workloads import AGENT_WORKLOADS
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS

    for cmd in ("bench", "bench-loop"):
        with pytest.raises(SystemExit):
            cli.main([cmd, "--help"])
        text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
        for name in (*wl.WORKLOADS, *FOLLOW_WORKLOADS, *AGENT_WORKLOADS):
            assert name in text, (cmd, name)


def test_agent_episode_still_takes_todays_arguments():
    h = _synthetic()
    tr = agent_episode(h, "agent-clear", (1000, 3, 0), min_tokens=300, max_tokens=2000, max_versions=3)
    assert tr is not None and tr["meta"]["trigger"] == 1000 and tr["versions"][0]["edit"] == "base"
    with pytest.raises(ValueError, match="setting"):
        agent_episode(h, "agent-clear", None)

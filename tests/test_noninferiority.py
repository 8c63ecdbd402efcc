"""The pooled non-inferiority score: counts, interval, near-ties and the CLI, on hand-built rows whose answer is
counted by hand."""

from __future__ import annotations

import json

import pytest

from benchmarks.noninferiority import _mcnemar_p, markdown, non_inferiority


def _call(i, workload, cand, floor, *, kind="clear", action="call", version=1):
    base = {"id": f"{workload}/{i}", "workload": workload, "version": version, "model": "m", "call_kind": kind,
            "action_kind": action}
    return [dict(base, strategy="exact", next_action=None),
            dict(base, strategy="cand", next_action=cand),
            dict(base, strategy="kv-bf16", floor=True, next_action=floor)]


def _rows(spec):
    """spec: (workload, candidate keeps, floor keeps, count) ..."""
    rows, i = [], 0
    for w, c, f, n in spec:
        for _ in range(n):
            rows += _call(i, w, c, f)
            i += 1
    return rows


def test_counts_difference_and_per_workload_figures():
    rows = _rows([("a", False, True, 3), ("a", True, False, 1), ("a", True, True, 46),
                  ("b", True, False, 2), ("b", True, True, 48)])
    rows += _call(999, "a", False, False, kind="append")  # append-only: not scored
    r = non_inferiority(rows, "cand")
    assert (r["n"], r["b"], r["c"], r["near_ties"]) == (100, 3, 3, 0)
    assert r["diff_per_100"] == 0.0 and r["meets_next_action"] and r["meets"]
    assert r["by_workload"]["a"] == {"n": 50, "b": 3, "c": 1, "near_ties": 0, "candidate_kept": 47,
                                     "floor_kept": 49, "diff_per_100": 4.0}
    assert r["by_workload"]["b"]["diff_per_100"] == -4.0
    lo, hi = r["ci95_per_100"]
    assert -6.5 < lo < -3.5 and 3.5 < hi < 6.5  # the normal approximation: +- 1.96 * sqrt(6 / 100) * 10 = +- 4.8
    assert r["mcnemar_p"] == 1.0
    assert "b = 3" in markdown(r) and "| a | 50 | 47 | 49 | 3 | 1 | 0 | +4.0 |" in markdown(r)


def test_a_candidate_worse_than_the_margin_does_not_meet():
    rows = _rows([("a", False, True, 5), ("a", True, True, 95)])
    r = non_inferiority(rows, "cand")
    assert r["diff_per_100"] == 5.0 and not r["meets_next_action"] and not r["meets"]
    assert r["ci95_per_100"][0] > 0.0  # every discordant call goes one way: the interval excludes 0
    assert r["mcnemar_p"] == pytest.approx(2 / 2 ** 5)
    assert r["tool_calls"] == {"n": 100, "candidate": 0.95, "floor": 1.0, "floor_ties_scored": 1.0, "near_ties": 0,
                               "meets": False}


def test_a_floor_that_changes_between_its_runs_makes_a_near_tie():
    rows = _rows([("a", False, True, 3), ("a", True, True, 97)])
    # the floor's repeat (another thread count) misses the first call: that call becomes a tie
    repeat = [dict(r, next_action=False) if r["strategy"] == "kv-bf16" and r["id"] == "a/0" else r
              for r in rows if r["strategy"] == "kv-bf16"]
    r = non_inferiority(rows, "cand", floor_repeat=repeat)
    assert (r["b"], r["c"], r["near_ties"], r["diff_per_100"]) == (2, 0, 1, 2.0)
    assert r["meets_next_action"] and r["floor_repeated"]
    # the tool-call decisions score the near tie as a tie too: the floor's 100 / 100 becomes 99 / 100
    tc = r["tool_calls"]
    assert (tc["candidate"], tc["floor"], tc["floor_ties_scored"], tc["near_ties"]) == (0.97, 1.0, 0.99, 1)
    assert not tc["meets"] and "1 near tie(s) scored as ties" in markdown(r)


def test_tool_calls_meet_once_the_near_ties_are_ties():
    rows = _rows([("a", False, True, 2), ("a", True, True, 98)])
    repeat = [dict(r, next_action=False) if r["strategy"] == "kv-bf16" and r["id"] in ("a/0", "a/1") else r
              for r in rows if r["strategy"] == "kv-bf16"]
    tc = non_inferiority(rows, "cand")["tool_calls"]
    assert not tc["meets"]
    tc = non_inferiority(rows, "cand", floor_repeat=repeat)["tool_calls"]
    assert tc["floor_ties_scored"] == 0.98 and tc["candidate"] == 0.98 and tc["meets"]


def test_qa_rows_use_the_continuation_and_old_rows_the_suffix():
    """Rows without next_action (QA edits) are judged by exact_continuation; rows written before call_kind are
    edited when they keep a suffix after the edit."""
    rows = []
    for i, (c, f, suffix) in enumerate([(False, True, 10), (True, True, 0), (True, False, 5)]):
        base = {"id": f"q{i}", "workload": "qa", "version": 1, "model": "m"}
        rows += [dict(base, strategy="cand", exact_continuation=c, suffix_tokens=suffix),
                 dict(base, strategy="kv-bf16", floor=True, exact_continuation=f)]
    r = non_inferiority(rows, "cand")
    assert (r["n"], r["b"], r["c"]) == (2, 1, 1)


def test_nothing_in_common_is_a_clear_error():
    rows = _rows([("a", True, True, 2)])
    with pytest.raises(ValueError, match="no edited call has a verdict from both 'other'"):
        non_inferiority(rows, "other")


def test_mcnemar_is_the_exact_binomial():
    assert _mcnemar_p(0, 0) == 1.0
    assert _mcnemar_p(0, 6) == pytest.approx(2 / 64)
    assert _mcnemar_p(1, 3) == pytest.approx(2 * (1 + 4) / 16)


def test_bench_summarize_scores_the_floor_and_takes_a_repeat(tmp_path, capsys):
    from patchkv_agent.cli import main

    rows = _rows([("a", False, True, 3), ("a", True, True, 17)])
    for r in rows:
        r.setdefault("ttft_s", None if r.get("floor") else 0.1)
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    repeat = [dict(r, next_action=False) if r["id"] == "a/0" else r for r in rows if r.get("floor")]
    (tmp_path / "f.jsonl").write_text("".join(json.dumps(r) + "\n" for r in repeat))
    assert main(["bench", "--summarize", str(tmp_path / "r.jsonl"), "--floor-repeat", str(tmp_path / "f.jsonl"),
                 "--out-dir", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "summary.json").read_text())
    scored = out["non_inferiority"]["kv-bf16"]["cand"]
    assert (scored["n"], scored["b"], scored["near_ties"], scored["diff_per_100"]) == (20, 2, 1, 10.0)
    assert "Non-inferiority of `cand` to `kv-bf16` (does not meet" in (tmp_path / "out" / "summary.md").read_text()
    assert "near ties 1" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--floor-repeat", str(tmp_path / "f.jsonl"), "--out-dir", str(tmp_path / "o2")])
    assert "--floor-repeat scores a summary" in capsys.readouterr().err


def test_follow_rates_come_from_the_follow_rows():
    rows = _rows([("f", True, True, 4)])
    for r in rows:
        if r["strategy"] == "exact":
            r.update(follows=True, stale=False)
        elif r["strategy"] == "cand":
            r.update(follows=r["id"] != "f/0", stale=r["id"] == "f/0")
    f = non_inferiority(rows, "cand")["follow"]
    assert (f["follow"], f["follow_n"], f["stale"], f["stale_n"]) == (0.75, 4, 0.25, 4) and not f["meets"]
    assert non_inferiority(_rows([("a", True, True, 2)]), "cand")["follow"] is None

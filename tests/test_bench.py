"""Benchmark: summary arithmetic on hand-made rows, run_bench on a tiny engine, the frontier notebook."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks.bench import markdown_table, plot_frontier, read_results, run_bench, summarize, write_summary
from patchkv_agent.eval.traces import RESULT_FIELDS

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "tests" / "data" / "results_small.jsonl"


def row(workload, strategy, ttft, *, ep="e0", ratio=1.0, payload=0, f1=None, top1=None, tf=None, cont=None):
    return {"id": ep, "workload": workload, "strategy": strategy, "ttft_s": ttft, "recompute_ratio": ratio,
            "payload_bytes": payload, "f1": f1, "top1_agree": top1, "tf_agree": tf, "exact_continuation": cont,
            "first_token_kl": None if strategy == "exact" else 0.5, "model": "m"}


ROWS = [
    row("w1", "exact", 0.40, ep="a", f1=1.0),
    row("w1", "exact", 0.60, ep="b", f1=0.5),
    row("w1", "prefix", 0.20, ep="a", ratio=1.0, f1=1.0, top1=True, tf=1.0, cont=True),
    row("w1", "prefix", 0.30, ep="b", ratio=1.0, f1=0.5, top1=True, tf=1.0, cont=True),
    row("w1", "patchkv", 0.05, ep="a", ratio=0.2, payload=2**20, f1=1.0, top1=True, tf=0.75, cont=False),
    row("w1", "patchkv", 0.15, ep="b", ratio=0.4, payload=3 * 2**20, f1=0.0, top1=False, tf=0.25, cont=False),
    row("w2", "prefix", 0.10, ep="c", f1=None, top1=True, tf=1.0, cont=True),
    row("w2", "patchkv", 0.02, ep="c", ratio=0.1, payload=2**19, f1=None, top1=True, tf=1.0, cont=True),
]


def test_summarize_exact_numbers():
    s = summarize(ROWS)
    assert s["workloads"] == ["w1", "w2"] and s["strategies"] == ["exact", "prefix", "patchkv"]
    assert s["n_rows"] == 8 and s["models"] == ["m"]
    w1 = s["by_workload"]["w1"]
    assert w1["exact"]["ttft_s_median"] == pytest.approx(0.5)
    assert w1["exact"]["speedup_vs_prefix"] == pytest.approx(0.25 / 0.5)
    assert w1["exact"]["top1_agree"] is None and w1["exact"]["tf_agree"] is None
    assert w1["exact"]["f1_mean"] == pytest.approx(0.75)
    p = w1["patchkv"]
    assert p["n"] == 2 and p["episodes"] == 2
    assert p["ttft_ms_median"] == pytest.approx(100.0)
    assert p["speedup_vs_prefix"] == pytest.approx(0.25 / 0.10)
    assert p["recompute_ratio_mean"] == pytest.approx(0.3)
    assert p["payload_mib_mean"] == pytest.approx(2.0)
    assert p["f1_mean"] == pytest.approx(0.5)
    assert p["top1_agree"] == pytest.approx(0.5) and p["tf_agree"] == pytest.approx(0.5)
    assert p["exact_continuation"] == 0.0 and p["first_token_kl_mean"] == pytest.approx(0.5)
    assert w1["prefix"]["speedup_vs_prefix"] == pytest.approx(1.0)
    w2 = s["by_workload"]["w2"]
    assert "exact" not in w2 and w2["patchkv"]["speedup_vs_prefix"] == pytest.approx(5.0)
    assert w2["patchkv"]["f1_mean"] is None and w2["patchkv"]["payload_mib_mean"] == pytest.approx(0.5)
    pooled = s["by_workload"]["all"]["patchkv"]  # pooled: median of 0.05, 0.15, 0.02; prefix 0.1, 0.2, 0.3
    assert pooled["ttft_s_median"] == pytest.approx(0.05) and pooled["speedup_vs_prefix"] == pytest.approx(4.0)


def test_summarize_reports_edited_and_append_only_calls_apart():
    kinds = ["clear", "append", "append", "summarize"]
    rows = []
    for i, kind in enumerate(kinds):
        for strategy, t in (("prefix", 1.0 + i), ("patchkv", 0.25 + i if kind != "append" else 1.0 + i)):
            rows.append({**row("w", strategy, t, ep=f"e{i}"), "call_kind": kind, "version": 1})
    s = summarize(rows)
    w = s["by_call"]["w"]
    assert set(w) == {"edited", "append"}
    assert w["edited"]["patchkv"]["n"] == 2 and w["append"]["patchkv"]["n"] == 2
    # edited: prefix median (1 + 4) / 2 over patchkv's (0.25 + 3.25) / 2; append-only: alike
    assert w["edited"]["patchkv"]["speedup_vs_prefix"] == pytest.approx(2.5 / 1.75)
    assert w["append"]["patchkv"]["speedup_vs_prefix"] == pytest.approx(1.0)
    assert s["by_workload"]["w"]["patchkv"]["n"] == 4  # the pooled table is unchanged
    md = markdown_table(s).splitlines()
    assert "| w | edited | patchkv | 2 | 1750.0 | 1.43x | - |" in md
    assert "| w | append | prefix | 2 | 2500.0 | 1.00x | - |" in md
    assert "by_call" not in summarize(ROWS)  # rows without call kinds: no split


def test_markdown_table_exact_text():
    md = markdown_table(summarize(ROWS))
    lines = md.splitlines()
    assert lines[0] == ("| workload | strategy | n | TTFT ms (median) | speedup vs prefix | recompute ratio | "
                        "payload MiB | F1 | follow | stale | top-1 agree | TF agree | exact cont. |")
    assert "| w1 | exact | 2 | 500.0 | 0.50x | 1.000 | 0.00 | 0.750 | - | - | - | - | - |" in lines
    assert "| w1 | patchkv | 2 | 100.0 | 2.50x | 0.300 | 2.00 | 0.500 | - | - | 0.500 | 0.500 | 0.000 |" in lines
    assert "| w2 | patchkv | 1 | 20.0 | 5.00x | 0.100 | 0.50 | - | - | - | 1.000 | 1.000 | 1.000 |" in lines
    assert len(lines) == 2 + 3 + 2 + 3  # header and rule, w1 x3, w2 x2, pooled "all" x3


def test_plot_frontier_writes_png(tmp_path):
    fig = plot_frontier([r for r in ROWS if r["workload"] == "w1"], tmp_path / "f.png", title="w1")
    assert (tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    labels = [t.get_text() for t in fig.axes[1].texts]
    assert sorted(labels) == ["exact", "patchkv", "prefix"]  # exact drawn at tf_agree = 1 as the reference
    fig2 = plot_frontier([r for r in ROWS if r["workload"] == "w2"])
    assert "no values" in fig2.axes[0].texts[0].get_text()  # no gold answers: F1 panel says so


# ----------------------------------------------------------------------------------- run_bench, tiny engine

STRATS = ["exact", "prefix", "direct", "cacheblend", "patchkv"]


def tiny_traces(vocab: int) -> list[dict]:
    rng = np.random.default_rng(3)
    v0 = rng.integers(3, vocab, 80).tolist()
    v1 = v0[:20] + rng.integers(3, vocab, 9).tolist() + v0[26:]
    v2 = v1 + rng.integers(3, vocab, 4).tolist()  # an append-only call: nothing before its new tokens changed
    w0 = rng.integers(3, vocab, 60).tolist()
    w1 = w0[:10] + w0[20:]  # a compaction: span removed, suffix shifts left
    return [
        {"id": "tiny/0", "workload": "tiny-a", "edit": "multi", "answers": ["x"],
         "versions": [{"token_ids": v0}, {"token_ids": v1, "edit": "multi"}, {"token_ids": v2, "edit": "none"}]},
        {"id": "tiny/1", "workload": "tiny-b", "edit": "compact_history",
         "versions": [{"token_ids": w0}, {"token_ids": w1}]},
    ]


def test_run_bench_rows_files_and_resume(engine, tmp_path):
    traces = tiny_traces(engine.spec.vocab_size)
    summary = run_bench(engine, traces, STRATS, tmp_path, max_new_tokens=3, model_name="tiny-llama", progress=False)
    rows = read_results(tmp_path / "results.jsonl")
    assert len(rows) == (2 + 1) * len(STRATS)
    for r in rows:
        missing = [f for f in RESULT_FIELDS if f not in r]
        assert not missing, missing
        assert r["model"] == "tiny-llama" and len(r["output_ids"]) == 3
        assert (r["first_token_kl"] is None) == (r["strategy"] == "exact")
        assert (r["f1"] is None) == (r["id"] == "tiny/1")  # f1 only where the trace has answers
    key = {(r["id"], r["version"], r["strategy"]): r for r in rows}
    for tr_id, k in (("tiny/0", 1), ("tiny/0", 2), ("tiny/1", 1)):
        ex, pre = key[(tr_id, k, "exact")], key[(tr_id, k, "prefix")]
        assert pre["output_ids"] == ex["output_ids"]
        assert pre["top1_agree"] and pre["tf_agree"] == 1.0 and pre["exact_continuation"]
        # cacheblend restores the rows after an edit; an append-only call has none (its prefix is reused)
        assert pre["payload_bytes"] == 0 and (key[(tr_id, k, "cacheblend")]["payload_bytes"] > 0) == (k == 1)
    assert {(r["id"], r["version"], r["call_kind"]) for r in rows} == {
        ("tiny/0", 1, "multi"), ("tiny/0", 2, "append"), ("tiny/1", 1, "compact_history")}
    split = summary["by_call"]["tiny-a"]
    assert split["edited"]["prefix"]["n"] == split["append"]["prefix"]["n"] == 1
    assert split["append"]["prefix"]["ttft_s_median"] == key[("tiny/0", 2, "prefix")]["ttft_s"]
    assert summary["errors"] == [] and summary["strategies"] == STRATS
    assert summary["workloads"] == ["tiny-a", "tiny-b"] and "all" in summary["by_workload"]
    for name in ("summary.json", "summary.md", "frontier_tiny-a.png", "frontier_tiny-b.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "summary.json").read_text())["n_rows"] == len(rows)
    assert "| tiny-a | cacheblend |" in (tmp_path / "summary.md").read_text()

    # resume: drop the patchkv rows of one episode and leave a cut-off line, as a killed run would
    kept = [r for r in rows if not (r["id"] == "tiny/1" and r["strategy"] == "patchkv")]
    text = "".join(json.dumps(r) + "\n" for r in kept) + json.dumps(rows[0])[:40]
    (tmp_path / "results.jsonl").write_text(text)
    run_bench(engine, traces, STRATS, tmp_path, max_new_tokens=3, model_name="tiny-llama", resume=True,
              warmup=False, progress=False)
    again = read_results(tmp_path / "results.jsonl")
    assert len(again) == len(rows)
    redo = [r for r in again[len(kept):]]
    assert [(r["id"], r["strategy"]) for r in redo] == [("tiny/1", "patchkv")]
    old = key[("tiny/1", 1, "patchkv")]
    assert redo[0]["output_ids"] == old["output_ids"] and redo[0]["recompute_tokens"] == old["recompute_tokens"]


def test_run_bench_refuses_unknown_strategy_and_reports_refused_episodes(engine, tmp_path):
    with pytest.raises(ValueError, match="unknown strategies"):
        run_bench(engine, [], ["exact", "magic"], tmp_path, progress=False)
    bad = {"id": "bad/0", "workload": "tiny-a", "edit": "append", "versions": [{"token_ids": [1, 2, 3]}]}
    summary = run_bench(engine, [bad], ["exact", "prefix"], tmp_path, progress=False)
    assert [e["id"] for e in summary["errors"]] == ["bad/0"] and summary["n_rows"] == 0


def test_write_summary_on_committed_small_results(tmp_path):
    rows = read_results(SMALL)
    assert rows, f"{SMALL} is empty"
    for r in rows:
        assert all(f in r for f in RESULT_FIELDS)
    s = write_summary(rows, tmp_path)
    assert set(s["strategies"]) >= {"exact", "prefix", "direct", "cacheblend", "patchkv"}
    assert all(Path(f).exists() for f in s["files"])


def test_cli_summarize(tmp_path, capsys):
    from patchkv_agent.cli import main

    assert main(["bench", "--summarize", str(SMALL), "--out-dir", str(tmp_path)]) == 0
    assert "| strategy |" in capsys.readouterr().out and (tmp_path / "summary.md").exists()


def test_cli_summarize_merges_shards(tmp_path, capsys):
    """Two shard files summarize to the same numbers as the one file they were split from."""
    from patchkv_agent.cli import main
    from patchkv_agent.cli_args import _shard

    rows = read_results(SMALL)
    ids = sorted({r["id"] for r in rows})
    for i in range(2):
        part = [r for r in rows if ids.index(r["id"]) % 2 == i]
        (tmp_path / f"s{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    assert main(["bench", "--summarize", str(tmp_path / "s0.jsonl"), str(tmp_path / "s1.jsonl"),
                 "--out-dir", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "summary.json").read_text())
    whole = summarize(rows)
    assert merged["by_workload"] == json.loads(json.dumps(whole["by_workload"])) and merged["n_rows"] == len(rows)
    assert _shard("1/3") == (1, 3)
    for bad in ("3/3", "x", "1/0"):
        with pytest.raises(SystemExit, match="shard"):
            _shard(bad)


def test_cli_summarize_keeps_the_noise_floor_rows_of_a_run(tmp_path, capsys):
    """A run with --noise-floor writes untimed floor rows (ttft_s None); merging its shards summarizes them
    (it was refused as 'not a number'), while an untimed row of a strategy still is."""
    from patchkv_agent.cli import main

    rows = read_results(SMALL)
    floor = [dict(r, strategy="kv-bf16", floor=True, ttft_s=None) for r in rows if r["strategy"] == "prefix"]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + floor))
    assert main(["bench", "--summarize", str(tmp_path / "s.jsonl"), "--out-dir", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert "kv-bf16" in out["strategies"] and out["n_rows"] == len(rows) + len(floor)
    capsys.readouterr()
    bad = dict(floor[0], floor=None)
    (tmp_path / "b.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(SystemExit):
        main(["bench", "--summarize", str(tmp_path / "b.jsonl"), "--out-dir", str(tmp_path / "out2")])
    assert "ttft_s is 'None', not a number" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- the notebook

def test_frontier_notebook_runs_top_to_bottom(tmp_path):
    from nb_helpers import run_notebook

    outputs, text = run_notebook("frontier.ipynb")
    assert "| workload | strategy |" in text
    assert any("image/png" in o.get("data", {}) for o in outputs)


# ----------------------------------------------------------------------------------- options of the commands

def test_cli_bench_follow_runs_the_edit_following_set(tmp_path, monkeypatch, one_torch_thread):
    """``bench --follow`` (was scripts/bench_follow.py): the four follow-* workloads under the default
    strategies and ``patchkv-noreaders``, whose plan recomputes less than patchkv's (no reader blocks)."""
    from tiny_models import chat_engine

    from patchkv_agent import cli
    from benchmarks.bench import FOLLOW_STRATEGIES, NOREADERS
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS
    from patchkv_agent.strategies import STRATEGIES

    monkeypatch.setattr(cli, "_engine", lambda args: chat_engine())
    saved = dict(STRATEGIES)
    try:
        assert cli.main(["bench", "--follow", "--n", "1", "--target-tokens", "400", "--max-new-tokens", "1",
                         "--out-dir", str(tmp_path)]) == 0
    finally:
        STRATEGIES.clear()
        STRATEGIES.update(saved)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["workloads"] == list(FOLLOW_WORKLOADS) and set(s["strategies"]) == set(FOLLOW_STRATEGIES)
    pooled = s["by_workload"]["all"]
    assert pooled[NOREADERS]["n"] == pooled["patchkv"]["n"] == len(FOLLOW_WORKLOADS)
    assert pooled[NOREADERS]["recompute_ratio_mean"] < pooled["patchkv"]["recompute_ratio_mean"]


def test_cli_transport_capture_cost_on_a_tiny_model(tmp_path, monkeypatch, one_torch_thread):
    """``bench-transport --capture-cost`` (was scripts/capture_cost.py): medians of the plain and the
    capturing prefill of the same context, written as JSON."""
    from tiny_models import chat_engine

    from patchkv_agent import cli
    from patchkv_agent.engine import PatchKVEngine

    monkeypatch.setattr(PatchKVEngine, "from_pretrained", classmethod(lambda cls, *a, **k: chat_engine()))
    out = tmp_path / "capture.json"
    assert cli.main(["bench-transport", "--capture-cost", "--tokens", "120", "--repeats", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["tokens"] == 120 and r["repeats"] == 2 and len(r["all_s"]["plain"]) == len(r["all_s"]["capture"]) == 2
    assert r["plain_s"] > 0 and r["capture_s"] > 0 and r["extra"] == r["capture_s"] / r["plain_s"] - 1.0


def test_episodes_selects_a_subset_in_run_order_and_names_a_missing_id(tmp_path):
    from benchmarks.bench_cli import episode_ids, only_episodes
    from patchkv_agent.usage import UsageError

    traces = [{"id": f"w/{i}"} for i in range(5)]
    assert [t["id"] for t in only_episodes(traces, episode_ids("w/3, w/1"))] == ["w/1", "w/3"]
    f = tmp_path / "ids"
    f.write_text("# the calls a floor decides\nw/4\n\nw/0\n")
    assert [t["id"] for t in only_episodes(traces, episode_ids(f"@{f}"))] == ["w/0", "w/4"]
    with pytest.raises(UsageError, match="'w/9'.*options of the run they came from"):
        only_episodes(traces, ["w/0", "w/9"])
    with pytest.raises(UsageError, match="names no episode"):
        episode_ids(" , ")
    with pytest.raises(UsageError, match="cannot read it"):
        episode_ids(f"@{tmp_path / 'missing'}")

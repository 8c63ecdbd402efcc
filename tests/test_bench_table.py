"""scripts/bench_table.py: the per-workload figures docs/RESULTS.md quotes, from results.jsonl rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _row(wl, i, strategy, **kw):
    base = {"id": f"{wl}/ep{i}", "version": 1, "workload": wl, "strategy": strategy}
    return {**base, **kw}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(*args):
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_table.py"), *args], capture_output=True,
                         text=True, check=True).stdout
    return {tuple(c.strip() for c in line.strip("|").split("|")[:4]): [c.strip() for c in line.strip("|").split("|")]
            for line in out.splitlines()[2:]}


def test_rows_cost_speed_and_the_floor_per_workload_and_pooled(tmp_path):
    rows = []
    for i, (agree, kind) in enumerate([(True, "call"), (False, "call"), (True, "text")]):
        rows += [_row("a", i, "prefix", recompute_tokens=1000, ttft_s=4.0 + i, next_action=True),
                 _row("a", i, "kv-bf16", floor=True, recompute_tokens=1000, ttft_s=None, next_action=i != 2),
                 _row("a", i, "patchkv", recompute_tokens=250 * (i + 1), tail_probe_tokens=300, restore_tokens=10 * i,
                      ttft_s=1.0 + i, next_action=agree, action_kind=kind)]
    got = _run(_write(tmp_path / "r.jsonl", rows), "--probe-share", "0.1")
    line = got[("a", "3", "2 / 3", "patchkv")]
    # 2 / 3 agree; tool calls 1 / 2; restored on 2; rows (250+500+750)/3000; cost adds 900 * 0.1; 5 s / 2 s medians
    assert line[4:] == ["2 / 3", "0.500", "2", "0.50", "0.53", "2.50x"]
    assert got[("all", "3", "2 / 3", "patchkv")][4:] == line[4:]


def test_a_later_file_replaces_the_rows_of_the_same_call_and_strategy(tmp_path):
    old = [_row("a", 0, "prefix", recompute_tokens=100, ttft_s=2.0, next_action=True),
           _row("a", 0, "patchkv", recompute_tokens=50, ttft_s=1.0, next_action=False, action_kind="text")]
    new = [_row("a", 0, "patchkv", recompute_tokens=20, ttft_s=0.5, next_action=True, action_kind="text")]
    got = _run(_write(tmp_path / "old.jsonl", old), _write(tmp_path / "new.jsonl", new))
    assert got[("a", "1", "0 / 0", "patchkv")][4:] == ["1 / 1", "-", "0", "0.20", "0.20", "4.00x"]


def test_calls_of_keeps_only_the_calls_a_rerun_holds(tmp_path):
    old = [_row("a", i, s, recompute_tokens=100, ttft_s=2.0, next_action=True, action_kind="call", floor=s == "kv-bf16")
           for i in range(3) for s in ("prefix", "kv-bf16", "patchkv")]
    new = [_row("a", 0, "patchkv", recompute_tokens=10, ttft_s=1.0, next_action=False, action_kind="call")]
    n = _write(tmp_path / "new.jsonl", new)
    got = _run(_write(tmp_path / "old.jsonl", old), n, "--calls-of", n)
    assert got[("a", "1", "1 / 1", "patchkv")][4:] == ["0 / 1", "0.000", "0", "0.10", "0.10", "2.00x"]


def test_head_tokens_reads_the_near_head_rule_off_the_same_run(tmp_path):
    # ep0 starts 40 tokens in and restored rows (a miss): under head_tokens 150 it takes prefix's row (exact, its
    # rows and TTFT); ep1 starts 400 in, ep2 restored nothing: both keep the strategy's own row
    rows = []
    for i, (p, restore, agree) in enumerate([(40, 30, False), (400, 30, True), (40, 0, True)]):
        rows += [_row("a", i, "prefix", recompute_tokens=1000, ttft_s=4.0, next_action=True),
                 _row("a", i, "patchkv", prefix_tokens=p, restore_tokens=restore, recompute_tokens=200,
                      tail_probe_tokens=100, ttft_s=1.0, next_action=agree, action_kind="call")]
    got = _run(_write(tmp_path / "r.jsonl", rows), "--head-tokens", "patchkv:150", "--probe-share", "0.1")
    assert got[("a", "3", "0 / 0", "patchkv")][4:] == ["2 / 3", "0.667", "2", "0.20", "0.21", "4.00x"]
    # rows (1000 + 200 + 200) / 3000, probes 200 * 0.1; TTFT medians 4 s / 1 s
    assert got[("a", "3", "0 / 0", "patchkv+head150")][4:] == ["3 / 3", "1.000", "1", "0.47", "0.47", "4.00x"]
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_table.py"), str(tmp_path / "r.jsonl"),
                          "--head-tokens", "patchkv"], capture_output=True, text=True)
    assert bad.returncode != 0 and "STRATEGY:H" in bad.stderr

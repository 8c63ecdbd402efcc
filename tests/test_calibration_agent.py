"""The agent stage of calibration (calibration/agent_stage.py): the recency window chosen by next-action
agreement, oracle = the exact resume; the selection rule; the wiring into ``calibrate`` and its options."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from patchkv_agent.calibration.agent_stage import (
    DEFAULT_WINDOWS,
    agent_traces,
    choose_window,
    choose_window_every,
    select_recent_window,
    with_recent_window,
)
from benchmarks.tiny import CHATML, tiny_engine
from patchkv_agent.strategies.builtin import PatchKVStrategy
from tiny_models import tiny_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread (conftest.py)

TOKENS = 48  # greedy tokens per resume, as the stage's default (an agent's next tool call)

# --- the selection rule -----------------------------------------------------------------------------------------------


def _grid(*rows):
    return {w: {"agree": a, "n": n} for w, a, n in rows}


def test_choose_window_takes_the_smallest_window_reaching_the_target():
    g = _grid((0, 5, 12), (256, 11, 12), (512, 12, 12), (1024, 12, 12))
    assert choose_window(g, 0.9) == 256  # 11/12 = 0.917
    assert choose_window(g, 0.95) == 512
    assert choose_window(g, 1.0) == 512  # 1024 reaches it too: the smaller wins
    assert choose_window(g, 0.0) == 0
    # the boundary counts as reached, whatever the float rounding of 19/20 against 0.95
    assert choose_window(_grid((0, 18, 20), (64, 19, 20)), 0.95) == 64
    # keys may be strings (a grid read back from a profile) and in any order
    assert choose_window({"1024": {"agree": 4, "n": 4}, "0": {"agree": 1, "n": 4}, "16": {"agree": 4, "n": 4}},
                         0.95) == 16


def test_choose_window_without_a_window_reaching_the_target_takes_the_most_agreeing_smaller_one():
    g = _grid((0, 6, 12), (256, 9, 12), (512, 10, 12), (1024, 10, 12))
    assert choose_window(g, 0.95) == 512  # tie with 1024 at 10/12: the smaller window
    assert choose_window(_grid((0, 3, 4), (128, 3, 4)), 1.0) == 0  # every window ties: the smallest
    assert choose_window(_grid((0, 2, 4), (128, 1, 4)), 0.9) == 0  # a larger window can agree less


def test_choose_window_every_needs_the_target_on_each_workload():
    # the held-out SmolLM2 shape: agent-clear needs 1024, agent-offload agrees everywhere; pooled, 512 would pass
    clear = _grid((0, 9, 15), (512, 14, 15), (768, 14, 15), (1024, 15, 15))
    offload = _grid((0, 9, 10), (512, 10, 10), (768, 10, 10), (1024, 10, 10))
    assert choose_window(_grid((0, 18, 25), (512, 24, 25), (768, 24, 25), (1024, 25, 25)), 0.95) == 512
    assert choose_window_every({"agent-clear": clear, "agent-offload": offload}, 0.95) == 1024
    assert choose_window_every({"agent-offload": offload}, 0.95) == 512
    # none reaches it on every workload: the best worst-workload share, ties to the smaller window
    hard = _grid((0, 1, 4), (512, 3, 4), (768, 3, 4), (1024, 2, 4))
    assert choose_window_every({"a": clear, "b": hard}, 0.95) == 512
    with pytest.raises(ValueError, match="different windows"):
        choose_window_every({"a": clear, "b": _grid((0, 1, 1))}, 0.95)
    with pytest.raises(ValueError, match="no workload grids"):
        choose_window_every({}, 0.95)


def test_choose_window_every_takes_a_target_per_workload_such_as_a_noise_floor():
    clear = _grid((0, 9, 15), (512, 13, 15), (1024, 15, 15))
    offload = _grid((0, 8, 10), (512, 10, 10), (1024, 10, 10))
    # a bf16 KV cache agrees on 13/15 and 8/10 of the same calls: 512 is as good as serving in bf16
    assert choose_window_every({"c": clear, "o": offload}, {"c": 13 / 15, "o": 0.8}) == 512
    assert choose_window_every({"c": clear, "o": offload}, {"c": 0.5, "o": 0.8}) == 0
    with pytest.raises(ValueError, match="no target for workload"):
        choose_window_every({"c": clear, "o": offload}, {"c": 0.5})


def test_choose_plan_every_takes_the_cheapest_candidate_meeting_the_target_everywhere():
    from patchkv_agent.calibration.agent_stage import choose_plan_every

    def grid(*rows):
        return {k: {"agree": a, "n": n} for k, a, n in rows}

    a = grid(("0", 5, 10), ("1024", 10, 10), ("1024@0.01", 10, 10), ("1024@0.04", 9, 10))
    b = grid(("0", 8, 10), ("1024", 10, 10), ("1024@0.01", 10, 10), ("1024@0.04", 10, 10))
    pooled = {"0": {"recompute_tokens_mean": 100.0}, "1024": {"recompute_tokens_mean": 900.0},
              "1024@0.01": {"recompute_tokens_mean": 500.0}, "1024@0.04": {"recompute_tokens_mean": 300.0}}
    assert choose_plan_every({"a": a, "b": b}, 0.95, pooled) == "1024@0.01"  # 0.04 misses on a
    assert choose_plan_every({"a": a, "b": b}, {"a": 0.9, "b": 0.8}, pooled) == "1024@0.04"  # a floor of 0.9 on a
    assert choose_plan_every({"a": a, "b": b}, 0.5, pooled) == "0"
    # none meets 1.0 on a and b together except the full window and the 0.01 probe: the cheaper one
    assert choose_plan_every({"a": a, "b": b}, 1.0, pooled) == "1024@0.01"
    # none meets: the best worst-workload margin, then the fewer rows
    c = grid(("0", 1, 10), ("1024", 6, 10), ("1024@0.01", 6, 10), ("1024@0.04", 2, 10))
    assert choose_plan_every({"a": a, "c": c}, 0.95, pooled) == "1024@0.01"
    # with the probe's cost counted (cost_rows_mean), a probe that recomputes fewer rows can still cost more
    costed = {k: dict(v, cost_rows_mean=v["recompute_tokens_mean"]) for k, v in pooled.items()}
    costed["1024@0.01"]["cost_rows_mean"] = 950.0
    assert choose_plan_every({"a": a, "b": b}, 1.0, costed) == "1024"
    with pytest.raises(ValueError, match="different candidates"):
        choose_plan_every({"a": a, "x": grid(("0", 1, 1))}, 0.95, pooled)


def test_parse_target():
    from patchkv_agent.calibration.agent_stage import parse_target

    assert parse_target(0.9) == (0.9, None) and parse_target("0.95") == (0.95, None)
    assert parse_target("floor:kv-bf16") == (None, "kv-bf16")
    for bad in ("floor:", "floor:fp4", "x", 2):
        with pytest.raises(ValueError):
            parse_target(bad)


@pytest.mark.parametrize("grid,target,match", [
    ({}, 0.9, "empty"),
    (_grid((0, 0, 0)), 0.9, "need n >= 1"),
    (_grid((0, 5, 4)), 0.9, "agree <= n"),
    ({"abc": {"agree": 1, "n": 1}}, 0.9, "not a window"),
    ({-1: {"agree": 1, "n": 1}}, 0.9, "not a window"),
    (_grid((0, 1, 1)), 1.5, "target must be a number in"),
    (_grid((0, 1, 1)), math.nan, "target must be a number in"),
])
def test_choose_window_rejects_bad_grids_and_targets(grid, target, match):
    with pytest.raises(ValueError, match=match):
        choose_window(grid, target)


# --- the stage end to end on a tiny engine, against exact -------------------------------------------------------------


def _agent_like_trace(i: int, rng, n: int = 260, vocab: int = 211) -> dict:
    """Agent-like versions as token ids: a tool result cleared in the middle and a new result appended
    (restores a tail), an append-only call (restores nothing), a second clear further on."""
    v0 = rng.integers(3, vocab, n).tolist()
    v1 = v0[:70] + rng.integers(3, vocab, 6).tolist() + v0[110:] + rng.integers(3, vocab, 12).tolist()
    v2 = v1 + rng.integers(3, vocab, 20).tolist()
    v3 = v2[:150] + rng.integers(3, vocab, 4).tolist() + v2[175:] + rng.integers(3, vocab, 8).tolist()
    return {"id": f"agent-clear/syn{i}", "workload": "agent-clear",
            "versions": [{"token_ids": v} for v in (v0, v1, v2, v3)]}


# the `engine` fixture (conftest.py); token ids only: next actions compared as output ids
ENGINE = dict(max_positions=1024)


def _oracle(eng, traces, window, decode=None):
    """Per version with a restoring plan at W=0: whether PatchKVStrategy(recent_window=window) takes the
    exact resume's next action, computed here directly."""
    from patchkv_agent.eval.metrics import next_action_agree
    from patchkv_agent.eval.traces import version_ids

    out = []
    for tr in traces:
        ids = [version_ids(eng, v) for v in tr["versions"]]
        for k in range(1, len(ids)):
            ckpt = eng.checkpoint(ids[k - 1])
            if eng.resume(ckpt, ids[k], strategy=PatchKVStrategy(recent_window=0),
                          max_new_tokens=0).stats["restore_tokens"] == 0:
                continue
            got = eng.resume(ckpt, ids[k], strategy=PatchKVStrategy(recent_window=window), max_new_tokens=TOKENS)
            ref = eng.resume(None, ids[k], strategy="exact", max_new_tokens=TOKENS)
            if decode is None:
                out.append(list(got.output_ids) == list(ref.output_ids))
            else:
                out.append(next_action_agree(decode(got.output_ids), decode(ref.output_ids)))
    return out


def test_stage_scores_w0_as_exact_says_and_a_whole_suffix_window_agrees_always(engine):
    rng = np.random.default_rng(7)
    traces = [_agent_like_trace(i, rng) for i in range(2)]
    big, bigger = 4096, 8192  # more than any suffix: every restored row is recomputed (exact)
    rows: list[dict] = []
    out = select_recent_window(engine, traces, windows=(big, 0, 16, bigger, 16), target=0.95,
                               max_new_tokens=TOKENS, progress=False, rows=rows)
    json.dumps(out)  # JSON-safe
    assert list(out["grid"]) == ["0", "16", str(big), str(bigger)]  # sorted, duplicates dropped
    w0 = _oracle(engine, traces, 0)
    n = len(w0)
    assert n == 4 and out["n_scored"] == n and out["n_versions"] == 6  # the append-only calls restore nothing
    assert [r["version"] for r in rows] == [1, 3, 1, 3]
    assert out["grid"]["0"] == {"agree": sum(w0), "n": n, "share": sum(w0) / n,
                                "recompute_tokens_mean": pytest.approx(np.mean(
                                    [r["results"]["0"]["recompute_tokens"] for r in rows])),
                                # a fixed window probes nothing: its cost is its recomputed rows
                                "cost_rows_mean": pytest.approx(np.mean(
                                    [r["results"]["0"]["recompute_tokens"] for r in rows]))}
    assert out["grid"]["16"]["agree"] == sum(_oracle(engine, traces, 16))
    # the whole-suffix window recomputes everything after the prefix: exact, agreement n/n
    assert out["grid"][str(big)]["agree"] == n == out["grid"][str(bigger)]["n"]
    assert out["grid"][str(big)]["recompute_tokens_mean"] == pytest.approx(out["prefix_recompute_tokens_mean"])
    for r in rows:
        assert r["results"][str(big)]["restore_tokens"] == 0 and r["results"]["0"]["restore_tokens"] > 0
        assert r["results"][str(bigger)]["reused"] and not r["results"][str(big)]["reused"]
        rec = [r["results"][w]["recompute_tokens"] for w in out["grid"]]
        assert rec == sorted(rec)  # a larger window only adds recomputed blocks
    assert out["chosen"] == choose_window(out["grid"], 0.95)
    assert out["target_met"] == (out["grid"][str(out["chosen"])]["share"] >= 0.95)
    assert out["workloads"] == ["agent-clear"] and out["episodes"] == [t["id"] for t in traces]
    assert out["settings"]["block_size"] == engine.settings.block_size and out["max_new_tokens"] == TOKENS


def test_stage_with_a_noise_floor_target_scores_the_floor_on_the_same_calls(engine):
    rng = np.random.default_rng(7)
    traces = [_agent_like_trace(i, rng) for i in range(2)]
    rows: list[dict] = []
    out = select_recent_window(engine, traces, windows=(0, 16, 4096), target="floor:kv-fp8",
                               max_new_tokens=TOKENS, progress=False, rows=rows)
    json.dumps(out)
    fl = out["floor_by_workload"]["agent-clear"]
    assert out["floor"] == "kv-fp8" and out["target"] == "floor:kv-fp8" and fl["n"] == out["n_scored"]
    assert fl["agree"] == sum(1 for r in rows if r["floor_agree"])
    grid = out["grid_by_workload"]["agent-clear"]
    meets = [int(w) for w, g in grid.items() if g["agree"] >= fl["agree"]]
    assert out["chosen"] == min(meets) and out["target_met"]  # the whole-suffix window always meets it


def test_stage_with_tail_thresholds_scores_each_candidate_at_the_largest_window():
    eng = tiny_engine(max_positions=1024, layers=4)  # a layer after the check layer: the probe runs
    rng = np.random.default_rng(7)
    traces = [_agent_like_trace(i, rng) for i in range(2)]
    rows: list[dict] = []
    out = select_recent_window(eng, traces, windows=(0, 64), target=0.95, max_new_tokens=TOKENS, progress=False,
                               rows=rows, thresholds=(1e-9, 1e9))
    json.dumps(out)
    assert list(out["grid"]) == ["0", "64", "64@1e-09", "64@1e+09"]
    # a threshold of 0+ keeps every probed block: the fixed window's rows; an unreachable one keeps none
    for r in rows:
        assert r["results"]["64@1e-09"]["recompute_tokens"] == r["results"]["64"]["recompute_tokens"]
        assert r["results"]["64@1e+09"]["recompute_tokens"] == r["results"]["0"]["recompute_tokens"]
    from patchkv_agent.calibration.agent_stage import choose_plan_every

    key = choose_plan_every(out["grid_by_workload"], 0.95, out["grid"])
    assert (str(out["chosen"]) if out["chosen_tail_threshold"] == 0 else
            f"{out['chosen']}@{out['chosen_tail_threshold']:g}") == key
    prof = with_recent_window({"block_size": 8}, out)
    assert prof["recent_window"] == out["chosen"] and prof["tail_threshold"] == out["chosen_tail_threshold"]
    # the window candidates are fixed windows even under a profile that sets the tail rule (here: keep no block)
    import dataclasses

    eng.settings = dataclasses.replace(eng.settings, tail_threshold=1e9)
    rows2: list[dict] = []
    select_recent_window(eng, traces, windows=(0, 64), target=0.95, max_new_tokens=TOKENS, progress=False, rows=rows2)
    assert [r["results"]["64"]["recompute_tokens"] for r in rows2] == [r["results"]["64"]["recompute_tokens"]
                                                                        for r in rows]
    assert any(r["results"]["64"]["recompute_tokens"] > r["results"]["0"]["recompute_tokens"] for r in rows2)


def _probe_stage(**kw):
    """A 4-layer engine (a layer after the check layer: the probe runs), two agent-like traces and the stage run on
    them at windows (0, 64) with ``kw``: ``(engine, traces, rows, selection)``."""
    eng = tiny_engine(max_positions=1024, layers=4)
    rng = np.random.default_rng(7)
    traces = [_agent_like_trace(i, rng) for i in range(2)]
    rows: list[dict] = []
    out = select_recent_window(eng, traces, windows=(0, 64), max_new_tokens=TOKENS, progress=False, rows=rows, **kw)
    json.dumps(out)  # JSON-safe
    return eng, traces, rows, out


def test_tail_windows_run_each_threshold_at_each_window_and_a_whole_suffix_probe_can_reach_past_the_tail():
    eng, traces, rows, out = _probe_stage(target=0.95, thresholds=(1e-9, 1e9), tail_windows=(4096, 64, 4096))
    assert out["tail_windows"] == [64, 4096]
    assert list(out["grid"]) == ["0", "64", "64@1e-09", "64@1e+09", "4096@1e-09", "4096@1e+09"]
    for r in rows:
        res = r["results"]
        # keeping every probed block at the whole-suffix window recomputes every restored row: prefix's rows, exact
        assert res["4096@1e-09"]["recompute_tokens"] == r["prefix_recompute_tokens"] and res["4096@1e-09"]["agree"]
        assert res["4096@1e-09"]["restore_tokens"] == 0
        # keeping none restores what window 0 restores, wherever the probe looked
        assert res["4096@1e+09"]["recompute_tokens"] == res["64@1e+09"]["recompute_tokens"] == res["0"][
            "recompute_tokens"]
        assert res["64@1e-09"]["recompute_tokens"] == res["64"]["recompute_tokens"]
        # the probe's rows cost their share of the layers (check layer 1 + 1 of 4): the whole-suffix probe costs more
        for key in ("64@1e+09", "4096@1e+09"):
            assert res[key]["cost_rows"] == pytest.approx(res[key]["recompute_tokens"] + res[key]["probe_tokens"] / 2)
        assert res["4096@1e+09"]["probe_tokens"] > res["64@1e+09"]["probe_tokens"] > 0
    assert out["grid"]["4096@1e+09"]["cost_rows_mean"] > out["grid"]["64@1e+09"]["cost_rows_mean"]
    prof = with_recent_window({"block_size": 8}, dict(out, chosen=4096, chosen_tail_threshold=1e-9))
    assert prof["recent_window"] == 4096 and prof["tail_threshold"] == 1e-9
    with pytest.raises(ValueError, match="thresholds too"):
        select_recent_window(eng, traces, windows=(0, 64), progress=False, tail_windows=(4096,))
    with pytest.raises(ValueError, match="tail window must be an int > 0"):
        select_recent_window(eng, traces, windows=(0, 64), progress=False, thresholds=(0.1,), tail_windows=(0,))


def test_variants_of_a_probed_base_set_the_check_layer_with_its_threshold_and_cost_that_layers_share():
    from patchkv_agent.calibration.agent_stage import candidate_keys
    from patchkv_agent.profiles import Profile

    # the engine's profile ships a fixed window; the variants run at the probed candidate named as their base
    eng, traces, rows, out = _probe_stage(target=0.0, thresholds=(1e9,), min_restore_shares=(0.0,),
                                          variants=("tail_check_layer=2:tail_threshold=1e-09", "tail_check_layer=2"),
                                          variant_base="64@1e+09/r0")
    base = "64@1e+09/r0"
    assert list(out["grid"]) == ["0", "64", base, f"{base}|tail_check_layer=2:tail_threshold=1e-09",
                                 f"{base}|tail_check_layer=2"]
    for r in rows:
        tr = next(t for t in traces if t["id"] == r["id"])
        old, new = (tr["versions"][r["version"] - k]["token_ids"] for k in (1, 0))
        ckpt = eng.checkpoint(old)
        ref = list(eng.resume(None, new, strategy="exact", max_new_tokens=TOKENS).output_ids)
        for opts in ({"tail_check_layer": 2, "tail_threshold": 1e-9}, {"tail_check_layer": 2}):
            key = f"{base}|" + ":".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in opts.items())
            got = eng.resume(ckpt, new, strategy=PatchKVStrategy(**{"recent_window": 64, "tail_threshold": 1e9,
                                                                     "min_restore_share": 0.0, **opts}),
                             max_new_tokens=TOKENS)
            res = r["results"][key]
            assert res["recompute_tokens"] == got.stats["recompute_tokens"]
            assert res["probe_tokens"] == got.stats["tail_probe_tokens"] > 0
            assert res["agree"] == (list(got.output_ids) == ref)
            # probed rows ran check layer 2 + 1 of the 4 layers: 3 / 4 of a row each (layer 1's probe: 2 / 4)
            assert res["cost_rows"] == pytest.approx(res["recompute_tokens"] + 0.75 * res["probe_tokens"])
        assert r["results"][base]["cost_rows"] == pytest.approx(
            r["results"][base]["recompute_tokens"] + 0.5 * r["results"][base]["probe_tokens"])
        # the variant's own threshold wins over the base's: a threshold of 1e-9 keeps every probed block
        assert r["results"][f"{base}|tail_check_layer=2:tail_threshold=1e-09"]["recompute_tokens"] == \
            r["results"]["64"]["recompute_tokens"]
    # a chosen variant's threshold is the chosen tail threshold, and both land in the profile the loader reads
    sel = dict(out, chosen=64, chosen_tail_threshold=1e9, chosen_min_restore_share=0.0,
               chosen_variant="tail_check_layer=2:tail_threshold=0.05",
               chosen_variant_options={"tail_check_layer": 2, "tail_threshold": 0.05})
    prof = with_recent_window(tiny_profile(eng), sel)
    s = Profile.from_dict(prof).settings()
    assert (s.recent_window, s.tail_threshold, s.tail_check_layer, s.min_restore_share) == (64, 0.05, 2, 0.0)
    assert candidate_keys((0, 64), (1e9,), (0.0,)) == ["0", "64", base]
    for kw in ({"variant_base": "64@0.5"}, {"variant_base": base, "variants": ()}):
        with pytest.raises(ValueError, match="variant_base"):
            select_recent_window(eng, traces, windows=(0, 64), progress=False, thresholds=(1e9,),
                                 min_restore_shares=(0.0,), **{"variants": ("tail_check_layer=2",), **kw})


def test_stage_with_small_restore_shares_scores_each_threshold_at_each_share():
    eng, traces, rows, out = _probe_stage(target=0.0, thresholds=(1e9,), min_restore_shares=(1.0, 0.0))
    assert list(out["grid"]) == ["0", "64", "64@1e+09/r0", "64@1e+09/r1"]
    for r in rows:
        # share 0 never turns a plan exact (the probe alone: the window-0 plan); share 1 turns every plan that
        # restores less than the whole suffix into the suffix recomputed whole (prefix's rows)
        assert r["results"]["64@1e+09/r0"]["recompute_tokens"] == r["results"]["0"]["recompute_tokens"]
        assert r["results"]["64@1e+09/r1"]["recompute_tokens"] == r["prefix_recompute_tokens"]
        assert r["results"]["64@1e+09/r1"]["agree"]  # exact
    # a target of 0 is met by every candidate: the cheapest wins (a tie with window 0 goes to the earlier key, which
    # leaves the profile's share as it is); without window 0 it is the probe at share 0, written to the profile
    assert out["chosen"] == 0 and out["chosen_min_restore_share"] is None
    assert with_recent_window({"block_size": 8, "min_restore_share": 0.5}, out)["min_restore_share"] == 0.5
    from patchkv_agent.calibration.agent_stage import _parse_key, choose_plan_every

    def drop0(g):
        return {k: v for k, v in g.items() if k != "0"}

    key = choose_plan_every({wl: drop0(g) for wl, g in out["grid_by_workload"].items()}, 0.0, drop0(out["grid"]))
    assert _parse_key(key) == (64, 1e9, 0.0)
    prof = with_recent_window({"block_size": 8, "min_restore_share": 0.5},
                              dict(out, chosen=64, chosen_tail_threshold=1e9, chosen_min_restore_share=0.0))
    assert prof["min_restore_share"] == 0.0 and prof["tail_threshold"] == 1e9 and prof["recent_window"] == 64
    with pytest.raises(ValueError, match="thresholds too"):
        select_recent_window(eng, traces, windows=(0, 64), progress=False, min_restore_shares=(0.5,))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        select_recent_window(eng, traces, windows=(0, 64), progress=False, thresholds=(0.1,), min_restore_shares=(2,))


def test_stage_with_plan_variants_scores_each_against_a_direct_resume_and_writes_the_chosen_options():
    import dataclasses

    from patchkv_agent.calibration.agent_stage import choose_plan_every, parse_variant
    from patchkv_agent.profiles import Profile

    eng = tiny_engine(max_positions=1024, layers=4)
    eng.settings = dataclasses.replace(eng.settings, tail_threshold=1e9)  # the profile's tail rule: keep no block
    rng = np.random.default_rng(7)
    traces = [_agent_like_trace(i, rng) for i in range(2)]
    rows: list[dict] = []
    out = select_recent_window(eng, traces, windows=(0, 64), target=1.0, max_new_tokens=TOKENS, progress=False,
                               rows=rows, variants=("rewrite_share=0.0", "kappa=1.0", " kappa=1.0 "))
    json.dumps(out)
    # the engine's own plan at the largest window runs as the base of the variants; a repeated variant runs once
    assert list(out["grid"]) == ["0", "64", "64@1e+09", "64@1e+09|rewrite_share=0.0", "64@1e+09|kappa=1.0"]
    assert out["variants"] == ["rewrite_share=0.0", "kappa=1.0"]
    base = {"recent_window": 64, "tail_threshold": 1e9}
    for r in rows:
        tr = next(t for t in traces if t["id"] == r["id"])
        old, new = (tr["versions"][r["version"] - k]["token_ids"] for k in (1, 0))
        ckpt = eng.checkpoint(old)
        ref = list(eng.resume(None, new, strategy="exact", max_new_tokens=TOKENS).output_ids)
        for key, opts in (("64@1e+09", {}), ("64@1e+09|rewrite_share=0.0", {"rewrite_share": 0.0}),
                          ("64@1e+09|kappa=1.0", {"kappa": 1.0})):
            got = eng.resume(ckpt, new, strategy=PatchKVStrategy(**base, **opts), max_new_tokens=TOKENS)
            assert r["results"][key]["recompute_tokens"] == got.stats["recompute_tokens"]
            assert r["results"][key]["agree"] == (list(got.output_ids) == ref)
        # a head-rewrite share of 0 turns every edit into a rewrite: the suffix recomputed whole, exact
        assert r["results"]["64@1e+09|rewrite_share=0.0"]["recompute_tokens"] == r["prefix_recompute_tokens"]
        assert r["results"]["64@1e+09|rewrite_share=0.0"]["agree"]
    key = choose_plan_every(out["grid_by_workload"], 1.0, out["grid"])
    assert out["chosen_variant"] == (key.partition("|")[2] or None)
    # a chosen variant's options go where a profile keeps them, and the loader reads them back
    sel = dict(out, chosen=64, chosen_tail_threshold=1e9, chosen_variant="kappa=0.02:reader_budget=0.1:rewrite_share=0.5",
               chosen_variant_options={"kappa": 0.02, "reader_budget": 0.1, "rewrite_share": 0.5})
    prof = with_recent_window(tiny_profile(eng), sel)
    assert prof["kappa"] == 0.02 and prof["rewrite_share"] == 0.5 and prof["reader_rule"]["budget"] == 0.1
    s = Profile.from_dict(prof).settings()
    assert (s.kappa, s.rewrite_share, s.reader_budget, s.recent_window) == (0.02, 0.5, 0.1, 64)
    for bad, match in (("window=3", "not a variant option"), ("kappa", "not key=value"), ("kappa=2", "kappa"),
                       ("kappa=0.1:kappa=0.2", "twice"), ("recent_window=64", "candidates of their own"), ("", "key=value")):
        with pytest.raises(ValueError, match=match):
            parse_variant(bad)
    assert parse_variant("rewrite_share=0.5:kappa=0") == ("kappa=0:rewrite_share=0.5", {"kappa": 0, "rewrite_share": 0.5})


def test_a_rewrite_share_variant_scores_the_summarized_heads_the_engines_rule_recomputes_whole():
    eng = tiny_engine(max_positions=1024, layers=4)
    rng = np.random.default_rng(3)
    v0 = rng.integers(3, 211, 260).tolist()
    v1 = v0[:4] + rng.integers(3, 211, 12).tolist() + v0[160:] + rng.integers(3, 211, 10).tolist()  # a summary
    traces = [{"id": "agent-summarize/syn", "workload": "agent-summarize",
               "versions": [{"token_ids": v0}, {"token_ids": v1}]}]
    with pytest.raises(ValueError, match="restores rows"):  # the engine's head-rewrite rule: nothing to score
        select_recent_window(eng, traces, windows=(0, 64), max_new_tokens=TOKENS, progress=False)
    rows: list[dict] = []
    out = select_recent_window(eng, traces, windows=(0, 64), target=0.0, max_new_tokens=TOKENS, progress=False,
                               rows=rows, variants=("rewrite_share=1.0",))
    # the engine's own plan (no tail rule) is the window-64 candidate: the variant's base, not run twice
    assert out["n_scored"] == 1 and list(out["grid"]) == ["0", "64", "64|rewrite_share=1.0"]
    r = rows[0]["results"]
    # every candidate at the engine's share still rewrites: exact, at prefix's rows; the variant restores rows
    for key in ("0", "64"):
        assert r[key]["recompute_tokens"] == rows[0]["prefix_recompute_tokens"] and r[key]["agree"]
    assert r["64|rewrite_share=1.0"]["restore_tokens"] > 0
    got = eng.resume(eng.checkpoint(v0), v1, strategy=PatchKVStrategy(recent_window=64, rewrite_share=1.0),
                     max_new_tokens=TOKENS)
    ref = eng.resume(None, v1, strategy="exact", max_new_tokens=TOKENS)
    assert r["64|rewrite_share=1.0"]["recompute_tokens"] == got.stats["recompute_tokens"]
    assert r["64|rewrite_share=1.0"]["agree"] == (list(got.output_ids) == list(ref.output_ids))


def test_stage_decodes_the_next_action_with_a_tokenizer():
    eng = tiny_engine(chat_template=CHATML, config={"vocab_size": 102}, max_positions=2048)
    sysm = {"role": "system", "content": "You are an agent with a search tool."}
    task = {"role": "user", "content": "Find the year the bridge opened."}

    def exchange(i, text):
        return [{"role": "assistant", "content": "", "tool_calls": [{"id": f"c{i}", "name": "search",
                                                                      "args": {"query": f"bridge {i}"}}]},
                {"role": "tool", "tool_call_id": f"c{i}", "content": text}]

    results = [f"Result {i}: " + "the old stone bridge over the river was rebuilt. " * 3 for i in range(4)]
    full = [sysm, task] + [m for i, t in enumerate(results) for m in exchange(i, t)]
    cleared = [sysm, task] + exchange(0, "[cleared]") + [m for i, t in enumerate(results[1:], 1)
                                                         for m in exchange(i, t)]
    trace = {"id": "agent-clear/chat", "workload": "agent-clear",
             "versions": [{"messages": full}, {"messages": cleared + exchange(9, "Opened in 1932.")}]}
    out = select_recent_window(eng, [trace], windows=(0, 4096), max_new_tokens=TOKENS, progress=False)
    decode = lambda ids: eng.tokenizer.decode(list(ids), skip_special_tokens=True)  # noqa: E731
    assert out["grid"]["0"]["n"] == 1 and out["grid"]["0"]["agree"] == sum(_oracle(eng, [trace], 0, decode))
    assert out["grid"]["4096"]["agree"] == 1


def test_stage_rejects_bad_settings_and_traces_with_nothing_to_choose_by(engine):
    rng = np.random.default_rng(1)
    ids = rng.integers(3, 211, 120).tolist()
    append_only = {"id": "a", "workload": "agent-clear", "versions": [{"token_ids": ids}, {"token_ids": ids + [5, 6]}]}
    with pytest.raises(ValueError, match="restores rows at recent_window=0"):
        select_recent_window(engine, [append_only], progress=False)
    with pytest.raises(ValueError, match="no agent traces"):
        select_recent_window(engine, [], progress=False)
    for bad in ((), (0, -1), (0, 1.5), (True,)):
        with pytest.raises(ValueError, match="window"):
            select_recent_window(engine, [append_only], windows=bad, progress=False)
    with pytest.raises(ValueError, match="target"):
        select_recent_window(engine, [append_only], target=2, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        select_recent_window(engine, [append_only], max_new_tokens=0, progress=False)


def test_agent_traces_are_the_ones_after_the_benchmarks_first():
    from patchkv_agent.eval.episodes import build_workload_traces

    got = agent_traces("agent-clear", n=2, skip=3, target_tokens=4000)  # LangChain's approximate token count
    bench = build_workload_traces("agent-clear", n=3, target_tokens=4000)
    longer = build_workload_traces("agent-clear", n=5, target_tokens=4000)
    assert [t["id"] for t in got] == [t["id"] for t in longer[3:]] and len(got) == 2
    assert not {t["meta"]["history"] for t in got} & {t["meta"]["history"] for t in bench}
    with pytest.raises(ValueError, match="unknown agent workload"):
        agent_traces("hotpotqa-e")


# --- wiring: the profile gets recent_window and loads with it ---------------------------------------------------------


def test_calibrate_wiring_writes_a_recent_window_the_profile_loader_reads(engine, tmp_path):
    from patchkv_agent.calibration.cli import _agent_stage, build_calibrate_parser
    from patchkv_agent.calibration.outputs import save_rows, write_profile
    from patchkv_agent.engine import PatchKVEngine
    from patchkv_agent.profiles import read_profile

    profile = tiny_profile(engine, readers=("none",), model_name="tiny-agent")
    before = engine.settings
    args = build_calibrate_parser().parse_args(["--agent-workloads", "agent-clear", "--agent-windows", "0,4096",
                                                "--no-progress"])
    traces = [_agent_like_trace(0, np.random.default_rng(3))]
    try:
        out = _agent_stage(engine, profile, traces, args, "pytest")
    finally:
        engine.settings = before  # the module's engine is shared
    sel = out["recent_window_selection"]
    assert out["recent_window"] == sel["chosen"] in (0, 4096) and "recent_window" not in profile
    keys = list(out)
    assert keys.index("recent_window") == keys.index("readers") + 1  # beside the other plan settings
    assert sel["grid"]["4096"]["agree"] == sel["grid"]["4096"]["n"] == 2 and sel["skip"] == 20
    assert sel["settings"]["block_size"] == profile["block_size"] and sel["settings"]["readers"] == "none"
    assert "last 6 of the first 26" in sel["episodes_from"] and out["timing"]["agent_stage_s"] >= 0
    path = write_profile(out, tmp_path / "tiny-agent.json")
    stages = [json.loads(x)["stage"] for x in save_rows(out, tmp_path / "r.jsonl").read_text().splitlines()]
    assert stages.count("agent") == 2
    loaded = read_profile(path)
    assert loaded.recent_window == sel["chosen"]
    assert PatchKVEngine(engine.model, profile=loaded).settings.recent_window == sel["chosen"]
    # with nothing to choose by the profile keeps no recent_window and says why
    ids = traces[0]["versions"][0]["token_ids"]
    none = [{"id": "a", "workload": "agent-clear", "versions": [{"token_ids": ids}, {"token_ids": ids + [7]}]}]
    try:
        skipped = _agent_stage(engine, profile, none, args, "pytest")
    finally:
        engine.settings = before
    assert "recent_window" not in skipped and "restores rows" in skipped["recent_window_selection"]["skipped"]
    assert read_profile(write_profile(skipped, tmp_path / "skipped.json")).recent_window is None


def test_with_recent_window_replaces_an_old_choice_and_leaves_the_input():
    prof = {"kappa": 0.0, "block_size": 32, "recent_window": 64, "recent_window_selection": {"chosen": 64}, "x": 1}
    out = with_recent_window(prof, {"chosen": 256, "grid": {}})
    assert list(out) == ["kappa", "block_size", "recent_window", "recent_window_selection", "x"]
    assert out["recent_window"] == 256 and prof["recent_window"] == 64


# --- the command line -------------------------------------------------------------------------------------------------


BAD = [
    (["--agent-workloads", "nope"], r"--agent-workloads: unknown agent workload\(s\) \['nope'\]; choose from"),
    (["--agent-workloads", "agent-clear,hotpotqa-e"], r"--agent-workloads: unknown .*'hotpotqa-e'.*'none' to skip"),
    (["--agent-n", "0"], r"--agent-n must be >= 1"),
    (["--agent-skip", "-1"], r"--agent-skip must be >= 0"),
    (["--agent-windows", "0,-256"], r"--agent-windows must be >= 0 .*got -256"),
    (["--agent-windows", "0,1.5"], r"--agent-windows: expected comma-separated integers"),
    (["--agent-windows", ","], r"--agent-windows: expected one or more"),
    (["--agent-target", "1.5"], r"--agent-target: target must be a share in \[0, 1\] or floor:<name>"),
    (["--agent-target", "nan"], r"--agent-target: target must be a share in \[0, 1\]"),
    (["--agent-target", "high"], r"--agent-target: target must be a share in \[0, 1\] or floor:<name>"),
    (["--agent-target", "floor:kv-int3"], r"--agent-target: unknown noise floors \['kv-int3'\]"),
    (["--agent-target-tokens", "0"], r"--agent-target-tokens must be >= 1"),
    (["--agent-n", "x"], r"--agent-n: invalid int value"),
    (["--agent-tail-windows", "0", "--agent-thresholds", "0.02"], r"--agent-tail-windows must be > 0"),
    (["--agent-tail-windows", "32768"], r"--agent-tail-windows .*give --agent-thresholds too"),
    (["--agent-variants", "window=3"], r"--agent-variants: variant 'window=3': 'window' is not a variant option"),
    (["--agent-variants", "kappa=0.1,kappa=7"], r"--agent-variants: variant 'kappa=7': .*kappa"),
    (["--agent-variant-base", "1024@0.02", "--agent-variants", "kappa=0.1"],
     r"--agent-variant-base '1024@0.02' must be one of the stage's candidates"),
    (["--agent-variant-base", "1024", "--agent-windows", "0,1024"], r"--agent-variant-base .*needs --agent-variants"),
]


@pytest.mark.parametrize("argv,pattern", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_agent_options_give_one_line_and_exit_2_before_any_model_loads(argv, pattern, no_model, capsys):
    from patchkv_agent import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["calibrate", *argv])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    assert re.search(pattern, lines[0]) and lines[0].startswith("patchkv-agent"), lines[0]


def test_agent_options_default_to_a_skipped_stage():
    from patchkv_agent.calibration.cli import _agent_workloads, build_calibrate_parser, check_calibrate_args
    from patchkv_agent.calibration.cli import main as calibrate_cli_main

    args = build_calibrate_parser().parse_args([])
    check_calibrate_args(args)
    assert _agent_workloads(args.agent_workloads) == [] and _agent_workloads("none") == []
    assert (args.agent_n, args.agent_skip, args.agent_windows, args.agent_target, args.agent_target_tokens) == (
        6, 20, DEFAULT_WINDOWS, "0.95", 4000)
    assert _agent_workloads(" agent-clear,agent-offload,agent-clear ") == ["agent-clear", "agent-offload"]
    with pytest.raises(SystemExit) as e:  # the stand-alone entry point checks them too
        calibrate_cli_main(["--agent-n", "0"])
    assert e.value.code == 2

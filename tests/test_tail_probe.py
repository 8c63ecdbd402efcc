"""The measured tail rule on tiny fp32 models: the recency window's blocks are probed at a check layer and only the
ones whose K/V deviation there reaches the threshold are recomputed past it.

Oracles: a threshold of 0+ keeps every probed block, so the resume equals the fixed-window plan's (one forward
over the same rows); an unreachable threshold keeps none, so the deeper layers of the probed rows are the restored
rows of the plan without a window; and the blocks a middle threshold keeps are those whose deviation, computed
here from the fixed-window run (fresh rows) and the window-less run (restored rows), reaches it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_helpers import plan_settings
from patchkv_agent import PatchKVEngine
from patchkv_agent.core import layerwise
from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.layerwise import row_deviation
from patchkv_agent.core.plan import LengthModel, PlanDraft, plan_repair, rule_last_block, rule_recency
from benchmarks.tiny import tiny_engine
from patchkv_agent.strategies import PatchKVStrategy
from test_recovery import edited_pair

TOL = 1e-4
LAYERS = 4
WINDOW = 48


def make_engine(family: str = "llama") -> PatchKVEngine:
    return tiny_engine(family, layers=LAYERS, dirty_window=4, mixed_precision=False, readers="none")


def run(eng, ckpt, new, **options):
    """The patchkv strategy with these options, called directly: (plan given, RecoveryOutput)."""
    strat = PatchKVStrategy(**{"recent_window": WINDOW, "precision": "fp16", **options})
    edit = diff_versions(ckpt.token_ids, np.asarray(new))
    plan = strat.plan(eng.settings, ckpt, edit)
    return plan, strat.execute(eng.runner, eng.spec, eng.settings, ckpt, edit, plan, torch.tensor(new))


def test_rule_recency_probes_the_window_instead_of_recomputing_it():
    old = list(range(1000, 1200))
    new = old[:50] + [7, 8, 9] + old[60:]
    edit = diff_versions(old, new)
    fixed = PlanDraft.start(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=8,
                                                      recent_window=40))
    probed = PlanDraft.start(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=8,
                                                       recent_window=40, tail_threshold=0.1))
    for d in (fixed, probed):
        rule_last_block(d)
        rule_recency(d)
    assert fixed.n_recent == probed.n_recent > 0
    assert np.array_equal(fixed.repair & ~probed.repair, probed.probe)  # the same blocks, probed not recomputed
    plan = probed.build()
    assert plan.probe_blocks.tolist() == np.flatnonzero(probed.probe).tolist() and plan.tail_threshold == 0.1
    # the probed rows are restored rows of the plan, and the last token is never among them
    assert set(plan.probe_positions()) <= set(plan.restore_new_positions) and len(new) - 1 not in plan.probe_positions()
    # the small-restore rule that fires clears the probe (everything is recomputed)
    small = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=8, recent_window=40,
                                                  tail_threshold=0.1, min_restore_share=1.0))
    assert small.small_restore and small.probe_blocks.size == 0 and small.n_restore == 0


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_threshold_of_zero_plus_keeps_every_block_and_equals_the_fixed_window(family):
    eng = make_engine(family)
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    fixed_plan, fixed = run(eng, ckpt, new)
    plan, out = run(eng, ckpt, new, tail_threshold=1e-12)
    assert fixed_plan.probe_blocks.size == 0 and plan.probe_blocks.size == fixed_plan.n_recent > 0
    assert np.array_equal(out.plan.recompute_positions, fixed_plan.recompute_positions)
    assert np.array_equal(out.plan.restore_new_positions, fixed_plan.restore_new_positions)
    assert np.array_equal(out.plan.restore_old_positions, fixed_plan.restore_old_positions)
    assert (out.logits - fixed.logits).abs().max().item() <= TOL
    for a, b in zip(out.keys + out.values, fixed.keys + fixed.values):
        assert (a - b).abs().max().item() <= TOL
    x = out.stats.extras
    assert x["tail_recomputed_blocks"] == x["tail_probe_blocks"] == plan.probe_blocks.size
    assert out.stats.recompute_tokens == fixed_plan.n_recompute


def test_an_unreachable_threshold_keeps_none_and_deeper_layers_stay_restored():
    eng = make_engine()
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    bare_plan, bare = run(eng, ckpt, new, tail_threshold=1e9, recent_window=0)  # (the option wins over WINDOW)
    plan, out = run(eng, ckpt, new, tail_threshold=1e9)
    assert out.plan is plan and out.stats.extras["tail_recomputed_blocks"] == 0
    assert out.stats.recompute_tokens == bare_plan.n_recompute == plan.n_recompute
    probe = torch.from_numpy(plan.probe_positions())
    c = plan.tail_check_layer
    for layer in range(LAYERS):
        for a, b in ((out.keys[layer], bare.keys[layer]), (out.values[layer], bare.values[layer])):
            diff = (a[0][:, probe] - b[0][:, probe]).abs().max().item()
            if layer > c:  # restored in both
                assert diff == 0.0
            elif layer >= 1:  # recomputed here, restored there; the edit moved them
                assert diff > 1e-3


def test_a_middle_threshold_keeps_the_blocks_whose_deviation_reaches_it():
    eng = make_engine()
    old, new = edited_pair(eng.spec.vocab_size, seed=3)
    ckpt = eng.checkpoint(old)
    plan, fixed = run(eng, ckpt, new)  # fresh K/V of every window row at the check layer
    _, bare = run(eng, ckpt, new, recent_window=0)  # the restored rows
    probed_plan, _ = run(eng, ckpt, new, tail_threshold=1.0)
    probe = probed_plan.probe_positions()
    c = probed_plan.tail_check_layer
    idx = torch.from_numpy(probe)
    dev = row_deviation(bare.keys[c][0][:, idx], bare.values[c][0][:, idx], fixed.keys[c][0][:, idx],
                        fixed.values[c][0][:, idx])
    blocks = probed_plan.probe_blocks
    block_of = np.searchsorted(probed_plan.block_starts, probe, side="right") - 1
    block_dev = np.array([dev[block_of == b].max() for b in blocks])
    assert len(set(np.round(block_dev, 6))) > 1  # the blocks deviate differently
    tau = float(np.median(block_dev))
    _, out = run(eng, ckpt, new, tail_threshold=tau)
    kept = sorted(set(out.plan.repair_blocks) - set(probed_plan.repair_blocks))
    assert kept == sorted(blocks[block_dev >= tau].tolist()) and 0 < len(kept) < len(blocks)
    assert out.stats.extras["tail_deviation_max"] == pytest.approx(block_dev.max(), rel=1e-4)
    assert out.plan.n_recompute + out.plan.n_restore + out.plan.prefix_len == len(new)


def test_engine_resume_reports_what_ran_and_a_model_without_layerwise_forward_recomputes_the_window(monkeypatch):
    eng = make_engine()
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy=PatchKVStrategy(recent_window=WINDOW, tail_threshold=1e-12,
                                                         precision="fp16"), max_new_tokens=2)
    s = res.stats
    assert s["tail_recomputed_blocks"] > 0
    assert s["prefix_tokens"] + s["restore_tokens"] + s["recompute_tokens"] >= len(new) - 1
    assert s["restore_tokens"] == len(new) - s["recompute_tokens"] - min(s["prefix_tokens"], len(new) - 1)
    monkeypatch.setattr(layerwise, "LAYERWISE_MODEL_TYPES", frozenset())
    plan, out = run(eng, ckpt, new, tail_threshold=0.5)
    fixed_plan, fixed = run(eng, ckpt, new)
    assert out.stats.extras["tail_probe"].startswith("off: model type 'llama'")
    assert out.stats.recompute_tokens == fixed_plan.n_recompute
    assert (out.logits - fixed.logits).abs().max().item() <= TOL


def test_the_small_restore_rule_applies_to_what_the_probe_left_restored():
    eng = make_engine()
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    # every probed block kept: fewer rows stay restored than half the suffix, so the suffix is recomputed (exact)
    plan, out = run(eng, ckpt, new, tail_threshold=1e-12, min_restore_share=0.5, recent_window=10_000)
    assert not plan.small_restore and plan.probe_blocks.size  # the plan counted the probed blocks as restored
    assert out.plan.small_restore and out.plan.n_restore == 0 and out.stats.extras["tail_small_restore"]
    ref = eng.resume(None, new, strategy="exact", max_new_tokens=0)
    assert (out.logits - ref.logits).abs().max().item() <= TOL
    # none kept: the rows stay restored
    _, kept_none = run(eng, ckpt, new, tail_threshold=1e9, min_restore_share=0.5, recent_window=10_000)
    assert "tail_small_restore" not in kept_none.stats.extras and kept_none.plan.n_restore > 0


def test_a_strategy_spec_registers_a_strategy_with_options():
    from patchkv_agent.strategies import STRATEGIES, get_strategy, register_spec

    name = register_spec("patchkv:tail_threshold=0.03:recent_window=96")
    assert register_spec(name) == name and name in STRATEGIES  # idempotent
    s = get_strategy(name)
    assert s.name == name and dict(s.overrides)["tail_threshold"] == 0.03 and s.overrides["recent_window"] == 96
    assert register_spec("prefix") == "prefix"  # a plain name passes through
    for bad, match in (("patchkv:tail_threshold", "key=value"), ("patchkv:nope=1", "option"),
                       ("nothing:kappa=0.1", "unknown strategy"), ("patchkv:kappa=2", "kappa")):
        with pytest.raises(ValueError, match=match):
            register_spec(bad)


def test_the_strict_preset_recomputes_the_whole_window_whatever_the_engine_measures():
    from patchkv_agent.strategies import get_strategy

    eng = make_engine()
    eng.settings = eng.settings.replace(tail_threshold=0.5, recent_window=WINDOW)  # a profile that ships a tail
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    tail = eng.resume(ckpt, new, strategy="patchkv", max_new_tokens=0)
    strict = eng.resume(ckpt, new, strategy="patchkv-strict", max_new_tokens=0)
    fixed = eng.resume(ckpt, new, strategy=PatchKVStrategy(tail_threshold=0.0), max_new_tokens=0)
    assert "tail_recomputed_blocks" in tail.stats.to_json() and "tail_recomputed_blocks" not in strict.stats.to_json()
    assert strict.stats["recompute_tokens"] == fixed.stats["recompute_tokens"] > tail.stats["recompute_tokens"]
    assert (strict.logits - fixed.logits).abs().max().item() <= TOL
    assert "tail_threshold" not in get_strategy("patchkv-strict").option_names()
    with pytest.raises(ValueError, match="does not take|tail_threshold"):  # by name: not among its options
        get_strategy("patchkv-strict", {"tail_threshold": 0.02})
    from patchkv_agent.strategies import StrictPatchKVStrategy

    with pytest.raises(TypeError, match="fixes tail_threshold"):
        StrictPatchKVStrategy(tail_threshold=0.02)

"""The CacheBlend baseline on tiny fp32 models: exact at ratio 1, exact up to the check layer, stale
beyond it at ratio 0, and the selection equals the top value deviation computed from a full prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchkv_agent.strategies.cacheblend import CacheBlendStrategy, select_top_deviation
from patchkv_agent.core.diff import diff_versions
from test_recovery import assert_cache_equal, edited_pair, multi_edit_pair, oracle
from patchkv_agent.strategies import get_strategy
from tiny_models import family_engine

TOL = 1e-4
DEEP = 4  # layers: the tiny_model default of 2 leaves no layer after the default check layer 1


def engine_of(family: str):
    """The tiny engine of ``family`` with :data:`DEEP` layers, full-precision checkpoints (cacheblend restores
    full-precision rows)."""
    return family_engine(family, layers=DEEP, mixed_precision=False)


def run(eng, old, new, **options):
    """Call the strategy directly (its stats carry the selection, which the engine does not report)."""
    ckpt = eng.checkpoint(old)
    strat = CacheBlendStrategy(**options)
    edit = diff_versions(ckpt.token_ids, np.asarray(new))
    plan = strat.plan(eng.settings, ckpt, edit)
    return ckpt, edit, plan, strat.execute(eng.runner, eng.spec, eng.settings, ckpt, edit, plan, torch.tensor(new))


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm", "gemma3"])
def test_ratio_one_equals_full_prefill(family):
    eng = engine_of(family)
    old, new = multi_edit_pair(eng.spec.vocab_size)
    res = eng.resume(eng.checkpoint(old), new, strategy=get_strategy("cacheblend", {"ratio": 1.0}), max_new_tokens=1)
    ref_logits, ref_cache = oracle(eng.model, new)
    assert (res.logits - ref_logits).abs().max().item() <= TOL
    assert_cache_equal(res.cache, ref_cache, eng.spec.num_layers)
    assert res.stats["recompute_tokens"] == len(new) - res.stats["prefix_tokens"]
    assert res.stats["fallback"] is None


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_layers_up_to_check_layer_are_fresh_and_later_ones_stale(family):
    eng = engine_of(family)
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt, edit, plan, out = run(eng, old, new, ratio=0.0)
    fresh = eng.checkpoint(new)
    suffix = np.array(plan.restore_new_positions)
    for layer in (0, 1):  # layers <= check layer: every suffix row recomputed with exact history
        assert (out.keys[layer][0][:, suffix] - fresh.keys[layer][:, suffix]).abs().max().item() <= TOL
        assert (out.values[layer][0][:, suffix] - fresh.values[layer][:, suffix]).abs().max().item() <= TOL
    old_pos = np.array(plan.restore_old_positions)
    for layer in range(2, DEEP):  # beyond it, ratio 0 keeps the restored (stale) rows bit for bit
        assert torch.equal(out.values[layer][0][:, suffix], ckpt.values[layer][:, old_pos])
        assert (out.values[layer][0][:, suffix] - fresh.values[layer][:, suffix]).abs().max().item() > 1e-3
    ref_logits, _ = oracle(eng.model, new)
    assert (out.logits - ref_logits).abs().max().item() > 1e-4
    assert out.stats.extras["cacheblend_selected"] == 0
    assert out.stats.recompute_tokens == edit.new_token_count + 1  # X and the last token
    assert out.stats.extras["cacheblend_full_layers"] == 2
    assert out.stats.extras["cacheblend_full_tokens"] == len(new) - plan.prefix_len


@pytest.mark.parametrize("check_layer", [0, 1])
def test_selection_is_top_value_deviation_against_independent_reference(check_layer):
    eng = engine_of("qwen3")
    old, new = multi_edit_pair(eng.spec.vocab_size)
    ckpt, edit, plan, out = run(eng, old, new, ratio=0.15, check_layer=check_layer)
    # reference: layers <= check layer are exact, so the recomputed values are a full prefill's;
    # the cached ones are the checkpoint's (values never rotate)
    fresh = eng.checkpoint(new)
    newp, oldp = np.array(plan.restore_new_positions), np.array(plan.restore_old_positions)
    v_new = fresh.values[check_layer][:, newp].double()
    v_old = ckpt.values[check_layer][:, oldp].double()
    dev = torch.linalg.vector_norm((v_new - v_old).permute(1, 0, 2).reshape(len(newp), -1), dim=1).numpy()
    k = int(len(newp) * 0.15)
    expected = np.sort(newp[np.argsort(-dev)[:k]])
    assert k > 5 and np.array_equal(out.stats.extras["cacheblend_selected_positions"], expected)
    # selected rows carry hidden states of exact layers <= check, so at check+1 they equal a recompute over
    # the same stale cache; unselected suffix rows stay restored
    later = check_layer + 1
    unsel = np.setdiff1d(newp, expected)
    assert torch.equal(out.values[later][0][:, unsel], ckpt.values[later][:, oldp[np.searchsorted(newp, unsel)]])
    assert not torch.equal(out.values[later][0][:, expected], ckpt.values[later][:, oldp[np.searchsorted(newp, expected)]])
    assert out.stats.recompute_tokens == k + len(plan.recompute_positions)


def test_more_recompute_is_closer_to_exact():
    eng = engine_of("llama")
    old, new = edited_pair(eng.spec.vocab_size)
    ref_logits, _ = oracle(eng.model, new)
    errs = [(run(eng, old, new, ratio=r)[3].logits - ref_logits).abs().max().item() for r in (0.0, 1.0)]
    assert errs[1] <= TOL < errs[0]


def test_engine_reports_cacheblend_through_the_common_interface():
    eng = engine_of("llama")
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy="cacheblend", max_new_tokens=3)
    s = res.stats
    n_suffix = len(new) - s["prefix_tokens"] - s["new_tokens"]
    assert s["strategy"] == "cacheblend" and len(res.output_ids) == 3
    assert s["recompute_tokens"] == int(n_suffix - 1) * 15 // 100 + s["new_tokens"] + 1
    assert s["payload_bytes"] == (n_suffix - 1) * ckpt.bytes_per_token  # all of S but the last token restored
    assert s["restore_s"] >= 0 and s["recompute_s"] > 0


def test_select_top_deviation_and_bad_options():
    assert select_top_deviation(np.array([0.1, 0.9, 0.5, 0.9]), 0.5).tolist() == [1, 3]
    assert select_top_deviation(np.array([1.0, 2.0, 3.0]), 0.0).tolist() == []
    assert select_top_deviation(np.array([3.0, 1.0, 2.0]), 1.0).tolist() == [0, 1, 2]
    assert select_top_deviation(np.zeros(0), 0.5).tolist() == []
    with pytest.raises(ValueError, match="ratio"):
        CacheBlendStrategy(ratio=1.5)
    with pytest.raises(ValueError, match="check_layer"):
        CacheBlendStrategy(check_layer=-1)


def test_unsupported_family_is_refused_with_a_fix():
    eng = engine_of("llama")
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    eng.model.config.model_type = "mistral"  # a family whose decoder loop this module does not replicate
    try:
        with pytest.raises(ValueError, match="use 'direct'"):
            eng.resume(ckpt, new, strategy="cacheblend", max_new_tokens=1)
    finally:
        eng.model.config.model_type = "llama"

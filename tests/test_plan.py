"""Repair planner: exact block ids on hand-made edits, the length model, and the partition property."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.settings import RecoverySettings
from kv_helpers import plan_settings
from patchkv_agent.core.plan import (
    plan_blocks,
    plan_suffix_blocks,
    LengthModel,
    RepairPlan,
    plan_direct,
    plan_full,
    plan_repair,
)
from patchkv_agent.core.blocks import block_round, suffix_blocks

OLD = np.arange(1000, 1200, dtype=np.int64)  # 200 distinct tokens


def marks(n: int, base: int = 9000) -> np.ndarray:
    return np.arange(base, base + n, dtype=np.int64)


def rng(a: int, b: int) -> list[int]:
    return list(range(a, b))


def check_partition(plan: RepairPlan, edit) -> None:
    covered = np.zeros(plan.new_len, dtype=np.int64)
    covered[: plan.prefix_len] += 1
    np.add.at(covered, plan.restore_new_positions, 1)
    np.add.at(covered, plan.recompute_positions, 1)
    assert covered.tolist() == [1] * plan.new_len
    assert plan.new_len - 1 in plan.recompute_positions
    assert np.all(np.diff(plan.recompute_positions) > 0)
    assert np.all(np.diff(plan.restore_new_positions) > 0)
    assert plan.prefix_len <= edit.prefix_len
    # restored rows come from the same token in the old version
    assert np.array_equal(edit.new_to_old[plan.restore_new_positions], plan.restore_old_positions)
    assert np.isin(edit.new_positions, plan.recompute_positions).all()  # X is always recomputed
    assert sorted(plan.repair_blocks.tolist() + plan.restore_blocks.tolist()) == list(range(len(plan.block_starts)))


# --- hand-made cases ------------------------------------------------------------------------------------------------


def test_edit_at_start_empty_prefix():
    new = np.concatenate([marks(10), OLD[5:100]])  # span old[0,5) -> new[0,10); segment new[10,105)
    edit = diff_versions(OLD[:100], new)
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(20), block_size=32))
    assert plan.prefix_len == 0
    assert plan.block_starts.tolist() == [10, 42, 74] and plan.block_ends.tolist() == [42, 74, 105]
    assert plan.repair_blocks.tolist() == [0, 2]  # dirty window [10,30) and the last-token block
    assert plan.restore_blocks.tolist() == [1]
    assert plan.recompute_positions.tolist() == rng(0, 42) + rng(74, 105)
    assert plan.restore_new_positions.tolist() == rng(42, 74)
    assert plan.restore_old_positions.tolist() == rng(37, 69)
    assert plan.d_hat.tolist() == [20] and plan.n_dirty == 20 and plan.n_new_tokens == 10 and plan.n_suffix == 95
    check_partition(plan, edit)


def test_plan_blocks_recomputes_exactly_the_chosen_blocks():
    new = np.concatenate([marks(10), OLD[5:100]])  # suffix blocks [10,42) [42,74) [74,105)
    edit = diff_versions(OLD[:100], new)
    assert plan_suffix_blocks(edit, block_size=32).starts.tolist() == [10, 42, 74]
    plan = plan_blocks(edit, [1], block_size=32, strategy="probe")
    assert plan.strategy == "probe" and plan.repair_blocks.tolist() == [1, 2]  # + the last-token block
    assert plan.recompute_positions.tolist() == rng(0, 10) + rng(42, 105)
    assert plan.restore_new_positions.tolist() == rng(10, 42) and plan.restore_old_positions.tolist() == rng(5, 37)
    check_partition(plan, edit)
    assert plan_blocks(edit, [], block_size=32).repair_blocks.tolist() == [2]
    with pytest.raises(ValueError, match="repair blocks"):
        plan_blocks(edit, [3], block_size=32)


def test_edit_at_end_empty_suffix():
    edit = diff_versions(OLD[:100], np.concatenate([OLD[:90], marks(7)]))
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(32)))
    assert plan.prefix_len == 90
    assert plan.recompute_positions.tolist() == rng(90, 97)
    assert plan.restore_new_positions.size == 0 and plan.block_starts.size == 0
    assert plan.d_hat.tolist() == [0]
    check_partition(plan, edit)


def test_deletion_at_end_recomputes_last_prefix_token():
    edit = diff_versions(OLD[:100], OLD[:90])
    assert edit.prefix_len == 90
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(32)))
    assert plan.prefix_len == 89 and plan.recompute_positions.tolist() == [89]
    check_partition(plan, edit)


def test_identical_versions_recompute_only_last_token():
    edit = diff_versions(OLD[:50], OLD[:50])
    for plan in (plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(32))), plan_full(edit),
                                                       plan_direct(edit)):
        assert plan.prefix_len == 49
        assert plan.recompute_positions.tolist() == [49]
        assert plan.restore_new_positions.size == 0 and plan.repair_blocks.size == 0
        check_partition(plan, edit)


def _two_span_edit():
    # span0 old[20,30) -> 4 new tokens at new[20,24); seg0 old[30,100) -> new[24,94);
    # span1 deletes old[100,110) (empty at new 94); seg1 old[110,200) -> new[94,184)
    new = np.concatenate([OLD[:20], marks(4), OLD[30:100], OLD[110:200]])
    edit = diff_versions(OLD, new)
    assert len(edit.spans) == 2 and [s.new_start for s in edit.segments] == [24, 94]
    return edit


def test_several_spans():
    edit = _two_span_edit()
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(20), block_size=16))
    assert plan.block_starts.tolist() == [24, 40, 56, 72, 88, 94, 110, 126, 142, 158, 174]
    assert plan.block_ends.tolist() == [40, 56, 72, 88, 94, 110, 126, 142, 158, 174, 184]
    assert plan.repair_blocks.tolist() == [0, 1, 5, 6, 10]  # window after each span + last-token block
    assert plan.restore_blocks.tolist() == [2, 3, 4, 7, 8, 9]
    assert plan.recompute_positions.tolist() == rng(20, 56) + rng(94, 126) + rng(174, 184)
    assert plan.d_hat.tolist() == [20, 20] and plan.n_dirty == 40
    check_partition(plan, edit)


def test_suffix_blocks_match_edit_arrays():
    edit = _two_span_edit()
    blocks = suffix_blocks(edit, block_size=16)
    assert np.array_equal(blocks.new_positions, edit.suffix_new_positions)
    assert np.array_equal(blocks.old_positions, edit.suffix_old_positions)
    assert np.array_equal(blocks.distance, edit.suffix_distance)
    assert blocks.segment.tolist() == [0] * 5 + [1] * 6
    assert block_round([24, 39, 93, 94, 183, 5, 500], blocks).tolist() == [0, 4, 5, 10]
    assert block_round([], blocks).tolist() == []


def test_baseline_plans_on_several_spans():
    edit = _two_span_edit()
    full = plan_full(edit, block_size=16)
    assert full.strategy == "prefix" and full.prefix_len == 20
    assert full.recompute_positions.tolist() == rng(20, 184) and full.restore_new_positions.size == 0
    assert full.repair_blocks.tolist() == list(range(11))
    direct = plan_direct(edit, block_size=16)
    assert direct.strategy == "direct"
    assert direct.recompute_positions.tolist() == rng(20, 24) + [183]
    assert direct.restore_new_positions.tolist() == rng(24, 183)
    assert direct.restore_blocks.tolist() == list(range(11)) and direct.repair_blocks.size == 0
    check_partition(full, edit)
    check_partition(direct, edit)


@pytest.mark.parametrize("tail", [1, 5])
def test_suffix_shorter_than_a_block(tail):
    new = np.concatenate([OLD[:30], marks(4), OLD[40 - tail : 40]])
    edit = diff_versions(OLD[:40], new)
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=32))
    assert plan.block_starts.tolist() == [34] and plan.block_ends.tolist() == [34 + tail]
    assert plan.repair_blocks.tolist() == [0]  # the only block holds the last token
    assert plan.recompute_positions.tolist() == rng(30, 34 + tail)
    assert plan.restore_new_positions.size == 0 and plan.d_hat.tolist() == [0]
    check_partition(plan, edit)


def _insertion_edit():
    # insert 2 tokens at 10: span new[10,12); segment old[10,200) -> new[12,202), delta +2
    return diff_versions(OLD, np.concatenate([OLD[:10], marks(2), OLD[10:]]))


def test_kappa_picks_high_attention_blocks():
    edit = _insertion_edit()
    scores = np.zeros(200, dtype=np.float32)
    scores[100] = 0.5  # new 102: block 2 = [76,108)
    scores[150] = 0.3  # new 152: block 4 = [140,172)
    scores[14] = 0.9  # new 16: inside the dirty window, never counts for H
    lm = LengthModel.fixed(8)
    n_out = 190 - 8
    top1 = plan_repair(edit, scores, plan_settings(length_model=lm, kappa=1 / n_out))
    assert top1.block_starts.tolist() == [12, 44, 76, 108, 140, 172]
    assert top1.repair_blocks.tolist() == [0, 2, 5] and top1.n_high == 1
    top2 = plan_repair(edit, scores, plan_settings(length_model=lm, kappa=2 / n_out))
    assert top2.repair_blocks.tolist() == [0, 2, 4, 5] and top2.n_high == 2
    assert top2.restore_blocks.tolist() == [1, 3]
    check_partition(top2, edit)
    none = plan_repair(edit, None, plan_settings(length_model=lm, kappa=0.5))
    assert none.repair_blocks.tolist() == [0, 5] and none.n_high == 0
    everything = plan_repair(edit, scores, plan_settings(length_model=lm, kappa=1.0))
    assert everything.restore_new_positions.size == 0


def test_kappa_ties_break_by_position():
    edit = _insertion_edit()
    scores = np.ones(200)
    plan = plan_repair(edit, scores, plan_settings(length_model=LengthModel.fixed(8), kappa=1 / 182))
    assert plan.n_high == 1 and plan.repair_blocks.tolist() == [0, 5]  # first token outside D: new 20, block 0


def test_last_token_block_always_recomputed():
    edit = _insertion_edit()
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0)))
    assert plan.repair_blocks.tolist() == [5] and plan.n_dirty == 0
    assert plan.recompute_positions.tolist() == [10, 11] + rng(172, 202)


def test_plan_arrays_are_read_only():
    plan = plan_repair(_insertion_edit(), None, plan_settings(length_model=LengthModel.fixed(8)))
    with pytest.raises(ValueError):
        plan.recompute_positions[0] = 1


def test_bad_arguments():
    edit = _insertion_edit()
    with pytest.raises(ValueError, match="kappa"):
        plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(8), kappa=1.5))
    with pytest.raises(ValueError, match="old position"):
        plan_repair(edit, np.ones(5), plan_settings(length_model=LengthModel.fixed(8), kappa=0.1))
    with pytest.raises(ValueError, match="block_size"):
        plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(8), block_size=0))
    with pytest.raises(ValueError, match="empty"):
        plan_repair(diff_versions([1, 2], []), None, plan_settings(length_model=LengthModel.fixed(8)))


# --- length model ---------------------------------------------------------------------------------------------------


def test_fixed_length_model_is_exact_and_clipped():
    lm = LengthModel.fixed(32)
    assert lm.predict(np.array([5, 100]), np.array([3, 7]), np.array([1000, 10])).tolist() == [32, 10]
    assert LengthModel.fixed(0).predict(np.array([5]), np.array([3]), np.array([100])).tolist() == [0]
    with pytest.raises(ValueError):
        LengthModel.fixed(-1)


def test_length_model_formula_and_json_round_trip():
    w = (0.5, 0.1, 0.3, 0.2, -0.01, 0.02, 0.03)
    lm = LengthModel(weights=w, d_min=4, quantile=0.9)
    p, e, s = np.array([100, 0, 3000]), np.array([20, 1, 400]), np.array([500, 2, 5000])
    a, b, c = np.log1p(p), np.log1p(e), np.log1p(s)
    raw = np.exp(w[0] + w[1] * a + w[2] * b + w[3] * c + w[4] * a * b + w[5] * a * c + w[6] * b * c)
    expected = np.minimum(np.ceil(np.maximum(raw, 4) - 1e-6), s).astype(int)
    assert lm.predict(p, e, s).tolist() == expected.tolist()
    back = LengthModel.from_dict(json.loads(json.dumps(lm.to_dict())))
    assert back == lm
    assert LengthModel.from_dict(LengthModel.fixed(16).to_dict()) == LengthModel.fixed(16)
    with pytest.raises(ValueError):
        LengthModel(weights=(1.0, 2.0))
    with pytest.raises(ValueError):
        LengthModel(weights=(math.inf,) + (0.0,) * 6)
    with pytest.raises(ValueError, match="kind"):
        LengthModel.from_dict({"kind": "mlp", "weights": []})


def test_length_model_uses_per_span_features():
    edit = _two_span_edit()
    # d = exp(c) - 1 with c = log(1 + S_k): the window covers the whole segment after each span
    lm = LengthModel(weights=(0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0))
    plan = plan_repair(edit, None, plan_settings(length_model=lm, block_size=16))
    assert plan.d_hat.tolist() == [70, 90]
    assert plan.restore_new_positions.size == 0


# --- property: the plan partitions [0, new_len) ----------------------------------------------------------------------

_edit_op = st.tuples(st.integers(0, 2), st.integers(0, 300), st.integers(0, 40), st.integers(0, 40))


@settings(max_examples=120, deadline=None)
@given(
    n_old=st.integers(1, 300),
    ops=st.lists(_edit_op, max_size=4),
    kappa=st.floats(0.0, 1.0),
    d=st.integers(0, 64),
    block_size=st.sampled_from([1, 3, 8, 32]),
    seed=st.integers(0, 2**16),
)
def test_plan_partitions_new_context(n_old, ops, kappa, d, block_size, seed):
    old = list(range(n_old))
    new = list(old)
    marker = 10_000
    for kind, at, n_del, n_ins in ops:  # replace / insert / delete somewhere
        at = min(at, len(new))
        n_del = 0 if kind == 1 else n_del
        n_ins = 0 if kind == 2 else n_ins
        new[at : at + n_del] = range(marker, marker + n_ins)
        marker += n_ins
    if not new:
        new = [marker]
    edit = diff_versions(old, new)
    scores = np.random.default_rng(seed).random(n_old)
    plans = [
        plan_repair(edit, scores, plan_settings(length_model=LengthModel.fixed(d), kappa=kappa, block_size=block_size)),
        plan_full(edit, block_size=block_size),
        plan_direct(edit, block_size=block_size),
    ]
    for plan in plans:
        check_partition(plan, edit)
        # blocks never straddle an edited span and are block_size long at most
        assert np.all(plan.block_ends - plan.block_starts <= block_size)
        for lo, hi in zip(plan.block_starts, plan.block_ends):
            olds = edit.new_to_old[lo:hi]
            assert lo >= plan.prefix_len and np.all(olds >= 0) and np.all(np.diff(olds) == 1)
    rep = plans[0]
    # every repaired block is recomputed entirely; the dirty window is inside R
    for b in rep.repair_blocks:
        assert np.isin(np.arange(rep.block_starts[b], rep.block_ends[b]), rep.recompute_positions).all()
    blocks = suffix_blocks(edit, block_size=block_size, keep_from=rep.prefix_len)
    dirty = blocks.new_positions[blocks.distance < d]
    assert np.isin(dirty, rep.recompute_positions).all()


def _random_edit(seed: int):
    """``(rng, edit, scores)``: one replaced span in a random context, and random stored attention."""
    r = np.random.default_rng(seed)
    old = r.integers(0, 500, size=int(r.integers(80, 400))).astype(np.int64)
    cut = int(r.integers(1, len(old) - 10))
    new = np.concatenate([old[:cut], marks(int(r.integers(1, 20))), old[cut + int(r.integers(0, 9)):]])
    return r, diff_versions(old, new), r.random(len(old)).astype(np.float32)


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("window", [1, 31, 100, 10_000])
def test_recency_window_recomputes_the_last_restored_tokens_blocks(seed, window):
    """The recency rule against its definition: take the plan without it, the last ``window`` tokens it
    restores (by new position), and recompute their whole blocks; nothing else changes."""
    r, edit, scores = _random_edit(seed)
    kw = dict(length_model=LengthModel.fixed(int(r.integers(0, 40))), kappa=0.05, block_size=16)
    base = plan_repair(edit, scores, plan_settings(**kw))
    got = plan_repair(edit, scores, plan_settings(recent_window=window, **kw))
    check_partition(got, edit)
    blocks_of = np.searchsorted(base.block_ends, base.restore_new_positions, side="right")
    want = set(base.repair_blocks.tolist()) | set(blocks_of[-window:].tolist())
    assert set(got.repair_blocks.tolist()) == want
    assert got.n_recent == len(want) - len(base.repair_blocks)
    assert set(base.recompute_positions.tolist()) <= set(got.recompute_positions.tolist())
    if window >= len(base.restore_new_positions):
        assert got.n_restore == 0  # the whole suffix is recomputed
    assert plan_repair(edit, scores, plan_settings(recent_window=0,
                                                   **kw)).repair_blocks.tolist() == base.repair_blocks.tolist()


def test_recency_window_is_validated():
    edit = diff_versions(np.arange(50), np.concatenate([np.arange(20), marks(3), np.arange(25, 50)]))
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="recent_window"):
            plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(4), recent_window=bad))


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("share", [0.2, 0.5, 0.9])
def test_small_restore_rule_recomputes_the_suffix_when_little_would_be_restored(seed, share):
    """The small-restore rule against its definition: the plan without it restores ``F``; when ``|F|`` is
    below ``share`` of the suffix the plan recomputes every suffix token (the prefix plan's rows, exact),
    else it is the plan without the rule."""
    r, edit, scores = _random_edit(seed)
    kw = dict(length_model=LengthModel.fixed(int(r.integers(0, 120))), kappa=float(r.choice([0.0, 0.3])),
              block_size=16, recent_window=int(r.choice([0, 64])))
    base = plan_repair(edit, scores, plan_settings(**kw))
    got = plan_repair(edit, scores, plan_settings(min_restore_share=share, **kw))
    check_partition(got, edit)
    if base.n_restore < share * base.n_suffix:
        full = plan_full(edit, block_size=16)
        assert got.small_restore and got.n_restore == 0
        assert got.recompute_positions.tolist() == full.recompute_positions.tolist()
    else:
        assert not got.small_restore
        assert got.recompute_positions.tolist() == base.recompute_positions.tolist()
        assert got.restore_old_positions.tolist() == base.restore_old_positions.tolist()


def test_small_restore_share_is_validated():
    edit = diff_versions(np.arange(50), np.concatenate([np.arange(20), marks(3), np.arange(25, 50)]))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_restore_share"):
            plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(4), min_restore_share=bad))
    with pytest.raises(ValueError, match="min_restore_share"):
        RecoverySettings(min_restore_share=2.0)

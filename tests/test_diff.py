"""Tests for patchkv_agent.core.diff: hand-made cases with exact values, input handling, and hypothesis properties."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from patchkv_agent.core.diff import AlignedSegment, Edit, EditedSpan, diff_versions


def spans(e: Edit) -> list[tuple[int, int, int, int]]:
    return [(s.old_start, s.old_end, s.new_start, s.new_end) for s in e.spans]


def segs(e: Edit) -> list[tuple[int, int, int]]:
    return [(s.old_start, s.new_start, s.length) for s in e.segments]


def eq(a, b) -> bool:
    return np.array_equal(np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64))


# ---------------------------------------------------------------------------------------------------------------------
# Hand-made cases
# ---------------------------------------------------------------------------------------------------------------------


def test_identical():
    old = list(range(50))
    e = diff_versions(old, list(old))
    assert e.identical and e.prefix_len == 50 and e.spans == () and e.segments == ()
    assert e.suffix_len == 0 and e.new_token_count == 0
    assert eq(e.old_to_new, range(50)) and eq(e.new_to_old, range(50))
    assert e.new_positions.shape == (0,) and e.suffix_distance.shape == (0,)


def test_empty_versions():
    e = diff_versions([], [])
    assert e.identical and e.prefix_len == 0 and e.old_to_new.shape == (0,)
    e = diff_versions([], [4, 5])
    assert spans(e) == [(0, 0, 0, 2)] and segs(e) == [] and eq(e.new_positions, [0, 1])
    e = diff_versions([4, 5], [])
    assert spans(e) == [(0, 2, 0, 0)] and eq(e.old_to_new, [-1, -1]) and e.new_token_count == 0


def test_pure_append():
    e = diff_versions(list(range(10)), list(range(12)))
    assert e.prefix_len == 10 and spans(e) == [(10, 10, 10, 12)] and segs(e) == []
    assert not e.identical and e.suffix_len == 0 and e.new_token_count == 2
    assert eq(e.new_positions, [10, 11]) and eq(e.new_to_old, list(range(10)) + [-1, -1])
    assert e.spans[0].old_len == 0 and e.spans[0].new_len == 2 and e.spans[0].delta == 2


def test_insertion():
    old = list(range(20))
    e = diff_versions(old, old[:5] + [100, 101] + old[5:])
    assert e.prefix_len == 5 and spans(e) == [(5, 5, 5, 7)] and segs(e) == [(5, 7, 15)]
    seg = e.segments[0]
    assert seg.delta == 2 and seg.distance_base == 7 and seg.old_end == 20 and seg.new_end == 22
    assert eq(e.new_positions, [5, 6]) and eq(e.suffix_distance, range(15))
    assert eq(e.suffix_old_positions, range(5, 20)) and eq(e.suffix_new_positions, range(7, 22))
    assert eq(e.old_to_new, list(range(5)) + list(range(7, 22)))
    assert eq(e.new_to_old, list(range(5)) + [-1, -1] + list(range(5, 20)))


def test_deletion():
    old = list(range(20))
    e = diff_versions(old, old[:5] + old[9:])
    assert e.prefix_len == 5 and spans(e) == [(5, 9, 5, 5)] and segs(e) == [(9, 5, 11)]
    assert e.spans[0].delta == -4 and e.segments[0].delta == -4 and e.new_token_count == 0
    assert eq(e.old_to_new, list(range(5)) + [-1] * 4 + list(range(5, 16)))
    assert eq(e.new_to_old, list(range(5)) + list(range(9, 20)))
    assert eq(e.suffix_distance, range(11))


def test_edit_at_position_zero():
    e = diff_versions([1, 2, 3, 4], [9, 2, 3, 4])
    assert e.prefix_len == 0 and spans(e) == [(0, 1, 0, 1)] and segs(e) == [(1, 1, 3)]
    assert eq(e.old_to_new, [-1, 1, 2, 3]) and eq(e.new_positions, [0])


def test_edit_touching_the_end():
    e = diff_versions([1, 2, 3, 4], [1, 2, 3, 9, 8])
    assert e.prefix_len == 3 and spans(e) == [(3, 4, 3, 5)] and segs(e) == [] and e.suffix_len == 0
    e = diff_versions([1, 2, 3, 4], [1, 2])  # truncation
    assert e.prefix_len == 2 and spans(e) == [(2, 4, 2, 2)] and segs(e) == []


def test_total_replacement():
    e = diff_versions([1, 2, 3], [4, 5])
    assert e.prefix_len == 0 and spans(e) == [(0, 3, 0, 2)] and segs(e) == []
    assert eq(e.old_to_new, [-1, -1, -1]) and eq(e.new_to_old, [-1, -1]) and eq(e.new_positions, [0, 1])


def test_several_spans():
    old = list(range(100))
    new = old[:10] + [1000, 1001] + old[13:40] + old[45:70] + [2000] * 3 + old[70:]
    e = diff_versions(old, new)
    assert e.prefix_len == 10
    assert spans(e) == [(10, 13, 10, 12), (40, 45, 39, 39), (70, 70, 64, 67)]
    assert segs(e) == [(13, 12, 27), (45, 39, 25), (70, 67, 30)]
    assert [s.delta for s in e.segments] == [-1, -6, -3]
    assert [s.distance_base for s in e.segments] == [12, 39, 67]
    assert e.suffix_len == 82 and e.new_token_count == 5
    assert eq(e.new_positions, [10, 11, 64, 65, 66])
    assert eq(e.suffix_distance, list(range(27)) + list(range(25)) + list(range(30)))


def test_min_match_merges_close_edits():
    old = list(range(100))
    new = list(old)
    new[50], new[53] = 500, 503  # two edits 2 tokens apart
    assert spans(diff_versions(old, new)) == [(50, 54, 50, 54)]
    e = diff_versions(old, new, min_match=2)
    assert spans(e) == [(50, 51, 50, 51), (53, 54, 53, 54)] and segs(e) == [(51, 51, 2), (54, 54, 46)]


@pytest.mark.parametrize(
    ("old", "new", "prefix", "expected_spans"),
    [
        ([1, 1, 1], [1, 1], 2, [(2, 3, 2, 2)]),
        ([1, 1], [1, 1, 1], 2, [(2, 2, 2, 3)]),
        ([1, 2, 1], [1], 1, [(1, 3, 1, 1)]),
        ([1, 2, 1, 2], [1, 2], 2, [(2, 4, 2, 2)]),
        ([7, 1, 1, 1], [7, 1, 1, 1, 1], 4, [(4, 4, 4, 5)]),
    ],
)
def test_repeated_tokens_prefix_suffix_do_not_overlap(old, new, prefix, expected_spans):
    e = diff_versions(old, new)
    assert e.prefix_len == prefix and spans(e) == expected_spans and segs(e) == []


def test_anchor_free_repeated_middle_uses_fallback():
    old = [9] + [1] * 20 + [8, 2]
    new = [7] + [1] * 20 + [6, 3]
    e = diff_versions(old, new)
    assert spans(e) == [(0, 1, 0, 1), (21, 23, 21, 23)] and segs(e) == [(1, 1, 20)]


def test_moved_block_keeps_the_longest_consistent_match():
    a, b = list(range(100, 140)), list(range(200, 220))
    e = diff_versions([0] + a + b + [1], [2] + b + a + [3])
    assert segs(e) == [(1, 21, 40)]  # the longer block wins; the crossing one is an edit
    assert spans(e) == [(0, 1, 0, 21), (41, 62, 61, 62)]


# ---------------------------------------------------------------------------------------------------------------------
# Inputs, validation, immutability
# ---------------------------------------------------------------------------------------------------------------------


class _FakeCudaTensor:
    """Mimics a device tensor: np.asarray fails, tolist works."""

    def __init__(self, data):
        self._data = list(data)

    def __array__(self, *args, **kwargs):
        raise TypeError("can't convert cuda tensor to numpy")

    def tolist(self):
        return list(self._data)


class _Iterable:
    def __init__(self, data):
        self._data = list(data)

    def __len__(self):
        return len(self._data)

    def __iter__(self):
        return iter(self._data)


@pytest.mark.parametrize(
    "convert",
    [list, tuple, np.array, lambda x: np.array(x, dtype=np.int32), lambda x: np.array(x, dtype=np.uint16),
     _FakeCudaTensor, _Iterable, lambda x: (t for t in x)],
)
def test_input_forms(convert):
    old = list(range(30))
    new = old[:10] + [99] + old[12:]
    e = diff_versions(convert(old), convert(new))
    assert e.prefix_len == 10 and spans(e) == [(10, 12, 10, 11)] and segs(e) == [(12, 11, 18)]


def test_torch_tensor_input():
    torch = pytest.importorskip("torch")
    e = diff_versions(torch.arange(30), torch.cat([torch.arange(10), torch.tensor([99]), torch.arange(12, 30)]))
    assert spans(e) == [(10, 12, 10, 11)] and segs(e) == [(12, 11, 18)]


@pytest.mark.parametrize(
    "bad", [np.zeros((2, 3), dtype=np.int64), 5, [[1, 2], [3, 4]], [1.5, 2.0], "abc", [[1], [2, 3]]]
)
def test_rejects_bad_input(bad):
    with pytest.raises(ValueError):
        diff_versions(bad, [1, 2, 3])
    with pytest.raises(ValueError):
        diff_versions([1, 2, 3], bad)


@pytest.mark.parametrize("mm", [0, -1, 2.5, True])
def test_rejects_bad_min_match(mm):
    with pytest.raises(ValueError):
        diff_versions([1, 2], [1, 3], min_match=mm)


def test_frozen_and_readonly():
    e = diff_versions(list(range(20)), [5] + list(range(20)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.prefix_len = 3  # type: ignore[misc]
    with pytest.raises(ValueError):
        e.old_to_new[0] = 7
    assert e == diff_versions(list(range(20)), [5] + list(range(20)))


def test_layout_validation():
    with pytest.raises(ValueError):
        EditedSpan(old_start=3, old_end=3, new_start=4, new_end=4)
    with pytest.raises(ValueError):
        AlignedSegment(old_start=0, new_start=0, length=0)
    with pytest.raises(ValueError):  # segment not preceded by a span
        Edit(old_len=5, new_len=5, prefix_len=2, spans=(),
             segments=(AlignedSegment(old_start=2, new_start=2, length=3),))
    with pytest.raises(ValueError):  # does not cover the versions
        Edit(old_len=5, new_len=5, prefix_len=2, spans=(EditedSpan(old_start=2, old_end=3, new_start=2, new_end=3),),
             segments=())
    ok = Edit(old_len=5, new_len=4, prefix_len=1, spans=[EditedSpan(old_start=1, old_end=2, new_start=1, new_end=1)],
              segments=[AlignedSegment(old_start=2, new_start=1, length=3)])
    assert isinstance(ok.spans, tuple) and eq(ok.new_to_old, [0, 2, 3, 4])


def test_10k_tokens_three_spans():
    """Structure on a long input (speed belongs to benchmarks, not tests)."""
    rng = np.random.default_rng(0)
    old = rng.integers(0, 32000, 10000)
    new = np.concatenate([old[:2000], rng.integers(0, 32000, 150), old[2100:6000], old[6050:9000],
                          rng.integers(0, 32000, 40), old[9000:]])
    e = diff_versions(old, new)
    assert len(e.spans) == 3
    assert e.prefix_len == 2000 and e.suffix_len == 3900 + 2950 + 1000


# ---------------------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------------------


@st.composite
def version_pairs(draw):
    vocab = draw(st.sampled_from([2, 5, 1000]))
    old = draw(st.lists(st.integers(0, vocab - 1), max_size=150))
    new = list(old)
    for _ in range(draw(st.integers(0, 5))):
        pos = draw(st.integers(0, len(new)))
        n_del = draw(st.integers(0, min(12, len(new) - pos)))
        ins = draw(st.lists(st.integers(0, vocab + 20), max_size=12))
        new[pos : pos + n_del] = ins
    return old, new, draw(st.sampled_from([1, 2, 3, 8]))


def check_invariants(old: list[int], new: list[int], e: Edit, min_match: int) -> None:
    o, n = np.asarray(old, dtype=np.int64), np.asarray(new, dtype=np.int64)
    p = e.prefix_len
    assert (e.old_len, e.new_len) == (len(old), len(new))
    assert e.identical == (old == new) == (e.spans == ())
    assert old[:p] == new[:p] and (p == min(len(old), len(new)) or old[p] != new[p])  # P maximal
    # Layout: P, then alternating span / segment, contiguous on both sides, covering both versions.
    assert len(e.segments) in (len(e.spans), len(e.spans) - 1) or not e.spans
    oa = na = p
    for k, sp in enumerate(e.spans):
        assert (sp.old_start, sp.new_start) == (oa, na) and (sp.old_len > 0 or sp.new_len > 0)
        oa, na = sp.old_end, sp.new_end
        if k < len(e.segments):
            sg = e.segments[k]
            assert (sg.old_start, sg.new_start) == (oa, na) and sg.length >= 1
            assert old[sg.old_start : sg.old_end] == new[sg.new_start : sg.new_end]
            assert sg.old_start >= p and sg.new_start >= p  # S never overlaps P
            if (sg.old_end, sg.new_end) != (len(old), len(new)):
                assert sg.length >= min_match
            oa, na = sg.old_end, sg.new_end
    assert (oa, na) == (len(old), len(new))
    # The tail segment is exactly the common suffix, bounded so it never overlaps P.
    s = 0
    while s < min(len(old), len(new)) - p and old[len(old) - 1 - s] == new[len(new) - 1 - s]:
        s += 1
    tail = [g for g in e.segments if (g.old_end, g.new_end) == (len(old), len(new))]
    assert [g.length for g in tail] == ([s] if s else [])
    # Position maps.
    kept = np.flatnonzero(e.old_to_new >= 0)
    tgt = e.old_to_new[kept]
    assert np.all(np.diff(tgt) > 0)
    assert np.array_equal(n[tgt], o[kept]) and np.array_equal(e.new_to_old[tgt], kept)
    reused = np.flatnonzero(e.new_to_old >= 0)
    assert reused.shape == kept.shape and np.array_equal(e.old_to_new[e.new_to_old[reused]], reused)
    assert np.array_equal(np.flatnonzero(e.new_to_old < 0), e.new_positions)
    assert e.new_token_count == sum(sp.new_len for sp in e.spans) == len(new) - len(kept)
    # Suffix arrays.
    assert e.suffix_len == sum(g.length for g in e.segments) == len(kept) - p
    assert np.array_equal(e.old_to_new[e.suffix_old_positions], e.suffix_new_positions)
    assert np.all(e.suffix_new_positions >= p) and np.all(e.suffix_old_positions >= p)
    assert np.all(e.suffix_distance >= 0)
    bases = np.concatenate([[g.distance_base] * g.length for g in e.segments]) if e.segments else np.zeros(0)
    assert np.array_equal(e.suffix_new_positions - bases, e.suffix_distance)
    for g in e.segments:
        assert e.suffix_distance[np.searchsorted(e.suffix_new_positions, g.new_start)] == 0
    for arr in (e.old_to_new, e.new_to_old, e.suffix_old_positions, e.suffix_new_positions, e.suffix_distance,
                e.new_positions):
        assert arr.dtype == np.int64 and not arr.flags.writeable


@settings(max_examples=300, deadline=None)
@given(version_pairs())
def test_properties(case):
    old, new, min_match = case
    check_invariants(old, new, diff_versions(old, new, min_match=min_match), min_match)


@settings(max_examples=300, deadline=None)
@given(version_pairs())
def test_properties_reversed_direction(case):
    old, new, min_match = case
    check_invariants(new, old, diff_versions(new, old, min_match=min_match), min_match)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32), st.integers(1, 6))
def test_properties_long_versions(seed, n_edits):
    """Long versions (the anchored path, not the SequenceMatcher fallback) with several distinct edits."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 500, int(rng.integers(500, 3000))).tolist()
    new = list(old)
    for _ in range(n_edits):
        pos = int(rng.integers(0, len(new) + 1))
        n_del = int(rng.integers(0, 80))
        new[pos : pos + n_del] = rng.integers(1000, 1500, int(rng.integers(0, 80))).tolist()
    check_invariants(old, new, diff_versions(old, new), 8)


def test_with_words_attaches_a_signal_to_a_diff_made_without_one():

    rng = np.random.default_rng(3)
    old = rng.integers(0, 50, 400)
    new = np.concatenate([old[:100], rng.integers(0, 50, 30), old[120:]])

    def words(ids):
        return np.asarray(ids, dtype=np.int64) // 3  # any per-position map: a word id per token

    plain = diff_versions(old, new)
    _ = plain.suffix_new_positions  # a derived array, computed before the signal is attached
    got = plain.with_words(words, words(old))
    want = diff_versions(old, new, words=words, old_words=words(old))
    assert got == want  # same structure
    np.testing.assert_array_equal(got.suffix_new_positions, want.suffix_new_positions)
    np.testing.assert_array_equal(got.new_to_old, want.new_to_old)
    np.testing.assert_array_equal(got.new_words(), want.new_words())
    for a, b in zip(got.words(), want.words()):
        np.testing.assert_array_equal(a, b)
    assert plain.word_index is None and plain.new_words() is None  # the original is unchanged
    assert plain.with_words(words, np.zeros(3, dtype=np.int64)).old_words is None  # wrong length: ignored

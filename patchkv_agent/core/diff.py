"""Token-level diff of two context versions of one agent thread.

``C_old = P + M_old + S`` and ``C_new = P + M_new + S`` (docs/DESIGN.md section 2), generalized to several
edited spans: after the exact-hit prefix ``P`` the two versions alternate between *edited spans*
(``M_old``/``M_new`` pairs, either side may be empty) and *aligned segments* (runs of identical tokens,
shifted by their own ``delta``), so ``S`` is the union of the segments.

Boundary: this module knows nothing about models, tokenizers, torch or KV caches. It takes token ids
(anything convertible to a 1-D integer numpy array) and returns frozen dataclasses holding plain ints and
read-only int64 numpy arrays. It depends on numpy and the standard library only.

Algorithm: ``P`` is the longest common prefix; ``s`` the longest common suffix of what is left, bounded so
that it never overlaps ``P``. The middles ``old[P:-s]`` / ``new[P:-s]`` are aligned patience-style: k-grams
(``k = min(min_match, 32)``) that occur exactly once in both sides are anchors, anchors are grouped into
diagonal runs and extended to maximal matches, and the longest mutually consistent (monotone,
non-crossing) matches are kept; the gaps between them are aligned again recursively. Gaps without unique
anchors fall back to :class:`difflib.SequenceMatcher` when they are small (bounded total work); large
anchor-free gaps (e.g. long runs of one repeated token) stay inside an edited span. Only matches of at least
``min_match`` tokens become middle segments. Cost: two 10,000-token versions with three
edited spans diff in ~8 ms on one CPU thread.
"""

from __future__ import annotations

import bisect
import difflib
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable

import numpy as np

from .runs import expand_runs

__all__ = ["AlignedSegment", "Edit", "EditedSpan", "diff_versions"]

_ANCHOR_MAX_K = 32  # anchor k-gram length cap (k = min(min_match, this))
_FALLBACK_MAX_CELLS = 1 << 16  # SequenceMatcher only on anchor-free gaps with len_a * len_b <= this,
_FALLBACK_BUDGET = 1 << 18  # and on at most this many cells per diff (bounds the worst case)
_SAMPLE_FROM = 4096  # ranges with more k-grams than this look for anchors among a content-defined sample ...
_SAMPLE_MASK = np.uint64(15)  # ... the k-grams whose hash is 0 mod 16 (both sides keep the same k-grams)
_SMALL_RANGE = 512  # ranges of at most this many tokens (both sides) find their anchors in Python
_MIX = np.uint64(0x9E3779B97F4A7C15)
_BASE = np.uint64(0xC2B2AE3D27D4EB4F)


@dataclass(frozen=True, kw_only=True)
class EditedSpan:
    """One edited region: ``M_old = old[old_start:old_end]`` became ``M_new = new[new_start:new_end]``.

    Either side may be empty (insertion: empty old side; deletion: empty new side), not both.
    """

    old_start: int
    old_end: int
    new_start: int
    new_end: int

    def __post_init__(self) -> None:
        if not (0 <= self.old_start <= self.old_end and 0 <= self.new_start <= self.new_end):
            raise ValueError(f"invalid span bounds: {self}")
        if self.old_start == self.old_end and self.new_start == self.new_end:
            raise ValueError(f"edited span is empty on both sides: {self}")

    @property
    def old_len(self) -> int:
        return self.old_end - self.old_start

    @property
    def new_len(self) -> int:
        return self.new_end - self.new_start

    @property
    def delta(self) -> int:
        """``new_len - old_len``: the position shift this span adds to everything after it."""
        return self.new_len - self.old_len


@dataclass(frozen=True, kw_only=True)
class AlignedSegment:
    """A run of ``length`` tokens identical in both versions: ``old[old_start:old_start+length] ==
    new[new_start:new_start+length]``. Reuse candidates (same tokens, shifted positions, stale history)."""

    old_start: int
    new_start: int
    length: int

    def __post_init__(self) -> None:
        if self.old_start < 0 or self.new_start < 0 or self.length < 1:
            raise ValueError(f"invalid aligned segment: {self}")

    @property
    def old_end(self) -> int:
        return self.old_start + self.length

    @property
    def new_end(self) -> int:
        return self.new_start + self.length

    @property
    def delta(self) -> int:
        """``new_start - old_start``: the RoPE position shift of this segment."""
        return self.new_start - self.old_start

    @property
    def distance_base(self) -> int:
        """New position of the end of the edited span right before this segment (``d_i = new_pos - base``).

        Every segment directly follows an edited span (a deletion's empty ``M_new`` sits at this position
        too), so this equals ``new_start``.
        """
        return self.new_start


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a


# the derived position arrays of an Edit (cached properties), which depend on its spans and segments only
_POSITION_ARRAYS = ("old_to_new", "new_to_old", "suffix_old_positions", "suffix_new_positions", "suffix_distance",
                    "new_positions")


@dataclass(frozen=True, kw_only=True)
class Edit:
    """The diff of two context versions: prefix ``P``, edited spans and aligned suffix segments.

    Layout, on both the old and the new side: ``[0, prefix_len)`` is ``P``, then span 0, segment 0,
    span 1, segment 1, ... in order, contiguous, covering ``[0, old_len)`` resp. ``[0, new_len)``. The
    last span may or may not be followed by a segment. ``spans`` is empty iff the versions are identical.

    Derived read-only int64 arrays (computed on first use from the spans and segments, then cached):
        old_to_new: ``[old_len]`` new position of each kept old token (prefix and segments), ``-1`` if dropped.
        new_to_old: ``[new_len]`` old position of each reused new token, ``-1`` for new tokens (``X``).
        suffix_new_positions / suffix_old_positions: ``[|S|]`` positions of the suffix tokens, in order.
        suffix_distance: ``[|S|]`` ``d_i``, distance from the end of the preceding edited span in new
            coordinates (0 for the first token after a span).
        new_positions: ``[|X|]`` new positions of all tokens of the ``M_new`` spans, in order.
    """

    old_len: int
    new_len: int
    prefix_len: int
    spans: tuple[EditedSpan, ...]
    segments: tuple[AlignedSegment, ...]
    old_ids: np.ndarray | None = field(default=None, repr=False, compare=False)  # the diffed versions, when known
    new_ids: np.ndarray | None = field(default=None, repr=False, compare=False)
    word_index: Callable[[np.ndarray], np.ndarray] | None = field(default=None, repr=False, compare=False)
    old_words: np.ndarray | None = field(default=None, repr=False, compare=False)  # word ids of old_ids, when known

    def __post_init__(self) -> None:
        object.__setattr__(self, "spans", tuple(self.spans))
        object.__setattr__(self, "segments", tuple(self.segments))
        self._check_layout()

    # The per-token arrays below are derived from the spans and segments on first use and cached: the resume
    # path (plan, word carry) works on the runs, so a diff costs the edits, not the context.

    @cached_property
    def old_to_new(self) -> np.ndarray:
        """``[old_len]`` new position of each kept old token (prefix and segments), ``-1`` if dropped."""
        o2n = np.full(self.old_len, -1, dtype=np.int64)
        o2n[: self.prefix_len] = np.arange(self.prefix_len, dtype=np.int64)
        o2n[self.suffix_old_positions] = self.suffix_new_positions
        return _readonly(o2n)

    @cached_property
    def new_to_old(self) -> np.ndarray:
        """``[new_len]`` old position of each reused new token, ``-1`` for new tokens (``X``)."""
        n2o = np.full(self.new_len, -1, dtype=np.int64)
        n2o[: self.prefix_len] = np.arange(self.prefix_len, dtype=np.int64)
        n2o[self.suffix_new_positions] = self.suffix_old_positions
        return _readonly(n2o)

    @cached_property
    def suffix_old_positions(self) -> np.ndarray:
        """``[|S|]`` old positions of the suffix tokens, in order."""
        return _readonly(expand_runs([s.old_start for s in self.segments], [s.length for s in self.segments]))

    @cached_property
    def suffix_new_positions(self) -> np.ndarray:
        """``[|S|]`` new positions of the suffix tokens, in order."""
        return _readonly(expand_runs([s.new_start for s in self.segments], [s.length for s in self.segments]))

    @cached_property
    def suffix_distance(self) -> np.ndarray:
        """``[|S|]`` ``d_i``: distance from the end of the preceding edited span (new coordinates)."""
        return _readonly(expand_runs([0] * len(self.segments), [s.length for s in self.segments]))

    @cached_property
    def new_positions(self) -> np.ndarray:
        """``[|X|]`` new positions of all tokens of the ``M_new`` spans, in order."""
        return _readonly(expand_runs([s.new_start for s in self.spans], [s.new_len for s in self.spans]))

    def with_words(self, words: Callable[[np.ndarray], np.ndarray] | None,
                   old_words: np.ndarray | None = None) -> "Edit":
        """This diff with another word signal attached (``words`` and ``old_words`` as in
        :func:`diff_versions`).

        The diff is on token ids alone, so a caller that diffed without words (the thread registry's context
        choice) hands its diff to the resume, which attaches its own signal here instead of diffing again;
        the position arrays already derived are kept.
        """
        e = replace(self, word_index=words,
                    old_words=old_words if old_words is not None and len(old_words) == self.old_len else None)
        for name in _POSITION_ARRAYS:
            if name in self.__dict__:
                e.__dict__[name] = self.__dict__[name]
        return e

    def words(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Word id per position of both versions (read-only int64 arrays), from ``word_index``.

        The old version's are ``old_words`` when given (carried with its checkpoint), else mapped whole; the
        new version's come from :meth:`new_words`. Computed on first use and cached, so strategies that
        never read words do not pay for them.

        Returns:
            ``(old_words, new_words)``, or None without a ``word_index``, ids or edited spans.
        Raises:
            ValueError: ``word_index`` (or ``old_words``) gives another number of ids than tokens.
        """
        if not self.spans:
            return None
        old = self._old_words()
        new = self.new_words()
        return None if old is None or new is None else (old, new)

    def _old_words(self) -> np.ndarray | None:
        got = self.__dict__.get("_old_words_cache")
        if got is None and self.old_ids is not None:
            if self.old_words is not None:
                got = self.old_words
            elif self.word_index is not None:
                got = self.word_index(self.old_ids)
            if got is not None:
                got = _readonly(np.asarray(got, dtype=np.int64).ravel())
                if got.shape != self.old_ids.shape:
                    raise ValueError(f"{got.shape[0]} old word ids for {self.old_len} tokens; word ids come one "
                                     "per position")
                object.__setattr__(self, "_old_words_cache", got)
        return got

    def new_words(self) -> np.ndarray | None:
        """Word id per position of the new version (read-only int64), or None without ``word_index`` or ids.

        With a ``word_index`` that has ``carry_runs`` (a :class:`~patchkv_agent.core.lexicon.WordIndex`),
        only the words touching the edited spans are read; the rest are the old version's ids copied run by
        run (prefix and aligned segments). Cached on first use.

        Raises:
            ValueError: ``word_index`` returned another number of ids than tokens.
        """
        got = self.__dict__.get("_new_words_cache")
        if got is not None or self.word_index is None or self.new_ids is None:
            return got
        carry = getattr(self.word_index, "carry_runs", None)
        old = self._old_words() if callable(carry) else None
        if old is not None:
            runs = [(0, 0, self.prefix_len)] + [(s.new_start, s.old_start, s.length) for s in self.segments]
            got = carry(self.new_ids, old, runs, [(s.new_start, s.new_end) for s in self.spans])
        else:
            got = self.word_index(self.new_ids)
        got = _readonly(np.asarray(got, dtype=np.int64).ravel())
        if got.shape != self.new_ids.shape:
            raise ValueError(f"word_index returned {got.shape[0]} ids for {self.new_len} tokens; it must return "
                             "one word id per position")
        object.__setattr__(self, "_new_words_cache", got)
        return got

    def _check_layout(self) -> None:
        if not (0 <= self.prefix_len <= min(self.old_len, self.new_len)):
            raise ValueError(f"prefix_len {self.prefix_len} out of range for lengths {self.old_len}, {self.new_len}")
        n_sp, n_sg = len(self.spans), len(self.segments)
        if n_sg not in (n_sp, n_sp - 1) or (n_sp == 0 and n_sg != 0):
            raise ValueError(f"{n_sp} spans and {n_sg} segments cannot alternate")
        o = n = self.prefix_len
        for k, sp in enumerate(self.spans):
            if (sp.old_start, sp.new_start) != (o, n):
                raise ValueError(f"span {k} {sp} does not start at old {o} / new {n}")
            o, n = sp.old_end, sp.new_end
            if k < n_sg:
                sg = self.segments[k]
                if (sg.old_start, sg.new_start) != (o, n):
                    raise ValueError(f"segment {k} {sg} does not start at old {o} / new {n}")
                o, n = sg.old_end, sg.new_end
        if (o, n) != (self.old_len, self.new_len):
            raise ValueError(f"layout covers old [0, {o}) / new [0, {n}), not {self.old_len} / {self.new_len}")

    @property
    def suffix_len(self) -> int:
        """``|S|``: total length of the aligned segments."""
        return sum(s.length for s in self.segments)

    @property
    def new_token_count(self) -> int:
        """``|X|``: total length of the ``M_new`` spans."""
        return sum(s.new_len for s in self.spans)

    @property
    def identical(self) -> bool:
        """True iff both versions are the same token sequence."""
        return not self.spans


# ---------------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------------


def _as_token_array(ids: Any, name: str) -> np.ndarray:
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError, RuntimeError):
        arr = None
    if arr is None or arr.dtype == object:  # e.g. a CUDA tensor, or a plain iterable
        try:
            tolist = getattr(ids, "tolist", None)
            arr = np.asarray(tolist() if callable(tolist) else list(ids))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} must be a 1-D sequence of integer token ids: {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D sequence of token ids, got an array of shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _run_length(x: np.ndarray, y: np.ndarray, i: int, j: int, limit: int) -> int:
    """Length of the common run ``x[i:] == y[j:]``, at most ``limit`` (chunked, vectorized: chunks grow 8x, so a
    run of ``r`` tokens costs ``O(r)`` element compares in ``O(log r)`` numpy calls)."""
    n, step = 0, 64
    while n < limit:
        c = min(step, limit - n)
        ne = x[i + n : i + n + c] != y[j + n : j + n + c]
        k = int(ne.argmax())  # the first mismatch, or 0 when there is none
        if ne[k]:
            return n + k
        n += c
        step *= 8
    return n


def _kgram_hashes(x: np.ndarray, k: int) -> np.ndarray:
    """64-bit polynomial hash of every k-gram ``x[i:i+k]`` (uint64, length ``max(0, len(x)-k+1)``)."""
    m = x.shape[0] - k + 1
    if m <= 0:
        return np.zeros(0, dtype=np.uint64)
    with np.errstate(over="ignore"):
        v = x.view(np.uint64)
        v = (v ^ (v >> np.uint64(29))) * _MIX
        v ^= v >> np.uint64(32)
        h = v[:m].copy()
        for t in range(1, k):  # in place: no temporaries per step
            h *= _BASE
            h += v[t : t + m]
    return h


class _Aligner:
    """Aligned matching runs (>= min_match) between two token arrays; see the module docstring."""

    def __init__(self, a: np.ndarray, b: np.ndarray, min_match: int) -> None:
        self.a, self.b, self.min_match = a, b, min_match
        self.a_rev, self.b_rev = a[::-1], b[::-1]
        self.k = min(min_match, _ANCHOR_MAX_K)
        self._hashes: tuple[np.ndarray, np.ndarray] | None = None  # k-gram hashes, for the first large range
        self._small: tuple[tuple[int, int, int, int], dict, dict] | None = None  # the last small range's k-grams
        self.budget = _FALLBACK_BUDGET

    def _kgrams_small(self, lo: int, hi: int, x: np.ndarray) -> dict[tuple[int, ...], int]:
        """k-gram -> its start in ``x[lo:hi]`` (``-1`` when it occurs more than once), in Python (small ranges)."""
        xs, k, out = x[lo:hi].tolist(), self.k, {}
        for i in range(len(xs) - k + 1):
            g = tuple(xs[i:i + k])
            out[g] = -1 if g in out else i + lo
        return out

    def _kgram_pair(self, a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> tuple[dict, dict]:
        """Both ranges' :meth:`_kgrams_small`, kept for the range's fallback (which asks for the same pair)."""
        key = (a_lo, a_hi, b_lo, b_hi)
        if self._small is None or self._small[0] != key:
            self._small = (key, self._kgrams_small(a_lo, a_hi, self.a), self._kgrams_small(b_lo, b_hi, self.b))
        return self._small[1], self._small[2]

    def _anchors(self, a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> tuple[Any, Any]:
        """Starts ``(ai, bj)`` of the k-grams that occur exactly once in both ranges, sorted by ``ai`` (lists for a
        small range, int64 arrays otherwise)."""
        k = self.k
        if (a_hi - a_lo) + (b_hi - b_lo) <= _SMALL_RANGE:  # exact k-grams in Python: no per-call numpy overhead
            ga, gb = self._kgram_pair(a_lo, a_hi, b_lo, b_hi)
            pairs = sorted((i, gb[g]) for g, i in ga.items() if i >= 0 and gb.get(g, -1) >= 0)
            return [p[0] for p in pairs], [p[1] for p in pairs]
        if self._hashes is None:
            self._hashes = (_kgram_hashes(self.a, k), _kgram_hashes(self.b, k))
        ha, hb = self._hashes[0][a_lo : a_hi - k + 1], self._hashes[1][b_lo : b_hi - k + 1]
        if min(ha.shape[0], hb.shape[0]) > _SAMPLE_FROM:
            # long ranges (many edits far apart): anchors among the k-grams whose hash is 0 mod 16. A hash is
            # sampled on both sides or on neither, so a sampled k-gram is unique exactly when it was; every
            # long match holds sampled anchors, and the gaps between the kept matches are aligned again at
            # full density (short matches are found there). Sorting 1/16 of the k-grams: the cost of a
            # many-edit diff follows the edits, not the context.
            sa = np.flatnonzero((ha & _SAMPLE_MASK) == 0)
            sb = np.flatnonzero((hb & _SAMPLE_MASK) == 0)
            ha, hb = ha[sa], hb[sb]
        else:
            sa = sb = None
        ua, pa, ca = np.unique(ha, return_index=True, return_counts=True)
        ub, pb, cb = np.unique(hb, return_index=True, return_counts=True)
        once_a, once_b = ca == 1, cb == 1
        _, xa, xb = np.intersect1d(ua[once_a], ub[once_b], assume_unique=True, return_indices=True)
        if xa.size == 0:
            return [], []
        ai, bj = pa[once_a][xa], pb[once_b][xb]
        if sa is not None:
            ai, bj = sa[ai], sb[bj]
        order = np.argsort(ai, kind="stable")
        return ai[order] + a_lo, bj[order] + b_lo

    def blocks(self) -> list[tuple[int, int, int]]:
        """Monotone, non-overlapping ``(a_start, b_start, length)`` matches, sorted."""
        found: list[tuple[int, int, int]] = []
        stack = [(0, len(self.a), 0, len(self.b))]
        while stack:
            a_lo, a_hi, b_lo, b_hi = stack.pop()
            if a_hi - a_lo < self.min_match or b_hi - b_lo < self.min_match:
                continue
            chosen = self._anchored(a_lo, a_hi, b_lo, b_hi)
            if not chosen:
                cells = (a_hi - a_lo) * (b_hi - b_lo)
                if cells <= min(_FALLBACK_MAX_CELLS, self.budget):
                    self.budget -= cells
                    found.extend(self._fallback(a_lo, a_hi, b_lo, b_hi))
                continue
            found.extend(chosen)
            pa, pb = a_lo, b_lo
            for i, j, n in chosen:  # align the gaps again: anchors may be unique there
                stack.append((pa, i, pb, j))
                pa, pb = i + n, j + n
            stack.append((pa, a_hi, pb, b_hi))
        found.sort()
        return found

    def _anchored(self, a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> list[tuple[int, int, int]]:
        ai, bj = self._anchors(a_lo, a_hi, b_lo, b_hi)
        if len(ai) == 0:
            return []
        # runs of anchors on one diagonal at consecutive positions: only the first of each run is extended
        if isinstance(ai, list):
            starts = [(i, j) for t, (i, j) in enumerate(zip(ai, bj))
                      if t == 0 or i != ai[t - 1] + 1 or j - i != bj[t - 1] - ai[t - 1]]
            si, sj = [p[0] for p in starts], [p[1] for p in starts]
        else:
            brk = np.ones(ai.shape[0], dtype=bool)
            brk[1:] = (np.diff(ai) != 1) | (np.diff(bj - ai) != 0)
            si, sj = ai[brk], bj[brk]
        cands: list[tuple[int, int, int, int]] = []  # (size, start, start + diagonal, anchor)
        if len(si) <= 64:  # few: one pass in order, a covered end per diagonal
            covered: dict[int, int] = {}  # diagonal -> old end of the last match extended on it
            for i0, j0 in zip(list(si), list(sj)):
                i0, j0 = int(i0), int(j0)
                if i0 < covered.get(j0 - i0, -1):
                    continue
                got = self._extend(i0, j0, a_lo, a_hi, b_lo, b_hi)
                if got is not None:
                    covered[j0 - i0] = got[1] + got[0]
                    if got[0] >= self.min_match:
                        cands.append(got)
        else:  # many (long ranges: sampled anchors): per diagonal, jump past each extended match
            si, sj = np.asarray(si, dtype=np.int64), np.asarray(sj, dtype=np.int64)
            diag = sj - si
            order = np.lexsort((si, diag))
            d_sorted, i_sorted = diag[order], si[order]
            cuts = np.flatnonzero(np.diff(d_sorted)) + 1
            for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), d_sorted.shape[0]]):
                d, pos = int(d_sorted[lo]), i_sorted[lo:hi]
                t = 0
                while t < pos.shape[0]:
                    i0 = int(pos[t])
                    got = self._extend(i0, i0 + d, a_lo, a_hi, b_lo, b_hi)
                    if got is None:
                        t += 1
                        continue
                    if got[0] >= self.min_match:
                        cands.append(got)
                    t = max(t + 1, int(np.searchsorted(pos, got[1] + got[0], side="left")))
        # the in-order pass appended by anchor; the per-diagonal one sorts the same way (ties below)
        cands = [c[:3] for c in sorted(cands, key=lambda c: (-c[0], c[1], c[3]))]
        # Longest first; keep a match only if it is consistent (monotone, non-overlapping) with the kept ones.
        keys: list[int] = []
        sel: list[tuple[int, int, int]] = []
        for n, i, j in cands:
            p = bisect.bisect_left(keys, i)
            if p > 0 and (sel[p - 1][0] + sel[p - 1][2] > i or sel[p - 1][1] + sel[p - 1][2] > j):
                continue
            if p < len(sel) and (i + n > sel[p][0] or j + n > sel[p][1]):
                continue
            keys.insert(p, i)
            sel.insert(p, (i, j, n))
        return sel

    def _extend(self, i0: int, j0: int, a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> tuple[int, int, int, int] | None:
        """The maximal match through the anchor ``(i0, j0)`` within the range: ``(size, start, start + diagonal,
        i0)``, or None on a hash collision (fewer than k equal tokens from the anchor)."""
        right = _run_length(self.a, self.b, i0, j0, min(a_hi - i0, b_hi - j0))
        if right < self.k:  # hash collision
            return None
        left = _run_length(self.a_rev, self.b_rev, len(self.a) - i0, len(self.b) - j0, min(i0 - a_lo, j0 - b_lo))
        start = i0 - left
        return left + right, start, start + (j0 - i0), i0

    def _fallback(self, a_lo: int, a_hi: int, b_lo: int, b_hi: int) -> list[tuple[int, int, int]]:
        if (a_hi - a_lo) + (b_hi - b_lo) <= _SMALL_RANGE:
            ga, gb = self._kgram_pair(a_lo, a_hi, b_lo, b_hi)
            if not ga.keys() & gb.keys():
                return []  # a match of >= min_match tokens holds a common k-gram: there is none
        sm = difflib.SequenceMatcher(None, self.a[a_lo:a_hi].tolist(), self.b[b_lo:b_hi].tolist(), autojunk=False)
        return [(a_lo + i, b_lo + j, n) for i, j, n in sm.get_matching_blocks() if n >= self.min_match]


# ---------------------------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------------------------


def diff_versions(old_ids: Any, new_ids: Any, *, min_match: int = 8,
                  words: Callable[[np.ndarray], np.ndarray] | None = None,
                  old_words: np.ndarray | None = None) -> Edit:
    """Diff two context versions of one thread into prefix, edited spans and aligned suffix segments.

    Args:
        old_ids: token ids of ``C_old``: a list/tuple of ints, a 1-D integer numpy array, a 1-D tensor
            (converted through ``tolist()`` if ``np.asarray`` fails) or any iterable of ints.
        new_ids: token ids of ``C_new``, same forms.
        min_match: shortest identical run inside the middle region that becomes an aligned segment
            (shorter runs stay inside an edited span). ``P`` and the tail segment have no minimum.
        words: ``ids -> word id per position`` (a :class:`~patchkv_agent.core.lexicon.WordIndex`), or
            None. When given, :meth:`Edit.words` maps both versions through it on first use (the lexical
            reader signal then compares words, not token ids); the diff itself is on token ids.
        old_words: the old version's word ids under ``words``, when known (carried with its checkpoint):
            then only the words at the edited spans are read (:meth:`Edit.new_words`). Ignored when its
            length is not ``len(old_ids)``.
    Returns:
        The :class:`Edit`.
    Raises:
        ValueError: if an input is not 1-D, holds non-integer values, or ``min_match < 1``.
    """
    if isinstance(min_match, bool) or not isinstance(min_match, (int, np.integer)) or min_match < 1:
        raise ValueError(f"min_match must be an int >= 1, got {min_match!r}")
    min_match = int(min_match)
    old = _as_token_array(old_ids, "old_ids")
    new = _as_token_array(new_ids, "new_ids")
    n_old, n_new = old.shape[0], new.shape[0]
    p = _run_length(old, new, 0, 0, min(n_old, n_new))
    s = _run_length(old[::-1], new[::-1], 0, 0, min(n_old, n_new) - p)
    a, b = old[p : n_old - s], new[p : n_new - s]
    blocks = _Aligner(a, b, min_match).blocks() if min(a.shape[0], b.shape[0]) >= min_match else []
    blocks.append((a.shape[0], b.shape[0], s))  # the tail segment (skipped below when s == 0)

    spans: list[EditedSpan] = []
    segments: list[AlignedSegment] = []
    o, n = p, p
    for i, j, size in blocks:
        i, j = p + i, p + j
        if i > o or j > n:
            spans.append(EditedSpan(old_start=o, old_end=i, new_start=n, new_end=j))
        elif size and segments:  # contiguous with the previous segment on both sides: merge
            last = segments.pop()
            size, i, j = size + last.length, last.old_start, last.new_start
        if size:
            segments.append(AlignedSegment(old_start=i, new_start=j, length=size))
        o, n = i + size, j + size
    return Edit(old_len=n_old, new_len=n_new, prefix_len=p, spans=tuple(spans), segments=tuple(segments),
                old_ids=_readonly(old.copy()), new_ids=_readonly(new.copy()),  # own copies: the caller's stay writable
                word_index=words,
                old_words=old_words if old_words is not None and len(old_words) == n_old else None)

"""Repair planner: an :class:`~patchkv_agent.core.diff.Edit` (plus stored attention) -> a :class:`RepairPlan`.

Boundary: numpy in, frozen dataclasses out. This module knows nothing about torch, models, KV tensors,
checkpoints or precision tags; its one pass over the context (the reader signal's word scan) runs in
``kernels/native.c`` where that library is built, and in numpy otherwise, with equal results. It decides
*which rows* of the new context are reused from the prefix, restored from the checkpoint (``F``) or recomputed
(``X`` and ``R``); the recovery executes that.

Vocabulary (docs/DESIGN.md section 2): suffix blocks are ``block_size`` consecutive suffix tokens, cut per
aligned segment from that segment's start in new coordinates, so a block never straddles an edited
span. ``D`` = the first ``d_hat`` suffix tokens after each edited span (``suffix_distance < d_hat``),
``H`` = the top ``kappa`` fraction of the suffix tokens outside ``D`` by stored attention,
``L`` = the *reader blocks* of the edit (:func:`lexical_reader_scores`: suffix blocks that share rare tokens
with the tokens an edit removed or added; downstream tokens that mention what was edited carry notes of
it, computed while the old version was in view), adding at most ``reader_budget`` to the recompute,
``W`` = the blocks of the last ``recent_window`` tokens the rest would restore (the recency rule: the rows
nearest the generation point, which the next action reads most),
``R = BlockRound(D | H) | L | W`` plus the block holding the last context token; ``F`` = the other blocks.
A plan whose ``F`` would hold less than ``min_restore_share`` of the suffix recomputes all of it instead
(``small_restore``: exact, where the saving is too small to pay for an approximation).

Per-span length features (shared with the calibration profiler through :func:`span_features`): for
edited span k, ``P_k`` = its new start (tokens before it), ``E_k`` = ``|M_old_k| + |M_new_k|``,
``S_k`` = length of the aligned segment that follows it (the tokens whose ``d_i`` it defines).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .length_model import LengthModel
from .runs import expand_runs

if TYPE_CHECKING:  # the planner reads an Edit; it never builds one
    from .diff import Edit

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DIRTY_WINDOW",
    "LengthModel",
    "SuffixBlocks",
    "RepairPlan",
    "span_features",
    "suffix_blocks",
    "plan_suffix_blocks",
    "lexical_reader_scores",
    "block_attention",
    "DEFAULT_READER_BUDGET",
    "READER_MAX_DF",
    "READERS",
    "READER_MIN_BLOCKS",
    "READER_MIN_SHARE",
    "READER_ATTENTION_BLOCKS",
    "plan_blocks",
    "block_round",
    "plan_repair",
    "plan_full",
    "plan_direct",
    "head_rewrite_share",
    "DEFAULT_REWRITE_SHARE",
    "DEFAULT_RECENT_WINDOW",
    "DEFAULT_MIN_RESTORE_SHARE",
]

DEFAULT_BLOCK_SIZE = 32  # suffix block size in tokens: unit of selection, transfer and precision tags
DEFAULT_DIRTY_WINDOW = 32  # fixed dirty-window length (tokens) used until a calibrated length model is given

# head-rewrite rule (plan_repair): share of the old context removed, attention-weighted (head_rewrite_share), at
# which every suffix token is recomputed; set on 8 summarization resumes of agent-summarize (SmolLM2:
# scripts/rewrite_study.py, docs/RESULTS.md "Head rewrites"): their shares were 0.39-0.62, a 94-token
# removal's 0.04
DEFAULT_REWRITE_SHARE = 0.35
# recency rule (plan_repair): the last restored tokens before the generation point are recomputed too; the
# next action reads them most. Off by default; a model's profile sets its window (SmolLM2: 1024, chosen by
# next-action agreement on held-out agent-clear resumes, docs/calibration.md "The agent stage: selecting recent_window")
DEFAULT_RECENT_WINDOW = 0
# small-restore rule (plan_repair): a plan that would restore less than this share of the suffix recomputes
# all of it. Off by default; a model's profile sets it (SmolLM2: 0.5, docs/RESULTS.md "Small restores")
DEFAULT_MIN_RESTORE_SHARE = 0.0
REWRITE_ATTENTION = 4.0  # removed attention share counts this many times (recent queries read ~1/4 of a summarized head)

READERS = ("none", "lexical")  # reader-block signals plan_repair knows
DEFAULT_READER_BUDGET = 0.25  # reader blocks add at most this share to the plan's recompute tokens (in blocks) ...
READER_MIN_BLOCKS = 3  # ... or this many blocks, whichever is more
READER_MIN_SHARE = 0.1  # a reader block holds at least this share of the weight of the edit's rare changed tokens
READER_ATTENTION_BLOCKS = 2  # an edit with reader blocks also recomputes this many top stored-attention blocks
READER_MAX_DF = 0.1  # a token counts as rare when at most this share of the context's blocks hold it ...
READER_MIN_DF = 3  # ... or at most this many blocks (short contexts)

def _readonly(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.setflags(write=False)
    return a


# ---------------------------------------------------------------------------------------------------------------------
# Suffix blocks
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class SuffixBlocks:
    """The suffix of one Edit cut into blocks (all in new order).

    Block ``b`` covers new positions ``[starts[b], ends[b])`` and old positions ``[old_starts[b], old_starts[b] +
    ends[b] - starts[b])``; ids are global and increase with position. The planner works on these per-block
    arrays (its cost follows the blocks and the edits); the per-token arrays (``new_positions``,
    ``old_positions``, ``distance``, ``token_block``) are derived on first use, for callers that want them.
    """

    block_size: int
    starts: np.ndarray  # [n_blocks] new position of the block's first token
    ends: np.ndarray  # [n_blocks] exclusive
    segment: np.ndarray  # [n_blocks] index of the aligned segment (in suffix order) holding the block
    old_starts: np.ndarray  # [n_blocks] old position of the block's first token
    base: np.ndarray  # [n_blocks] new end of the edited span before the block's segment (d_i = position - base)

    @property
    def n_blocks(self) -> int:
        return int(self.starts.shape[0])

    @cached_property
    def lengths(self) -> np.ndarray:
        """``[n_blocks]`` tokens per block."""
        return _readonly(self.ends - self.starts)

    @cached_property
    def n_tokens(self) -> int:
        """``|S|`` after the reused prefix: the tokens of all blocks."""
        return int(self.lengths.sum())

    @cached_property
    def new_positions(self) -> np.ndarray:
        """``[|S|]`` suffix tokens, new coordinates, increasing."""
        return _readonly(expand_runs(self.starts, self.lengths))

    @cached_property
    def old_positions(self) -> np.ndarray:
        """``[|S|]`` the same tokens in old coordinates."""
        return _readonly(expand_runs(self.old_starts, self.lengths))

    @cached_property
    def distance(self) -> np.ndarray:
        """``[|S|]`` ``d_i``: distance from the end of the preceding edited span."""
        return _readonly(self.new_positions - np.repeat(self.base, self.lengths))

    @cached_property
    def token_block(self) -> np.ndarray:
        """``[|S|]`` block id of each suffix token."""
        return _readonly(np.repeat(np.arange(self.n_blocks, dtype=np.int64), self.lengths))


def _suffix_segments(edit: Edit, keep_from: int) -> list[tuple[int, int, int, int]]:
    """Aligned segments after the prefix as ``(new_start, old_start, length, distance_base)``, clipped."""
    span_ends = [s.new_end for s in edit.spans]  # increasing (the layout alternates spans and segments)
    out = []
    for seg in edit.segments:
        lo = max(seg.new_start, keep_from)
        hi = seg.new_start + seg.length
        if hi <= lo:
            continue
        k = bisect.bisect_right(span_ends, seg.new_start) - 1
        if k < 0:  # not preceded by an edited span: part of the prefix, never a suffix segment
            continue
        out.append((lo, seg.old_start + (lo - seg.new_start), hi - lo, span_ends[k]))
    return out


def suffix_blocks(edit: Edit, *, block_size: int = DEFAULT_BLOCK_SIZE, keep_from: int | None = None) -> SuffixBlocks:
    """Cut the suffix of ``edit`` into blocks.

    Args:
        edit: the diff of two context versions.
        block_size: tokens per block, ``>= 1``.
        keep_from: ignore suffix tokens at new positions below this (default: ``edit.prefix_len``).
    Returns:
        The blocks (per-token arrays derived on first use).
    Raises:
        ValueError: if ``block_size < 1``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    segs = _suffix_segments(edit, edit.prefix_len if keep_from is None else keep_from)
    if not segs:
        e = _readonly(np.zeros(0, dtype=np.int64))
        return SuffixBlocks(block_size=block_size, starts=e, ends=e, segment=e, old_starts=e, base=e)
    if len(segs) <= _FEW_SEGMENTS:  # the common edit: a few aranges, not index arithmetic over every block
        return _few_segment_blocks(segs, block_size)
    seg_new, seg_old, seg_len, seg_base = (np.asarray(c, dtype=np.int64) for c in zip(*segs))
    n_per_seg = -(-seg_len // block_size)
    seg_of_block = np.repeat(np.arange(len(segs), dtype=np.int64), n_per_seg)
    first_block = np.cumsum(n_per_seg) - n_per_seg
    local = (np.arange(seg_of_block.shape[0], dtype=np.int64) - first_block[seg_of_block]) * block_size
    starts = seg_new[seg_of_block] + local
    return SuffixBlocks(
        block_size=block_size,
        starts=_readonly(starts),
        ends=_readonly(np.minimum(starts + block_size, (seg_new + seg_len)[seg_of_block])),
        segment=_readonly(seg_of_block),
        old_starts=_readonly(seg_old[seg_of_block] + local),
        base=_readonly(seg_base[seg_of_block]),
    )


_FEW_SEGMENTS = 4  # suffix segments cut into blocks segment by segment (fewer numpy calls: a resume's fixed cost)


def _few_segment_blocks(segs: list[tuple[int, int, int, int]], block_size: int) -> SuffixBlocks:
    """:func:`suffix_blocks` for a few segments: per segment one ``arange`` of block starts (the same blocks)."""
    parts = []
    for k, (lo, old, n, base) in enumerate(segs):
        st = np.arange(lo, lo + n, block_size, dtype=np.int64)
        en = st + block_size
        en[-1] = lo + n  # only the segment's last block can be short
        seg_col, base_col = np.empty(st.shape[0], dtype=np.int64), np.empty(st.shape[0], dtype=np.int64)
        seg_col.fill(k)  # (np.full: slower)
        base_col.fill(base)
        parts.append((st, en, seg_col, st + (old - lo), base_col))
    cols = parts[0] if len(parts) == 1 else [np.concatenate(c) for c in zip(*parts)]
    for c in cols:
        c.setflags(write=False)
    starts, ends, segment, old_starts, base_ = cols
    return SuffixBlocks(block_size=block_size, starts=starts, ends=ends, segment=segment, old_starts=old_starts,
                        base=base_)


def block_round(positions: np.ndarray, blocks: SuffixBlocks) -> np.ndarray:
    """``BlockRound(A)``: ids of all blocks that intersect the token set ``A``.

    Args:
        positions: new positions (any order, duplicates allowed); positions outside every block are ignored.
        blocks: the suffix blocks of the edit.
    Returns:
        Sorted unique int64 block ids.
    """
    pos = np.asarray(positions, dtype=np.int64).ravel()
    if pos.size == 0 or blocks.n_blocks == 0:
        return np.zeros(0, dtype=np.int64)
    b = np.searchsorted(blocks.starts, pos, side="right") - 1
    ok = (b >= 0) & (pos < blocks.ends[np.maximum(b, 0)])
    hit = np.zeros(blocks.n_blocks, dtype=bool)
    hit[b[ok]] = True
    return np.flatnonzero(hit).astype(np.int64)


def span_features(edit: Edit) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-span ``(P_k, E_k, S_k)`` token counts: the length-model inputs (see module docstring)."""
    spans = sorted(edit.spans, key=lambda s: s.new_start)
    if not spans:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    p = np.asarray([s.new_start for s in spans], dtype=np.int64)
    e = np.asarray([(s.old_end - s.old_start) + (s.new_end - s.new_start) for s in spans], dtype=np.int64)
    ends = np.asarray([s.new_end for s in spans], dtype=np.int64)
    seg_len = {seg.new_start: seg.length for seg in edit.segments}
    s = np.asarray([seg_len.get(int(x), 0) for x in ends], dtype=np.int64)
    return p, e, s


# ---------------------------------------------------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, eq=False)
class RepairPlan:
    """What the recovery executes: rows ``[0, prefix_len)`` reused, ``restore_*`` rows restored from the
    checkpoint (RoPE-corrected from old to new position), ``recompute_positions`` run through the model.

    The three sets partition ``[0, new_len)``. ``prefix_len`` may be one less than ``edit.prefix_len``
    when the last context token lies in the prefix (it is recomputed to produce the first logits).
    """

    strategy: str  # "patchkv" | "prefix" | "direct"
    new_len: int
    old_len: int
    prefix_len: int
    recompute_positions: np.ndarray  # int64 sorted new positions: X, R, last token
    restore_new_positions: np.ndarray  # int64 sorted new positions of F rows
    restore_old_positions: np.ndarray  # int64, aligned with restore_new_positions
    block_size: int
    block_starts: np.ndarray  # [n_blocks] new position of each suffix block's first token
    block_ends: np.ndarray  # [n_blocks] exclusive
    repair_blocks: np.ndarray  # block ids in R (sorted)
    restore_blocks: np.ndarray  # block ids in F (sorted)
    d_hat: np.ndarray  # [n_spans] dirty window per edited span, new order ("prefix": whole segment, "direct": 0)
    kappa: float = 0.0
    n_new_tokens: int = 0  # |X|
    n_suffix: int = 0  # |S|
    n_dirty: int = 0  # |D|
    n_high: int = 0  # |H|
    n_readers: int = 0  # reader blocks added beyond BlockRound(D | H)
    n_recent: int = 0  # blocks the recency rule added
    head_rewrite: bool = False  # the rewrite rule fired: every suffix token is recomputed
    small_restore: bool = False  # the small-restore rule fired: every suffix token is recomputed

    @property
    def n_recompute(self) -> int:
        return int(self.recompute_positions.shape[0])

    @property
    def n_restore(self) -> int:
        return int(self.restore_new_positions.shape[0])


def _member_positions(x: np.ndarray, sorted_set: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions ``i`` with ``x[i]`` in ``sorted_set`` (sorted int64) and the rank of ``x[i]`` in the set: a
    64 Ki-entry table of the set's low 16 bits screens ``x`` in one gather, and only the screened elements are
    searched."""
    if sorted_set.size == 0 or x.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e
    table = np.zeros(1 << 16, dtype=bool)
    table[sorted_set & 0xFFFF] = True
    cand = np.flatnonzero(table[x & 0xFFFF])
    v = x[cand]
    i = np.minimum(np.searchsorted(sorted_set, v), sorted_set.size - 1)
    hit = sorted_set[i] == v
    return cand[hit], i[hit]


_PAIR_TABLE_MAX = 1 << 22  # pairs deduplicated in a dense boolean table up to this many cells, else sorted


def _distinct_pairs(a: np.ndarray, b: np.ndarray, na: int, nb: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct pairs ``(a[i], b[i])`` with ``0 <= a < na``, ``0 <= b < nb``, ordered by ``(a, b)``: a dense
    table when ``na * nb`` is small (one scatter, no sort), else a sort of one int64 key per pair."""
    if na * nb <= _PAIR_TABLE_MAX:
        table = np.zeros(na * nb, dtype=bool)
        table[a * nb + b] = True
        key = np.flatnonzero(table)
    else:
        key = np.unique(a * nb + b)
    return key // nb, key % nb


def _distinct_counts(tok: np.ndarray, grid: np.ndarray, n_tok: int, n_grid: int) -> np.ndarray:
    """For each ``t < n_tok``, the number of distinct ``grid`` values paired with it (``int64 [n_tok]``)."""
    t, _ = _distinct_pairs(tok, grid, n_tok, n_grid)
    return np.bincount(t, minlength=n_tok)


def _top_fraction(values: np.ndarray, kappa: float) -> np.ndarray:
    """Indices of the top ``ceil(kappa*n)`` values; ties broken by lower index (deterministic)."""
    n = values.shape[0]
    k = min(n, int(math.ceil(kappa * n - 1e-9))) if kappa > 0 else 0
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    if k == n:
        return np.arange(n, dtype=np.int64)
    kth = np.partition(values, n - k)[n - k]  # k-th largest value
    above = np.flatnonzero(values > kth)
    ties = np.flatnonzero(values == kth)[: k - above.shape[0]]
    return np.sort(np.concatenate([above, ties]))


def _build(edit: Edit, blocks: SuffixBlocks, repair_mask: np.ndarray, *, strategy: str, prefix_len: int,
           d_hat: np.ndarray, kappa: float = 0.0, n_dirty: int = 0, n_high: int = 0,
           n_readers: int = 0, n_recent: int = 0, head_rewrite: bool = False,
           small_restore: bool = False) -> RepairPlan:
    """Assemble a plan from the block mask: the tokens of repaired blocks, the new tokens and the last context token
    are recomputed, the other blocks restored. Works on runs (spans and blocks); only the row lists the recovery
    gathers by are expanded, once each."""
    new_len = edit.new_len
    lens = blocks.lengths
    rest = ~repair_mask
    r_new, r_len = blocks.starts[rest], lens[rest]
    runs = [(sp.new_start, sp.new_len) for sp in edit.spans if sp.new_len > 0]  # X
    # the last context token always produces the first logits: cut it from a restored last block
    if r_len.size and blocks.ends[-1] == new_len and rest[-1]:
        r_len[-1] -= 1  # (a fancy-indexed copy)
        runs.append((new_len - 1, 1))
    if prefix_len < edit.prefix_len:  # last token sits in the prefix (or versions identical)
        runs.append((prefix_len, edit.prefix_len - prefix_len))
    rec_st = np.concatenate([np.asarray([r[0] for r in runs], dtype=np.int64), blocks.starts[repair_mask]])
    rec_len = np.concatenate([np.asarray([r[1] for r in runs], dtype=np.int64), lens[repair_mask]])
    order = rec_st.argsort(kind="stable")  # disjoint runs: sorted starts give sorted positions
    recompute = expand_runs(rec_st[order], rec_len[order])
    restore_new = expand_runs(r_new, r_len)
    restore_old = restore_new + (blocks.old_starts[rest] - r_new).repeat(r_len)  # one offset per block
    return RepairPlan(
        strategy=strategy,
        new_len=new_len,
        old_len=edit.old_len,
        prefix_len=prefix_len,
        recompute_positions=_readonly(recompute),
        restore_new_positions=_readonly(restore_new),
        restore_old_positions=_readonly(restore_old),
        block_size=blocks.block_size,
        block_starts=_readonly(blocks.starts),
        block_ends=_readonly(blocks.ends),
        repair_blocks=_readonly(repair_mask.nonzero()[0]),
        restore_blocks=_readonly(rest.nonzero()[0]),
        d_hat=_readonly(d_hat),
        kappa=float(kappa),
        n_new_tokens=int(edit.new_token_count),
        n_suffix=blocks.n_tokens,
        n_dirty=int(n_dirty),
        n_high=int(n_high),
        n_readers=int(n_readers),
        n_recent=int(n_recent),
        head_rewrite=bool(head_rewrite),
        small_restore=bool(small_restore),
    )


def _prep(edit: Edit, block_size: int) -> tuple[int, SuffixBlocks]:
    if edit.new_len < 1:
        raise ValueError("the new context is empty: there is no last token to produce logits from")
    prefix_len = min(edit.prefix_len, edit.new_len - 1)
    return prefix_len, suffix_blocks(edit, block_size=block_size, keep_from=prefix_len)


def block_attention(blocks: SuffixBlocks, scores: np.ndarray) -> np.ndarray:
    """Stored attention per suffix block: the maximum score of its tokens (at their old positions).

    Args:
        blocks: the suffix blocks.
        scores: per old position ``[N_old]`` (NaN counts as 0).
    Returns:
        float64 ``[n_blocks]`` (``-inf`` for an empty block).
    """
    return _block_max(blocks, _clean_scores(scores)[0])


def _block_max(blocks: SuffixBlocks, sc: np.ndarray) -> np.ndarray:
    if blocks.n_blocks == 0:
        return np.zeros(0, dtype=np.float64)
    # a block's tokens are one run in old coordinates, and runs increase: one reduceat over (start, end) pairs,
    # whose even entries are the blocks (odd ones: the gaps between them, dropped)
    cut = np.empty(2 * blocks.n_blocks, dtype=np.int64)
    cut[0::2] = blocks.old_starts
    cut[1::2] = blocks.old_starts + blocks.lengths
    if cut[-1] >= sc.shape[0]:
        cut = cut[:-1]
    return np.maximum.reduceat(sc, cut)[0::2].astype(np.float64)  # every block is non-empty


def _clean_scores(scores) -> tuple[np.ndarray, float]:
    """Stored attention as a flat float array with NaN read as 0 and infinities clipped (``np.nan_to_num``), and
    its float64 sum. A finite float32 / float64 array is returned as is: one summing pass (a finite sum means
    every value is finite), no copy."""
    sc = np.asarray(scores).ravel()
    if sc.dtype != np.float32 and sc.dtype != np.float64:
        sc = sc.astype(np.float64)
    total = float(np.add.reduce(sc, dtype=np.float64))
    if not math.isfinite(total):
        sc = np.nan_to_num(sc.astype(np.float64), nan=0.0)
        total = float(sc.sum())
    return sc, total


def lexical_reader_scores(edit: Edit, blocks: SuffixBlocks, *, max_df: float = READER_MAX_DF) -> np.ndarray:
    """How strongly each suffix block mentions what the edit changed: the lexical reader signal.

    The *changed tokens* are the words (:meth:`Edit.words <patchkv_agent.core.diff.Edit.words>`, from a
    :class:`~patchkv_agent.core.lexicon.WordIndex`; the token ids when the edit has no words) on exactly
    one side of the edited spans (in ``M_old`` or in ``M_new``, not both). Words, because a tokenizer
    spells one name differently by where it stands (``" Sofia"`` after a space, ``"S" "of" "ia"`` at the
    start of a line), and a later record naming the entity rarely puts it after a space as the edited
    sentence did. A changed token is *rare* when at most ``max_df`` of the new context's
    ``block_size``-token blocks (cut from position 0) contain it (a word spanning two blocks counts in the
    block of its first token); its weight is
    ``log((1 + n_blocks) / (1 + df))`` (rare: ``df <= max(READER_MIN_DF, max_df * n_blocks)``; a changed
    token absent from the new context counts with ``df = 0``). A suffix block's score is the summed weight
    of the distinct rare changed tokens it holds, divided by the summed weight of all rare changed tokens:
    the share of the edit's signature the block mentions. A later tool result naming the entity an edit
    replaced (or introduced) scores high; boilerplate shared by every record scores 0; a block sharing a
    few words with a replaced passage of hundreds of tokens scores low.

    Args:
        edit: the diff; needs ``edit.words()`` or ``edit.old_ids`` / ``new_ids`` (set by
            :func:`~patchkv_agent.core.diff.diff_versions`).
        blocks: the suffix blocks of the plan.
        max_df: rarity cut-off, a share of the context's blocks in ``(0, 1]``.
    Returns:
        float64 ``[n_blocks]`` scores in ``[0, 1]`` (all zero without ids, spans or rare changed tokens).
    Raises:
        ValueError: ``max_df`` outside ``(0, 1]``.
    """
    if not 0.0 < max_df <= 1.0:
        raise ValueError(f"max_df must be in (0, 1], got {max_df}")
    out = np.zeros(blocks.n_blocks, dtype=np.float64)
    words = edit.words()
    if words is not None:
        old, new = words
    else:
        old, new = edit.old_ids, edit.new_ids
    if old is None or new is None or not edit.spans or blocks.n_blocks == 0 or new.shape[0] == 0:
        return out
    # the changed words: those on one side of the edited spans only (a set difference over the edit's words)
    old_side: set[int] = set()
    new_side: set[int] = set()
    for sp in edit.spans:
        old_side.update(old[sp.old_start:sp.old_end].tolist())
        new_side.update(new[sp.new_start:sp.new_end].tolist())
    changed = np.asarray(sorted(w for w in old_side ^ new_side if w >= 0), dtype=np.int64)  # -1: no word
    if changed.size == 0:
        return out
    size = blocks.block_size
    n_ctx = -(-new.shape[0] // size)
    # document frequency of each changed word over the context's blocks, and the distinct (suffix block, changed
    # word) pairs: one pass over the context
    df, pair_blk, pair_tok = _reader_scan(new, changed, size, blocks)
    rare = df <= max(float(READER_MIN_DF), max_df * n_ctx)  # a changed token the edit removed has df 0: rare
    weight = np.where(rare, np.log((1.0 + n_ctx) / (1.0 + df)), 0.0)
    total = float(weight.sum())
    if total <= 0:  # (no rare changed word: every weight is 0)
        return out
    # each distinct (block, rare changed token) pair adds the token's weight to the block
    keep = rare[pair_tok]
    tok = pair_tok[keep]
    return np.bincount(pair_blk[keep], weights=weight[tok], minlength=blocks.n_blocks) / total


def _reader_scan_numpy(new: np.ndarray, changed: np.ndarray, size: int, blocks: SuffixBlocks
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reader signal's occurrence scan (``kernels/native.c`` ``pkv_reader_scan`` is its one-pass twin):
    ``df[t]``, the number of ``size``-token context blocks (cut from 0) holding the first token of an occurrence
    of ``changed[t]`` (a word spanning two blocks counts in the block of its first token), and the distinct
    ``(suffix block, t)`` pairs with ``changed[t]`` in the block, ordered by block, then ``t``."""
    all_pos, tok_all = _member_positions(new, changed)  # positions of changed words and their ranks in changed
    first = np.ones(all_pos.shape[0], dtype=bool)  # one occurrence per word: its first token
    first[1:] = (all_pos[1:] != all_pos[:-1] + 1) | (tok_all[1:] != tok_all[:-1])
    n_ctx = -(-new.shape[0] // size)
    df = _distinct_counts(tok_all[first], all_pos[first] // size, changed.size, n_ctx)
    # the changed-word positions inside a suffix block (the edited spans and the prefix lie outside every block)
    b = np.searchsorted(blocks.starts, all_pos, side="right") - 1
    ok = (b >= 0) & (all_pos < blocks.ends[np.maximum(b, 0)]) if blocks.n_blocks else np.zeros(b.shape, dtype=bool)
    blk, tok = _distinct_pairs(b[ok], tok_all[ok], blocks.n_blocks, changed.size)
    return df, blk, tok


_native = None  # kernels.native, once imported: the rest of the planner needs no torch


def _reader_scan(new: np.ndarray, changed: np.ndarray, size: int, blocks: SuffixBlocks
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`_reader_scan_numpy`, in one native pass once ``kernels/native.c`` is loaded (equal arrays). Never
    builds or loads the library on the resume path: :class:`~patchkv_agent.engine.PatchKVEngine` loads it when
    it is constructed."""
    global _native
    if _native is None:  # imported on first use (an import statement per call costs ~15 us cold)
        from ..kernels import native as _native
    if _native.ready():
        return _native.reader_scan_native(new, changed, size, blocks.starts, blocks.ends)
    return _reader_scan_numpy(new, changed, size, blocks)


def head_rewrite_share(edit: Edit, scores: np.ndarray | None) -> float:
    """The share of the old context an edit removes, weighted by what the stored attention read.

    ``min(removed tokens / old tokens, REWRITE_ATTENTION * removed attention / total attention)``
    when statistics exist (tokens only, otherwise), so that a long removal the recent queries ignored
    does not count as a rewrite of what the tail depends on.

    Args:
        edit: the diff.
        scores: stored attention per old position, or None.

    Returns:
        A share in ``[0, 1]``.
    """
    return _rewrite_share(edit, None if scores is None else _clean_scores(scores))


def _rewrite_share(edit: Edit, clean: tuple[np.ndarray, float] | None) -> float:
    if edit.old_len == 0 or not edit.spans:
        return 0.0
    n_removed = sum(sp.old_len for sp in edit.spans)
    share = n_removed / edit.old_len
    if clean is not None and n_removed:
        sc, total = clean
        if sc.shape[0] == edit.old_len and total > 0:
            removed = sum(float(np.add.reduce(sc[sp.old_start:sp.old_end], dtype=np.float64)) for sp in edit.spans)
            share = min(share, REWRITE_ATTENTION * removed / total)
    return float(min(1.0, share))


def plan_repair(edit: Edit, scores: np.ndarray | None = None, *, length_model: LengthModel, kappa: float = 0.0,
                block_size: int = DEFAULT_BLOCK_SIZE, readers: str = "none",
                reader_budget: float = DEFAULT_READER_BUDGET, reader_min_share: float = READER_MIN_SHARE,
                reader_min_blocks: int = READER_MIN_BLOCKS, reader_attention_blocks: int = READER_ATTENTION_BLOCKS,
                rewrite_share: float = DEFAULT_REWRITE_SHARE, recent_window: int = 0,
                min_restore_share: float = 0.0) -> RepairPlan:
    """The PatchKV plan: recompute ``X``, ``R = BlockRound(D | H) | L | W`` and the last token; restore ``F``.

    Args:
        edit: diff of the checkpointed (old) and the new context version.
        scores: stored attention per OLD position (length ``edit.old_len``), or None (then ``H`` is empty).
        length_model: gives ``d_hat`` per edited span.
        kappa: fraction of the suffix tokens outside ``D`` to add as high-attention tokens, in ``[0, 1]``.
        block_size: suffix tokens per block.
        readers: ``"lexical"`` adds the reader blocks ``L`` (:func:`lexical_reader_scores`), ``"none"`` not.
        reader_budget: reader blocks add at most this share of the plan's other recompute tokens, counted in
            blocks and rounded up, or ``reader_min_blocks`` blocks if that is more, the highest scores
            first (ties: the earlier block), in ``[0, 1]`` (0 adds none). A cost bound: the TTFT of a resume
            grows about linearly in recomputed tokens.
        reader_min_share: a block is a reader when its lexical score (the share of the edit's rare changed
            words it mentions) is at least this, in ``[0, 1]`` (default :data:`READER_MIN_SHARE`).
        reader_min_blocks: the reader budget is at least this many blocks, ``>= 0`` (default
            :data:`READER_MIN_BLOCKS`).
        reader_attention_blocks: an edit with reader blocks also recomputes this many restored blocks of
            highest stored attention, ``>= 0`` (default :data:`READER_ATTENTION_BLOCKS`). The three reader
            constants are calibrated per model (``calibration/reader_stage.py``).
        rewrite_share: the head-rewrite rule: when :func:`head_rewrite_share` of the edit is at least this,
            every suffix token is recomputed (``head_rewrite`` in the plan): after a summary replaced the
            history, every restored row was computed with the removed history in view, its drift grows
            with depth, and no selective plan held the next action (docs/RESULTS.md, "Head rewrites"),
            in ``[0, 1]`` (1.0: off).
        recent_window: the recency rule ``W``: the blocks holding the last ``recent_window`` suffix tokens
            that the rest of the plan would restore are recomputed too (the rows the next action reads
            most, nearest the generation point), ``>= 0`` (0: off, :data:`DEFAULT_RECENT_WINDOW`; a calibration
            profile sets a model's window).
        min_restore_share: the small-restore rule: when the rows the plan would restore are fewer than this
            share of the suffix, every suffix token is recomputed instead (``small_restore`` in the plan; the
            result is exact, and a resume that restores so little saves too little to pay for an
            approximation), in ``[0, 1]`` (0: off).
    Returns:
        The plan (``n_readers``: the reader blocks added beyond ``D | H``; when there are any and ``scores``
        is given, also the ``reader_attention_blocks`` restored blocks of highest stored attention;
        ``n_recent``: the blocks the recency rule added).
    Raises:
        ValueError: on an empty new context, ``kappa``, ``reader_budget``, ``reader_min_share``,
            ``rewrite_share`` or ``min_restore_share`` outside ``[0, 1]``, a negative
            ``reader_min_blocks`` or ``reader_attention_blocks``, an unknown
            ``readers``, a bad ``block_size`` or a ``scores`` array whose length is not ``edit.old_len``.
    """
    if not 0.0 <= kappa <= 1.0:
        raise ValueError(f"kappa must be in [0, 1], got {kappa}")
    if readers not in READERS:
        raise ValueError(f"readers must be one of {READERS}, got {readers!r}")
    if not 0.0 <= reader_budget <= 1.0:
        raise ValueError(f"reader_budget must be in [0, 1], got {reader_budget}")
    if not 0.0 <= reader_min_share <= 1.0:
        raise ValueError(f"reader_min_share must be in [0, 1], got {reader_min_share}")
    for name, v in (("reader_min_blocks", reader_min_blocks), ("reader_attention_blocks", reader_attention_blocks)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if not 0.0 <= rewrite_share <= 1.0:
        raise ValueError(f"rewrite_share must be in [0, 1], got {rewrite_share}")
    if not 0.0 <= min_restore_share <= 1.0:
        raise ValueError(f"min_restore_share must be in [0, 1], got {min_restore_share}")
    if isinstance(recent_window, bool) or not isinstance(recent_window, (int, np.integer)) or recent_window < 0:
        raise ValueError(f"recent_window must be an int >= 0, got {recent_window!r}")
    prefix_len, blocks = _prep(edit, block_size)
    clean = None
    if scores is not None:
        clean = _clean_scores(scores)
        if clean[0].shape[0] != edit.old_len:
            raise ValueError(f"scores must have one value per old position ({edit.old_len}), got {clean[0].shape[0]}")
    sc = None if clean is None else clean[0]
    p, e, s = span_features(edit)
    d_hat = length_model.predict(p, e, s)
    if rewrite_share < 1.0 and blocks.n_blocks and _rewrite_share(edit, clean) >= rewrite_share:
        return _build(edit, blocks, np.ones(blocks.n_blocks, dtype=bool), strategy="patchkv", prefix_len=prefix_len,
                      d_hat=d_hat, kappa=kappa, head_rewrite=True)
    # D, per block: d_hat is per span in new order; a block's tokens have distances dist0 .. dist0 + len - 1 from
    # the span before its segment, and the first d_hat of them are dirty
    lens = blocks.lengths
    if d_hat.size and blocks.n_blocks:
        span_ends = np.asarray([sp.new_end for sp in edit.spans], dtype=np.int64)  # increasing
        block_d = d_hat[span_ends.searchsorted(blocks.base, side="left")]
        n_dirty_b = np.minimum(np.maximum(block_d - (blocks.starts - blocks.base), 0), lens)  # (np.clip: slower)
    else:
        block_d = np.zeros(blocks.n_blocks, dtype=np.int64)
        n_dirty_b = np.zeros(blocks.n_blocks, dtype=np.int64)
    repair = n_dirty_b > 0
    n_dirty, n_high = int(n_dirty_b.sum()), 0
    if sc is not None and kappa > 0 and blocks.n_blocks:  # H: per token, among the suffix tokens outside D
        outside = np.flatnonzero(blocks.distance >= np.repeat(block_d, lens))
        high = outside[_top_fraction(sc[blocks.old_positions[outside]], kappa)]
        repair[blocks.token_block[high]] = True
        n_high = int(high.size)
    if blocks.n_blocks and blocks.ends[-1] == edit.new_len:
        repair[-1] = True  # the block holding the last context token
    n_readers = 0
    if readers == "lexical" and reader_budget > 0 and blocks.n_blocks:  # reader blocks L
        lex = lexical_reader_scores(edit, blocks)
        cand = ((lex >= reader_min_share if reader_min_share > 0 else lex > 0) & ~repair).nonzero()[0]
        base = edit.new_token_count + int(lens[repair].sum())
        k = min(cand.size, max(int(reader_min_blocks), int(math.ceil(reader_budget * base / blocks.block_size - 1e-9))))
        if k:
            order = np.lexsort((cand, -lex[cand]))  # highest score first, then the earlier block
            repair[cand[order[:k]]] = True
            n_readers = k
        if n_readers and sc is not None and reader_attention_blocks:
            # an edit with readers also refreshes the blocks the old question read most (the old answer's
            # evidence and reasoning): the top blocks by stored attention (block maximum), not yet repaired
            bmax = _block_max(blocks, sc)
            rest = (~repair).nonzero()[0]
            top = rest[np.lexsort((rest, -bmax[rest]))[:int(reader_attention_blocks)]]
            repair[top] = True
            n_readers += int(top.size)
    n_recent = 0
    if recent_window > 0 and blocks.n_blocks:  # W: the last restored tokens, nearest the generation point
        rest = (~repair).nonzero()[0][::-1]  # restored blocks, last first
        after = lens[rest].cumsum() - lens[rest]  # restored tokens after each
        add = rest[after < int(recent_window)]
        repair[add] = True
        n_recent = int(add.size)
    small = False
    if min_restore_share > 0 and blocks.n_blocks:  # too little to restore: recompute the suffix (exact)
        n_restore = int(lens[~repair].sum())
        if n_restore < min_restore_share * blocks.n_tokens:
            repair[:] = True
            small = True
    return _build(edit, blocks, repair, strategy="patchkv", prefix_len=prefix_len, d_hat=d_hat, kappa=kappa,
                  n_dirty=n_dirty, n_high=n_high, n_readers=n_readers, n_recent=n_recent, small_restore=small)


def plan_suffix_blocks(edit: Edit, *, block_size: int = DEFAULT_BLOCK_SIZE) -> SuffixBlocks:
    """The suffix blocks every plan of ``edit`` uses (the ids :func:`plan_blocks` takes).

    Args:
        edit: the diff.
        block_size: suffix tokens per block.
    Returns:
        The :class:`SuffixBlocks` after the reused prefix.
    Raises:
        ValueError: on an empty new context or a bad ``block_size``.
    """
    return _prep(edit, block_size)[1]


def plan_blocks(edit: Edit, repair_blocks, *, block_size: int = DEFAULT_BLOCK_SIZE,
                strategy: str = "custom") -> RepairPlan:
    """A plan that recomputes the given suffix blocks, plus (as every plan) the new tokens and the block
    holding the last context token; everything else in the suffix is restored. For experiments that
    choose blocks by other rules than :func:`plan_repair` (e.g. the selection analysis).

    Args:
        edit: the diff.
        repair_blocks: ids into :func:`plan_suffix_blocks` of the blocks to recompute.
        block_size: suffix tokens per block.
        strategy: the plan's ``strategy`` label.
    Returns:
        The plan.
    Raises:
        ValueError: a block id outside ``[0, n_blocks)``, an empty new context or a bad ``block_size``.
    """
    prefix_len, blocks = _prep(edit, block_size)
    ids = np.asarray(repair_blocks, dtype=np.int64).ravel()
    if ids.size and (ids.min() < 0 or ids.max() >= blocks.n_blocks):
        raise ValueError(f"repair blocks must lie in [0, {blocks.n_blocks}), got {ids.min()}..{ids.max()}")
    mask = np.zeros(blocks.n_blocks, dtype=bool)
    mask[ids] = True
    if blocks.n_blocks and blocks.ends[-1] == edit.new_len:
        mask[-1] = True  # the block holding the last context token
    return _build(edit, blocks, mask, strategy=strategy, prefix_len=prefix_len,
                  d_hat=np.zeros(len(edit.spans), dtype=np.int64))


def plan_full(edit: Edit, *, block_size: int = DEFAULT_BLOCK_SIZE) -> RepairPlan:
    """The prefix-cache baseline: reuse ``P``, recompute every row after it.

    Args:
        edit: the diff.
        block_size: suffix block size (for the block bookkeeping only).
    Returns:
        A plan with every suffix block in ``repair_blocks`` and nothing restored.
    Raises:
        ValueError: on an empty new context.
    """
    prefix_len, blocks = _prep(edit, block_size)
    _, _, s = span_features(edit)
    return _build(edit, blocks, np.ones(blocks.n_blocks, dtype=bool), strategy="prefix", prefix_len=prefix_len,
                  d_hat=s, n_dirty=blocks.n_tokens)


def plan_direct(edit: Edit, *, block_size: int = DEFAULT_BLOCK_SIZE) -> RepairPlan:
    """Direct reuse: recompute ``X`` and the last context token, restore all of ``S``.

    Args:
        edit: the diff.
        block_size: suffix block size (for the block bookkeeping only).
    Returns:
        A plan with every suffix block in ``restore_blocks``; if the last token is a suffix token it is
        recomputed while the rest of its block is restored.
    Raises:
        ValueError: on an empty new context.
    """
    prefix_len, blocks = _prep(edit, block_size)
    return _build(edit, blocks, np.zeros(blocks.n_blocks, dtype=bool), strategy="direct", prefix_len=prefix_len,
                  d_hat=np.zeros(len(edit.spans), dtype=np.int64))

"""Suffix blocks: the suffix of an :class:`~patchkv_agent.core.diff.Edit` cut into ``block_size``-token runs, and
the per-block reads of stored attention.

A block never straddles an edited span: blocks are cut per aligned segment from that segment's start, in new
coordinates (docs/DESIGN.md section 2). The planner (:mod:`.plan`), the reader signal (:mod:`.readers`) and the
calibration's analyses select and score blocks; this module only cuts them.

Boundary: numpy only; knows the Edit's spans and segments, nothing about models, KV or settings.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from .runs import expand_runs

if TYPE_CHECKING:
    from .diff import Edit

__all__ = ["DEFAULT_BLOCK_SIZE", "SuffixBlocks", "suffix_blocks", "block_round", "block_attention"]

DEFAULT_BLOCK_SIZE = 32  # suffix block size in tokens: unit of selection, transfer and precision tags

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

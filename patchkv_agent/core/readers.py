"""The lexical reader signal: which suffix blocks mention what an edit changed (the plan's ``L`` blocks).

A later block that names the entity an edit replaced or introduced was computed with the old version in view and
carries notes of it; :func:`lexical_reader_scores` finds such blocks by the rare words on one side of the edit.
Its one pass over the context runs in ``kernels/native.c`` where that library is built, in numpy otherwise,
with equal results.

Boundary: numpy only (the native twin is imported on first use); knows the Edit and the suffix blocks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .blocks import SuffixBlocks

if TYPE_CHECKING:
    from .diff import Edit

__all__ = ["READERS", "DEFAULT_READER_BUDGET", "READER_MIN_BLOCKS", "READER_MIN_SHARE", "READER_ATTENTION_BLOCKS",
           "READER_MAX_DF", "READER_MIN_DF", "lexical_reader_scores"]

READERS = ("none", "lexical")  # reader-block signals plan_repair knows
DEFAULT_READER_BUDGET = 0.25  # reader blocks add at most this share to the plan's recompute tokens (in blocks) ...
READER_MIN_BLOCKS = 3  # ... or this many blocks, whichever is more
READER_MIN_SHARE = 0.1  # a reader block holds at least this share of the weight of the edit's rare changed tokens
READER_ATTENTION_BLOCKS = 2  # an edit with reader blocks also recomputes this many top stored-attention blocks
READER_MAX_DF = 0.1  # a token counts as rare when at most this share of the context's blocks hold it ...
READER_MIN_DF = 3  # ... or at most this many blocks (short contexts)

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

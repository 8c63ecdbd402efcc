"""Repair planner: an :class:`~patchkv_agent.core.diff.Edit` (plus stored attention) -> a :class:`RepairPlan`.

Boundary: numpy in, frozen dataclasses out. This module knows nothing about torch, models, KV tensors,
checkpoints or precision tags. It decides *which rows* of the new context are reused from the prefix, restored
from the checkpoint (``F``), recomputed (``X`` and ``R``) or, with the measured tail rule, probed at a check
layer first (``T``); the recovery executes that. It reads one
:class:`~patchkv_agent.core.settings.RecoverySettings`, validated when it was built (the rules' defaults live
there).

Vocabulary (docs/DESIGN.md section 2): suffix blocks (:mod:`.blocks`) are ``block_size`` consecutive suffix tokens,
cut per aligned segment from that segment's start in new coordinates, so a block never straddles an edited
span. :func:`plan_repair` applies its rules in this order, each a small function of a :class:`PlanDraft`:

1. :func:`rule_head_rewrite`: an edit that removes most of what the stored attention read (a summary replacing
   the history), or that starts within the first ``head_tokens`` tokens of the context, recomputes every suffix
   token (``head_rewrite``);
2. :func:`rule_dirty_window`: ``D`` = the first ``d_hat`` suffix tokens after each edited span
   (``suffix_distance < d_hat``, ``d_hat`` from the length model);
3. :func:`rule_attention`: ``H`` = the top ``kappa`` fraction of the suffix tokens outside ``D`` by stored
   attention; ``D | H`` is block-rounded;
4. :func:`rule_last_block`: the block holding the last context token (it produces the first logits);
5. :func:`rule_readers`: ``L`` = the *reader blocks* of the edit (:func:`~.readers.lexical_reader_scores`:
   suffix blocks that share rare words with what an edit removed or added), at most ``reader_budget`` of the
   recompute so far;
6. :func:`rule_recency`: ``W`` = the blocks of the last ``recent_window`` tokens the rest would restore (the
   rows nearest the generation point, which the next action reads most). With ``tail_threshold == 0`` they
   are recomputed; with ``tail_threshold > 0`` they become the probe set ``T``: the recovery recomputes them
   up to ``tail_check_layer``, compares their fresh K/V with the restored rows there and carries on only with
   the blocks whose deviation reaches the threshold (the measured tail repair);
7. :func:`rule_small_restore`: a plan whose ``F`` would hold less than ``min_restore_share`` of the suffix
   recomputes all of it (``small_restore``: exact, where the saving is too small to pay for an approximation).

``R = BlockRound(D | H) | last | L | W``; ``F`` = the other blocks (``T`` among them until the probe decides).

Per-span length features (shared with the calibration profiler through :func:`span_features`): for
edited span k, ``P_k`` = its new start (tokens before it), ``E_k`` = ``|M_old_k| + |M_new_k|``,
``S_k`` = length of the aligned segment that follows it (the tokens whose ``d_i`` it defines).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .blocks import DEFAULT_BLOCK_SIZE, SuffixBlocks, _block_max, _clean_scores, _readonly, suffix_blocks
from .length_model import LengthModel
from .readers import lexical_reader_scores
from .runs import expand_runs
from .settings import (DEFAULT_DIRTY_WINDOW, DEFAULT_MIN_RESTORE_SHARE, DEFAULT_RECENT_WINDOW, DEFAULT_REWRITE_SHARE,
                       DEFAULT_TAIL_CHECK_LAYER, RecoverySettings)

if TYPE_CHECKING:  # the planner reads an Edit; it never builds one
    from .diff import Edit

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DIRTY_WINDOW",
    "DEFAULT_REWRITE_SHARE",
    "DEFAULT_RECENT_WINDOW",
    "DEFAULT_MIN_RESTORE_SHARE",
    "DEFAULT_TAIL_CHECK_LAYER",
    "LengthModel",
    "RepairPlan",
    "PlanDraft",
    "PLAN_RULES",
    "rule_head_rewrite",
    "rule_dirty_window",
    "rule_attention",
    "rule_last_block",
    "rule_readers",
    "rule_recency",
    "rule_small_restore",
    "plan_repair",
    "plan_full",
    "plan_direct",
    "plan_blocks",
    "plan_suffix_blocks",
    "span_features",
    "head_rewrite_share",
]

REWRITE_ATTENTION = 4.0  # removed attention share counts this many times (recent queries read ~1/4 of a summarized head)


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
    # the measured tail rule: these restored blocks (ids, sorted) are recomputed up to tail_check_layer, and past
    # it only those whose K/V deviation there reaches tail_threshold (empty: no probe; the recovery runs the plan
    # as it stands)
    probe_blocks: np.ndarray = field(default_factory=lambda: _readonly(np.zeros(0, dtype=np.int64)))
    tail_threshold: float = 0.0
    tail_check_layer: int = DEFAULT_TAIL_CHECK_LAYER

    @property
    def n_recompute(self) -> int:
        return int(self.recompute_positions.shape[0])

    @property
    def n_restore(self) -> int:
        return int(self.restore_new_positions.shape[0])

    def probe_positions(self) -> np.ndarray:
        """int64 sorted new positions of the probed blocks' restored rows (a subset of ``restore_new_positions``;
        the last context token, recomputed anyway, is not among them)."""
        if self.probe_blocks.size == 0:
            return np.zeros(0, dtype=np.int64)
        st, en = self.block_starts[self.probe_blocks], self.block_ends[self.probe_blocks]
        pos = expand_runs(st, en - st)
        return pos[pos < self.new_len - 1]


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
           small_restore: bool = False, probe_blocks: np.ndarray | None = None, tail_threshold: float = 0.0,
           tail_check_layer: int = DEFAULT_TAIL_CHECK_LAYER) -> RepairPlan:
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
        probe_blocks=_readonly(np.zeros(0, dtype=np.int64) if probe_blocks is None else probe_blocks),
        tail_threshold=float(tail_threshold),
        tail_check_layer=int(tail_check_layer),
    )


def _prep(edit: Edit, block_size: int) -> tuple[int, SuffixBlocks]:
    if edit.new_len < 1:
        raise ValueError("the new context is empty: there is no last token to produce logits from")
    prefix_len = min(edit.prefix_len, edit.new_len - 1)
    return prefix_len, suffix_blocks(edit, block_size=block_size, keep_from=prefix_len)


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


# ---------------------------------------------------------------------------------------------------------------------
# plan_repair: its rules, in order
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True, eq=False)
class PlanDraft:
    """A plan being built: the edit, its suffix blocks, the stored attention and the settings the rules read, and
    the block mask the rules fill (``repair``: recompute; ``probe``: the measured tail rule's candidates).

    :func:`plan_repair` runs :data:`PLAN_RULES` over one draft; a test or an experiment can build a draft with
    :meth:`start` and run one rule alone.

    Attributes:
        edit, settings: the inputs.
        prefix_len: rows reused from the prefix (one less than ``edit.prefix_len`` when the last context token
            lies in the prefix).
        blocks: the suffix blocks after ``prefix_len``.
        scores: stored attention per old position (NaN read as 0), or None; ``scores_total`` its sum.
        d_hat: the length model's dirty window per edited span (new order).
        block_d: ``d_hat`` of the span each block follows.
        repair, probe: bool ``[n_blocks]`` masks.
        n_dirty, n_high, n_readers, n_recent: what each rule added (tokens for ``D`` and ``H``, blocks otherwise).
        head_rewrite, small_restore: whether those rules fired.
        done: a rule decided the whole plan (the later rules leave it as it is).
    """

    edit: "Edit"
    settings: "RecoverySettings"
    prefix_len: int
    blocks: SuffixBlocks
    scores: np.ndarray | None
    scores_total: float
    d_hat: np.ndarray
    block_d: np.ndarray
    repair: np.ndarray
    probe: np.ndarray
    n_dirty: int = 0
    n_high: int = 0
    n_readers: int = 0
    n_recent: int = 0
    head_rewrite: bool = False
    small_restore: bool = False
    done: bool = False

    @classmethod
    def start(cls, edit: "Edit", scores: np.ndarray | None, settings: "RecoverySettings") -> "PlanDraft":
        """A draft with no block chosen yet.

        Raises:
            ValueError: an empty new context, a ``settings`` that is not a RecoverySettings or a ``scores``
                array whose length is not ``edit.old_len``.
        """
        _check_settings(settings)
        prefix_len, blocks = _prep(edit, settings.block_size)
        sc, total = None, 0.0
        if scores is not None:
            sc, total = _clean_scores(scores)
            if sc.shape[0] != edit.old_len:
                raise ValueError(f"scores must have one value per old position ({edit.old_len}), got {sc.shape[0]}")
        p, e, s = span_features(edit)
        d_hat = settings.length_model.predict(p, e, s)
        n = blocks.n_blocks
        if d_hat.size and n:
            span_ends = np.asarray([sp.new_end for sp in edit.spans], dtype=np.int64)  # increasing
            block_d = d_hat[span_ends.searchsorted(blocks.base, side="left")]
        else:
            block_d = np.zeros(n, dtype=np.int64)
        return cls(edit=edit, settings=settings, prefix_len=prefix_len, blocks=blocks, scores=sc, scores_total=total,
                   d_hat=d_hat, block_d=block_d, repair=np.zeros(n, dtype=bool), probe=np.zeros(n, dtype=bool))

    def build(self) -> RepairPlan:
        """The plan of this draft."""
        s = self.settings
        return _build(self.edit, self.blocks, self.repair, strategy="patchkv", prefix_len=self.prefix_len,
                      d_hat=self.d_hat, kappa=s.kappa, n_dirty=self.n_dirty, n_high=self.n_high,
                      n_readers=self.n_readers, n_recent=self.n_recent, head_rewrite=self.head_rewrite,
                      small_restore=self.small_restore, probe_blocks=np.flatnonzero(self.probe & ~self.repair),
                      tail_threshold=s.tail_threshold, tail_check_layer=s.tail_check_layer)


def _check_settings(settings) -> None:
    if not isinstance(settings, RecoverySettings):
        raise ValueError(f"settings must be a RecoverySettings, got {type(settings).__name__} "
                         "(patchkv_agent.RecoverySettings(...) or engine.settings)")


def rule_head_rewrite(d: PlanDraft) -> None:
    """A head rewrite recomputes the whole suffix: when :func:`head_rewrite_share` of the edit is at least
    ``settings.rewrite_share`` (1.0: off), or when the edit starts within the first ``settings.head_tokens`` tokens
    (0: off). After a summary replaced the history, every restored row was computed with the removed history in
    view, its drift grows with depth, and on SmolLM2 only recomputing ~94 % of the tail held the next action on
    every summarization resume; an edit right after the system prompt changes what every later row read from its first message on,
    and the probe of the tail does not see it (docs/RESULTS.md, "The probe at a deeper layer, and edits at the head")."""
    s = d.settings
    if not d.blocks.n_blocks:
        return
    clean = None if d.scores is None else (d.scores, d.scores_total)
    near_head = d.edit.prefix_len < s.head_tokens
    if near_head or (s.rewrite_share < 1.0 and _rewrite_share(d.edit, clean) >= s.rewrite_share):
        d.repair[:] = True
        d.head_rewrite = d.done = True


def rule_dirty_window(d: PlanDraft) -> None:
    """``D``: per block, the first ``d_hat`` tokens after the edited span it follows; a block holding any is
    recomputed. A block's tokens have distances ``dist0 .. dist0 + len - 1`` from that span."""
    b = d.blocks
    if not b.n_blocks or not d.d_hat.size:
        return
    n_dirty_b = np.minimum(np.maximum(d.block_d - (b.starts - b.base), 0), b.lengths)  # (np.clip: slower)
    d.repair |= n_dirty_b > 0
    d.n_dirty = int(n_dirty_b.sum())


def rule_attention(d: PlanDraft) -> None:
    """``H``: the top ``kappa`` share of the suffix tokens outside ``D`` by stored attention; their blocks are
    recomputed (needs stored attention)."""
    b, kappa = d.blocks, d.settings.kappa
    if d.scores is None or kappa <= 0 or not b.n_blocks:
        return
    outside = np.flatnonzero(b.distance >= np.repeat(d.block_d, b.lengths))
    high = outside[_top_fraction(d.scores[b.old_positions[outside]], kappa)]
    d.repair[b.token_block[high]] = True
    d.n_high = int(high.size)


def rule_last_block(d: PlanDraft) -> None:
    """The block holding the last context token is recomputed (that token produces the first logits)."""
    b = d.blocks
    if b.n_blocks and b.ends[-1] == d.edit.new_len:
        d.repair[-1] = True


def rule_readers(d: PlanDraft) -> None:
    """``L``: the blocks whose lexical reader score is at least ``reader_min_share`` (``readers="lexical"``), the
    highest first (ties: the earlier block), at most ``reader_budget`` of the recompute so far (in blocks,
    rounded up) or ``reader_min_blocks`` blocks if that is more; with stored attention, an edit with readers
    also recomputes the ``reader_attention_blocks`` restored blocks of highest stored attention (the old
    answer's evidence and reasoning). The reader constants are calibrated per model
    (``calibration/reader_stage.py``)."""
    s, b = d.settings, d.blocks
    if s.readers != "lexical" or s.reader_budget <= 0 or not b.n_blocks:
        return
    lex = lexical_reader_scores(d.edit, b)
    cand = ((lex >= s.reader_min_share if s.reader_min_share > 0 else lex > 0) & ~d.repair).nonzero()[0]
    base = d.edit.new_token_count + int(b.lengths[d.repair].sum())
    k = min(cand.size, max(int(s.reader_min_blocks), int(math.ceil(s.reader_budget * base / b.block_size - 1e-9))))
    if not k:
        return
    order = np.lexsort((cand, -lex[cand]))  # highest score first, then the earlier block
    d.repair[cand[order[:k]]] = True
    d.n_readers = k
    if d.scores is not None and s.reader_attention_blocks:
        bmax = _block_max(b, d.scores)
        rest = (~d.repair).nonzero()[0]
        top = rest[np.lexsort((rest, -bmax[rest]))[:int(s.reader_attention_blocks)]]
        d.repair[top] = True
        d.n_readers += int(top.size)


def rule_recency(d: PlanDraft) -> None:
    """``W``: the blocks holding the last ``recent_window`` tokens the plan would restore, nearest the generation
    point (the rows the next action reads most). ``tail_threshold == 0``: they are recomputed. ``> 0``: they are
    probed instead (the recovery recomputes them up to ``tail_check_layer`` and carries on with the blocks whose
    K/V deviation there reaches the threshold), so a tail the edit did not disturb is restored."""
    b, window = d.blocks, d.settings.recent_window
    if window <= 0 or not b.n_blocks:
        return
    rest = (~d.repair).nonzero()[0][::-1]  # restored blocks, last first
    after = b.lengths[rest].cumsum() - b.lengths[rest]  # restored tokens after each
    add = rest[after < int(window)]
    if d.settings.tail_threshold > 0:
        d.probe[add] = True
    else:
        d.repair[add] = True
    d.n_recent = int(add.size)


def rule_small_restore(d: PlanDraft) -> None:
    """Too little to restore: when the rows the plan would restore (probed blocks counted as restored) are fewer
    than ``min_restore_share`` of the suffix, every suffix token is recomputed (exact)."""
    b, share = d.blocks, d.settings.min_restore_share
    if share <= 0 or not b.n_blocks:
        return
    if int(b.lengths[~d.repair].sum()) < share * b.n_tokens:
        d.repair[:] = True
        d.probe[:] = False
        d.small_restore = True


PLAN_RULES = (rule_head_rewrite, rule_dirty_window, rule_attention, rule_last_block, rule_readers, rule_recency,
              rule_small_restore)


def plan_repair(edit: "Edit", scores: np.ndarray | None, settings: "RecoverySettings") -> RepairPlan:
    """The PatchKV plan: recompute ``X``, ``R = BlockRound(D | H) | last | L | W`` (or probe ``W``); restore the
    rest. The rules (:data:`PLAN_RULES`, module docstring) run in order on one :class:`PlanDraft`; a rule that
    decides the whole plan (the head rewrite) ends it.

    Args:
        edit: diff of the checkpointed (old) and the new context version.
        scores: stored attention per OLD position (length ``edit.old_len``), or None (then ``H`` and the readers'
            attention blocks are empty, and the head-rewrite share counts tokens only).
        settings: the :class:`~patchkv_agent.core.settings.RecoverySettings` (validated when built; a strategy's
            options are already applied).

    Returns:
        The plan (``n_dirty``/``n_high`` tokens, ``n_readers``/``n_recent`` blocks the rules added; ``probe_blocks``
        the measured tail rule's candidates; ``head_rewrite``/``small_restore`` when those rules fired).

    Raises:
        ValueError: an empty new context, ``settings`` not a RecoverySettings, or a ``scores`` array whose
            length is not ``edit.old_len``.
    """
    draft = PlanDraft.start(edit, scores, settings)
    for rule in PLAN_RULES:
        rule(draft)
        if draft.done:
            break
    return draft.build()


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
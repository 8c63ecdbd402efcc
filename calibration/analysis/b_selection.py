"""Figure (b): which extra blocks to recompute after the dirty window: attention vs readers vs distance vs random.

``D`` = the first ``window`` suffix tokens after each edited span, block-rounded as
:func:`patchkv_agent.core.plan.plan_repair` does with kappa 0 (new tokens and the block of the last
token always recomputed). Each selector adds the same budget of ``B`` blocks outside ``D``:
``attention`` (highest stored score per block: its maximum token score, i.e. the blocks the top tokens
of ``H`` hit first), ``readers`` (the edit's reader blocks: highest
:func:`~patchkv_agent.core.readers.lexical_reader_scores`, then the nearest), ``distance`` (the blocks nearest
to an edit after ``D``), ``random`` (seeded), ``low-attention`` (lowest score); ``D-only`` is the
reference. Scored against exact: exact continuation (greedy tokens equal), teacher-forced agreement,
first-token KL, and on edit-following contexts whether the answer follows the edit or stays stale. The block sets plug into the engine
through :class:`BlockSetStrategy` (no library module is patched).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.diff import Edit
from patchkv_agent.core.blocks import DEFAULT_BLOCK_SIZE, SuffixBlocks, block_attention
from patchkv_agent.core.plan import (DEFAULT_DIRTY_WINDOW, LengthModel, RepairPlan, plan_blocks, plan_repair,
                                     plan_suffix_blocks)
from patchkv_agent.core.readers import lexical_reader_scores
from patchkv_agent.core.settings import RecoverySettings
from patchkv_agent.strategies import Strategy

from .inputs import SELECTORS, PreparedContext, _mean, _score

class BlockSetStrategy(Strategy):
    """Recompute the new tokens, the given suffix blocks and the block of the last token; restore the rest.

    Blocks are those of :func:`patchkv_agent.core.blocks.suffix_blocks` at ``block_size`` (the planner's layout);
    the plan is assembled as :func:`patchkv_agent.core.plan.plan_repair` assembles its own. Not registered:
    pass an instance to ``engine.resume(ckpt, ids, strategy=BlockSetStrategy(...))``.

    Args:
        repair_blocks: block ids to recompute (bool mask or ids).
        block_size: block size in tokens.
        precision: ``fp16`` (checkpoint rows as stored) or ``mixed`` (the checkpoint's per-block tags).
        label: written to the plan's ``strategy`` field.

    Raises:
        ValueError: bad ``precision`` or ``block_size``.
    """

    name = "analysis-blocks"

    def __init__(self, repair_blocks: np.ndarray | Sequence[int], *, block_size: int, precision: str = "fp16",
                 label: str = "patchkv"):
        if precision not in ("fp16", "mixed"):
            raise ValueError(f"precision must be 'fp16' or 'mixed', got {precision!r}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        b = np.asarray(repair_blocks)
        self.repair_blocks = np.flatnonzero(b) if b.dtype == bool else b.astype(np.int64).ravel()
        self.block_size, self.label = int(block_size), label
        self.set_overrides(restore_precision=precision)  # read by the default execute

    def plan(self, settings, ckpt, edit: Edit) -> RepairPlan:
        """The plan (see the class docstring).

        Args:
            settings: the engine's recovery settings (unused: the block size is this strategy's).
            ckpt: the checkpoint (unused: the blocks are fixed in advance).
            edit: the diff of the checkpoint's version and the new context.
        Returns:
            A :class:`~patchkv_agent.core.plan.RepairPlan` (``strategy`` = ``label``).
        Raises:
            ValueError: a block id outside the edit's suffix blocks.
        """
        return plan_blocks(edit, self.repair_blocks, block_size=self.block_size, strategy=self.label)


def block_scores(blocks: SuffixBlocks, scores: np.ndarray) -> np.ndarray:
    """Stored attention per suffix block: the maximum score of its tokens (at their old positions).

    Ranking blocks by it is what :func:`patchkv_agent.core.plan.plan_repair`'s ``H`` does when its top tokens
    are taken one at a time until ``B`` distinct blocks are hit; it is the planner's own
    :func:`~patchkv_agent.core.blocks.block_attention`.

    Args:
        blocks: the suffix blocks.
        scores: per old position ``[N_old]`` (NaN counts as 0).
    Returns:
        float64 ``[n_blocks]``.
    """
    return block_attention(blocks, scores)


def _block_distance(blocks: SuffixBlocks) -> np.ndarray:
    out = np.full(blocks.n_blocks, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(out, blocks.token_block, blocks.distance)
    return out


def selection_masks(edit: Edit, scores: np.ndarray | None, *, window: int, block_size: int, budget: float = 0.05,
                    budget_blocks: int | None = None, seed: int = 0) -> dict[str, Any]:
    """The block sets of figure (b): ``D`` plus ``B`` extra blocks per selector.

    Args:
        edit: the diff.
        scores: the checkpoint's attention per old position (needed by ``attention`` / ``low-attention``).
        window: dirty window in tokens after each edited span.
        block_size: block size in tokens.
        budget: ``B = max(1, round(budget * n_blocks))`` when ``budget_blocks`` is None.
        budget_blocks: ``B`` in blocks.
        seed: seed of the ``random`` selector.
    Returns:
        ``{"masks": {selector: bool [n_blocks]}, "n_blocks", "n_dirty_blocks", "budget_blocks" (B, clipped
        to the blocks outside D), "extra": {selector: [block ids added]}}``. Every mask contains ``D``
        (which includes the last token's block).
    Raises:
        ValueError: ``scores`` is None or of the wrong length; bad window or block size.
    """
    base = plan_repair(edit, None, RecoverySettings(length_model=LengthModel.fixed(window), block_size=block_size,
                                                    readers="none"))
    blocks = plan_suffix_blocks(edit, block_size=block_size)
    n = blocks.n_blocks
    d_mask = np.zeros(n, dtype=bool)
    d_mask[np.asarray(base.repair_blocks)] = True
    cand = np.flatnonzero(~d_mask)
    b = int(budget_blocks) if budget_blocks is not None else max(1, int(round(budget * n)))
    b = max(0, min(b, cand.size))
    if scores is None or np.asarray(scores).ravel().shape[0] != edit.old_len:
        raise ValueError(f"selection needs one stored score per old position ({edit.old_len}); "
                         "take the checkpoint with engine.checkpoint() (attention capture)")
    sc = block_scores(blocks, scores)[cand]
    dist = _block_distance(blocks)[cand]
    lex = lexical_reader_scores(edit, blocks)[cand]
    rng = np.random.default_rng(seed)
    extra = {
        "D-only": np.zeros(0, dtype=np.int64),
        "attention": cand[np.lexsort((cand, -sc))[:b]],
        "readers": cand[np.lexsort((cand, dist, -lex))[:b]],
        "distance": cand[np.lexsort((cand, dist))[:b]],
        "random": np.sort(rng.choice(cand, size=b, replace=False)) if b else np.zeros(0, dtype=np.int64),
        "low-attention": cand[np.lexsort((cand, sc))[:b]],
    }
    masks = {}
    for name, ids in extra.items():
        m = d_mask.copy()
        m[ids] = True
        masks[name] = m
    return {"masks": masks, "n_blocks": n, "n_dirty_blocks": int(d_mask.sum()), "budget_blocks": b,
            "extra": {k: sorted(int(x) for x in v) for k, v in extra.items()}}


@torch.no_grad()
def evaluate_selection(engine, prep: PreparedContext, *, window: int = DEFAULT_DIRTY_WINDOW,
                       block_size: int = DEFAULT_BLOCK_SIZE, budget: float = 0.05,
                       budget_blocks: int | None = None, seed: int = 0, precision: str = "fp16",
                       max_new_tokens: int = 16, bar=None) -> list[dict[str, Any]]:
    """Figure (b) for one context: resume with each selector's block set and score it against exact.

    Args:
        engine: the engine.
        prep: the prepared context.
        window, block_size, budget, budget_blocks, seed: see :func:`selection_masks`.
        precision: restore precision (``fp16`` or ``mixed``).
        max_new_tokens: greedy tokens decoded (compared with the exact continuation).
        bar: optional progress bar (``update(1)`` per resume).
    Returns:
        One row per selector: ``selector, n_blocks, budget_blocks, repair_blocks`` (count) and the fields
        of the scoring (``exact_continuation, tf_agree, first_token_kl, top1_agree, recompute_tokens,
        recompute_ratio, ttft_s``).
    Raises:
        ValueError: as :func:`selection_masks`.
    """
    sel = selection_masks(prep.edit, prep.ckpt.scores, window=window, block_size=block_size, budget=budget,
                          budget_blocks=budget_blocks, seed=seed)
    rows = []
    for name in SELECTORS:
        strat = BlockSetStrategy(sel["masks"][name], block_size=block_size, precision=precision)
        res = engine.resume(prep.ckpt, list(prep.context.new_ids), strategy=strat, max_new_tokens=max_new_tokens)
        rows.append({"context": prep.context.id, "selector": name, "n_blocks": sel["n_blocks"],
                     "n_dirty_blocks": sel["n_dirty_blocks"], "budget_blocks": sel["budget_blocks"],
                     "repair_blocks": int(sel["masks"][name].sum()), "extra_blocks": sel["extra"][name],
                     **_score(engine, prep.ref, res, prep.context)})
        del res
        if bar is not None:
            bar.update(1)
    return rows


def summarize_selection(rows: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """Per selector: ``n``, ``exact_continuation`` rate, mean ``tf_agree``, mean and median first-token KL,
    mean recompute ratio, median TTFT, and on edit-following contexts ``follow_rate`` (among contexts where
    exact follows) / ``stale_rate`` (among contexts where exact is not stale) with their counts.

    Args:
        rows: rows of :func:`evaluate_selection`.
    Returns:
        ``{selector: {...}}`` in :data:`SELECTORS` order.
    """
    out = {}
    for name in SELECTORS:
        r = [x for x in rows if x["selector"] == name]
        if not r:
            continue
        kl = [x["first_token_kl"] for x in r]
        fol = [float(x["follows"]) for x in r if x.get("exact_follows")]
        sta = [float(x["stale"]) for x in r if "exact_stale" in x and not x["exact_stale"]]
        out[name] = {"n": len(r), "exact_continuation": _mean([float(x["exact_continuation"]) for x in r]),
                     "follow_rate": _mean(fol) if fol else None, "follow_n": len(fol),
                     "stale_rate": _mean(sta) if sta else None, "stale_n": len(sta),
                     "tf_agree": _mean([x["tf_agree"] for x in r]), "first_token_kl": _mean(kl),
                     "first_token_kl_median": float(np.median(kl)),
                     "recompute_ratio": _mean([x["recompute_ratio"] for x in r]),
                     "ttft_s_median": float(np.median([x["ttft_s"] for x in r]))}
    return out

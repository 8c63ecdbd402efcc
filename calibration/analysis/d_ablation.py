"""Figure (d): ``patchkv`` with a fixed dirty window over a ``kappa x block size`` grid.

The reader blocks are off here (``readers="none"``), so the grid isolates what ``kappa`` and the block
size do; figure (b) compares the reader signal with the others at equal budget.

Per grid point: mean recompute ratio, teacher-forced agreement, first-token KL, median TTFT and the
exact-continuation rate, all against the exact reference of :mod:`.inputs`.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.plan import DEFAULT_DIRTY_WINDOW

from .inputs import PreparedContext, _mean, _score

@torch.no_grad()
def ablation_grid(engine, prep: PreparedContext, *, kappas: Sequence[float], blocks: Sequence[int],
                  window: int = DEFAULT_DIRTY_WINDOW, precision: str = "fp16", max_new_tokens: int = 16,
                  bar=None) -> list[dict[str, Any]]:
    """Figure (d) for one context: ``patchkv`` with a fixed window over ``kappas x blocks``.

    Args:
        engine: the engine.
        prep: the prepared context.
        kappas, blocks: the grid.
        window: fixed dirty window in tokens.
        precision: restore precision (``fp16`` or ``mixed``).
        max_new_tokens: greedy tokens decoded.
        bar: optional progress bar (``update(1)`` per resume).
    Returns:
        One row per grid point: ``kappa, block_size, window`` and the scoring fields.
    """
    rows = []
    for b in blocks:
        for k in kappas:
            res = engine.resume(prep.ckpt, list(prep.context.new_ids), strategy=engine.strategy("patchkv", {
                "dirty_window": int(window), "kappa": float(k), "block_size": int(b), "precision": precision,
                "readers": "none"}), max_new_tokens=max_new_tokens)
            rows.append({"context": prep.context.id, "kappa": float(k), "block_size": int(b), "window": int(window),
                         **_score(engine, prep.ref, res)})
            del res
            if bar is not None:
                bar.update(1)
    return rows


def summarize_ablation(rows: Sequence[dict]) -> list[dict[str, Any]]:
    """Per ``(kappa, block_size)``: ``n``, mean recompute ratio, mean ``tf_agree``, mean first-token KL,
    median TTFT, exact-continuation rate.

    Args:
        rows: rows of :func:`ablation_grid`.
    Returns:
        One dict per grid point, sorted by ``(kappa, block_size)``.
    """
    keys = sorted({(r["kappa"], r["block_size"]) for r in rows})
    out = []
    for k, b in keys:
        r = [x for x in rows if x["kappa"] == k and x["block_size"] == b]
        out.append({"kappa": k, "block_size": b, "n": len(r),
                    "recompute_ratio": _mean([x["recompute_ratio"] for x in r]),
                    "tf_agree": _mean([x["tf_agree"] for x in r]),
                    "first_token_kl": _mean([x["first_token_kl"] for x in r]),
                    "ttft_s_median": float(np.median([x["ttft_s"] for x in r])),
                    "exact_continuation": _mean([float(x["exact_continuation"]) for x in r])})
    return out

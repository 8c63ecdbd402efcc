"""Figure (c): sensitivity of the first token to the precision of one suffix block at a time.

Per suffix block, only that block's checkpoint rows pass through the K8V4 quantize/dequantize reference
(one key-scale group over the block; every other row at full precision), then a ``direct`` resume; the
first-token KL against the full-precision ``direct`` resume. Blocks sorted by KL give a Lorenz-style
cumulative curve and the share of the total KL held by the most sensitive 10 % of blocks (over the
evaluated blocks: at most ``max_blocks``, evenly spaced). The checkpoint's rows are swapped in place and
put back, also after an error.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, plan_suffix_blocks
from patchkv_agent.eval.metrics import first_token_kl
from patchkv_agent.kernels.formats import FORMATS
from patchkv_agent.kernels.reference import reference_dequantize, reference_quantize_gather

from .b_selection import _block_distance, block_scores
from .inputs import PreparedContext, _mean

@contextlib.contextmanager
def quantized_rows(ckpt, rows: np.ndarray, fmt: str = "K8V4") -> Iterator[None]:
    """Within the block, the checkpoint's full-precision rows ``rows`` (every layer) hold their ``fmt`` round
    trip (quantize + dequantize with the kernels' torch reference, one key-scale group over ``rows``); the
    original rows are written back on exit, also after an error.

    Args:
        ckpt: a :class:`~patchkv_agent.core.checkpoint.Checkpoint` (its ``keys``/``values`` are modified in place).
        rows: old positions (one block: contiguous, any order accepted).
        fmt: ``K8V4``, ``K8V8`` or ``FP16`` (``FP16`` keeps the source dtype: an identity).
    Yields:
        None.
    Raises:
        ValueError: an unknown format or rows out of range.
    """
    idx = torch.from_numpy(np.asarray(rows, dtype=np.int64).copy())
    saved = []
    try:
        for k, v in zip(ckpt.keys, ckpt.values):
            i = idx.to(k.device)
            p = reference_quantize_gather(k, v, i, fmt, block_size=max(1, int(i.numel())))
            kq, vq = reference_dequantize(p)
            saved.append((k.index_select(1, i), v.index_select(1, i)))
            k.index_copy_(1, i, kq.to(k.dtype))
            v.index_copy_(1, i, vq.to(v.dtype))
        yield
    finally:
        for (sk, sv), k, v in zip(saved, ckpt.keys, ckpt.values):
            i = idx.to(k.device)
            k.index_copy_(1, i, sk)
            v.index_copy_(1, i, sv)


def _spread(n: int, m: int | None) -> np.ndarray:
    """``m`` evenly spaced ids in ``[0, n)`` (all when ``m`` is None or ``>= n``)."""
    if m is None or m >= n:
        return np.arange(n, dtype=np.int64)
    return np.unique(np.round(np.linspace(0, n - 1, m)).astype(np.int64))


@torch.no_grad()
def block_sensitivity(engine, prep: PreparedContext, *, block_size: int = DEFAULT_BLOCK_SIZE,
                      max_blocks: int | None = 48,
                      fmt: str = "K8V4", bar=None) -> dict[str, Any]:
    """Figure (c) for one context: first-token KL of quantizing one suffix block at a time.

    The reference is the ``direct`` resume from the unmodified (full-precision) checkpoint; each block's
    resume is the same ``direct`` resume with only that block's rows through the ``fmt`` round trip.

    Args:
        engine: the engine.
        prep: the prepared context (its checkpoint is modified and restored block by block).
        block_size: block size in tokens (the planner's suffix blocks).
        max_blocks: evaluate at most this many blocks, evenly spaced over the suffix (None: all).
        fmt: quantization format of the probed block.
        bar: optional progress bar (``update(1)`` per resume).
    Returns:
        ``{"context", "n_blocks", "direct_kl_vs_exact", "blocks": [{"block", "new_start", "old_start",
        "n_tokens", "distance", "last", "score", "kl"}, ...]}`` in block order; ``last`` marks the block
        holding the last context token (``patchkv`` always recomputes it; ``direct`` restores all of it but
        the last token), ``score`` its stored attention (:func:`block_scores`).
    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    ids = list(prep.context.new_ids)
    base = engine.resume(prep.ckpt, ids, strategy="direct", max_new_tokens=0)
    if bar is not None:
        bar.update(1)
    blocks = plan_suffix_blocks(prep.edit, block_size=block_size)
    scores = block_scores(blocks, prep.ckpt.scores) if prep.ckpt.scores is not None else None
    dist = _block_distance(blocks)
    out = []
    for b in _spread(blocks.n_blocks, max_blocks).tolist():
        rows = blocks.old_positions[blocks.token_block == b]
        with quantized_rows(prep.ckpt, rows, fmt):
            r = engine.resume(prep.ckpt, ids, strategy="direct", max_new_tokens=0)
        out.append({"block": int(b), "new_start": int(blocks.starts[b]), "old_start": int(rows.min()),
                    "n_tokens": int(rows.size), "distance": int(dist[b]),
                    "last": bool(blocks.ends[b] == prep.edit.new_len),
                    "score": None if scores is None else float(scores[b]),
                    "kl": float(first_token_kl(base.logits, r.logits))})
        if bar is not None:
            bar.update(1)
    return {"context": prep.context.id, "n_blocks": int(blocks.n_blocks),
            "direct_kl_vs_exact": float(first_token_kl(prep.ref.logits, base.logits)), "blocks": out}


def concentration(kls: Sequence[float], top: float = 0.1) -> dict[str, Any]:
    """Lorenz-style concentration of per-block KL: blocks sorted by KL, most sensitive first.

    Args:
        kls: per-block KL values (negative values count as 0).
        top: the share of blocks (most sensitive first) whose share of the total KL is reported.
    Returns:
        ``{"x": [0, 1/n, ..., 1], "y": [0, cumulative share of the total KL ...], "k_top": ceil(top * n),
        "top_share": y[k_top] (None when the total is 0 or there are no blocks), "total_kl"}``; ``y`` is
        non-decreasing and ends at 1 when the total is positive (all zeros otherwise).
    Raises:
        ValueError: ``top`` outside ``(0, 1]``.
    """
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top must be in (0, 1], got {top}")
    v = np.sort(np.clip(np.asarray(kls, dtype=np.float64).ravel(), 0.0, None))[::-1]
    n = v.size
    total = float(v.sum())
    cum = np.concatenate([[0.0], np.cumsum(v)])
    y = cum / total if total > 0 else np.zeros(n + 1)
    y = np.minimum(y, 1.0)
    k = int(math.ceil(top * n - 1e-9)) if n else 0
    return {"x": (np.arange(n + 1) / max(n, 1)).tolist(), "y": y.tolist(), "k_top": k,
            "top_share": float(y[k]) if n and total > 0 else None, "total_kl": total}


def summarize_precision(contexts: Sequence[dict], top: float = 0.1) -> dict[str, Any]:
    """Per context the concentration curve; overall the mean and median top share. Everything twice: over
    all probed blocks, and without the block of the last token (which ``patchkv`` always recomputes, so
    its precision never matters there).

    Args:
        contexts: results of :func:`block_sensitivity`.
        top: see :func:`concentration`.
    Returns:
        ``{"top": top, "per_context": [{"context", **concentration}], "top_share_mean", "top_share_median",
        "pooled": concentration over the blocks of all contexts}`` and the same three keys with the suffix
        ``_without_last``.
    """
    out: dict[str, Any] = {"top": top}
    for suffix, keep in (("", lambda b: True), ("_without_last", lambda b: not b.get("last", False))):
        per = [{"context": c["context"], **concentration([b["kl"] for b in c["blocks"] if keep(b)], top)}
               for c in contexts]
        shares = [p["top_share"] for p in per if p["top_share"] is not None]
        out.update({f"per_context{suffix}": per, f"top_share_mean{suffix}": _mean(shares),
                    f"top_share_median{suffix}": float(np.median(shares)) if shares else None,
                    f"pooled{suffix}": concentration([b["kl"] for c in contexts for b in c["blocks"] if keep(b)],
                                                     top)})
    return out

"""The precision stage: ``direct`` restores of the kept pairs at FP16 and at each candidate
mixed-precision policy ``(tau_L, tau_H)`` (:func:`evaluate_precision`), and the rule that picks the
smallest-payload policy whose worst per-workload increase of first-token KL stays under the target
(:func:`select_policy`).

Boundary: re-tags and quantizes a pair's checkpoint with :mod:`patchkv_agent.core.precision` and
:func:`patchkv_agent.core.checkpoint.quantize_mixed`, resumes through the engine's public
``resume(..., strategy=DirectStrategy(precision="mixed"))``; plain dict rows out, and the choice from them
(:func:`select_policy` is pure: rows in, a dict out). Knows nothing of the length model, the window and
grid stages or the profile file.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.checkpoint import key_residual, quantize_mixed
from patchkv_agent.core.precision import DEFAULT_G4K, PrecisionPolicy, Tag, assign_tags
from patchkv_agent.eval.metrics import first_token_kl
from patchkv_agent.kernels import value_residual_4bit

from .config import PairProfile

__all__ = ["evaluate_precision", "select_policy"]

_TAG_BYTES = {int(Tag.FP16): 4.0, int(Tag.K8V8): 2.25, int(Tag.K8V4): 1.75, int(Tag.K4V4): 1.25}  # K+V bytes per element pair


def evaluate_precision(engine, pairs: Sequence[PairProfile], policies: Sequence[PrecisionPolicy], *,
                       block_size: int, bar=None) -> list[dict]:
    """``direct`` at FP16 and at each mixed-precision policy on the kept pairs.

    Each policy re-tags the pair's checkpoint (its own attention scores and 4-bit value residuals,
    blocks of ``block_size``; the residuals are computed once per pair) and quantizes each distinct
    tag layout once (:func:`patchkv_agent.core.checkpoint.quantize_mixed`); ``direct``
    then restores the whole suffix from those runs, so the KL it adds over the FP16 restore is the
    precision policy's alone (no recomputed block hides a quantization error).

    Args:
        engine: the engine.
        pairs: pairs (those without a kept checkpoint are skipped).
        policies: the candidate policies.
        block_size: tokens per block for the tags.
        bar: optional progress bar (``update(1)`` per resume).
    Returns:
        One row per pair and policy: ``pair, workload, tau_L, tau_H, alpha, g4, tau_LL, g4k, kl_fp16,
        kl_mixed, payload_vs_fp16`` (payload per element pair relative to FP16 storage: 1.0, 0.5625,
        0.4375 and 0.3125 for FP16, K8V8, K8V4 and K4V4 blocks) and the block counts per tag.
    """
    rows = []
    for p in pairs:
        ck = p.ckpt
        if ck is None:
            continue
        base = engine.resume(ck, p.new_ids, strategy="direct", max_new_tokens=1)
        kl_fp16 = first_token_kl(p.ref_logits, base.logits.cpu())
        if bar is not None:
            bar.update(1)
        resid = value_residual_4bit(torch.stack([v.float() for v in ck.values])).cpu().numpy()
        kres = key_residual(list(ck.keys), block_size) if any(pol.tau_LL > 0 for pol in policies) else None
        attn = np.ones(resid.shape[0]) if ck.scores is None else np.asarray(ck.scores, dtype=np.float64)
        seen: dict[bytes, float] = {}
        for pol in policies:
            tags = assign_tags(attn, resid, block_size, pol, kres)
            sig = tags.tobytes()
            if sig not in seen:  # policies that tag this pair identically share one quantization and resume
                mixed = quantize_mixed(list(ck.keys), list(ck.values), tags, block_size=block_size)
                r = engine.resume(dataclasses.replace(ck, mixed=mixed), p.new_ids,
                                  strategy=engine.strategy("direct", {"precision": "mixed"}), max_new_tokens=1)
                seen[sig] = first_token_kl(p.ref_logits, r.logits.cpu())
            rows.append({"pair": p.pair_id, "workload": p.workload, "tau_L": pol.tau_L, "tau_H": pol.tau_H,
                         "alpha": pol.alpha, "g4": pol.g4, "tau_LL": pol.tau_LL, "g4k": pol.g4k,
                         "kl_fp16": kl_fp16, "kl_mixed": seen[sig],
                         "payload_vs_fp16": float(np.mean([_TAG_BYTES[int(t)] for t in tags]) / 4.0) if len(tags) else 1.0,
                         **{t.name: int((tags == int(t)).sum()) for t in Tag}})
            if bar is not None:
                bar.update(1)
    return rows


def select_policy(rows: Sequence[dict], target: float) -> dict[str, Any]:
    """The smallest-payload policy whose worst per-workload relative KL increase is at most ``target``.

    Per workload and policy: ``increase = mean(kl_mixed) / mean(kl_fp16) - 1``; a policy's ``worst`` is
    its largest increase over workloads. Ties on payload go to the smaller worst increase. When no
    policy meets the target, the one with the smallest worst increase is chosen and ``target_met`` is False.

    Args:
        rows: rows of :func:`evaluate_precision`.
        target: allowed relative increase (0.2: 20 %).
    Returns:
        ``tau_L, tau_H, alpha, g4, tau_LL, g4k, worst_increase, payload_vs_fp16, target, target_met, summary``.
    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no precision rows to select from")
    summary = []
    def _key(r):
        return r["tau_L"], r["tau_H"], r["alpha"], r["g4"], r.get("tau_LL", 0.0), r.get("g4k", DEFAULT_G4K)

    for key in sorted({_key(r) for r in rows}):
        sub = [r for r in rows if _key(r) == key]
        inc = {}
        for w in sorted({r["workload"] for r in sub}):
            ws = [r for r in sub if r["workload"] == w]
            fp = float(np.mean([r["kl_fp16"] for r in ws]))
            inc[w] = float(np.mean([r["kl_mixed"] for r in ws])) / fp - 1.0 if fp > 0 else 0.0
        summary.append({"tau_L": key[0], "tau_H": key[1], "alpha": key[2], "g4": key[3], "tau_LL": key[4],
                        "g4k": key[5], "increase": inc,
                        "worst_increase": max(inc.values()),
                        "payload_vs_fp16": float(np.mean([r["payload_vs_fp16"] for r in sub]))})
    ok = [s for s in summary if s["worst_increase"] <= target]
    pick = min(ok or summary, key=(lambda s: (s["payload_vs_fp16"], s["worst_increase"])) if ok
               else (lambda s: (s["worst_increase"], s["payload_vs_fp16"])))
    return {**{k: pick[k] for k in ("tau_L", "tau_H", "alpha", "g4", "tau_LL", "g4k", "worst_increase",
                                    "payload_vs_fp16")},
            "target": target, "target_met": bool(ok), "summary": summary}

"""Choose a configuration (``kappa``, ``block_size``, ``readers``; or ``tau_V``) from measured rows by the minimax rule.

Boundary: plain dict rows in (one per validation pair and configuration, as
:func:`patchkv_agent.calibration.evaluation.evaluate_configs` writes them), a summary dict out. No torch.

Rule:
1. quality loss of a row: first-token KL to ``exact`` in nats (``quality="kl"``, the default: continuous,
   so a dozen pairs already rank configurations) or ``1 - tf_agree`` (``quality="tf"``: share of greedy
   reference tokens whose argmax differs under teacher forcing).
2. per configuration and workload, the mean loss over that workload's pairs; the configuration's
   *worst* gap is the max over workloads.
3. with a ``follow_target`` and edit-following rows (``follows`` / ``exact_follows`` fields: the pair's
   gold answer changes with the edit, see :mod:`patchkv_agent.eval.follow`), a configuration must also
   answer the new gold in at least ``follow_target`` of the rows where ``exact`` does (its *follow
   rate*); a lower KL that leaves the old answer is not admissible. When no configuration meets it, the
   ones with the highest follow rate stay (``follow_target_met`` False). Steps 4-5 choose among them.
4. admissible: worst gap ``<= best + max(tol_abs, tol_rel * best) + z * se``, ``best`` the smallest
   worst gap and ``se`` the standard error of the configuration's own worst-workload mean (std over its
   pairs / sqrt(n)): a configuration is only ruled out when it is worse than the best by more than the
   tolerance *and* by more than ``z`` standard errors of its measurement (``z=0``: plain tolerance).
   With a quality ``target`` instead (e.g. ``quality="tf", target=0.01``: every workload keeps a
   teacher-forced agreement of at least 0.99), admissible means ``worst gap <= target``; when no
   configuration meets the target the rule above applies and ``target_met`` is False.
5. among admissible configurations, the least mean recompute tokens (deterministic, and proportional to
   resume compute; mean TTFT is reported beside it), then the smaller worst gap, then the smaller
   ``kappa`` (or ``tau_V``), then the larger block, then ``readers`` ``"lexical"`` before ``"none"`` (a
   tie means the reader rule added nothing on these pairs; it stays on for edits that have readers).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import numpy as np

__all__ = ["QUALITY", "row_loss", "summarize_grid", "select_config"]

QUALITY = ("kl", "tf")


def row_loss(row: dict[str, Any], quality: str = "kl") -> float:
    """Quality loss of one grid row.

    Args:
        row: needs ``first_token_kl`` (``quality="kl"``) or ``tf_agree`` (``quality="tf"``).
        quality: ``"kl"`` or ``"tf"``.
    Returns:
        The loss (``>= 0``; 0 = same as exact).
    Raises:
        ValueError: unknown quality.
    """
    if quality == "kl":
        return float(row["first_token_kl"])
    if quality == "tf":
        return 1.0 - float(row["tf_agree"])
    raise ValueError(f"unknown quality {quality!r}; choose one of {QUALITY}")


def summarize_grid(rows: Iterable[dict[str, Any]], quality: str = "kl",
                   keys: tuple[str, ...] = ("kappa", "block_size")) -> list[dict[str, Any]]:
    """One summary per configuration (distinct values of ``keys``).

    Args:
        rows: grid rows with the ``keys`` fields, ``workload``, ``recompute_tokens``, ``ttft_s``,
            ``first_token_kl``, ``tf_agree``.
        quality: loss used for ``gap_by_workload`` / ``worst_gap``.
        keys: the fields that identify a configuration.
    Returns:
        Dicts with the ``keys`` fields and ``n, gap_by_workload, worst_gap, worst_workload, worst_se,
        mean_kl, mean_tf_agree, mean_recompute_tokens, mean_ttft_s, follow_rate, follow_n, stale_rate,
        stale_n`` (follow rate: share of rows answering the new gold among rows whose ``exact_follows``;
        stale rate: share answering the old gold among rows whose exact reference does not; None / 0
        without edit-following rows), sorted by the key values.
    """
    by: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by[tuple(r[k] for k in keys)].append(r)
    out = []
    for kv, rs in sorted(by.items()):
        per_w: dict[str, list[float]] = defaultdict(list)
        for r in rs:
            per_w[str(r.get("workload", ""))].append(row_loss(r, quality))
        gaps = {w: float(np.mean(v)) for w, v in sorted(per_w.items())}
        ses = {w: float(np.std(v, ddof=1) / np.sqrt(len(v))) if len(v) > 1 else 0.0 for w, v in sorted(per_w.items())}
        worst_w = max(gaps, key=gaps.get)
        out.append({
            **dict(zip(keys, kv)), "n": len(rs), "gap_by_workload": gaps,
            "worst_gap": gaps[worst_w], "worst_workload": worst_w, "worst_se": ses[worst_w],
            "mean_kl": float(np.mean([r["first_token_kl"] for r in rs])),
            "mean_tf_agree": float(np.mean([r["tf_agree"] for r in rs])),
            "mean_recompute_tokens": float(np.mean([r["recompute_tokens"] for r in rs])),
            "mean_ttft_s": float(np.mean([r["ttft_s"] for r in rs])),
            **_follow_fields(rs),
        })
    return out


def _follow_fields(rows: list[dict[str, Any]]) -> dict[str, Any]:
    fol = [bool(r["follows"]) for r in rows if r.get("follows") is not None and r.get("exact_follows")]
    sta = [bool(r["stale"]) for r in rows
           if r.get("stale") is not None and r.get("exact_stale") is not None and not r["exact_stale"]]
    return {"follow_rate": float(np.mean(fol)) if fol else None, "follow_n": len(fol),
            "stale_rate": float(np.mean(sta)) if sta else None, "stale_n": len(sta)}


def _order_key(key: str, value: Any, sign: int) -> Any:
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
        return sign * value
    if key == "readers":
        return 0 if value == "lexical" else 1
    return str(value)


def select_config(rows: Iterable[dict[str, Any]], *, quality: str = "kl", tol_abs: float = 1e-3,
                  tol_rel: float = 0.1, z: float = 1.0, target: float | None = None,
                  keys: tuple[str, ...] = ("kappa", "block_size"),
                  prefer: tuple[int, ...] | None = None, follow_target: float | None = None) -> dict[str, Any]:
    """Apply the minimax rule (module docstring) to grid rows.

    Args:
        rows: grid rows (see :func:`summarize_grid`).
        quality: ``"kl"`` or ``"tf"``.
        tol_abs, tol_rel: admissibility tolerance on the worst gap.
        z: standard errors of slack (see the module docstring).
        target: optional quality target on the worst gap (replaces the tolerance rule when met).
        keys: configuration fields (default ``kappa, block_size``; e.g. ``("tau_v",)`` for the window stage).
        prefer: tie-break, per key: ``+1`` prefers the smaller value, ``-1`` the larger
            (default: smaller ``kappa``, larger ``block_size``, and smaller for any other numeric key;
            ``readers``: ``"lexical"`` first; other strings in order).
        follow_target: the least follow rate an admissible configuration needs (rule step 3), in
            ``[0, 1]``, or None (no follow condition). Ignored when no row is an edit-following row.
    Returns:
        The ``keys`` fields of the pick and ``worst_gap, best_worst_gap, tolerance, z, target, target_met,
        admissible, quality, follow_target, follow_target_met, follow_rate, summary``
        (``summary``: the per-configuration list of :func:`summarize_grid`; ``follow_target_met`` None
        without a follow target or without edit-following rows).
    Raises:
        ValueError: no rows, unknown quality, a negative tolerance, or ``follow_target`` outside ``[0, 1]``.
    """
    if quality not in QUALITY:
        raise ValueError(f"unknown quality {quality!r}; choose one of {QUALITY}")
    if tol_abs < 0 or tol_rel < 0 or z < 0:
        raise ValueError("tolerances and z must be >= 0")
    if follow_target is not None and not 0.0 <= follow_target <= 1.0:
        raise ValueError(f"follow_target must be in [0, 1] (or None), got {follow_target}")
    summary = summarize_grid(rows, quality, keys)
    if not summary:
        raise ValueError("no grid rows to select from")
    sign = prefer or tuple(-1 if k == "block_size" else 1 for k in keys)
    pool, follow_met = summary, None
    if follow_target is not None and any(s["follow_n"] for s in summary):
        rate = {id(s): s["follow_rate"] if s["follow_rate"] is not None else 1.0 for s in summary}
        pool = [s for s in summary if rate[id(s)] >= follow_target - 1e-12]
        follow_met = bool(pool)
        if not pool:  # nobody follows well enough: the best followers stay
            top = max(rate.values())
            pool = [s for s in summary if rate[id(s)] >= top - 1e-12]
    best = min(s["worst_gap"] for s in pool)
    tol = max(tol_abs, tol_rel * best)
    admissible = [s for s in pool if target is not None and s["worst_gap"] <= target]
    target_met = bool(admissible)
    if not admissible:
        admissible = [s for s in pool if s["worst_gap"] <= best + tol + z * s["worst_se"]]
    pick = min(admissible, key=lambda s: (s["mean_recompute_tokens"], s["worst_gap"],
                                          *(_order_key(k, s[k], g) for g, k in zip(sign, keys))))
    return {**{k: pick[k] for k in keys}, "worst_gap": pick["worst_gap"], "best_worst_gap": best,
            "tolerance": tol, "z": z, "target": target, "target_met": target_met if target is not None else None,
            "admissible": len(admissible), "quality": quality, "follow_target": follow_target,
            "follow_target_met": follow_met, "follow_rate": pick["follow_rate"], "summary": summary}

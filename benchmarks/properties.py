"""Property check of diff + plan + recover over random edits (the stress run's and the tests' shared check).

:func:`check_recovery` takes an engine and two context versions and checks, for that one pair:

- the diff is a valid alignment (every kept old token reappears, unchanged, at its new position);
- the PatchKV plan with the engine's defaults partitions the new context exactly: the reused prefix,
  the recomputed and the restored positions are disjoint and cover ``[0, new_len)``; restored rows are
  suffix rows (at their aligned old position); every new token, the last token and every token of a
  repaired block (the last block included) is recomputed;
- a PatchKV resume with a full repair set (a dirty window covering the whole suffix) equals the exact
  full prefill (first-token logits within ``1e-4`` on fp32);
- the default PatchKV resume runs without exception or fallback and executes that plan; when it restores
  nothing it equals the exact prefill too.

:func:`edit_pairs` is a Hypothesis strategy over (old, new) pairs: insertions, deletions, replacements,
several spans, edits at the head, the tail or both ends, and identical versions, over a wide or a tiny
alphabet (repeated content stresses the aligner). :func:`run_properties` runs the check over ``examples``
generated pairs and counts what ran and what failed (it does not stop at the first failure).

Hypothesis is a test dependency (the ``test`` extra); this module imports it only when a strategy is built.

Knows the engine, the diff and the plan; nothing about stores, threads or LangGraph.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import numpy as np
import torch

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.strategies import get_strategy

LOGIT_TOL = 1e-4
EDIT_KINDS = ("identical", "insert", "delete", "replace", "multi", "head", "tail", "both_ends")
HYPOTHESIS_HINT = ("the property check needs Hypothesis, which patchkv-agent lists in its test extra: "
                   "pip install 'patchkv-agent[test]' (or pip install hypothesis)")


class PropertyViolation(AssertionError):
    """A property of diff + plan + recover does not hold for one (old, new) pair."""


def _require(cond: bool, what: str) -> None:
    if not cond:
        raise PropertyViolation(what)


def _hypothesis():
    try:
        import hypothesis
    except ImportError as e:  # pragma: no cover - exercised only without the test extra
        raise ImportError(HYPOTHESIS_HINT) from e
    return hypothesis


def check_plan(edit, plan) -> None:
    """Check that ``plan`` partitions ``edit``'s new context exactly (see the module docstring).

    Raises:
        PropertyViolation: naming the first property that fails.
    """
    n, p = edit.new_len, plan.prefix_len
    rec = np.asarray(plan.recompute_positions, dtype=np.int64)
    res_new = np.asarray(plan.restore_new_positions, dtype=np.int64)
    res_old = np.asarray(plan.restore_old_positions, dtype=np.int64)
    _require(plan.new_len == n and plan.old_len == edit.old_len, "plan lengths differ from the edit's")
    _require(p <= edit.prefix_len and p <= n - 1, f"plan prefix {p} beyond the edit prefix {edit.prefix_len}")
    _require(bool(np.all(np.diff(rec) > 0)) and bool(np.all(np.diff(res_new) > 0)), "positions not sorted/unique")
    _require(rec.size == 0 or (rec[0] >= p and rec[-1] < n), "recompute positions outside [prefix, new_len)")
    _require(np.intersect1d(rec, res_new).size == 0, "a position is both recomputed and restored")
    _require(p + rec.size + res_new.size == n, f"prefix {p} + recompute {rec.size} + restore {res_new.size} != {n}")
    # restored rows are suffix rows, read from their aligned old position
    suffix = np.asarray(edit.suffix_new_positions, dtype=np.int64)
    _require(np.setdiff1d(res_new, suffix).size == 0, "a restored position is not a suffix position")
    _require(res_old.shape == res_new.shape and bool(np.all(edit.new_to_old[res_new] == res_old)),
             "restored rows not read from their aligned old positions")
    # the suffix (after the plan's prefix) is split exactly between recompute and restore
    after = suffix[suffix >= p]
    _require(np.setdiff1d(after, np.union1d(rec, res_new)).size == 0, "a suffix position is neither kind")
    # new tokens, the last token and repaired blocks are recomputed
    _require(np.setdiff1d(np.asarray(edit.new_positions), rec).size == 0, "a new token is not recomputed")
    _require(n - 1 in set(rec.tolist()), "the last context token is not recomputed")
    starts, ends = np.asarray(plan.block_starts), np.asarray(plan.block_ends)
    nb = starts.shape[0]
    rep, keep = np.asarray(plan.repair_blocks), np.asarray(plan.restore_blocks)
    _require(np.intersect1d(rep, keep).size == 0 and np.union1d(rep, keep).size == nb,
             "repair and restore blocks do not partition the suffix blocks")
    in_blocks = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)]) if nb else np.zeros(0, np.int64)
    _require(np.array_equal(np.intersect1d(in_blocks, suffix), np.sort(in_blocks)),
             "a suffix block holds a non-suffix position")
    for b in rep.tolist():
        _require(np.setdiff1d(np.arange(starts[b], ends[b]), rec).size == 0, f"repaired block {b} not recomputed")
    if nb and ends[-1] == n:
        _require(nb - 1 in set(rep.tolist()), "the block holding the last token is not repaired")


def check_recovery(engine, old_ids, new_ids, *, tol: float = LOGIT_TOL, ckpt=None) -> dict[str, Any]:
    """Diff, plan and recover one (old, new) pair on ``engine`` and check every property.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine` (fp32 for the default ``tol``).
        old_ids, new_ids: the two context versions (non-empty).
        tol: largest first-token logit difference from the exact prefill.
        ckpt: the checkpoint of ``old_ids`` (default: written here).

    Returns:
        ``{"old_len", "new_len", "spans", "suffix", "recompute", "restore", "full_diff", "default_diff"}``.

    Raises:
        PropertyViolation: a property fails (the message names it).
    """
    old, new = list(map(int, old_ids)), list(map(int, new_ids))
    edit = diff_versions(old, new)
    o2n = np.asarray(edit.old_to_new)
    kept = np.flatnonzero(o2n >= 0)
    _require(bool(np.all(np.asarray(old)[kept] == np.asarray(new)[o2n[kept]])), "diff aligns different tokens")
    _require(bool(np.all(np.diff(o2n[kept]) > 0)), "diff alignment is not monotone")
    _require(edit.identical == (old == new), "identical flag wrong")
    ckpt = ckpt if ckpt is not None else engine.checkpoint(old)
    plan = get_strategy("patchkv").plan(engine.settings, ckpt, edit)
    check_plan(edit, plan)
    full_plan = get_strategy("patchkv", {"dirty_window": 10**9}).plan(engine.settings, ckpt, edit)
    check_plan(edit, full_plan)
    _require(full_plan.n_restore == 0, "a dirty window over the whole suffix still restores rows")

    exact = engine.resume(None, new, strategy="exact", max_new_tokens=0)
    full = engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"dirty_window": 10**9}), max_new_tokens=0)
    _require(full.stats["fallback"] is None, f"full repair fell back: {full.stats['fallback']}")
    full_diff = float((full.logits - exact.logits).abs().max())
    _require(full_diff <= tol, f"full repair differs from exact by {full_diff:.3g} > {tol}")
    dflt = engine.resume(ckpt, new, strategy="patchkv", max_new_tokens=0)
    _require(dflt.stats["fallback"] is None, f"default resume fell back: {dflt.stats['fallback']}")
    _require(dflt.stats["recompute_tokens"] == plan.n_recompute and dflt.stats["restore_tokens"] == plan.n_restore,
             "the default resume did not execute the plan")
    _require(bool(torch.isfinite(dflt.logits).all()), "non-finite logits")
    default_diff = float((dflt.logits - exact.logits).abs().max())
    if plan.n_restore == 0:
        _require(default_diff <= tol, f"nothing restored, yet differs from exact by {default_diff:.3g}")
    return {"old_len": len(old), "new_len": len(new), "spans": len(edit.spans), "suffix": edit.suffix_len,
            "recompute": plan.n_recompute, "restore": plan.n_restore, "full_diff": full_diff,
            "default_diff": default_diff}


def edit_pairs(*, vocab: int = 211, min_len: int = 1, max_len: int = 160, max_span: int = 12):
    """A Hypothesis strategy of ``(kind, old_ids, new_ids)`` over every edit kind in :data:`EDIT_KINDS`.

    Ids are in ``[3, vocab)``, or, for a quarter of the pairs, in a 3-token alphabet (repeats everywhere).
    ``new_ids`` is never empty.
    """
    st = _hypothesis().strategies

    @st.composite
    def pairs(draw):
        lo, hi = 3, vocab - 1
        if draw(st.integers(0, 3)) == 0:
            hi = 5  # tiny alphabet: repeated runs, ambiguous alignments
        tok = st.integers(lo, hi)
        kind = draw(st.sampled_from(EDIT_KINDS))
        n = draw(st.integers(min_len, max_len))
        old = draw(st.lists(tok, min_size=n, max_size=n))
        new = list(old)
        chunk = st.lists(tok, min_size=1, max_size=max_span)

        def span() -> tuple[int, int]:
            i = draw(st.integers(0, len(new)))
            j = draw(st.integers(i, min(len(new), i + max_span)))
            return i, j

        if kind == "insert":
            i = draw(st.integers(0, len(new)))
            new[i:i] = draw(chunk)
        elif kind == "delete":
            i, j = span()
            del new[i:j]
        elif kind == "replace":
            i, j = span()
            new[i:j] = draw(chunk)
        elif kind == "multi":  # several spans anywhere, each replace / insert / delete
            for _ in range(draw(st.integers(2, 4))):
                i, j = span()
                new[i:j] = draw(st.lists(tok, min_size=0, max_size=max_span))
        elif kind in ("head", "both_ends"):
            j = draw(st.integers(0, min(len(new), max_span)))
            new[:j] = draw(st.lists(tok, min_size=0, max_size=max_span))
        if kind in ("tail", "both_ends"):
            i = draw(st.integers(max(0, len(new) - max_span), len(new)))
            new[i:] = draw(st.lists(tok, min_size=0, max_size=max_span))
        if not new:
            new = draw(st.lists(tok, min_size=1, max_size=max_span))
        return kind, old, new

    return pairs()


def run_properties(engine, examples: int = 1000, *, seed: int = 0, max_len: int = 160,
                   tol: float = LOGIT_TOL, max_failures_kept: int = 5) -> dict[str, Any]:
    """Run :func:`check_recovery` over ``examples`` pairs drawn from :func:`edit_pairs` (Hypothesis, seeded).

    Every failing pair is counted and the run goes on (no shrinking); the first ``max_failures_kept``
    are returned with their error, shortest first.

    Returns:
        ``{"examples", "failures", "kinds", "failed", "max_full_diff", "mean_recompute_fraction",
        "restoring_examples", "wall_s", "seed"}``.

    Raises:
        ImportError: Hypothesis is not installed (the message names the test extra).
        ValueError: ``examples`` < 0.
    """
    if examples < 0:
        raise ValueError(f"examples must be >= 0, got {examples}")
    hyp = _hypothesis()
    kinds: Counter = Counter()
    failed: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    if examples:
        @hyp.seed(seed)
        @hyp.settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                      suppress_health_check=list(hyp.HealthCheck), phases=[hyp.Phase.generate])
        @hyp.given(edit_pairs(vocab=engine.spec.vocab_size, max_len=max_len))
        def prop(case):
            kind, old, new = case
            kinds[kind] += 1
            try:
                rows.append(check_recovery(engine, old, new, tol=tol))
            except Exception as e:  # noqa: BLE001 - every failure is counted, the run goes on
                failed.append({"kind": kind, "old": old, "new": new, "error": f"{type(e).__name__}: {e}"})

        prop()
    failed.sort(key=lambda f: len(f["old"]) + len(f["new"]))
    n = sum(kinds.values())
    return {
        "examples": n, "failures": len(failed), "kinds": dict(sorted(kinds.items())),
        "failed": failed[:max_failures_kept],
        "max_full_diff": max((r["full_diff"] for r in rows), default=0.0),
        "mean_recompute_fraction": round(float(np.mean([r["recompute"] / (r["recompute"] + r["restore"])
                                                        for r in rows])), 4) if rows else 0.0,
        "restoring_examples": sum(1 for r in rows if r["restore"] > 0),
        "wall_s": round(time.perf_counter() - t0, 3), "seed": seed,
    }


def format_properties(p: dict[str, Any]) -> str:
    """One summary line (two when something failed) of :func:`run_properties`'s result."""
    line = (f"  property diff+plan+recover: {p['examples']} examples, {p['failures']} failures "
            f"({p['restoring_examples']} restoring rows; full repair vs exact max |dlogit| "
            f"{p['max_full_diff']:.2e}); {p['wall_s']} s")
    if p["failed"]:
        f = p["failed"][0]
        line += f"\n  first failure ({f['kind']}, old {len(f['old'])} / new {len(f['new'])} tokens): {f['error']}"
    return line


__all__ = ["check_recovery", "check_plan", "edit_pairs", "run_properties", "format_properties", "PropertyViolation",
           "EDIT_KINDS", "HYPOTHESIS_HINT"]

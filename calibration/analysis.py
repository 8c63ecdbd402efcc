"""Analysis figures (issue 4 item 6): drift by distance, selection, per-block precision, kappa x block ablation.

Boundary: drives a :class:`~patchkv_agent.engine.PatchKVEngine` through its public methods
(``checkpoint``, ``resume`` with a strategy name or a :class:`~patchkv_agent.strategies.Strategy` instance),
reads the planner's block layout and plan assembly (:mod:`patchkv_agent.core.plan`), the RoPE and K8V4/K8V8
torch references (:mod:`patchkv_agent.kernels`) and the scoring of :mod:`patchkv_agent.eval.replay`; per-token
cosines come from :func:`.drift.span_drift` / :func:`.drift.token_deviation`. It writes one JSON file and
one PNG per figure; the ``plot_*`` functions read only that JSON (no model), for the notebook. Nothing here
is imported by the resume path, and no module of the library is patched: the selection experiment plugs in
through :class:`BlockSetStrategy`, the precision experiment swaps rows of a checkpoint and puts them back.

Per edited context (version 0 checkpointed with ``engine.checkpoint``, version 1 prefilled exactly with
``engine.resume(None, ids, strategy="exact")``, aligned by :func:`patchkv_agent.core.diff.diff_versions`):

(a) drift: per edited span followed by an aligned segment, by distance from the span in ``bin_size``-token
    bins, the cosine similarity against the exact version-1 rows of (i) the stale values, (ii) the stale
    keys as stored (rotated for their old positions) and (iii) the stale keys RoPE-corrected by the
    position shift; each the mean over layers and KV heads, then over the tokens of the bin. Summary:
    median and 10-90 % band over spans per bin.
(b) selection: ``D`` = the first ``window`` suffix tokens after each edited span, block-rounded as
    :func:`patchkv_agent.core.plan.plan_repair` does with kappa 0 (new tokens and the block of the last token
    always recomputed). Each selector adds the same budget of ``B`` blocks outside ``D``: ``attention``
    (highest stored score per block: its maximum token score, i.e. the blocks the top tokens of ``H`` hit
    first), ``distance`` (the blocks nearest to an edit after ``D``), ``random`` (seeded),
    ``low-attention`` (lowest score); ``D-only`` is the reference. Scored against exact: exact continuation
    (greedy tokens equal), teacher-forced agreement, first-token KL.
(c) precision sensitivity: per suffix block, only that block's checkpoint rows pass through the K8V4
    quantize/dequantize reference (one key-scale group over the block; every other row at full
    precision), then a ``direct`` resume; the first-token KL against the full-precision ``direct`` resume.
    Blocks sorted by KL give a Lorenz-style cumulative curve and the share of the total KL held by the
    most sensitive 10 % of blocks (over the evaluated blocks: at most ``max_blocks``, evenly spaced).
(d) ablation: ``patchkv`` resumes with a fixed ``window`` over ``kappas x blocks``: mean recompute ratio,
    teacher-forced agreement, first-token KL, median TTFT.

Command line::

    python -m patchkv_agent.calibration.analysis --model smollm2-135m --n 3 --out-dir docs/figures/analysis
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from patchkv_agent.core.diff import Edit, diff_versions
from patchkv_agent.kernels.quant import FORMATS, reference_dequantize, reference_quantize_gather
from patchkv_agent.kernels.rope import rope_delta_reference
from patchkv_agent.core.plan import LengthModel, RepairPlan, SuffixBlocks, plan_blocks, plan_repair, plan_suffix_blocks
from patchkv_agent.eval.replay import first_token_kl, teacher_forced_agreement
from patchkv_agent.strategies import Strategy

from .drift import block_deviation, span_drift, token_deviation

__all__ = [
    "FIGURES", "SELECTORS", "Context", "AnalysisConfig", "PreparedContext", "prepare_context",
    "corrected_keys", "position_cosines", "drift_spans", "summarize_drift",
    "BlockSetStrategy", "block_scores", "selection_masks", "evaluate_selection", "summarize_selection",
    "quantized_rows", "block_sensitivity", "concentration", "summarize_precision",
    "ablation_grid", "summarize_ablation",
    "build_contexts", "run_analysis", "plot_drift", "plot_selection", "plot_precision", "plot_ablation",
    "write_outputs", "build_parser", "main",
]

FIGURES = ("a", "b", "c", "d")
FIGURE_NAMES = {"a": "drift", "b": "selection", "c": "precision", "d": "ablation"}
SELECTORS = ("D-only", "attention", "distance", "random", "low-attention")
DEFAULT_WORKLOADS = ("hotpotqa-e", "2wikimqa-e", "nq-e")
_PCT = (10, 50, 90)


# ----------------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True, kw_only=True)
class Context:
    """One edited context: version 0 (checkpointed) and version 1 (resumed), as token ids.

    Attributes:
        id: unique id (a trace id).
        workload, edit: provenance labels.
        old_ids, new_ids: token ids of version 0 and version 1.
    """

    id: str
    workload: str = ""
    edit: str = ""
    old_ids: tuple[int, ...]
    new_ids: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class AnalysisConfig:
    """Every knob of an analysis run (recorded in the JSON).

    Attributes:
        figures: which of ``a, b, c, d`` to compute.
        bin_size: (a) distance bin in tokens.
        layers: (a) layers averaged over (None: all).
        window: (b, d) fixed dirty window ``D`` in tokens after each edited span.
        block_size: (b, c) block size in tokens.
        budget: (b) extra blocks as a fraction of the suffix blocks (at least one block).
        budget_blocks: (b) the extra budget in blocks (overrides ``budget``).
        seed: (b) seed of the random selector.
        max_blocks: (c) blocks evaluated per context (evenly spaced; None: all).
        quant_format: (c) ``K8V4`` (default), ``K8V8`` or ``FP16`` (identity: a control).
        top_share: (c) the most sensitive share of blocks whose KL share is reported.
        kappas, blocks: (d) the grid.
        max_new_tokens: greedy reference tokens (exact continuation, teacher-forced agreement).
        precision: (b, d) restore precision of ``patchkv``-style resumes: ``fp16`` (checkpoint rows as
            stored) or ``mixed`` (the checkpoint's per-block tags).
    """

    figures: tuple[str, ...] = FIGURES
    bin_size: int = 32
    layers: tuple[int, ...] | None = None
    window: int = 32
    block_size: int = 32
    budget: float = 0.05
    budget_blocks: int | None = None
    seed: int = 0
    max_blocks: int | None = 48
    quant_format: str = "K8V4"
    top_share: float = 0.1
    kappas: tuple[float, ...] = (0.0, 0.01, 0.02, 0.03)
    blocks: tuple[int, ...] = (16, 32, 64, 128)
    max_new_tokens: int = 16
    precision: str = "fp16"

    def __post_init__(self) -> None:
        bad = [f for f in self.figures if f not in FIGURES]
        if bad or not self.figures:
            raise ValueError(f"figures must be a non-empty subset of {FIGURES}, got {self.figures}")
        if min(self.bin_size, self.block_size, *self.blocks) < 1 or self.window < 0:
            raise ValueError("bin_size, block_size and blocks must be >= 1 and window >= 0")
        if not 0.0 <= self.budget <= 1.0 or not 0.0 < self.top_share <= 1.0:
            raise ValueError("budget must be in [0, 1] and top_share in (0, 1]")
        if any(not 0.0 <= k <= 1.0 for k in self.kappas):
            raise ValueError(f"kappas must lie in [0, 1], got {self.kappas}")
        if self.quant_format not in FORMATS:
            raise ValueError(f"quant_format must be one of {FORMATS}, got {self.quant_format!r}")
        if self.precision not in ("fp16", "mixed"):
            raise ValueError(f"precision must be 'fp16' or 'mixed', got {self.precision!r}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise ValueError("max_blocks must be >= 1 (or None for all)")


@dataclass(eq=False)
class PreparedContext:
    """A context after its two passes: the version-0 checkpoint and the exact version-1 result.

    Attributes:
        context: the :class:`Context`.
        ckpt: ``engine.checkpoint(old_ids)`` (attention scores included).
        ref: ``engine.resume(None, new_ids, strategy="exact")``: logits, greedy output, K/V of version 1.
        edit: ``diff_versions(old_ids, new_ids)``.
    """

    context: Context
    ckpt: Any
    ref: Any
    edit: Edit


@torch.no_grad()
def prepare_context(engine, context: Context, *, max_new_tokens: int = 16, mixed: bool = False) -> PreparedContext:
    """Checkpoint version 0 and prefill version 1 exactly.

    Args:
        engine: the engine.
        context: the context.
        max_new_tokens: greedy reference tokens decoded after the exact prefill.
        mixed: also write mixed-precision runs into the checkpoint (needed for ``precision="mixed"``).
    Returns:
        The :class:`PreparedContext`.
    Raises:
        ValueError: as :meth:`PatchKVEngine.checkpoint` / ``resume`` (bad ids, versions identical).
    """
    saved = engine.mixed_precision
    engine.mixed_precision = mixed
    try:
        ckpt = engine.checkpoint(list(context.old_ids))
    finally:
        engine.mixed_precision = saved
    ref = engine.resume(None, list(context.new_ids), strategy="exact", max_new_tokens=max_new_tokens)
    edit = diff_versions(ckpt.token_ids, ref.context_ids)
    if edit.identical:
        raise ValueError(f"context {context.id!r}: the two versions are identical")
    return PreparedContext(context=context, ckpt=ckpt, ref=ref, edit=edit)


def _score(engine, ref, res) -> dict[str, Any]:
    """Fidelity of one resume against the exact reference, plus its cost fields."""
    return {
        "exact_continuation": bool(list(res.output_ids) == list(ref.output_ids)),
        "tf_agree": float(teacher_forced_agreement(engine, res, list(ref.output_ids))),
        "first_token_kl": float(first_token_kl(ref.logits, res.logits)),
        "top1_agree": bool(int(res.logits.argmax()) == int(ref.logits.argmax())),
        "recompute_tokens": int(res.stats["recompute_tokens"]),
        "recompute_ratio": float(res.stats["recompute_ratio"]),
        "ttft_s": float(res.stats["ttft_s"]),
    }


def _pcts(values: Sequence[float]) -> list[float | None]:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
    return [float(x) for x in np.percentile(v, _PCT)] if v.size else [None] * len(_PCT)


def _mean(values: Sequence[float]) -> float | None:
    v = [float(x) for x in values if x is not None]
    return float(np.mean(v)) if v else None


# ------------------------------------------------------------------------------------------------- (a) drift


def _layer_rows(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.dim() == 4 else t


def corrected_keys(spec, keys: Sequence[torch.Tensor], edit: Edit) -> list[torch.Tensor]:
    """Old keys moved to their new positions: each kept old row rotated by its shift (new - old position).

    Rows the edit drops and rows with zero shift are returned as stored (bit for bit when nothing shifts).

    Args:
        spec: the model's :class:`~patchkv_agent.core.models.ModelSpec` (per-layer RoPE).
        keys: per layer old keys ``[H, N_old, D]`` (or ``[1, H, N_old, D]``), as stored (post-RoPE).
        edit: the diff of the old and new versions.
    Returns:
        Per layer ``[H, N_old, D]`` keys (old row order), in the input dtype.
    Raises:
        ValueError: a row shifts under a RoPE the delta rotation cannot correct (``spec`` says unsupported).
    """
    delta = np.where(edit.old_to_new >= 0, edit.old_to_new - np.arange(edit.old_len, dtype=np.int64), 0)
    shifted = bool(np.any(delta != 0))
    delta_t = torch.from_numpy(delta)
    out = []
    for layer, k in enumerate(keys):
        k = _layer_rows(k)
        rope = spec.rope_for_layer(layer)
        if not shifted or rope.inv_freq is None:
            out.append(k)
            continue
        if not rope.supported:
            raise ValueError(f"layer {layer}: cannot RoPE-correct shifted keys ({rope.reason})")
        out.append(rope_delta_reference(k, delta_t.to(k.device), rope.inv_freq, interleaved=rope.interleaved))
    return out


def _layers(spec, layers: Sequence[int] | None) -> list[int]:
    return list(range(spec.num_layers)) if layers is None else [int(x) for x in layers]


def position_cosines(spec, old_keys, old_values, new_keys, new_values, edit: Edit, old_positions: np.ndarray,
                     new_positions: np.ndarray, *, layers: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Cosine similarity of old rows against new rows at aligned positions (mean over layers and KV heads).

    Args:
        spec: the model spec.
        old_keys, old_values: per layer old K/V (the checkpoint's ``[H, N_old, D]``).
        new_keys, new_values: per layer exact K/V of the new version (``[1, H, N_new, D]`` or ``[H, N_new, D]``).
        edit: the diff (gives each old row's shift for the RoPE correction).
        old_positions, new_positions: aligned int arrays: the same token in the two versions.
        layers: layers averaged over (None: all).
    Returns:
        ``{"value", "key_raw", "key_corrected"}``: float64 ``[len(positions)]`` cosines.
    Raises:
        ValueError: as :func:`.drift.token_deviation` and :func:`corrected_keys`.
    """
    ls = _layers(spec, layers)
    ck = corrected_keys(spec, old_keys, edit)
    old_positions = np.array(old_positions, dtype=np.int64)  # writable copies for torch.from_numpy
    new_positions = np.array(new_positions, dtype=np.int64)
    dev = {"value": token_deviation(old_values, new_values, old_positions, new_positions, layers=ls),
           "key_raw": token_deviation(old_keys, new_keys, old_positions, new_positions, layers=ls),
           "key_corrected": token_deviation(ck, new_keys, old_positions, new_positions, layers=ls)}
    return {k: 1.0 - v for k, v in dev.items()}


def drift_spans(spec, old_keys, old_values, new_keys, new_values, edit: Edit, *, layers: Sequence[int] | None = None,
                bin_size: int = 32) -> list[dict[str, Any]]:
    """Figure (a) for one context: per edited span with a following segment, the binned cosines by distance.

    Args:
        spec: the model spec.
        old_keys, old_values: the version-0 checkpoint's K/V.
        new_keys, new_values: the exact version-1 K/V.
        edit: the diff.
        layers: layers averaged over (None: all).
        bin_size: distance bin in tokens.
    Returns:
        One dict per span: ``P, E, S`` (:func:`patchkv_agent.core.plan.span_features`), ``shift`` (the segment's
        position shift) and, for ``value``, ``key_raw``, ``key_corrected``, the mean cosine per bin
        (``ceil(S / bin_size)`` values, bin ``j`` covering distances ``[j * bin_size, (j + 1) * bin_size)``).
    Raises:
        ValueError: as :func:`position_cosines`.
    """
    ls = _layers(spec, layers)
    ck = corrected_keys(spec, old_keys, edit)
    runs = {"value": span_drift(edit, old_values, new_values, layers=ls),
            "key_raw": span_drift(edit, old_keys, new_keys, layers=ls),
            "key_corrected": span_drift(edit, ck, new_keys, layers=ls)}
    seg_after = {seg.new_start: seg for seg in edit.segments}
    spans = [sp for sp in sorted(edit.spans, key=lambda s: s.new_start) if sp.new_end in seg_after]
    out = []
    for j, sd in enumerate(runs["value"]):
        seg = seg_after[spans[j].new_end]
        row: dict[str, Any] = {"P": sd.prefix_len, "E": sd.edit_len, "S": sd.suffix_len, "shift": int(seg.delta)}
        for name, lst in runs.items():
            row[name] = (1.0 - block_deviation(lst[j].deviation, bin_size, "mean")).tolist()
        out.append(row)
    return out


def summarize_drift(spans: Sequence[dict], bin_size: int) -> dict[str, Any]:
    """Median and 10-90 % band over spans per distance bin.

    Args:
        spans: rows of :func:`drift_spans` (any number of contexts).
        bin_size: their bin size.
    Returns:
        ``{"bin_start": [...], "n_spans": [...], "value"|"key_raw"|"key_corrected": {"p10", "p50", "p90"}}``.
    """
    n_bins = max((len(s["value"]) for s in spans), default=0)
    out: dict[str, Any] = {"bin_start": [j * bin_size for j in range(n_bins)],
                           "n_spans": [sum(len(s["value"]) > j for s in spans) for j in range(n_bins)]}
    for name in ("value", "key_raw", "key_corrected"):
        q = [_pcts([s[name][j] for s in spans if len(s[name]) > j]) for j in range(n_bins)]
        out[name] = {f"p{p}": [row[i] for row in q] for i, p in enumerate(_PCT)}
    return out


# --------------------------------------------------------------------------------------------- (b) selection


class BlockSetStrategy(Strategy):
    """Recompute the new tokens, the given suffix blocks and the block of the last token; restore the rest.

    Blocks are those of :func:`patchkv_agent.core.plan.suffix_blocks` at ``block_size`` (the planner's layout);
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
    are taken one at a time until ``B`` distinct blocks are hit.

    Args:
        blocks: the suffix blocks.
        scores: per old position ``[N_old]`` (NaN counts as 0).
    Returns:
        float64 ``[n_blocks]``.
    """
    sc = np.nan_to_num(np.asarray(scores, dtype=np.float64).ravel(), nan=0.0)
    out = np.full(blocks.n_blocks, -np.inf)
    np.maximum.at(out, blocks.token_block, sc[blocks.old_positions])
    return out


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
    base = plan_repair(edit, None, length_model=LengthModel.fixed(window), kappa=0.0, block_size=block_size)
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
    rng = np.random.default_rng(seed)
    extra = {
        "D-only": np.zeros(0, dtype=np.int64),
        "attention": cand[np.lexsort((cand, -sc))[:b]],
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
def evaluate_selection(engine, prep: PreparedContext, *, window: int = 32, block_size: int = 32, budget: float = 0.05,
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
                     **_score(engine, prep.ref, res)})
        del res
        if bar is not None:
            bar.update(1)
    return rows


def summarize_selection(rows: Sequence[dict]) -> dict[str, dict[str, Any]]:
    """Per selector: ``n``, ``exact_continuation`` rate, mean ``tf_agree``, mean and median first-token KL,
    mean recompute ratio, median TTFT.

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
        out[name] = {"n": len(r), "exact_continuation": _mean([float(x["exact_continuation"]) for x in r]),
                     "tf_agree": _mean([x["tf_agree"] for x in r]), "first_token_kl": _mean(kl),
                     "first_token_kl_median": float(np.median(kl)),
                     "recompute_ratio": _mean([x["recompute_ratio"] for x in r]),
                     "ttft_s_median": float(np.median([x["ttft_s"] for x in r]))}
    return out


# --------------------------------------------------------------------------------------------- (c) precision


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
def block_sensitivity(engine, prep: PreparedContext, *, block_size: int = 32, max_blocks: int | None = 48,
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


# ---------------------------------------------------------------------------------------------- (d) ablation


@torch.no_grad()
def ablation_grid(engine, prep: PreparedContext, *, kappas: Sequence[float], blocks: Sequence[int], window: int = 32,
                  precision: str = "fp16", max_new_tokens: int = 16, bar=None) -> list[dict[str, Any]]:
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
            res = engine.resume(prep.ckpt, list(prep.context.new_ids), strategy="patchkv",
                                max_new_tokens=max_new_tokens, dirty_window=int(window), kappa=float(k),
                                block_size=int(b), precision=precision)
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


# ---------------------------------------------------------------------------------------------------- driver


def build_contexts(engine, n: int, *, workloads: Sequence[str] = DEFAULT_WORKLOADS, target_tokens: int = 3000,
                   seed: int = 0) -> list[Context]:
    """``n`` edited contexts from the evaluation split: workloads round-robin, edit kinds in rotation.

    Context ``i`` is of workload ``workloads[i % len(workloads)]`` and edit kind
    ``EDITS[i % len(EDITS)]``: the first example of that workload's evaluation split that takes the kind
    and is not already used (:func:`patchkv_agent.eval.workloads.build_traces`, two versions).

    Args:
        engine: the engine (its tokenizer renders and counts the chat messages).
        n: contexts wanted.
        workloads: workload names.
        target_tokens: version-0 length target.
        seed: trace seed.
    Returns:
        Up to ``n`` contexts (fewer when a workload runs out of examples for a kind).
    Raises:
        ValueError: an unknown workload, or ``n < 0``.
    """
    from patchkv_agent.eval.replay import plain_messages, version_ids
    from patchkv_agent.eval.workloads import EDITS, build_traces

    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    workloads = list(workloads)

    def count(msgs):
        return len(engine.encode(plain_messages(msgs)))

    used: dict[str, set] = {w: set() for w in workloads}
    out = []
    for i in range(n):
        wl, kind = workloads[i % len(workloads)], EDITS[i % len(EDITS)]
        got = None
        for want in (len(used[wl]) + 1, len(used[wl]) + 8):
            for t in build_traces(wl, kind, n=want, split="eval", target_tokens=target_tokens, n_versions=2,
                                  seed=seed, count_tokens=count):
                if t["meta"]["source_id"] not in used[wl]:
                    got = t
                    break
            if got is not None:
                break
        if got is None:
            print(f"no further {wl} example takes {kind} at {target_tokens} tokens", file=sys.stderr)
            continue
        used[wl].add(got["meta"]["source_id"])
        out.append(Context(id=got["id"], workload=wl, edit=kind,
                           old_ids=tuple(version_ids(engine, got["versions"][0])),
                           new_ids=tuple(version_ids(engine, got["versions"][1]))))
    return out


def _work_units(ctx: Context, cfg: AnalysisConfig) -> int:
    units = 2
    if "b" in cfg.figures:
        units += len(SELECTORS)
    if "c" in cfg.figures:
        blocks = plan_suffix_blocks(diff_versions(np.asarray(ctx.old_ids), np.asarray(ctx.new_ids)),
                                    block_size=cfg.block_size)
        units += 1 + _spread(blocks.n_blocks, cfg.max_blocks).size
    if "d" in cfg.figures:
        units += len(cfg.kappas) * len(cfg.blocks)
    return units


def _context_meta(prep: PreparedContext) -> dict[str, Any]:
    e = prep.edit
    return {"id": prep.context.id, "workload": prep.context.workload, "edit": prep.context.edit,
            "old_tokens": int(e.old_len), "new_tokens": int(e.new_len), "prefix_tokens": int(e.prefix_len),
            "inserted_tokens": int(e.new_token_count), "suffix_tokens": int(e.suffix_len), "spans": len(e.spans),
            "reference_output_ids": [int(t) for t in prep.ref.output_ids]}


def run_analysis(engine, contexts: Sequence[Context], cfg: AnalysisConfig = AnalysisConfig(), *,
                 progress: bool = True) -> dict[str, Any]:
    """Compute the chosen figures over the contexts.

    Args:
        engine: the engine.
        contexts: the edited contexts.
        cfg: the configuration.
        progress: show a tqdm progress bar (one step per prefill/resume).
    Returns:
        The JSON-able result: ``config``, ``model`` (fingerprint), ``contexts`` (meta per context) and one
        section per computed figure: ``drift`` (``spans``, ``summary``), ``selection`` (``rows``,
        ``summary``), ``precision`` (``contexts``, ``summary``), ``ablation`` (``rows``, ``summary``).
    Raises:
        ValueError: no contexts, or as the per-figure functions.
    """
    from tqdm.auto import tqdm

    if not contexts:
        raise ValueError("no contexts to analyse")
    t0 = time.perf_counter()
    total = sum(_work_units(c, cfg) for c in contexts)
    bar = tqdm(total=total, desc="analysis", unit="pass", disable=not progress, file=sys.stderr)
    data: dict[str, Any] = {"config": {**asdict(cfg), "figures": list(cfg.figures)},
                            "fingerprint": engine.spec.fingerprint, "contexts": []}
    drift, sel_rows, prec, abl_rows = [], [], [], []
    try:
        for i, ctx in enumerate(contexts):
            bar.set_postfix_str(ctx.id[-40:])
            prep = prepare_context(engine, ctx, max_new_tokens=cfg.max_new_tokens, mixed=cfg.precision == "mixed")
            bar.update(2)
            data["contexts"].append(_context_meta(prep))
            if "a" in cfg.figures:
                for row in drift_spans(engine.spec, prep.ckpt.keys, prep.ckpt.values, prep.ref.keys,
                                       prep.ref.values, prep.edit, layers=cfg.layers, bin_size=cfg.bin_size):
                    drift.append({"context": ctx.id, **row})
            if "b" in cfg.figures:
                sel_rows += evaluate_selection(engine, prep, window=cfg.window, block_size=cfg.block_size,
                                               budget=cfg.budget, budget_blocks=cfg.budget_blocks,
                                               seed=cfg.seed * 100_003 + i, precision=cfg.precision,
                                               max_new_tokens=cfg.max_new_tokens, bar=bar)
            if "c" in cfg.figures:
                prec.append(block_sensitivity(engine, prep, block_size=cfg.block_size, max_blocks=cfg.max_blocks,
                                              fmt=cfg.quant_format, bar=bar))
            if "d" in cfg.figures:
                abl_rows += ablation_grid(engine, prep, kappas=cfg.kappas, blocks=cfg.blocks, window=cfg.window,
                                          precision=cfg.precision, max_new_tokens=cfg.max_new_tokens, bar=bar)
            del prep
    finally:
        bar.close()
    if "a" in cfg.figures:
        data["drift"] = {"bin_size": cfg.bin_size,
                         "layers": _layers(engine.spec, cfg.layers), "spans": drift,
                         "summary": summarize_drift(drift, cfg.bin_size)}
    if "b" in cfg.figures:
        data["selection"] = {"window": cfg.window, "block_size": cfg.block_size, "rows": sel_rows,
                             "summary": summarize_selection(sel_rows)}
    if "c" in cfg.figures:
        data["precision"] = {"format": cfg.quant_format, "block_size": cfg.block_size, "contexts": prec,
                             "summary": summarize_precision(prec, cfg.top_share)}
    if "d" in cfg.figures:
        data["ablation"] = {"window": cfg.window, "rows": abl_rows, "summary": summarize_ablation(abl_rows)}
    data["timing"] = {"analysis_s": round(time.perf_counter() - t0, 2)}
    return data


# ---------------------------------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        try:
            matplotlib.use("Agg")
        except Exception:  # pragma: no cover - an interactive backend already running
            pass
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _title(data: dict) -> str:
    n = len(data.get("contexts", []))
    return f"{data.get('model') or data.get('fingerprint', '')[:24]}: {n} edited context{'s' * (n != 1)}"


def plot_drift(data: dict, path: str | Path | None = None):
    """Figure (a): median and 10-90 % band of value, raw-key and RoPE-corrected-key cosine by distance.

    Args:
        data: the analysis JSON (needs ``drift``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``drift`` section.
    """
    plt = _plt()
    sec = data["drift"]
    s, bs = sec["summary"], sec["bin_size"]
    x = np.asarray(s["bin_start"], dtype=np.float64) + bs / 2
    fig, ax = plt.subplots(figsize=(8, 4.4))
    labels = {"value": "values (stale)", "key_raw": "keys, no RoPE correction", "key_corrected": "keys, RoPE-corrected"}
    for name, color in (("value", "C0"), ("key_raw", "C3"), ("key_corrected", "C2")):
        q = s[name]
        p10, p50, p90 = (np.asarray([np.nan if v is None else v for v in q[f"p{p}"]], dtype=np.float64) for p in _PCT)
        ax.fill_between(x, p10, p90, color=color, alpha=0.18)
        ax.plot(x, p50, color=color, marker="o", ms=3, label=f"{labels[name]}: median, 10-90 % band")
    ax.set_xlabel(f"distance from the edit (tokens, {bs}-token bins)")
    ax.set_ylabel("cosine similarity to exact (mean over layers, KV heads)")
    n_sp = max(s["n_spans"], default=0)
    ax.set_title(f"{_title(data)}, {n_sp} spans")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_selection(data: dict, path: str | Path | None = None):
    """Figure (b): bars per selector of exact-continuation rate, teacher-forced agreement, first-token KL.

    Args:
        data: the analysis JSON (needs ``selection``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``selection`` section.
    """
    plt = _plt()
    sec = data["selection"]
    summ = sec["summary"]
    names = [n for n in SELECTORS if n in summ]
    rows = sec["rows"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in ((axes[0], "exact_continuation", "exact continuation rate"),
                           (axes[1], "tf_agree", "teacher-forced agreement"),
                           (axes[2], "first_token_kl", "first-token KL (nats), mean")):
        vals = [summ[n][key] for n in names]
        ax.bar(range(len(names)), vals, color=[f"C{i}" for i in range(len(names))])
        for i, n in enumerate(names):  # individual contexts
            pts = [float(r[key]) for r in rows if r["selector"] == n]
            ax.scatter(np.full(len(pts), i) + np.linspace(-0.15, 0.15, len(pts)) if len(pts) > 1 else [i] * len(pts),
                       pts, color="k", s=8, zorder=3)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        if key != "first_token_kl":
            ax.set_ylim(0, 1.05)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    b = sorted({r["budget_blocks"] for r in rows})
    fig.suptitle(f"{_title(data)}; D = first {sec['window']} tokens after each edit, "
                 f"+{b[0] if len(b) == 1 else f'{b[0]}-{b[-1]}'} blocks of {sec['block_size']} per selector",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_precision(data: dict, path: str | Path | None = None):
    """Figure (c): cumulative share of first-token KL against the share of blocks (most sensitive first),
    one curve per context; right, per-block KL by distance from the edit.

    Args:
        data: the analysis JSON (needs ``precision``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``precision`` section.
    """
    plt = _plt()
    sec = data["precision"]
    summ = sec["summary"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
    a1.plot([0, 1], [0, 1], "k:", lw=1, label="uniform")
    without = summ.get("per_context_without_last") or [None] * len(summ["per_context"])
    for i, (c, w) in enumerate(zip(summ["per_context"], without)):
        def lab(x, what):
            share = x["top_share"]
            return f"{c['context'].split('/')[0]} {what} ({len(x['x']) - 1} blocks)" + (
                f": top {summ['top']:.0%} hold {share:.0%}" if share is not None else ": zero KL")
        a1.plot(c["x"], c["y"], color=f"C{i}", lw=1.5, label=lab(c, "all"))
        if w is not None and len(w["x"]) != len(c["x"]):
            a1.plot(w["x"], w["y"], color=f"C{i}", lw=1.2, ls="--", label=lab(w, "w/o last block"))
    a1.axvline(summ["top"], color="gray", lw=0.8, ls=":")
    a1.set_xlabel("share of blocks (most sensitive first)")
    a1.set_ylabel("share of summed first-token KL")
    a1.set_title(f"one {sec['format']} block at a time ({sec['block_size']} tokens)", fontsize=10)
    a1.legend(fontsize=7, loc="lower right")
    for i, c in enumerate(sec["contexts"]):
        for last, mk in ((False, "o"), (True, "x")):
            bl = [b for b in c["blocks"] if bool(b.get("last", False)) == last]
            a2.scatter([b["distance"] for b in bl], [max(b["kl"], 1e-12) for b in bl], s=14 if last else 12,
                       marker=mk, color=f"C{i}", alpha=0.8,
                       label="block of the last token" if last and bl and i == 0 else None)
    if any(b.get("last") for c in sec["contexts"] for b in c["blocks"]):
        a2.legend(fontsize=7, loc="lower right")
    a2.set_yscale("log")
    a2.set_xlabel("distance of the block from the edit (tokens)")
    a2.set_ylabel("first-token KL vs full-precision direct")
    a2.set_title(_title(data), fontsize=10)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_ablation(data: dict, path: str | Path | None = None):
    """Figure (d): one heatmap per metric over ``kappa`` (rows) x block size (columns).

    Args:
        data: the analysis JSON (needs ``ablation``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``ablation`` section.
    """
    plt = _plt()
    sec = data["ablation"]
    summ = sec["summary"]
    kappas = sorted({r["kappa"] for r in summ})
    blocks = sorted({r["block_size"] for r in summ})
    metrics = (("recompute_ratio", "mean recompute ratio", ".3f"), ("tf_agree", "mean TF agreement", ".3f"),
               ("first_token_kl", "mean first-token KL", ".2e"), ("ttft_s_median", "median TTFT (s)", ".2f"))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (key, label, fmt) in zip(axes, metrics):
        m = np.full((len(kappas), len(blocks)), np.nan)
        for r in summ:
            if r[key] is not None:
                m[kappas.index(r["kappa"]), blocks.index(r["block_size"])] = r[key]
        im = ax.imshow(m, aspect="auto", cmap="viridis")
        for i in range(len(kappas)):
            for j in range(len(blocks)):
                if np.isfinite(m[i, j]):
                    light = float(im.norm(m[i, j])) > 0.6  # viridis is light at the top of its range
                    ax.text(j, i, format(m[i, j], fmt), ha="center", va="center", fontsize=7,
                            color="k" if light else "w")
        ax.set_xticks(range(len(blocks)))
        ax.set_xticklabels([str(b) for b in blocks])
        ax.set_yticks(range(len(kappas)))
        ax.set_yticklabels([f"{k:g}" for k in kappas])
        ax.set_xlabel("block size")
        ax.set_ylabel("kappa")
        ax.set_title(label, fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"{_title(data)}; fixed window {sec['window']} tokens", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


_PLOTS = {"drift": plot_drift, "selection": plot_selection, "precision": plot_precision, "ablation": plot_ablation}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def write_outputs(data: dict, out_dir: str | Path) -> list[Path]:
    """Write ``analysis.json`` and one PNG per computed figure (``a_drift.png``, ``b_selection.png``,
    ``c_precision.png``, ``d_ablation.png``).

    Args:
        data: the result of :func:`run_analysis` (any extra keys are kept).
        out_dir: output folder (created).
    Returns:
        The written paths, JSON first.
    """
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "analysis.json"
    path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    paths = [path]
    for letter, name in FIGURE_NAMES.items():
        if name in data:
            png = out / f"{letter}_{name}.png"
            plt.close(_PLOTS[name](data, png))
            paths.append(png)
    return paths


# ------------------------------------------------------------------------------------------------------- cli


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m patchkv_agent.calibration.analysis``.

    Returns:
        The parser.
    """
    ap = argparse.ArgumentParser(prog="python -m patchkv_agent.calibration.analysis",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="HF id, local dir, .gguf path or 'smollm2-135m'")
    ap.add_argument("--n", type=int, default=3, help="edited contexts (workloads round-robin, edit kinds in rotation)")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    ap.add_argument("--target-tokens", type=int, default=3000, help="version-0 length in tokens")
    ap.add_argument("--seed", type=int, default=0, help="trace seed and random-selector seed")
    ap.add_argument("--out-dir", default="docs/figures/analysis")
    ap.add_argument("--figures", default="a,b,c,d", help="which figures, e.g. 'a,c'")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice; 1 is faster on a shared machine)")
    ap.add_argument("--bin-size", type=int, default=32, help="(a) distance bin in tokens")
    ap.add_argument("--layers", default="all", help="(a) comma-separated layers to average over, or 'all'")
    ap.add_argument("--window", type=int, default=32, help="(b, d) fixed dirty window in tokens")
    ap.add_argument("--block-size", type=int, default=32, help="(b, c) block size in tokens")
    ap.add_argument("--budget", type=float, default=0.05, help="(b) extra blocks as a share of the suffix blocks")
    ap.add_argument("--budget-blocks", type=int, default=None, help="(b) extra blocks (overrides --budget)")
    ap.add_argument("--max-blocks", type=int, default=48, help="(c) blocks probed per context, evenly spaced (0: all)")
    ap.add_argument("--quant-format", default="K8V4", choices=list(FORMATS), help="(c) format of the probed block")
    ap.add_argument("--kappas", type=_floats, default=(0.0, 0.01, 0.02, 0.03), help="(d) kappa grid")
    ap.add_argument("--blocks", type=_ints, default=(16, 32, 64, 128), help="(d) block-size grid")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="greedy reference tokens")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "mixed"],
                    help="(b, d) restore precision: checkpoint rows as stored, or the per-block mixed tags")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point: build the contexts, compute the figures, write ``analysis.json`` and the PNGs.

    Args:
        argv: arguments (default ``sys.argv[1:]``).
    Returns:
        0 on success.
    Raises:
        SystemExit: bad arguments, or no context could be built.
    """
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = tuple(f.strip() for f in args.figures.split(",") if f.strip())
    layers = None if args.layers.strip() == "all" else _ints(args.layers)
    try:
        cfg = AnalysisConfig(figures=figures, bin_size=args.bin_size, layers=layers, window=args.window,
                             block_size=args.block_size, budget=args.budget, budget_blocks=args.budget_blocks,
                             seed=args.seed, max_blocks=args.max_blocks or None, quant_format=args.quant_format,
                             kappas=tuple(args.kappas), blocks=tuple(args.blocks), max_new_tokens=args.max_new_tokens,
                             precision=args.precision)
    except ValueError as e:
        raise SystemExit(f"bad arguments: {e}") from None
    from patchkv_agent.engine import PatchKVEngine

    t0 = time.perf_counter()
    eng = PatchKVEngine.from_pretrained(args.model, profile=None, block_size=args.block_size,
                                        mixed_precision=args.precision == "mixed")
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    contexts = build_contexts(eng, args.n, workloads=[w.strip() for w in args.workloads.split(",") if w.strip()],
                              target_tokens=args.target_tokens, seed=args.seed)
    if not contexts:
        raise SystemExit("no edited context could be built; check --workloads/--target-tokens")
    print(f"{len(contexts)} contexts: " + ", ".join(f"{c.id} ({len(c.new_ids)} tokens)" for c in contexts),
          file=sys.stderr)
    data = run_analysis(eng, contexts, cfg, progress=not args.no_progress)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    data = {"model": args.model, "command": "python -m patchkv_agent.calibration.analysis " + shlex.join(argv_list),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads": torch.get_num_threads(), **data}
    data["timing"]["wall_s"] = round(time.perf_counter() - t0, 1)
    paths = write_outputs(data, args.out_dir)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    _print_summary(data)
    return 0


def _print_summary(data: dict) -> None:
    if "drift" in data:
        s = data["drift"]["summary"]
        for j in range(min(4, len(s["bin_start"]))):
            print(f"(a) bin {s['bin_start'][j]:>4}: median cos value {s['value']['p50'][j]:.4f}, key raw "
                  f"{s['key_raw']['p50'][j]:.4f}, key corrected {s['key_corrected']['p50'][j]:.4f} "
                  f"({s['n_spans'][j]} spans)")
    for name, r in data.get("selection", {}).get("summary", {}).items():
        print(f"(b) {name:>13}: exact cont. {r['exact_continuation']:.2f}, TF {r['tf_agree']:.3f}, "
              f"KL {r['first_token_kl']:.4g}, recompute ratio {r['recompute_ratio']:.3f}")
    if "precision" in data:
        s = data["precision"]["summary"]
        for c, w in zip(s["per_context"], s["per_context_without_last"]):
            share, share_w = ("n/a" if x["top_share"] is None else f"{x['top_share']:.3f}" for x in (c, w))
            print(f"(c) {c['context']}: top {s['top']:.0%} of {len(c['x']) - 1} blocks hold {share} of KL "
                  f"(sum {c['total_kl']:.4g}); without the last token's block {share_w} of {len(w['x']) - 1}")
    for r in data.get("ablation", {}).get("summary", []):
        print(f"(d) kappa {r['kappa']:g} block {r['block_size']:>3}: recompute {r['recompute_ratio']:.3f}, "
              f"TF {r['tf_agree']:.3f}, KL {r['first_token_kl']:.4g}, TTFT {r['ttft_s_median']:.2f}s")


if __name__ == "__main__":
    sys.exit(main())

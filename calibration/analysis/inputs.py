"""Inputs of the analysis: the edited contexts, the run configuration, the two reference passes, scoring.

:class:`Context` (version 0 and version 1 token ids), :class:`AnalysisConfig` (every knob, recorded in
the JSON), :func:`prepare_context` (checkpoint version 0, prefill version 1 exactly, diff them) and
:func:`build_contexts` (edited contexts from the packaged workloads). The fidelity of a resume against
the exact reference is scored by :mod:`patchkv_agent.eval.metrics`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.diff import Edit, diff_versions
from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, DEFAULT_DIRTY_WINDOW
from patchkv_agent.eval.metrics import fidelity
from patchkv_agent.kernels.formats import FORMATS

DESCRIPTION = ("Analysis figures: drift by distance, block selection, per-block precision sensitivity, "
               "kappa x block ablation.")

FIGURES = ("a", "b", "c", "d")
FIGURE_NAMES = {"a": "drift", "b": "selection", "c": "precision", "d": "ablation"}
SELECTORS = ("D-only", "attention", "readers", "distance", "random", "low-attention")
DEFAULT_WORKLOADS = ("hotpotqa-e", "2wikimqa-e", "nq-e")
_PCT = (10, 50, 90)


@dataclass(frozen=True, kw_only=True)
class Context:
    """One edited context: version 0 (checkpointed) and version 1 (resumed), as token ids.

    Attributes:
        id: unique id (a trace id).
        workload, edit: provenance labels.
        old_ids, new_ids: token ids of version 0 and version 1.
        old_answers, new_answers: the gold answers of each version (edit-following contexts), or None.
    """

    id: str
    workload: str = ""
    edit: str = ""
    old_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    old_answers: tuple[str, ...] | None = None
    new_answers: tuple[str, ...] | None = None


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
    window: int = DEFAULT_DIRTY_WINDOW
    block_size: int = DEFAULT_BLOCK_SIZE
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
        edit: ``diff_versions(old_ids, new_ids, words=engine.words)`` (as a resume diffs).
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
    saved = engine.settings
    engine.settings = saved.replace(mixed_precision=mixed)
    try:
        ckpt = engine.checkpoint(list(context.old_ids))
    finally:
        engine.settings = saved
    ref = engine.resume(None, list(context.new_ids), strategy="exact", max_new_tokens=max_new_tokens)
    edit = diff_versions(ckpt.token_ids, ref.context_ids, words=getattr(engine, "words", None))
    if edit.identical:
        raise ValueError(f"context {context.id!r}: the two versions are identical")
    return PreparedContext(context=context, ckpt=ckpt, ref=ref, edit=edit)


def _score(engine, ref, res, context: Context | None = None) -> dict[str, Any]:
    """Fidelity of one resume against the exact reference (:func:`patchkv_agent.eval.metrics.fidelity`),
    plus its cost fields and, for an edit-following context, ``follows`` / ``stale`` of the resume and of
    the reference (``exact_follows``, ``exact_stale``)."""
    f = fidelity(engine, res, ref)
    extra: dict[str, Any] = {}
    if context is not None and context.new_answers and context.old_answers and engine.tokenizer is not None:
        from patchkv_agent.eval.metrics import answer_match

        text = engine.tokenizer.decode(res.output_ids, skip_special_tokens=True)
        ref_text = engine.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
        extra = {"follows": answer_match(text, context.new_answers), "stale": answer_match(text, context.old_answers),
                 "exact_follows": answer_match(ref_text, context.new_answers),
                 "exact_stale": answer_match(ref_text, context.old_answers)}
    return {**extra,
        "exact_continuation": f["exact_continuation"],
        "tf_agree": float(f["tf_agree"]),
        "first_token_kl": float(f["first_token_kl"]),
        "top1_agree": f["top1_agree"],
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


def build_contexts(engine, n: int, *, workloads: Sequence[str] = DEFAULT_WORKLOADS, target_tokens: int = 3000,
                   seed: int = 0) -> list[Context]:
    """``n`` edited contexts from the evaluation split: workloads round-robin, edit kinds in rotation.

    Context ``i`` is of workload ``workloads[i % len(workloads)]`` and edit kind
    ``EDITS[i % len(EDITS)]``: the first example of that workload's evaluation split that takes the kind
    and is not already used (:func:`patchkv_agent.eval.workloads.build_traces`, two versions). The
    edit-following workloads (``follow-*``) have one edit kind of their own and carry each version's gold
    answers into the context.

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
    from patchkv_agent.eval.traces import plain_messages, version_ids
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
                if t["meta"].get("source_id", t["id"]) not in used[wl]:
                    got = t
                    break
            if got is not None:
                break
        if got is None:
            print(f"no further {wl} example takes {kind} at {target_tokens} tokens", file=sys.stderr)
            continue
        used[wl].add(got["meta"].get("source_id", got["id"]))
        v0, v1 = got["versions"][0], got["versions"][1]
        out.append(Context(id=got["id"], workload=wl, edit=got.get("edit") or kind,
                           old_ids=tuple(version_ids(engine, v0)), new_ids=tuple(version_ids(engine, v1)),
                           old_answers=tuple(v0["answers"]) if v0.get("answers") else None,
                           new_answers=tuple(v1["answers"]) if v1.get("answers") else None))
    return out

"""The resume critical path (docs/DESIGN.md section 4, "Resume"): one strategy over one edit, from the diff to the
typed result.

A resume is validated and resolved once, into a :class:`ResumeRequest` (:meth:`PatchKVEngine.request
<patchkv_agent.engine.PatchKVEngine.request>`: the ids checked and copied, ``max_new_tokens`` clipped, the strategy
resolved, and, when a caller has already diffed the versions, their :class:`~patchkv_agent.core.diff.Edit`); every
layer below takes the request as it is.

:func:`run_resume` is what :meth:`PatchKVEngine.resume <patchkv_agent.engine.PatchKVEngine.resume>` runs once it has
checked the ids and the checkpoint's weights, while it holds the model's forward lock. It diffs the checkpoint's
version against the new ids, asks the strategy for its plan (an unsupported RoPE with shifted rows plans the exact
prefix recompute instead), runs it under the model's attention capture (a corrupt checkpoint run falls back to the
exact recompute), decodes greedily from the recovered cache and builds the result's
:class:`~patchkv_agent.results.EnginePart` from what ran (an executor that changed the plan, like the measured tail
rule, reports its own). Every fallback is recorded, never raised. The K/V go through it in the runner's one layout
(``[1, H, N, D]`` per layer on the model's device).

Knows the mechanisms (diff, plan, recovery, the model's runner), the strategies and the result types; knows nothing
about the engine's settings sources, profiles, the runtime or LangGraph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

import numpy as np
import torch

from .core.checkpoint import Checkpoint, CorruptCheckpoint, count_nonfinite
from .core.diff import Edit, diff_versions
from .core.fallback import Fallback, FallbackKind
from .core.models import ModelSpec
from .core.plan import plan_full
from .core.recovery import execute
from .core.runner import ModelRunner
from .core.settings import RecoverySettings
from .results import EnginePart, ResumeResult, ResumeStats
from .strategies import Strategy, exact_reuse, full_prefill

__all__ = ["ResumeRequest", "run_resume", "exact_rows_of"]


@dataclass(frozen=True)
class ResumeRequest:
    """One resume, validated and resolved once (build it with :meth:`PatchKVEngine.request
    <patchkv_agent.engine.PatchKVEngine.request>`, which is the only validator).

    Attributes:
        ids: the new context's ids, an int64 array the request owns (validated: 1-D, in the vocabulary, within
            the model's positions).
        strategy: the resolved :class:`~patchkv_agent.strategies.Strategy`.
        max_new_tokens: tokens to decode, clipped to the positions the model has left after ``ids``.
        edit: a diff of some earlier version into ``ids`` that a caller already computed (the thread
            registry's context choice), or None. The resume uses it only when its old side is the base
            checkpoint's ids (:meth:`edit_from`); otherwise it diffs again.
        checked_for: the fingerprint of the model whose engine validated it (set by ``engine.request``); a
            request built by hand, or for another model, is validated again by the engine that runs it.
    """

    ids: np.ndarray
    strategy: Strategy
    max_new_tokens: int
    edit: Edit | None = None
    checked_for: str = dataclasses.field(default="", repr=False, compare=False)

    def with_strategy(self, strategy: Strategy) -> "ResumeRequest":
        """This request under another (resolved) strategy."""
        return dataclasses.replace(self, strategy=strategy)

    def as_full_prefill(self) -> "ResumeRequest":
        """This request as a full prefill that reads no base (a fallback, a call with nothing to resume from)."""
        return self.with_strategy(full_prefill())

    def as_exact_reuse(self) -> "ResumeRequest":
        """This request reusing its base's rows up to the first change, recomputing the rest (a base of exact
        rows: a prepared context)."""
        return self.with_strategy(exact_reuse())

    def prefill_only(self) -> "ResumeRequest":
        """This request without its decode (a :class:`~patchkv_agent.runtime.stream.TokenStream` decodes)."""
        return dataclasses.replace(self, max_new_tokens=0)

    def edit_from(self, old: np.ndarray) -> Edit | None:
        """The carried diff when it is the diff of ``old`` into :attr:`ids`, else None."""
        e = self.edit
        if e is None or e.old_ids is None or e.new_ids is None:
            return None
        if e.old_len != len(old) or e.new_len != len(self.ids):
            return None
        if not (np.array_equal(e.old_ids, old) and np.array_equal(e.new_ids, self.ids)):
            return None
        return e


def exact_rows_of(ckpt: Checkpoint | None) -> int | None:
    """Leading exact rows of a checkpoint's K/V (None: all of them)."""
    if ckpt is None:
        return None
    return ckpt.provenance.exact_rows


def run_resume(runner: ModelRunner, spec: ModelSpec, settings: RecoverySettings, request: ResumeRequest,
               ckpt: Checkpoint | None, *, words=None, eos_ids=frozenset(),
               fallback: Fallback | None = None) -> ResumeResult:
    """Recover and decode one resume (the engine's :meth:`~patchkv_agent.engine.PatchKVEngine.resume` body).

    Args:
        runner: the model's :class:`~patchkv_agent.core.runner.ModelRunner` (call under its lock).
        spec: its :class:`~patchkv_agent.core.models.ModelSpec`.
        settings: the settings snapshot of this resume.
        request: the validated :class:`ResumeRequest` (its strategy ``exact`` after a weights-changed
            fallback); its carried diff is used when it diffs ``ckpt``'s ids.
        ckpt: the checkpoint of the previous version, or None (``exact``).
        words: the engine's :class:`~patchkv_agent.core.lexicon.WordIndex` (the reader signal), or None.
        eos_ids: ids that end the decode.
        fallback: a fallback already decided (weights changed: ``ckpt`` is None then).

    Returns:
        The :class:`ResumeResult`.

    Raises:
        ValueError: a plan that does not cover the context (a strategy bug).
    """
    fp = spec.fingerprint
    strat, new, max_new_tokens = request.strategy, request.ids, request.max_new_tokens
    t0 = time.perf_counter()
    old = ckpt.token_ids if ckpt is not None else np.zeros(0, dtype=np.int64)
    old_words = ckpt.words if ckpt is not None else None
    edit = request.edit_from(old)
    if edit is not None:  # the structure is on token ids only: attach this resume's word signal
        edit = edit.with_words(words, old_words)
    else:
        edit = diff_versions(old, new, words=words, old_words=old_words)
    new_words = edit.new_words()  # the edited words only (the rest moved through the position map)
    plan = strat.plan(settings, ckpt, edit)
    restore_new = np.asarray(plan.restore_new_positions)
    if len(restore_new) and not spec.rope_supported:
        shifted = np.any(restore_new != np.asarray(plan.restore_old_positions))
        if shifted:
            fallback = Fallback(FallbackKind.UNSUPPORTED_ROPE, spec.rope_unsupported_reason)
            plan = plan_full(edit, block_size=settings.block_size)
    plan_s = time.perf_counter() - t0

    t1 = time.perf_counter()
    out = None
    # the resume's own forward records the statistics of the next checkpoint (its last recomputed query
    # rows end with the last context token): checkpoint_from then needs no second pass
    cap = runner.capture(settings.capture_window)
    with cap if cap is not None else contextlib.nullcontext():
        if fallback is None or fallback.kind is FallbackKind.WEIGHTS_CHANGED:
            try:
                out = strat.execute(runner, spec, settings, ckpt, edit, plan, torch.from_numpy(new))
            except CorruptCheckpoint as e:  # never serve corrupted state: recompute exactly, say why
                fallback = Fallback(FallbackKind.CORRUPT_RUN, e)
                plan = plan_full(edit, block_size=settings.block_size)
                if cap is not None:
                    cap.reset()
        if out is None:
            out = execute(runner, spec, torch.from_numpy(new), plan, ckpt.keys, ckpt.values)
    first = int(out.logits.argmax())
    ttft = time.perf_counter() - t1
    if out.plan is not None:  # the executor changed the plan (the measured tail rule): report what ran
        plan = out.plan
    scores = None
    if cap is not None and cap.n_records:
        scores = cap.scores()
        scores = scores[: len(new)] if len(scores) >= len(new) else None
    cache = runner.dynamic_cache(out.keys, out.values)
    output_ids = runner.greedy_decode(cache, out.logits, len(new), max_new_tokens, eos_ids)
    assert not output_ids or output_ids[0] == first
    n_restore = len(plan.restore_new_positions)
    prefix_tokens = min(edit.prefix_len, len(new))
    denom = max(1, len(new) - min(plan.prefix_len, prefix_tokens))
    exact_rows = len(new)
    if n_restore:
        exact_rows = int(np.min(plan.restore_new_positions))
    base_exact = exact_rows_of(ckpt) if strat.uses_checkpoint else None
    if base_exact is not None and base_exact < min(plan.prefix_len, prefix_tokens):
        exact_rows = min(exact_rows, base_exact)  # rows reused from an approximate base stay approximate
    prov = ckpt.provenance if ckpt is not None else None
    stats = ResumeStats(EnginePart(
        strategy=strat.name,
        prompt_tokens=len(new),
        prefix_tokens=prefix_tokens,
        new_tokens=int(edit.new_token_count),
        suffix_tokens=int(edit.suffix_len),
        recompute_tokens=int(out.stats.recompute_tokens),
        recompute_ratio=out.stats.recompute_tokens / denom,
        restore_tokens=int(n_restore),
        payload_bytes=int(out.stats.payload_bytes),
        ttft_s=ttft,
        plan_s=plan_s,
        restore_s=out.stats.restore_s,
        recompute_s=out.stats.recompute_s,
        offload_s=prov.offload_s if prov is not None else None,
        stats_s=prov.stats_s if prov is not None else None,
        quantize_s=prov.quantize_s if prov is not None else None,
        fallback=fallback,
        approx_rows=len(new) - exact_rows,
        restore_kernel=out.stats.restore_kernel,
        extras=out.stats.extras,  # the strategy's own fields
        # non-finite values the forward produced (logits and its recomputed K/V rows): reported, never raised
        nonfinite_values=count_nonfinite(out.logits, out.keys, out.values, plan.recompute_positions),
        head_rewrite=bool(getattr(plan, "head_rewrite", False)),
        small_restore=bool(getattr(plan, "small_restore", False)),
    ))
    return ResumeResult(logits=out.logits, output_ids=output_ids, cache=cache, stats=stats,
                        context_ids=new, keys=out.keys, values=out.values, edit=edit, fingerprint=fp,
                        scores=scores, exact_rows=exact_rows, words=new_words)

"""Checkpoint storage: the one boundary where the engine's K/V become a
:class:`~patchkv_agent.core.checkpoint.Checkpoint`.

The engine's K/V are in one layout (:mod:`patchkv_agent.core.runner`: ``[1, H, N, D]`` per layer on the model's
device and dtype); a checkpoint holds ``[H, N, D]`` per layer on the CPU. Two ways across:

- :func:`offload` copies (the checkpoint-creation path, docs/DESIGN.md section 4, steps 3 to 5: precision tags,
  quantized mixed runs, host copies pinned when CUDA is present), for ``engine.checkpoint`` and
  ``engine.checkpoint_from``;
- :func:`resident_checkpoint` views (no copy, full precision): a resident result resumed from without an offload
  (``engine.as_checkpoint``).

Knows checkpoints, the recovery settings and the result type; no model, no forward, no engine.
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from .core.provenance import CheckpointProvenance, Source
from .core.checkpoint import Checkpoint, build_mixed
from .core.runner import stored_layout
from .core.settings import RecoverySettings
from .results import ResumeResult

__all__ = ["offload", "resident_checkpoint", "scores_for"]


def scores_for(result: ResumeResult) -> np.ndarray | None:
    """``result.scores`` over ``result.context_ids`` (positions past the resumed context, e.g. decoded
    tokens a runtime appended, score 0), or None when the resume took none."""
    sc = result.scores
    n = len(result.context_ids)
    if sc is None or len(sc) > n:
        return None
    if len(sc) == n:
        return sc
    out = np.zeros(n, dtype=np.float32)
    out[: len(sc)] = sc
    return out


def offload(ids, keys, values, scores, fp: str, settings: RecoverySettings) -> Checkpoint:
    """A checkpoint of ``ids`` holding CPU copies of ``keys`` / ``values`` (``[1, H, N, D]`` per layer) and,
    with ``settings.mixed_precision``, their mixed-precision runs tagged by ``scores``; its provenance has
    ``quantize_s`` (split into its stages) and ``copy_s``."""
    t0 = time.perf_counter()
    mixed = None
    stages: dict[str, float] = {}
    if settings.mixed_precision:
        mixed = build_mixed(stored_layout(keys), stored_layout(values), scores,
                            block_size=settings.block_size, policy=settings.precision_policy, timings=stages)
        mixed = replace(mixed, payloads=[{t: _host(p) for t, p in layer.items()} for layer in mixed.payloads])
    t1 = time.perf_counter()
    host_k = [_host(k.detach()) for k in stored_layout(keys)]
    host_v = [_host(v.detach()) for v in stored_layout(values)]
    prov = CheckpointProvenance(quantize_s=t1 - t0, copy_s=time.perf_counter() - t1, **stages)
    return Checkpoint(token_ids=np.asarray(ids, dtype=np.int64).copy(), keys=host_k, values=host_v, fingerprint=fp,
                      scores=scores, mixed=mixed, provenance=prov)


def resident_checkpoint(result: ResumeResult, fingerprint: str, words: np.ndarray | None) -> Checkpoint:
    """A zero-copy checkpoint view of ``result`` (full precision, no mixed runs), ``fingerprint`` unless the
    result carries its own, with ``words`` the word ids of its context."""
    ids = np.asarray(result.context_ids, dtype=np.int64)
    return Checkpoint(token_ids=ids,
                      keys=stored_layout(result.keys), values=stored_layout(result.values),
                      fingerprint=result.fingerprint or fingerprint, scores=scores_for(result),
                      mixed=None, words=words,
                      provenance=CheckpointProvenance(offload_s=0.0, quantize_s=0.0, source=Source.RESIDENT,
                                                      exact_rows=result.exact_rows))


def _host(x):
    """A CPU copy of a tensor or RunPayload, pinned when CUDA is present (for non-blocking restores)."""
    x = x.to("cpu") if not isinstance(x, torch.Tensor) else x.to("cpu", copy=True)
    return x.pin_memory() if torch.cuda.is_available() else x

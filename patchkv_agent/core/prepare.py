"""Exact KV of a predicted context, computed in chunks while the agent waits for its tools.

When a response asks for tools, the next call's context up to the tool results is known (the history,
the response, and whatever the agent's editors will do to them). :func:`prepare_exact` computes that
context's K/V exactly: the leading rows it shares with an exact base are copied, every row from the first
difference on is recomputed by forwards over ``chunk_tokens`` rows at a time, each chunk attending to the
rows before it (chunked prefill: equal to one full prefill up to fp rounding order). Each chunk holds the
model's :class:`~patchkv_agent.core.weights.ForwardLock` in background mode, so a foreground forward of any
thread waits for at most the chunk that is running; ``should_stop`` is checked between chunks, and a
stopped preparation returns the rows it finished (still exact) as a shorter context.

On CUDA the chunks run on a stream of their own at the lowest priority; the forward lock is released as
soon as a chunk is launched, and the stream is synchronized once at the end.

Boundary: tensors (the layout of :mod:`.runner`: ``[1, H, N, D]`` per layer), a model's
:class:`~patchkv_agent.core.runner.ModelRunner` (its lock and capture) and its
:class:`~patchkv_agent.core.models.ModelSpec`; knows nothing about threads, registries or LangChain
(``runtime/threads.py`` schedules it, the engine wraps it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .models import ModelSpec, cache_kwarg
from .recovery import ScatterCache, build_masks
from .runner import ModelRunner

__all__ = ["PreparedKV", "prepare_exact", "DEFAULT_CHUNK_TOKENS"]

DEFAULT_CHUNK_TOKENS = 256


@dataclass
class PreparedKV:
    """What :func:`prepare_exact` computed.

    Attributes:
        token_ids: int64 ``[done]`` ids whose K/V are ready (all of the predicted ids unless stopped).
        keys, values: per layer ``[1, H, done, D]`` exact K/V.
        logits: the last row's next-token logits (None when stopped before the last chunk).
        reused_rows: leading rows copied from the base (not recomputed).
        computed_rows: rows recomputed here.
        chunks: forwards run.
        stopped: ``should_stop`` ended it early.
        elapsed_s: wall time from the first chunk to the end (waits for the lock included).
        forward_s: time spent inside chunk forwards.
        scores: attention statistics of the last chunk's queries (None: no capture or stopped).
    """

    token_ids: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor | None
    reused_rows: int
    computed_rows: int
    chunks: int
    stopped: bool
    elapsed_s: float
    forward_s: float
    scores: np.ndarray | None = None


def _stream_for(device: torch.device):
    if device.type != "cuda":
        return None
    lo, _hi = torch.cuda.Stream.priority_range()  # (lowest, highest): larger numbers are lower priority
    return torch.cuda.Stream(device, priority=lo)


@torch.no_grad()
def prepare_exact(runner: ModelRunner, spec: ModelSpec, ids: np.ndarray, *,
                  base_keys: list[torch.Tensor] | None = None, base_values: list[torch.Tensor] | None = None,
                  reuse_rows: int = 0, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                  should_stop: Callable[[], bool] | None = None, capture_window: int | None = None) -> PreparedKV:
    """The exact K/V of ``ids``, reusing the base's first ``reuse_rows`` rows (which must be exact for ``ids``).

    Args:
        runner: the HF causal LM's :class:`~patchkv_agent.core.runner.ModelRunner`; its lock is taken per chunk
            in background mode.
        spec: its :class:`ModelSpec`.
        ids: int64 ``[n]`` ids of the predicted context.
        base_keys, base_values: per layer ``[1, H, >= reuse_rows, D]`` K/V whose leading ``reuse_rows`` rows
            equal a full prefill of ``ids[:reuse_rows]``.
        reuse_rows: rows copied from the base (0: a chunked full prefill).
        chunk_tokens: rows per forward.
        should_stop: checked before each chunk; True ends the preparation with the rows done so far.
        capture_window: the last chunk records attention statistics of its last ``capture_window`` queries
            (None: none).

    Returns:
        A :class:`PreparedKV`.

    Raises:
        ValueError: ``chunk_tokens`` < 1, ``reuse_rows`` outside ``[0, n - 1]`` or beyond the base.
    """
    n = int(len(ids))
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if not 0 <= reuse_rows <= n - 1:
        raise ValueError(f"reuse_rows must be in [0, {n - 1}] (the last row is always computed), got {reuse_rows}")
    model, lock = runner.model, runner.lock
    param = runner.parameter()
    device, dtype = param.device, param.dtype
    shape = (1, spec.num_kv_heads, n, spec.head_dim)
    keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(spec.num_layers)]
    if reuse_rows:
        if base_keys is None or base_values is None:
            raise ValueError("reuse_rows > 0 needs the base's keys and values")
        for dst, src in ((keys, base_keys), (values, base_values)):
            for layer, s in enumerate(src):
                if s.shape[-2] < reuse_rows:
                    raise ValueError(f"the base holds {s.shape[-2]} rows, reuse_rows is {reuse_rows}")
                dst[layer][:, :, :reuse_rows].copy_(s[:, :, :reuse_rows], non_blocking=True)
    ids_t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(device)
    side = _stream_for(device)
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))  # the base rows are copied first
    t0 = time.perf_counter()
    forward_s, chunks, done, logits, scores, stopped = 0.0, 0, reuse_rows, None, None, False
    starts = list(range(reuse_rows, n, chunk_tokens))
    if len(starts) > 1 and n - starts[-1] < chunk_tokens // 2:
        starts.pop()  # a short last chunk joins the one before it (the statistics read its last queries)
    for i, a in enumerate(starts):
        if should_stop is not None and should_stop():
            stopped = True
            break
        b = starts[i + 1] if i + 1 < len(starts) else n
        last = b == n
        with lock.background():
            t1 = time.perf_counter()
            cap = runner.capture(capture_window) if (last and capture_window is not None) else None
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                q_pos = torch.arange(a, b, device=device)
                cache = ScatterCache([k[:, :, :b] for k in keys], [v[:, :, :b] for v in values])
                cache.set_targets(q_pos)
                with cap if cap is not None else contextlib.nullcontext():
                    out = model(input_ids=ids_t[a:b][None], position_ids=q_pos[None],
                                attention_mask=build_masks(spec, model, q_pos, b, dtype), **{cache_kwarg(model): cache},
                                use_cache=True, logits_to_keep=1)
                if last:
                    logits = out.logits[0, -1].float()
                    if cap is not None and cap.n_records:
                        sc = cap.scores()
                        scores = sc[:n] if len(sc) >= n else None
            forward_s += time.perf_counter() - t1
        chunks += 1
        done = b
    if side is not None:
        side.synchronize()
    if done < n:
        keys = [k[:, :, :done].contiguous() for k in keys]
        values = [v[:, :, :done].contiguous() for v in values]
    return PreparedKV(token_ids=np.asarray(ids[:done], dtype=np.int64).copy(), keys=keys, values=values,
                      logits=logits, reused_rows=reuse_rows, computed_rows=done - reuse_rows, chunks=chunks,
                      stopped=stopped, elapsed_s=time.perf_counter() - t0, forward_s=forward_s, scores=scores)

"""The noise floor: accepted approximations of exact, run on the same calls as the strategies.

A deployment never serves exact fp32: it serves a bf16 or fp8 KV cache, or the whole model in bf16. How
often those keep exact's next action is the bar an approximate resume is judged against (a strategy that
agrees with exact as often as a bf16 KV cache does is as trustworthy as serving in bf16). Each *floor* is an
emulation on the same model, computed from the same context as ``exact``:

- ``kv-fp16``, ``kv-bf16``: every K/V row the cache stores is rounded to that dtype;
- ``kv-int8``: symmetric int8 per (head, token) over the head dimension;
- ``kv-fp8``: float8 e4m3 with a per-(head, token) scale; ``kv-fp8-tensor``: one scale per layer and step;
- ``weights-bf16``: the whole model in bf16 (weights, activations and KV), logits read in fp32.

The cache emulations wrap ``DynamicCache.update``: the rows are rounded before they are stored, so both the
prefill's attention and every decode step read the rounded K/V, as from a quantized cache. On CPU these
are emulations (the arithmetic stays fp32); the rounding is the formats'.

Boundary: a model, token ids and transformers caches; knows nothing about strategies, plans or traces
(:mod:`.replay` runs the floors beside the strategies and scores them with :mod:`.metrics`).
"""

from __future__ import annotations

import copy
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

__all__ = ["FLOORS", "DEFAULT_FLOORS", "FloorResult", "fake_quant", "run_floor", "parse_floors"]

FLOORS: tuple[str, ...] = ("kv-fp16", "kv-bf16", "kv-int8", "kv-fp8", "kv-fp8-tensor", "weights-bf16")
DEFAULT_FLOORS: tuple[str, ...] = ("kv-bf16", "kv-int8", "kv-fp8", "weights-bf16")
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value
_BF16_MODELS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_BF16_LOCK = threading.Lock()


def parse_floors(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Floor names from ``"all"``, ``"default"``, a comma-separated list or a sequence (None / "": none).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if not spec:
        return ()
    if isinstance(spec, str):
        if spec == "all":
            return FLOORS
        if spec == "default":
            return DEFAULT_FLOORS
        spec = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [s for s in spec if s not in FLOORS]
    if bad:
        raise ValueError(f"unknown noise floors {bad}; choose from {list(FLOORS)}, 'default' or 'all'")
    return tuple(dict.fromkeys(spec))


def fake_quant(x: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` (``[..., tokens, head_dim]``) rounded as a KV cache of format ``kind`` would store it.

    Raises:
        ValueError: an unknown format.
    """
    if kind == "kv-fp16":
        return x.to(torch.float16).to(x.dtype)
    if kind == "kv-bf16":
        return x.to(torch.bfloat16).to(x.dtype)
    xf = x.float()
    if kind == "kv-int8":
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127.0
        return (torch.round(xf / scale).clamp(-127, 127) * scale).to(x.dtype)
    if kind in ("kv-fp8", "kv-fp8-tensor"):
        amax = xf.abs().amax(dim=-1, keepdim=True) if kind == "kv-fp8" else xf.abs().amax()
        scale = amax.clamp_min(1e-12) / FP8_MAX
        return ((xf / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    raise ValueError(f"unknown KV format {kind!r}")


def _quantizing(cache, kind: str):
    """``cache`` whose ``update`` rounds the rows it stores (and hands attention the rounded rows)."""
    update = cache.update

    def rounded(key_states, value_states, *args, **kwargs):
        return update(fake_quant(key_states, kind), fake_quant(value_states, kind), *args, **kwargs)

    cache.update, cache.raw_update = rounded, update
    return cache


def _copy(cache, fresh):
    """``fresh`` holding a copy of ``cache``'s rows (stored as they are: already rounded)."""
    put = getattr(fresh, "raw_update", fresh.update)
    for i, layer in enumerate(cache.layers):
        put(layer.keys.clone(), layer.values.clone(), i)
    return fresh


def _bf16_model(model):
    with _BF16_LOCK:
        m = _BF16_MODELS.get(model)
        if m is None:
            m = _BF16_MODELS[model] = copy.deepcopy(model).to(torch.bfloat16).eval()
        return m


@dataclass
class FloorResult:
    """One floor's view of a call: first-token logits (fp32), the greedy continuation, and the
    teacher-forced argmax agreement with the reference continuation."""

    name: str
    logits: torch.Tensor
    output_ids: list[int]
    tf_agree: float


@torch.no_grad()
def run_floor(model, ids: np.ndarray | Sequence[int], kind: str, *, max_new_tokens: int, eos_ids: set[int],
              ref_ids: Sequence[int] = ()) -> FloorResult:
    """Prefill ``ids`` under floor ``kind``, decode greedily, and teacher-force ``ref_ids``.

    Args:
        model: the HF causal LM (fp32).
        ids: the call's context.
        kind: a name from :data:`FLOORS`.
        max_new_tokens: greedy tokens (stops after EOS).
        eos_ids: the model's EOS ids.
        ref_ids: exact's continuation, for the teacher-forced agreement (empty: 1.0).

    Returns:
        A :class:`FloorResult`.

    Raises:
        ValueError: an unknown floor.
    """
    from transformers import DynamicCache

    from ..core.models import cache_kwarg

    if kind not in FLOORS:
        raise ValueError(f"unknown noise floor {kind!r}; choose from {list(FLOORS)}")
    m = _bf16_model(model) if kind == "weights-bf16" else model
    device = next(m.parameters()).device
    x = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)[None]
    n = x.shape[1]

    def new_cache():
        c = DynamicCache(config=m.config)
        return c if kind == "weights-bf16" else _quantizing(c, kind)

    cache = new_cache()
    logits = m(input_ids=x, **{cache_kwarg(m): cache}, use_cache=True, logits_to_keep=1).logits[0, -1].float()
    ref_ids = [int(t) for t in ref_ids]
    tf = 1.0
    if ref_ids:
        preds = [int(logits.argmax())]
        if len(ref_ids) > 1:  # one forward of ref[:-1] over a copy of the prefilled cache
            c2 = _copy(cache, new_cache())
            feed = torch.tensor([ref_ids[:-1]], device=device)
            pos = torch.arange(n, n + len(ref_ids) - 1, device=device)[None]
            preds += m(input_ids=feed, position_ids=pos, **{cache_kwarg(m): c2}, use_cache=True).logits[0].argmax(-1).tolist()
        tf = sum(int(a == b) for a, b in zip(preds, ref_ids)) / len(ref_ids)
    out: list[int] = []
    tok = int(logits.argmax())
    pos = n
    while max_new_tokens > 0:
        out.append(tok)
        if len(out) >= max_new_tokens or tok in eos_ids:
            break
        step = m(input_ids=torch.tensor([[tok]], device=device), position_ids=torch.tensor([[pos]], device=device),
                 **{cache_kwarg(m): cache}, use_cache=True).logits[0, -1]
        tok, pos = int(step.argmax()), pos + 1
    return FloorResult(name=kind, logits=logits, output_ids=out, tf_agree=tf)

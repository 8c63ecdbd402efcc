"""The model facts recovery needs: :class:`ModelSpec` of a loaded causal LM.

Describes a loaded model as a :class:`ModelSpec`: layers, KV heads, head_dim, per-layer-type RoPE (kind,
frequencies, rotary_dim, half vs interleaved layout, probed against the model's own
``apply_rotary_pos_emb``) and a fingerprint of weights + tokenizer that checkpoints carry.

Boundary: reads a model that is already loaded; acquiring one (downloads, weight caches, loading) lives
above the mechanisms, in :mod:`patchkv_agent.loading`. Knows nothing about checkpoints, plans or LangGraph.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ..kernels.rope import rope_delta_reference

log = logging.getLogger(__name__)

# RoPE kinds whose frequencies are position-independent, so a delta rotation is exact.
SUPPORTED_ROPE_KINDS = frozenset({"default", "linear", "llama3", "yarn"})


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """RoPE of one layer type. ``supported`` is False (with ``reason``) when a delta rotation is not exact."""

    kind: str
    inv_freq: torch.Tensor | None  # [rotary_dim // 2], float32, CPU
    interleaved: bool
    supported: bool
    reason: str = ""

    @property
    def rotary_dim(self) -> int:
        return 0 if self.inv_freq is None else 2 * self.inv_freq.numel()


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What recovery needs to know about a model."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: dict[str, RopeSpec]  # by layer type
    fingerprint: str

    def rope_for_layer(self, layer_idx: int) -> RopeSpec:
        return self.rope[self.layer_types[layer_idx]]

    @property
    def rope_supported(self) -> bool:
        return all(r.supported for r in self.rope.values())

    @property
    def rope_unsupported_reason(self) -> str:
        return "; ".join(f"{t}: {r.reason}" for t, r in self.rope.items() if not r.supported)


def text_config(model) -> Any:
    """The text part of a model's config (``config.get_text_config()`` where there is one, else ``config``)."""
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


_text_config = text_config

_CACHE_KWARG: dict[type, str] = {}


def cache_kwarg(model) -> str:
    """The keyword a model's ``forward`` takes its cache under: ``cache`` (transformers >= ~5.2x) or
    ``past_key_values`` (earlier 5.x, e.g. 5.17, which would ignore an unknown ``cache=`` and run without it).

    Read once per model class from the forward's signature (``inspect`` follows transformers' deprecation
    wrappers); ``cache`` when the signature names neither.
    """
    kind = type(model)
    got = _CACHE_KWARG.get(kind)
    if got is None:
        import inspect

        try:
            params = inspect.signature(kind.forward).parameters
        except (TypeError, ValueError):
            params = {}
        got = "past_key_values" if "past_key_values" in params and "cache" not in params else "cache"
        _CACHE_KWARG[kind] = got
    return got


def _layer_types(cfg) -> tuple[str, ...]:
    lt = getattr(cfg, "layer_types", None)
    if lt:
        return tuple(lt)
    return ("full_attention",) * cfg.num_hidden_layers


def _rope_kind(cfg, layer_type: str) -> str:
    rp = getattr(cfg, "rope_parameters", None) or {}
    if layer_type in rp and isinstance(rp[layer_type], dict):
        rp = rp[layer_type]
    return str(rp.get("rope_type", "default"))


def _probe_rope(model, rotary, layer_type: str, multi: bool, inv_freq: torch.Tensor, scaling: float) -> str | None:
    """Return "half"/"interleaved" if the model's own apply_rotary_pos_emb matches a delta rotation, else None."""
    module = sys.modules.get(type(model).__module__)
    apply = getattr(module, "apply_rotary_pos_emb", None)
    if apply is None:
        return None
    head_dim = _head_dim(_text_config(model))
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 1, 3, head_dim, generator=g)
    pos = torch.tensor([[0, 5, 37]])
    x = torch.zeros(1, 3, head_dim)
    with torch.no_grad():
        cos, sin = rotary(x, pos, layer_type) if multi else rotary(x, pos)
        _, k_hf = apply(k, k, cos.float() / scaling, sin.float() / scaling)
    for layout, inter in (("half", False), ("interleaved", True)):
        ours = rope_delta_reference(k, pos[0], inv_freq, interleaved=inter)
        if torch.allclose(ours, k_hf.float(), atol=1e-5, rtol=1e-5):
            return layout
    return None


def _head_dim(cfg) -> int:
    hd = getattr(cfg, "head_dim", None)
    return int(hd) if hd else cfg.hidden_size // cfg.num_attention_heads


def model_spec(model, tokenizer=None) -> ModelSpec:
    """Describe a loaded HF causal LM.

    Args:
        model: a transformers causal LM (``model.model.rotary_emb`` is used for RoPE).
        tokenizer: optional; its identity enters the fingerprint.

    Returns:
        The :class:`ModelSpec`; RoPE layer types that cannot be delta-rotated exactly are marked
        unsupported with a reason (recovery then takes the exact path and says so).
    """
    cfg = _text_config(model)
    layer_types = _layer_types(cfg)
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    rope: dict[str, RopeSpec] = {}
    for lt in sorted(set(layer_types)):
        kind = _rope_kind(cfg, lt)
        if rotary is None:
            rope[lt] = RopeSpec(kind=kind, inv_freq=None, interleaved=False, supported=False,
                                reason="model has no model.rotary_emb")
            continue
        multi = hasattr(rotary, f"{lt}_inv_freq")
        inv = getattr(rotary, f"{lt}_inv_freq" if multi else "inv_freq").detach().float().cpu().clone()
        scaling = float(getattr(rotary, f"{lt}_attention_scaling" if multi else "attention_scaling", 1.0))
        if kind not in SUPPORTED_ROPE_KINDS:
            rope[lt] = RopeSpec(kind=kind, inv_freq=inv, interleaved=False, supported=False,
                                reason=f"RoPE kind {kind!r} has position-dependent frequencies")
            continue
        layout = _probe_rope(model, rotary, lt, multi, inv, scaling)
        if layout is None:
            rope[lt] = RopeSpec(kind=kind, inv_freq=inv, interleaved=False, supported=False,
                                reason="RoPE layout not recognized by the probe against apply_rotary_pos_emb")
        else:
            rope[lt] = RopeSpec(kind=kind, inv_freq=inv, interleaved=layout == "interleaved", supported=True)
    return ModelSpec(
        model_type=str(cfg.model_type),
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads),
        head_dim=_head_dim(cfg),
        vocab_size=int(cfg.vocab_size),
        max_positions=int(getattr(cfg, "max_position_embeddings", 1 << 30) or (1 << 30)),
        layer_types=layer_types,
        sliding_window=getattr(cfg, "sliding_window", None),
        rope=rope,
        fingerprint=fingerprint(model, tokenizer),
    )


def fingerprint(model, tokenizer=None) -> str:
    """xxh3-128 over the config, every parameter's bytes and the tokenizer's vocabulary.

    Args:
        model: a torch module with a ``config``.
        tokenizer: optional HF tokenizer.

    Returns:
        A hex digest prefixed by the model type, e.g. ``"llama:3f2a..."``.
    """
    h = xxhash.xxh3_128()
    cfg = _text_config(model)
    h.update(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode())
    seen: set[int] = set()
    for name, p in model.state_dict().items():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        h.update(name.encode())
        t = p.detach().contiguous().cpu()
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        h.update(type(tokenizer).__name__.encode())
        h.update(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False).encode())
    return f"{cfg.model_type}:{h.hexdigest()}"

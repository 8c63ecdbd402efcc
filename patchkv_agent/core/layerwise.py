"""Layer-wise recovery: decoder layers run one at a time over a set of query rows that may shrink between layers.

Two executors use it. CacheBlend (:mod:`patchkv_agent.strategies.cacheblend`) recomputes every non-prefix
token up to its check layer and then only the tokens whose values deviate most. The measured tail rule of
``patchkv`` (:func:`execute_probed`) recomputes the plan's rows through every layer and, up to the plan's
``tail_check_layer``, also the restored rows of the *probed* tail blocks
(:func:`~patchkv_agent.core.plan.rule_recency`); at that layer it compares each probed row's fresh K/V with the
restored one and carries on past it with the blocks whose relative deviation reaches ``tail_threshold``. The
rest of the probed rows keep their restored K/V from the next layer on, so a tail the edit did not disturb
costs ``(check_layer + 1) / num_layers`` of its recompute, and one it did is recomputed where it deviates.

The relative deviation of a row is ``sqrt(|dK|^2 + |dV|^2) / sqrt(|K|^2 + |V|^2)`` over KV heads and channels
at the check layer (fresh K/V in the denominator); a block's is the largest of its rows.

Supported families are those whose decoder loop is replicated faithfully here (llama, qwen2, qwen3, glm, gemma3
text): the loop calls each Hugging Face decoder layer with the masks, rotary embeddings and cache that the
model's own forward would give it. :func:`layerwise_supported` says why another model is not.

Knows models, the recovery buffers and plans (duck-typed); nothing about planning policy, engines or LangGraph.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .blocks import _readonly
from .models import ModelSpec, cache_kwarg, text_config
from .recovery import (RecoveryBuffers, RecoveryOutput, RecoveryStats, ScatterCache, build_masks, execute,
                       start_restore)

if TYPE_CHECKING:
    from .checkpoint import Checkpoint
    from .runner import ModelRunner
    from .settings import RecoverySettings

__all__ = ["LAYERWISE_MODEL_TYPES", "LayerwiseForward", "layerwise_supported", "execute_probed", "row_deviation"]

LAYERWISE_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "glm", "gemma3_text"})


def layerwise_supported(model, spec: ModelSpec | None = None, check_layer: int | None = None) -> str | None:
    """Why this model cannot run layer by layer (None: it can).

    Args:
        model: a transformers causal LM.
        spec: its model spec (needed with ``check_layer``).
        check_layer: a layer that must have a layer after it (the measured tail rule's), or None.

    Returns:
        None, or a short reason.
    """
    mt = str(getattr(text_config(model), "model_type", ""))
    base = getattr(model, "model", None)
    if mt not in LAYERWISE_MODEL_TYPES:
        return f"model type {mt!r} has no layer-wise forward (supported: {sorted(LAYERWISE_MODEL_TYPES)})"
    if not (all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and hasattr(model, "lm_head")):
        return f"{type(model).__name__} lacks the decoder layout of a *ForCausalLM"
    if check_layer is not None and spec is not None and check_layer + 1 >= spec.num_layers:
        return f"check layer {check_layer} has no layer after it ({spec.num_layers} layers)"
    return None


class LayerwiseForward:
    """The decoder layers of one model run one at a time over the query rows ``active`` of a recovery.

    Args:
        model: the HF causal LM (a supported family: :func:`layerwise_supported`).
        spec: its model spec.
        buf: the recovery's buffers (restored rows in place or on their way: ``events``).
        new_ids: int64 ``[N_new]`` ids of ``C_new``.
        active: sorted int64 new positions run through the first layer (they must end with the last token).
        events: per-layer CUDA events of a side-stream restore (:func:`~patchkv_agent.core.recovery.start_restore`),
            or None.

    Attributes:
        active: the rows the next layer runs.
        next_layer: the first layer not run yet.
    """

    def __init__(self, model, spec: ModelSpec, buf: RecoveryBuffers, new_ids: torch.Tensor, active: np.ndarray,
                 events: list[Any] | None = None):
        self.model, self.spec, self.buf = model, spec, buf
        self.base = model.model
        self.cache = ScatterCache(buf.keys, buf.values)
        self.events = events
        for layer, ev in enumerate(events or ()):
            self.cache.layers[layer].ready = ev
        self.layer_types = list(spec.layer_types)
        self.per_type_rope = "layer_type" in inspect.signature(self.base.rotary_emb.forward).parameters
        self.active = np.asarray(active, dtype=np.int64)
        pos = torch.from_numpy(self.active).to(buf.device)
        self.hidden = self.base.embed_tokens(new_ids.to(buf.device)[pos][None])
        self.next_layer = 0
        self._prepare(pos)

    def _prepare(self, pos: torch.Tensor) -> None:
        self.pos = pos
        self.cache.set_targets(pos)
        self.masks = build_masks(self.spec, self.model, pos, self.buf.n_new, self.buf.dtype)
        rotary = self.base.rotary_emb
        if self.per_type_rope:
            self.rope = {lt: rotary(self.hidden, pos[None], lt) for lt in set(self.layer_types)}
        else:
            self.rope = rotary(self.hidden, pos[None])

    def run(self, stop: int) -> None:
        """Run layers ``next_layer .. stop - 1`` over the active rows (their K/V rows are written in place)."""
        for i in range(self.next_layer, min(stop, self.spec.num_layers)):
            lt = self.layer_types[i]
            self.hidden = self.base.layers[i](
                self.hidden,
                attention_mask=self.masks[lt] if isinstance(self.masks, dict) else self.masks,
                position_embeddings=self.rope[lt] if self.per_type_rope else self.rope,
                position_ids=self.pos[None],
                **{cache_kwarg(self.base.layers[i]): self.cache},
                use_cache=True,
            )
            self.next_layer = i + 1

    def restored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V buffers ``[1, H, N_new, D]``, its side-stream restore waited for."""
        ev = self.cache.layers[layer].ready
        if ev is not None:
            torch.cuda.current_stream(self.buf.device).wait_event(ev)
            self.cache.layers[layer].ready = None
        return self.buf.keys[layer], self.buf.values[layer]

    def narrow(self, keep: np.ndarray) -> None:
        """Carry on with the rows ``keep`` (sorted, a subset of :attr:`active` holding the last token)."""
        keep = np.asarray(keep, dtype=np.int64)
        if keep.shape == self.active.shape:
            return
        idx = torch.from_numpy(np.searchsorted(self.active, keep)).to(self.buf.device)
        self.hidden = self.hidden.index_select(1, idx)
        self.active = keep
        self._prepare(torch.from_numpy(keep).to(self.buf.device))

    def logits(self) -> torch.Tensor:
        """The last active row's next-token logits (float32 ``[vocab]``), after the final norm and soft-capping."""
        hidden = self.base.norm(self.hidden[:, -1:])
        logits = self.model.lm_head(hidden)[0, -1].float()
        cap = getattr(text_config(self.model), "final_logit_softcapping", None)
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


def row_deviation(k_old: torch.Tensor, v_old: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> np.ndarray:
    """Relative K/V deviation per row: ``sqrt(|dK|^2 + |dV|^2) / sqrt(|K_new|^2 + |V_new|^2)`` over heads and
    channels of ``[H, n, D]`` tensors (float64 ``[n]``; a row whose fresh K/V is zero counts its absolute
    deviation)."""
    k_old, v_old, k_new, v_new = (t.float() for t in (k_old, v_old, k_new, v_new))
    num = (k_new - k_old).pow(2).sum(dim=(0, 2)) + (v_new - v_old).pow(2).sum(dim=(0, 2))
    den = k_new.pow(2).sum(dim=(0, 2)) + v_new.pow(2).sum(dim=(0, 2))
    return (num / den.clamp_min(1e-30)).sqrt().cpu().numpy().astype(np.float64)


@torch.no_grad()
def execute_probed(runner: "ModelRunner", spec: ModelSpec, settings: "RecoverySettings", ckpt: "Checkpoint", plan,
                   new_ids: torch.Tensor) -> RecoveryOutput:
    """Run a plan with probed tail blocks (the measured tail rule).

    Restores the plan's ``F`` rows (probed blocks included) as :func:`~patchkv_agent.core.recovery.execute` does,
    runs the plan's recompute rows and the probed rows up to ``plan.tail_check_layer``, keeps the probed blocks
    whose largest row deviation there (:func:`row_deviation`) is at least ``plan.tail_threshold``, and runs the
    recompute rows plus those blocks through the remaining layers. When the rows left restored would be fewer than
    ``settings.min_restore_share`` of the suffix (the small-restore rule, applied to what the probe decided), the
    suffix is recomputed whole instead (exact; ``tail_small_restore`` in the extras, the probe's time counted).

    Args:
        runner: the model's :class:`~patchkv_agent.core.runner.ModelRunner` (:func:`layerwise_supported` for
            ``plan.tail_check_layer`` must hold for its model).
        spec: its model spec.
        settings: the resolved settings (``restore_precision`` says whether the mixed runs are read).
        ckpt: the checkpoint of the previous version.
        plan: a :class:`~patchkv_agent.core.plan.RepairPlan` with ``probe_blocks``.
        new_ids: int64 ``[N_new]`` ids of ``C_new``.

    Returns:
        :class:`RecoveryOutput` whose ``plan`` is the plan that ran (the kept probed blocks moved to the recompute
        rows); ``stats.recompute_tokens`` counts rows run through every layer, and ``extras`` hold
        ``tail_probe_blocks``, ``tail_probe_tokens`` (rows run up to the check layer), ``tail_recomputed_blocks``,
        ``tail_recomputed_tokens``, ``tail_deviation_max`` and ``tail_block_deviation`` (float32, per probed block in
        order: what a threshold is calibrated on).

    Raises:
        ValueError: the model has no layer-wise forward, or a plan that does not recompute the last token.
        CorruptCheckpoint: a mixed run failed its checksum.
    """
    model = runner.model
    why = layerwise_supported(model, spec, plan.tail_check_layer)
    if why is not None:
        raise ValueError(f"the measured tail rule needs a layer-wise forward: {why}")
    t0 = time.perf_counter()
    buf = RecoveryBuffers(runner, spec, new_ids, plan)
    mixed = ckpt.mixed if settings.restore_precision == "mixed" else None
    events = start_restore(buf, ckpt.keys, ckpt.values, mixed)
    t1 = time.perf_counter()
    probe = plan.probe_positions()
    fwd = LayerwiseForward(model, spec, buf, new_ids, np.union1d(buf.recompute, probe), events)
    c = int(plan.tail_check_layer)
    fwd.run(c)
    k_buf, v_buf = fwd.restored(c)
    probe_t = torch.from_numpy(probe).to(buf.device)
    k_old, v_old = k_buf[0].index_select(1, probe_t), v_buf[0].index_select(1, probe_t)  # copies
    fwd.run(c + 1)
    dev = row_deviation(k_old, v_old, k_buf[0].index_select(1, probe_t), v_buf[0].index_select(1, probe_t))
    blocks = np.asarray(plan.probe_blocks, dtype=np.int64)
    first = np.searchsorted(probe, plan.block_starts[blocks])  # each probed block's first row in `probe`
    block_dev = np.maximum.reduceat(dev, first) if probe.size else np.zeros(0)
    chosen = block_dev >= float(plan.tail_threshold)
    selected = probe[np.repeat(chosen, np.diff(np.append(first, probe.size)))]
    probe_stats = {"tail_probe_blocks": int(blocks.size), "tail_probe_tokens": int(probe.size),
                   "tail_recomputed_blocks": int(chosen.sum()), "tail_recomputed_tokens": int(selected.size),
                   "tail_deviation_max": float(block_dev.max()) if block_dev.size else 0.0,
                   "tail_block_deviation": block_dev.astype(np.float32)}
    left = len(buf.restore_new) - int(selected.size)
    if settings.min_restore_share > 0 and left < settings.min_restore_share * plan.n_suffix:
        # the small-restore rule on what the probe left restored: too little to pay for an approximation, so the
        # suffix is recomputed whole (exact), from the first layer; the probe's layers are the price of asking
        full = dataclasses.replace(plan, recompute_positions=_readonly(np.arange(plan.prefix_len, buf.n_new)),
                                   restore_new_positions=_readonly(np.zeros(0)), restore_old_positions=_readonly(np.zeros(0)),
                                   repair_blocks=_readonly(np.arange(len(plan.block_starts))),
                                   restore_blocks=_readonly(np.zeros(0)), small_restore=True)
        probed_s = time.perf_counter() - t1
        out = execute(runner, spec, new_ids, full, ckpt.keys, ckpt.values)
        stats = out.stats.adding(restore_s=t1 - t0, recompute_s=probed_s, **probe_stats, tail_small_restore=True)
        return dataclasses.replace(out, stats=stats, plan=full)
    keep = np.union1d(buf.recompute, selected)
    fwd.narrow(keep)
    fwd.run(spec.num_layers)
    logits = fwd.logits()
    if buf.device.type == "cuda":
        torch.cuda.current_stream(buf.device).synchronize()  # the decode waits for every restored row
    t2 = time.perf_counter()
    ran = plan
    if selected.size:
        stay = ~np.isin(plan.restore_new_positions, selected, assume_unique=True)
        ran = dataclasses.replace(plan, recompute_positions=_readonly(keep),
                                  restore_new_positions=_readonly(plan.restore_new_positions[stay]),
                                  restore_old_positions=_readonly(plan.restore_old_positions[stay]),
                                  repair_blocks=_readonly(np.union1d(plan.repair_blocks, blocks[chosen])),
                                  restore_blocks=_readonly(np.setdiff1d(plan.restore_blocks, blocks[chosen])))
    return RecoveryOutput(
        logits=logits, keys=buf.keys, values=buf.values, plan=ran,
        stats=RecoveryStats(restore_s=t1 - t0, recompute_s=t2 - t1, recompute_tokens=len(keep),
                            payload_bytes=buf.payload_bytes, restore_kernel=buf.kernel, extras=probe_stats),
    )

"""CacheBlend baseline: layer-wise selective recompute picked by value drift at a check layer.

CacheBlend (Yao et al., EuroSys'25, "CacheBlend: Fast LLM Serving for RAG with Cached Knowledge
Fusion") fuses independently precomputed KV chunks. It loads every chunk's cached KV, recomputes the
first layer for all tokens, measures at a check layer how far each token's freshly computed KV
deviates from the cached one, and from then on recomputes only the tokens with the largest deviation
(about 15%), carrying their hidden states layer by layer; the other tokens keep their cached KV.
The public code (github.com/YaoJiayi/CacheBlend, ``vllm_blend``: the xformers backend and
``models/llama.py``) checks at layer 1, ranks by the summed squared value difference over heads and
channels, keeps ``int(n * recomp_ratio)`` tokens plus the query suffix (always recomputed), writes the
check layer's fresh K/V for every token and runs its attention for the selected queries only.

Here, on an edited agent context:
- start from the same stale KV as ``direct``: prefix rows exact, all suffix rows restored from the
  checkpoint with the RoPE correction (:class:`~patchkv_agent.core.recovery.RecoveryBuffers`, the
  same validation, allocation and restore as every other strategy, on the
  :func:`~patchkv_agent.core.plan.plan_direct` plan);
- layers ``0..check_layer`` recompute every non-prefix token (``X`` and all of ``S``);
- at the check layer, rank suffix tokens by ``||V_recomputed - V_restored||`` (L2 over KV heads and
  channels) and keep the top ``floor(ratio * |S|)`` (the public code's ``int(n * ratio)``), plus all
  new tokens ``X`` and the last context token (CacheBlend's always-recomputed query);
- layers after the check layer recompute only those tokens; every other row keeps its restored K/V.

Where this differs from the original, deliberately:
- a true per-token causal mask (:func:`~patchkv_agent.core.recovery.build_masks` for the queries being
  recomputed), not the public code's bottom-right mask, which lets a recomputed token see rows at later
  positions than its own;
- one selection at the check layer, not the paper's gradual filtering over several layers (the public
  code also selects once);
- the check layer runs as a whole Hugging Face decoder layer, so its attention and MLP also run for the
  tokens that are then dropped (the public code runs them for the selected queries only): the K/V and
  the selected tokens' hidden states are the same, the extra cost is one layer over the dropped tokens;
- restored rows come at FP16/full precision from our checkpoint (no quantization), and the ranked set
  is the aligned suffix ``S`` (the prefix is exact, so its deviation is zero by construction);
- no pipelining of KV loading with recompute (the restore happens before the first layer).

Supported families are those whose decoder loop is replicated faithfully here: llama, qwen2, qwen3,
glm and gemma3 (text). Anything else raises ``ValueError`` naming the strategies that work.
Knows models, plans and the recovery helpers; nothing about planning policy or LangGraph.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.layerwise import LAYERWISE_MODEL_TYPES, LayerwiseForward, layerwise_supported
from ..core.plan import plan_direct
from ..core.recovery import RecoveryBuffers, RecoveryOutput, RecoveryStats
from .base import Strategy, register_strategy

if TYPE_CHECKING:
    from ..core.checkpoint import Checkpoint
    from ..core.diff import Edit
    from ..core.models import ModelSpec
    from ..core.runner import ModelRunner
    from ..core.settings import RecoverySettings

SUPPORTED_MODEL_TYPES = LAYERWISE_MODEL_TYPES


def select_top_deviation(deviation: np.ndarray, ratio: float) -> np.ndarray:
    """Indices of the ``floor(ratio * n)`` largest deviations, sorted ascending (ties: lower index).

    Args:
        deviation: float ``[n]`` per-token deviation.
        ratio: fraction in ``[0, 1]``.

    Returns:
        Sorted int64 indices into ``deviation``.

    Raises:
        ValueError: ``ratio`` outside ``[0, 1]``.
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"cacheblend ratio must be in [0, 1], got {ratio}")
    dev = np.asarray(deviation, dtype=np.float64)
    k = min(dev.shape[0], int(dev.shape[0] * ratio + 1e-9))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.argsort(-dev, kind="stable")  # stable: equal deviations keep position order
    return np.sort(order[:k]).astype(np.int64)


def check_supported(model) -> None:
    """Raise ``ValueError`` unless the model's decoder loop is one this module replicates.

    Args:
        model: a transformers causal LM.

    Raises:
        ValueError: unsupported family or layout (the message names the strategies that work).
    """
    why = layerwise_supported(model)
    if why is not None:
        raise ValueError(
            f"the cacheblend strategy drives decoder layers by hand and supports model types "
            f"{sorted(SUPPORTED_MODEL_TYPES)} (as *ForCausalLM): {why}; use 'direct', 'patchkv', "
            "'prefix' or 'exact' with this model")


@register_strategy
class CacheBlendStrategy(Strategy):
    """CacheBlend: full recompute up to a check layer, then only the top value-deviation tokens.

    Args:
        ratio: fraction of suffix tokens recomputed after the check layer (default 0.15).
        check_layer: the layer at which deviation is measured (default 1); layers ``<=`` it recompute
            every non-prefix token.

    Raises:
        ValueError: ``ratio`` outside ``[0, 1]`` or a negative ``check_layer``.
    """

    name = "cacheblend"

    def __init__(self, *, ratio: float = 0.15, check_layer: int = 1):
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"cacheblend ratio must be in [0, 1], got {ratio}")
        if check_layer < 0:
            raise ValueError(f"cacheblend check_layer must be >= 0, got {check_layer}")
        self.ratio, self.check_layer = float(ratio), int(check_layer)

    def plan(self, settings, ckpt, edit):
        return plan_direct(edit, block_size=settings.block_size)

    @torch.no_grad()
    def execute(self, runner: "ModelRunner", spec: "ModelSpec", settings: "RecoverySettings",
                ckpt: "Checkpoint | None", edit: "Edit", plan, new_ids: torch.Tensor) -> RecoveryOutput:
        """Restore like ``direct``, then recompute layer by layer with the CacheBlend selection.

        Args:
            runner: the HF causal LM's :class:`~patchkv_agent.core.runner.ModelRunner`.
            spec: its model spec.
            settings: the recovery settings (unused: CacheBlend restores full-precision rows).
            ckpt: the checkpoint of the previous version.
            edit: the diff (unused beyond the plan).
            plan: a ``plan_direct`` plan: ``recompute_positions`` = X + last token, restore = all of S.
            new_ids: int64 ``[N_new]`` ids of ``C_new``.

        Returns:
            :class:`RecoveryOutput`; ``stats`` holds ``restore_s``, ``recompute_s``, ``payload_bytes``,
            ``recompute_tokens``
            (tokens run through the layers after the check layer; all non-prefix tokens when no layer
            follows it), ``cacheblend_full_layers``, ``cacheblend_full_tokens``, ``cacheblend_selected``
            (suffix tokens picked by deviation) and ``cacheblend_selected_positions``.

        Raises:
            ValueError: unsupported model family, or a plan that does not recompute the last token.
        """
        model = runner.model
        check_supported(model)
        # ---- restore: exact prefix rows, RoPE-corrected suffix rows (the `direct` starting point)
        t0 = time.perf_counter()
        buf = RecoveryBuffers(runner, spec, new_ids, plan)
        keys, values, device = buf.keys, buf.values, buf.device
        n, n_prefix, always, rest_new = buf.n_new, buf.prefix_len, buf.recompute, buf.restore_new
        buf.restore(ckpt.keys, ckpt.values)  # full-precision rows (CacheBlend does not quantize)
        payload = buf.payload_bytes
        t1 = time.perf_counter()

        # ---- layer-wise recompute: every non-prefix token up to the check layer, then the selection
        fwd = LayerwiseForward(model, spec, buf, new_ids, np.arange(n_prefix, n, dtype=np.int64))
        full_layers = min(self.check_layer + 1, spec.num_layers)
        full_tokens = len(fwd.active)
        selected = rest_new  # with no layer after the check layer, everything stays recomputed
        if self.check_layer + 1 < spec.num_layers:
            fwd.run(self.check_layer)
            rest_new_t = torch.from_numpy(rest_new).to(device)
            # the restored (stale) values of the suffix rows, before the check layer overwrites them
            v_cached = values[self.check_layer][0].index_select(1, rest_new_t).float()
            fwd.run(self.check_layer + 1)
            v_fresh = values[self.check_layer][0].index_select(1, rest_new_t).float()
            # [H, S, D] -> [S]: L2 over heads and channels
            dev = (v_fresh - v_cached).pow(2).sum(dim=(0, 2)).sqrt().cpu().numpy()
            selected = rest_new[select_top_deviation(dev, self.ratio)]
            fwd.narrow(np.sort(np.concatenate([selected, always])))
        fwd.run(spec.num_layers)
        logits = fwd.logits()
        t2 = time.perf_counter()
        return RecoveryOutput(
            logits=logits, keys=keys, values=values,
            stats=RecoveryStats(restore_s=t1 - t0, recompute_s=t2 - t1, recompute_tokens=len(fwd.active),
                                payload_bytes=payload, extras={
                "cacheblend_full_layers": full_layers,
                "cacheblend_full_tokens": full_tokens,
                "cacheblend_selected": int(len(selected)),
                "cacheblend_selected_positions": np.asarray(selected, dtype=np.int64),
            }),
        )

"""KV checkpoints: one context version's KV held off the accelerator, with the metadata a resume needs.

A :class:`Checkpoint` holds, for one thread version, every layer's K/V rows ``[H, N, D]`` in CPU
memory, the token ids, the model fingerprint, per-token attention scores from the checkpoint pass,
and the off-path costs of writing it. It knows nothing about plans or models beyond the fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass(frozen=True, kw_only=True, eq=False)
class Checkpoint:
    """The offloaded KV of one context version.

    Attributes:
        token_ids: int64 ``[N]`` ids of the context.
        keys, values: per layer ``[num_kv_heads, N, head_dim]`` CPU tensors (post-RoPE keys).
        fingerprint: :func:`patchkv_agent.models.fingerprint` of the model that wrote it.
        scores: float32 ``[N]`` normalized attention mass per token from the checkpoint pass, or None.
        stats: off-path costs (``offload_s``, ``stats_s``, ``quantize_s``) and provenance.
    """

    token_ids: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    fingerprint: str
    scores: np.ndarray | None = None
    stats: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def bytes_per_token(self) -> int:
        """Bytes of K+V of one token across all layers."""
        return sum(k.shape[0] * k.shape[2] * k.element_size() + v.shape[0] * v.shape[2] * v.element_size()
                   for k, v in zip(self.keys, self.values))

    @property
    def nbytes(self) -> int:
        """Exact payload bytes of the K/V held."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values))

"""KV checkpoints: one context version's KV held off the accelerator, with the metadata a resume needs.

A :class:`Checkpoint` holds, for one thread version, every layer's K/V rows ``[H, N, D]`` in CPU
memory at full precision (what the ``prefix``/``direct``/``cacheblend`` baselines restore), the
token ids, the model fingerprint, per-token attention scores from the checkpoint pass, its provenance
(:class:`~patchkv_agent.core.provenance.CheckpointProvenance`: how it was computed, what writing it cost),
and (optionally) a :class:`MixedKV`: the same rows grouped into blocks, each
block tagged FP16 / K8V8 / K8V4 / K4V4 by the precision policy, blocks of one tag clustered into runs, one
:class:`~patchkv_agent.kernels.RunPayload` per (layer, run) with an xxhash checksum.
Checkpoints are immutable once built, so publication is atomic: a reader holds either the whole
object or none. Knows kernels and the precision policy; nothing about plans or models beyond the
fingerprint.
"""

from __future__ import annotations

import time

from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ..kernels import RunPayload, key_residual_sq, quantize_gather, value_residual_layers
from .fallback import Fallback, FallbackKind
from .plan import DEFAULT_BLOCK_SIZE
from .provenance import CheckpointProvenance
from .precision import FP16_SAFE, PrecisionPolicy, Run, Tag, assign_tags, cluster_runs


class CorruptCheckpoint(RuntimeError):
    """A checkpoint run failed its integrity check; callers fall back to exact recomputation."""


def payload_checksum(p: RunPayload) -> int:
    """xxh3-64 over every tensor of a run payload (data, scales, zeros) and its header."""
    h = xxhash.xxh3_64()
    h.update(f"{p.tag}:{p.n_rows}:{p.num_kv_heads}:{p.head_dim}:{p.block_size}:{p.v_group}".encode())
    for name, t in p.tensors().items():
        h.update(name.encode())
        t = t.detach().contiguous().cpu()
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.intdigest()


@dataclass(frozen=True, kw_only=True, eq=False)
class MixedKV:
    """Mixed-precision copy of a checkpoint's rows.

    Blocks of one tag are clustered into runs (``runs``: metadata that scales with runs, not
    tokens); per layer, all runs of one tag are packed into one payload, so a restore makes at most
    one kernel call per (layer, tag) whatever the fragmentation. Key scales stay per block: every block
    but the sequence's last is full, so blocks keep their boundaries inside the packed payload.

    Attributes:
        block_size: tokens per block (blocks start at old position 0).
        tags: int8 ``[n_blocks]`` :class:`~patchkv_agent.core.precision.Tag` per block.
        runs: consecutive blocks of one tag, in block order.
        tag_rows: per tag name, the sorted old positions packed in that tag's payloads.
        payloads: ``payloads[layer][tag name]``.
        checksums: ``checksums[layer][tag name]``, xxh3-64 of each payload.
    """

    block_size: int
    tags: np.ndarray
    runs: tuple[Run, ...]
    tag_rows: dict[str, np.ndarray]
    payloads: list[dict[str, RunPayload]]
    checksums: list[dict[str, int]]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for layer in self.payloads for p in layer.values())

    def verify(self, layer: int, tag: str) -> RunPayload:
        """The payload of (layer, tag) after checking its checksum.

        Raises:
            CorruptCheckpoint: the bytes do not match the checksum written with them.
        """
        p = self.payloads[layer][tag]
        if payload_checksum(p) != self.checksums[layer][tag]:
            raise CorruptCheckpoint(f"checksum mismatch in the {tag} payload of layer {layer}")
        return p


def key_residual(keys: list[torch.Tensor], block_size: int = DEFAULT_BLOCK_SIZE, eps: float = 1e-12) -> np.ndarray:
    """Per-token 4-bit key residual over all layers (the G4K input of ``precision.assign_tags``).

    Layer by layer (no stacked copy of the keys): ``sqrt(sum_l err_l / sum_l ref_l)`` with
    ``kernels.residual.key_residual_sq`` at ``block_size``, i.e. ``key_residual_4bit`` of the stacked keys.

    Args:
        keys: per layer ``[H, N, D]``.
        block_size: tokens per block (the tags' block size).
        eps: guards all-zero rows.

    Returns:
        float64 ``[N]``.

    Raises:
        ValueError: no layers, or layers of different token counts.
    """
    if not keys or any(k.shape[1] != keys[0].shape[1] for k in keys):
        raise ValueError("keys must be a non-empty list of [H, N, D] layers of one N")
    err = ref = None
    for k in keys:
        e, r = key_residual_sq(k, block_size)
        err, ref = (e, r) if err is None else (err + e, ref + r)
    return (err / ref.clamp_min(eps)).sqrt().cpu().numpy().astype(np.float64)


def build_mixed(keys: list[torch.Tensor], values: list[torch.Tensor], scores: np.ndarray | None, *,
                block_size: int = DEFAULT_BLOCK_SIZE, policy: PrecisionPolicy = PrecisionPolicy(),
                timings: dict[str, float] | None = None) -> MixedKV:
    """Tag blocks by risk (attention x 4-bit value residual; 4-bit key residual for K4V4) and
    quantize every layer's rows per tag.

    Args:
        keys, values: per layer ``[H, N, D]``.
        scores: per-token attention ``[N]`` (None: uniform).
        block_size: tokens per block.
        policy: precision thresholds (``tau_LL == 0``: no K4V4, and the key residual is not computed).
        timings: when given, filled with the seconds of each stage: ``value_residual_s``,
            ``key_residual_s``, ``tags_s``, ``pack_s`` (quantize every layer's rows and checksum them), and
            ``kept_full_tokens``: tokens in blocks kept ``FP16`` because a K or V value of the block is
            non-finite or beyond the fp16 range (:func:`unquantizable_tokens`; never quantized, never raised).

    Returns:
        The :class:`MixedKV` (payloads on the device of ``keys``).
    """
    n = keys[0].shape[1]
    t0 = time.perf_counter()
    resid = value_residual_layers(values).cpu().numpy()  # one native pass on CPU (no stacked copy)
    t1 = time.perf_counter()
    key_resid = key_residual(keys, block_size) if policy.tau_LL > 0 else None
    t2 = time.perf_counter()
    keep = unquantizable_tokens(keys, values)
    keep |= ~np.isfinite(resid)
    resid = np.where(keep, 0.0, resid)  # those blocks are FP16 whatever their residual
    if key_resid is not None:
        keep |= ~np.isfinite(key_resid)
        key_resid = np.where(keep, 0.0, key_resid)
    attn = np.ones(n, dtype=np.float64) if scores is None else np.asarray(scores, dtype=np.float64)
    bad = ~np.isfinite(attn) | (attn < 0)
    if bad.any():  # attention of a non-finite forward: unknown counts as the most attended (safer tags)
        good = attn[~bad]
        attn = np.where(bad, good.max() if good.size else 1.0, attn)
    tags = assign_tags(attn, resid, block_size, policy, key_resid, keep_full=keep)
    t3 = time.perf_counter()
    mixed = quantize_mixed(keys, values, tags, block_size=block_size)
    if timings is not None:
        timings.update(value_residual_s=t1 - t0, key_residual_s=t2 - t1, tags_s=t3 - t2,
                       pack_s=time.perf_counter() - t3)
        timings["kept_full_tokens"] = int(np.isin(np.arange(n) // block_size,
                                                  np.unique(np.flatnonzero(keep) // block_size)).sum())
    return mixed


def unquantizable_tokens(keys: list[torch.Tensor], values: list[torch.Tensor]) -> np.ndarray:
    """Tokens whose K or V, in any layer or head, are non-finite or beyond ``precision.FP16_SAFE``.

    No quantized format holds them (the fp16 scale or zero of their group would overflow and decode to
    NaN); :func:`build_mixed` keeps their blocks ``FP16`` (the source dtype).

    Args:
        keys, values: per layer ``[H, N, D]``.

    Returns:
        bool ``[N]``.
    """
    out = None
    for x in (*keys, *values):
        # one pass over x: the per-(head, token) maximum magnitude; amax propagates NaN, and NaN <= bound is
        # False, so NaN, inf and out-of-range values all mark their token
        bad = ~(x.abs().amax(2) <= FP16_SAFE).all(0)
        out = bad if out is None else out | bad
    return out.cpu().numpy() if out is not None else np.zeros(0, dtype=bool)


def count_nonfinite(logits: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    rows: np.ndarray | None = None) -> int:
    """Non-finite values a forward produced: in ``logits`` and in rows ``rows`` of every layer's K/V.

    Args:
        logits: the forward's logits.
        keys, values: per layer ``[1, H, N, D]``.
        rows: the positions the forward computed (None: all).

    Returns:
        The count (0 for a healthy forward).
    """
    n = int((~torch.isfinite(logits)).sum())
    idx = None
    if rows is not None and len(rows) != (keys[0].shape[2] if keys else 0):
        idx = torch.as_tensor(np.array(rows, dtype=np.int64), device=keys[0].device) if keys else None
    for x in (*keys, *values):
        x = x if idx is None else x.index_select(2, idx)
        n += int((~torch.isfinite(x)).sum())
    return n


def quantize_mixed(keys: list[torch.Tensor], values: list[torch.Tensor], tags: np.ndarray, *,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> MixedKV:
    """Quantize every layer's rows at given block tags (the second half of :func:`build_mixed`).

    Args:
        keys, values: per layer ``[H, N, D]``.
        tags: int8 :class:`~patchkv_agent.core.precision.Tag` per block of ``block_size`` tokens.
        block_size: tokens per block.

    Returns:
        The :class:`MixedKV` (payloads on the device of ``keys``).
    """
    n = keys[0].shape[1]
    runs = tuple(cluster_runs(tags))
    block_of_row = np.arange(n) // block_size
    tag_rows = {Tag(t).name: np.flatnonzero(tags[block_of_row] == t).astype(np.int64)
                for t in np.unique(tags).tolist()}
    payloads, checksums = [], []
    for k, v in zip(keys, values):
        lp = {name: quantize_gather(k, v, torch.from_numpy(rows).to(k.device), name, block_size)
              for name, rows in tag_rows.items()}
        payloads.append(lp)
        checksums.append({name: payload_checksum(p) for name, p in lp.items()})
    return MixedKV(block_size=block_size, tags=tags, runs=runs, tag_rows=tag_rows, payloads=payloads,
                   checksums=checksums)


@dataclass(frozen=True, kw_only=True, eq=False)
class Checkpoint:
    """The offloaded KV of one context version.

    Attributes:
        token_ids: int64 ``[N]`` ids of the context.
        keys, values: per layer ``[num_kv_heads, N, head_dim]`` CPU tensors (post-RoPE keys).
        fingerprint: :func:`patchkv_agent.core.models.fingerprint` of the model that wrote it.
        scores: float32 ``[N]`` normalized attention mass per token from the checkpoint pass, or None.
        provenance: how the K/V were computed (:class:`~patchkv_agent.core.provenance.Source`), how many
            leading rows are exact, and the off-path costs of writing it (``offload_s``, ``stats_s``,
            ``quantize_s``, ...).
        mixed: the mixed-precision runs (``patchkv`` restores from these), or None.
        words: int64 ``[N]`` word ids of ``token_ids`` (the lexical reader signal's per-version data,
            :class:`~patchkv_agent.core.lexicon.WordIndex`), carried so the next resume maps only its
            edited words; None when unknown.
    """

    token_ids: np.ndarray
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    fingerprint: str
    scores: np.ndarray | None = None
    provenance: CheckpointProvenance = field(default_factory=CheckpointProvenance)
    mixed: MixedKV | None = None
    words: np.ndarray | None = field(default=None, repr=False)

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


def identity_fallback(ckpt: "Checkpoint", current: str, past: set[str] | frozenset[str]) -> Fallback | None:
    """Whether a checkpoint is of the model whose fingerprint is ``current``.

    Args:
        ckpt: the checkpoint.
        current: the model's fingerprint now.
        past: the fingerprints the model had before its weights changed in place.

    Returns:
        None for a checkpoint of the current weights; a ``WEIGHTS_CHANGED`` fallback for one written before
        an in-place change (its KV is stale).

    Raises:
        TypeError: ``ckpt`` is not a :class:`Checkpoint`.
        ValueError: a checkpoint of another model or tokenizer.
    """
    if not isinstance(ckpt, Checkpoint):
        raise TypeError(f"expected a Checkpoint from PatchKVEngine.checkpoint, got {type(ckpt).__name__}")
    if ckpt.fingerprint == current:
        return None
    if ckpt.fingerprint in past:
        return Fallback(FallbackKind.WEIGHTS_CHANGED,
                        f"the model's weights changed since this checkpoint was written "
                        f"({ckpt.fingerprint[:24]}... -> {current[:24]}...); its KV is stale")
    raise ValueError(
        f"checkpoint was written by another model or tokenizer ({ckpt.fingerprint[:24]}...) than this "
        f"engine's ({current[:24]}...); re-create it with this engine's checkpoint()")

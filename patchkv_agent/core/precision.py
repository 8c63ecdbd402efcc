"""Per-block precision tags from stored attention x 4-bit value residual.

Knows nothing about torch, models or kernels: numpy arrays in, tags and runs out. The residual
``e`` comes from ``patchkv_agent.kernels.quant.value_residual_4bit``, the key residual ``ek`` from
``patchkv_agent.kernels.quant.key_residual_4bit``; attention from the capture pass. The tag names
and their order match the kernel formats (``kernels.quant.FORMATS``).

Per token ``i``: ``A_i`` is the stored attention rescaled to mean 1 over the given tokens (so the
input's own normalization does not matter and thresholds do not depend on context length), ``e_i``
the normalized 4-bit value residual ``||v_i - Q4(v_i)|| / ||v_i||`` (its range on real values: docs/RESULTS.md).
Per block ``b`` (``block_size`` consecutive tokens, the last block may be shorter)::

    r_b = alpha * max_i(A_i * e_i) + (1 - alpha) * mean_i(A_i * e_i)
    r_b >= tau_H                                 -> FP16
    tau_L <= r_b < tau_H                         -> K8V8
    r_b < tau_L and G4 fails                     -> K8V8
    r_b < tau_L and G4 passes                    -> K8V4, except:
    r_b < tau_LL and G4 passes and G4K passes    -> K4V4
    G4 (low-bit test): max_i e_i <= g4 over the block, i.e. 4 bit reconstructs every value
    row of the block to within a relative error g4 (fails on rows with heavy outlier channels).
    G4K (4-bit key test): max_i ek_i <= g4k over the block, with ``ek_i = ||k_i - Q4K(k_i)|| /
    ||k_i||`` the token's relative key error under the K4V4 key quantizer (per channel over the
    block, all layers and heads), i.e. 4-bit keys reconstruct every key row of the block to within
    g4k (fails on blocks whose channel ranges are set by a few outlier tokens). Without key
    residuals (``key_resid=None``) G4K fails everywhere: no block becomes K4V4.

Defaults (alpha 0.7, tau_L 1.0, tau_H 8.0, g4 0.15) come from the policy grid of
`patchkv-agent bench-transport` on an 8k-token SmolLM2-135M-Instruct checkpoint: the largest payload
cut whose first-token KL cost stays small. The tags and payload they gave there, the first choice they
replaced and what the thresholds mean in multiples of the mean attention are in docs/RESULTS.md
(section "Precision defaults"). Calibration replaces these per model.

The K4V4 thresholds (``tau_LL`` 0.05 = ``K4V4_TAU_LL``, ``g4k`` 0.045) came later, from the K4V4 grid of the same
benchmark (``bench-transport --k4-grid``: tau_LL in 0..1 x g4k in 0.04..1 at tau_L 1, tau_H 8): the
largest payload cut with payload <= 40 % of FP16 on the 8k checkpoint (37.9 %: 142 of 256 blocks
K4V4) whose direct@mixed first-token KL over 4 edited contexts stays within +3.7 % of direct@FP16
(+3.5 %; no K4V4: +3.7 %). Only that grid point met both; the KL differences between neighbouring
points are of the order of the noise of 4 contexts, so recalibrate per model. SmolLM2's 4-bit key
residuals ``ek`` are ~0.04 (median 0.039, max 0.074): ``g4k`` sits just above the median.
``tau_LL`` defaults to ``min(DEFAULT_TAU_LL, tau_L)`` so any ``tau_L`` (e.g. of a profile written
before K4V4 existed) gives a valid policy.

**K4V4 is off by default** (``DEFAULT_TAU_LL = 0``; pass ``tau_LL=K4V4_TAU_LL`` to turn it on). Judged where
a user feels it, it costs decisions the first-token KL did not show: on the edit-following benchmark
(``scripts/bench_follow.py --n 40``, SmolLM2, shipped profile) K4V4 at 0.05 turned two of the 91 pairs
where ``exact`` answers the new gold into other answers (two-hop episode 30, count episode 12; both
follow again with ``tau_LL=0``, at 1 and 2 torch threads alike): pooled follow rate 0.978 instead of
1.000. The payload cut (44.8 % -> 37.9 % of FP16 on the 8k checkpoint) is there for memory-bound
deployments that accept it; docs/RESULTS.md has both measurements.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import NamedTuple

import numpy as np


class Tag(enum.IntEnum):
    """Block precision, ordered by precision (``max`` of two tags is the safer one).

    The values are also the stored codes of checkpoints (``mixed.tags``, runs), so they never
    change: ``K4V4`` was added below ``K8V4`` as -1. Do not use them as list or array indices.
    """

    K4V4 = -1
    K8V4 = 0
    K8V8 = 1
    FP16 = 2


class Run(NamedTuple):
    """Consecutive blocks of one tag: blocks ``first_block .. first_block + n_blocks - 1``."""

    tag: Tag
    first_block: int
    n_blocks: int


FP16_SAFE = 6.0e4  # |x| beyond this (or non-finite) cannot be quantized: its fp16 scale or zero would overflow
K4V4_TAU_LL = 0.05  # the K4V4 risk threshold measured for payload <= 40 % (see the module docstring)
DEFAULT_TAU_LL = 0.0  # K4V4 off by default: it flips edit-following answers (module docstring)
DEFAULT_G4K = 0.045  # K4V4 4-bit key test


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """Thresholds of the precision rule (see the module docstring).

    Attributes:
        alpha: weight of the block max against the block mean in ``r_b``.
        tau_L, tau_H: risk thresholds of K8V8 and FP16.
        g4: the G4 bound on the 4-bit value residual (K8V4 and K4V4 blocks).
        tau_LL: risk threshold of K4V4 (``r_b < tau_LL``); ``None`` (the default) resolves to
            ``min(DEFAULT_TAU_LL, tau_L)`` at construction, so the attribute is always a float.
            ``0`` disables K4V4.
        g4k: the G4K bound on the 4-bit key residual (K4V4 blocks).

    Raises:
        ValueError: unless ``0 <= alpha <= 1``, ``0 <= tau_L < tau_H``, ``0 <= tau_LL <= tau_L``,
            ``g4 > 0`` and ``g4k > 0``.
    """

    alpha: float = 0.7
    tau_L: float = 1.0
    tau_H: float = 8.0
    g4: float = 0.15
    tau_LL: float | None = None
    g4k: float = DEFAULT_G4K

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 <= self.tau_L < self.tau_H:
            raise ValueError(f"need 0 <= tau_L < tau_H, got tau_L={self.tau_L}, tau_H={self.tau_H}")
        if not self.g4 > 0.0:
            raise ValueError(f"g4 must be > 0, got {self.g4}")
        if self.tau_LL is None:
            object.__setattr__(self, "tau_LL", min(DEFAULT_TAU_LL, self.tau_L))
        if not 0.0 <= self.tau_LL <= self.tau_L:
            raise ValueError(f"need 0 <= tau_LL <= tau_L, got tau_LL={self.tau_LL}, tau_L={self.tau_L}; lower "
                             "tau_LL (0 disables K4V4) or pass tau_LL=None for min(DEFAULT_TAU_LL, tau_L)")
        if not self.g4k > 0.0:
            raise ValueError(f"g4k must be > 0, got {self.g4k}")


def _check(attn: np.ndarray, resid: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(attn, dtype=np.float64)
    e = np.asarray(resid, dtype=np.float64)
    if a.ndim != 1 or a.shape != e.shape:
        raise ValueError(f"attn and resid must be 1-D of one length, got {a.shape} and {e.shape}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    for name, x in (("attn", a), ("resid", e)):
        if not np.all(np.isfinite(x)) or np.any(x < 0):
            raise ValueError(f"{name} must be finite and non-negative")
    return a, e


def _block_reduce(x: np.ndarray, block_size: int, ufunc: np.ufunc) -> np.ndarray:
    starts = np.arange(0, x.shape[0], block_size)
    return ufunc.reduceat(x, starts) if x.size else np.zeros(0)


def normalized_attention(attn: np.ndarray) -> np.ndarray:
    """``attn`` rescaled to mean 1 (all zeros stay zeros).

    Args:
        attn: non-negative ``[N]``.

    Returns:
        float64 ``[N]``.
    """
    a = np.asarray(attn, dtype=np.float64)
    total = a.sum()
    return a * (a.shape[0] / total) if total > 0 else np.zeros_like(a)


def block_risk(attn: np.ndarray, resid: np.ndarray, block_size: int, alpha: float) -> np.ndarray:
    """Per-block risk ``r_b`` (module docstring), for the policy and for calibration.

    Args:
        attn: non-negative per-token attention ``[N]`` (any normalization).
        resid: non-negative per-token 4-bit value residual ``[N]``.
        block_size: tokens per block.
        alpha: weight of the block max against the block mean.

    Returns:
        float64 ``[ceil(N / block_size)]``.

    Raises:
        ValueError: on mismatched shapes, negative or non-finite inputs, ``block_size < 1``.
    """
    a, e = _check(attn, resid, block_size)
    p = normalized_attention(a) * e
    counts = np.diff(np.append(np.arange(0, p.shape[0], block_size), p.shape[0]))
    mean = _block_reduce(p, block_size, np.add) / np.maximum(counts, 1)
    return alpha * _block_reduce(p, block_size, np.maximum) + (1.0 - alpha) * mean


def assign_tags(
    attn: np.ndarray,
    resid: np.ndarray,
    block_size: int,
    policy: PrecisionPolicy = PrecisionPolicy(),
    key_resid: np.ndarray | None = None,
    keep_full: np.ndarray | None = None,
) -> np.ndarray:
    """Precision tag per block.

    Args:
        attn: non-negative per-token attention ``[N]`` (rescaled to mean 1 internally).
        resid: per-token normalized 4-bit value residual ``e_i`` ``[N]``.
        block_size: tokens per block (the last block may be shorter).
        policy: thresholds.
        key_resid: per-token normalized 4-bit key residual ``ek_i`` ``[N]``
            (``kernels.quant.key_residual_4bit`` with the same ``block_size``), or ``None``: no
            block becomes K4V4 (the tags of the rule without K4V4).
        keep_full: bool ``[N]``, or None: tokens no format can quantize (non-finite, or beyond
            :data:`FP16_SAFE`); every block holding one is ``FP16`` (stored in the source dtype, which holds
            them), whatever the rule says.

    Returns:
        int8 ``[ceil(N / block_size)]`` of :class:`Tag` values.

    Raises:
        ValueError: as :func:`block_risk`; ``key_resid`` not of ``resid``'s shape, negative or
            non-finite; ``keep_full`` not a bool ``[N]``.
    """
    r = block_risk(attn, resid, block_size, policy.alpha)
    e_max = _block_reduce(np.asarray(resid, dtype=np.float64), block_size, np.maximum)
    low = np.where(e_max <= policy.g4, Tag.K8V4, Tag.K8V8)
    if key_resid is not None and policy.tau_LL > 0.0:
        ek = np.asarray(key_resid, dtype=np.float64)
        if ek.shape != np.shape(resid):
            raise ValueError(f"key_resid must be [N] like resid, got {ek.shape} and {np.shape(resid)}")
        if not np.all(np.isfinite(ek)) or np.any(ek < 0):
            raise ValueError("key_resid must be finite and non-negative")
        ek_max = _block_reduce(ek, block_size, np.maximum)
        low = np.where((low == Tag.K8V4) & (r < policy.tau_LL) & (ek_max <= policy.g4k), Tag.K4V4, low)
    tags = np.where(r >= policy.tau_H, Tag.FP16, np.where(r >= policy.tau_L, Tag.K8V8, low))
    if keep_full is not None:
        kf = np.asarray(keep_full)
        if kf.dtype != bool or kf.shape != np.shape(resid):
            raise ValueError(f"keep_full must be bool [N] like resid, got {kf.dtype} {kf.shape}")
        tags = np.where(_block_reduce(kf, block_size, np.logical_or), Tag.FP16, tags)
    return tags.astype(np.int8)


def cluster_runs(tags: np.ndarray) -> list[Run]:
    """Group consecutive blocks of one tag into runs, in block order.

    Args:
        tags: ``[n_blocks]`` tag values.

    Returns:
        ``[Run(tag, first_block, n_blocks), ...]`` covering every block once; empty for no blocks.

    Raises:
        ValueError: if ``tags`` is not 1-D or holds a value that is not a :class:`Tag`.
    """
    t = np.asarray(tags)
    if t.ndim != 1:
        raise ValueError(f"tags must be 1-D, got shape {t.shape}")
    if t.size == 0:
        return []
    valid = {int(x) for x in Tag}
    if not set(np.unique(t).tolist()) <= valid:
        raise ValueError(f"tags hold values outside {sorted(valid)}")
    starts = np.flatnonzero(np.r_[True, t[1:] != t[:-1]])
    ends = np.r_[starts[1:], t.size]
    return [Run(Tag(int(t[s])), int(s), int(e - s)) for s, e in zip(starts, ends)]

"""Per-block precision tags from stored attention x 4-bit value residual.

What it does: given per-token attention (from the capture pass) and per-token 4-bit residuals of the
values (and, for K4V4, of the keys), it gives every suffix block one of the four transport formats,
FP16 / K8V8 / K8V4 / K4V4 (:class:`Tag`; names and order match ``kernels.formats.FORMATS``), and groups
consecutive equal tags into runs (:func:`cluster_runs`). The rule in words: a block that the context
attends to a lot *and* whose values 4 bit reconstructs poorly (high attention x residual) is kept at
high precision, a little-read one goes to 4-bit values, and to 4-bit keys too (K4V4) only where its risk
is lower still and its keys quantize well; a block with any value row that 4 bit reconstructs poorly
(heavy outlier channels) keeps 8-bit values whatever its attention.

Per token ``i``: ``A_i`` is the stored attention rescaled to mean 1 over the given tokens (so the
input's own normalization does not matter and thresholds do not depend on context length), ``e_i``
the normalized 4-bit value residual ``||v_i - Q4(v_i)|| / ||v_i||``, ``ek_i`` the same for keys under
the K4V4 key quantizer (per channel over the block, all layers and heads). Per block ``b``
(``block_size`` consecutive tokens, the last block may be shorter)::

    r_b = alpha * max_i(A_i * e_i) + (1 - alpha) * mean_i(A_i * e_i)
    r_b >= tau_H                                 -> FP16
    tau_L <= r_b < tau_H                         -> K8V8
    r_b < tau_L and G4 fails                     -> K8V8
    r_b < tau_L and G4 passes                    -> K8V4, except:
    r_b < tau_LL and G4 passes and G4K passes    -> K4V4
    G4 (low-bit test):  max_i e_i  <= g4 over the block (4-bit values reconstruct every row within g4)
    G4K (4-bit keys):   max_i ek_i <= g4k over the block (fails where a few outlier tokens set the
                        channel ranges)

Without key residuals (``key_resid=None``) G4K fails everywhere: no block becomes K4V4. ``tau_LL``
defaults to ``min(DEFAULT_TAU_LL, tau_L)``, so any ``tau_L`` (e.g. of a profile written before K4V4
existed) gives a valid policy. K4V4 is off by default (``DEFAULT_TAU_LL = 0``); ``tau_LL=K4V4_TAU_LL``
turns it on.

What it knows: numpy arrays in, tags and runs out, under the thresholds of a :class:`PrecisionPolicy`.
What it does not know: torch, models, kernels, how the residuals are computed
(``patchkv_agent.kernels.residual``: ``value_residual_4bit``, ``key_residual_4bit``) or the attention
captured, and whether a threshold suits a model: the built-in defaults were picked on
SmolLM2-135M-Instruct, and calibration replaces them per model.

The measurements behind the defaults: the built-in policy (alpha 0.7, tau_L 1.0, tau_H 8.0, g4 0.15) is the
largest payload cut of ``patchkv-agent bench-transport``'s policy grid on an 8k-token SmolLM2 checkpoint whose
first-token KL cost stays small (237 of 256 blocks K8V4, 18 K8V8, 1 FP16; payload 44.8 % of FP16). The K4V4
thresholds (``K4V4_TAU_LL`` 0.05, ``DEFAULT_G4K`` 0.045, just above SmolLM2's median 4-bit key residual 0.039)
are the K4V4 grid's (``--k4-grid``) largest cut with payload <= 40 % (37.9 %) whose first-token KL stays within
that of FP16. K4V4 is off by default: on the edit-following benchmark it turns 2 of 91 followed answers into
other answers (follow 0.978 against 1.000). The 4-bit value residual on real values: median ~0.083.
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
DEFAULT_TAU_LL = 0.0  # K4V4 off by default: it flips edit-following answers (see the module docstring)
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
            (``kernels.residual.key_residual_4bit`` with the same ``block_size``), or ``None``: no
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

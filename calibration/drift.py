"""Drift labels: how far stale (direct-restored) suffix values are from exact ones, and the oracle window.

Boundary: torch tensors of one old/new version pair in (the per-layer V of an exact prefill of each
version, plus their :class:`~patchkv_agent.core.diff.Edit`), numpy arrays and small dataclasses out. This
module runs no model, knows nothing about engines, checkpoints' storage or plans beyond
:func:`patchkv_agent.core.plan.span_features`.

Definitions (the vocabulary of docs/DESIGN.md section 2):

- token deviation of suffix token ``i``: the value of token ``i`` restored as-is from the old version
  (values never rotate, so "RoPE-corrected old V" is the old V row) against the exact new V row,
  ``1 - cos`` (``metric="cosine"``) or ``||v_old - v_new|| / ||v_new||`` (``metric="rel_l2"``) per KV
  head, averaged over heads and the profiled layers.
- block deviation: per aligned segment (the tokens after one edited span), consecutive blocks of
  ``block_size`` tokens from the segment start; the max (or mean) of the token deviations in the block.
- oracle boundary ``d*`` of a span: the smallest block boundary ``d = j * block_size`` (in tokens from
  the end of the span) such that at least a ``gamma`` share of the blocks starting at or after ``d``
  have deviation ``<= tau_V``; ``d = S_k`` (the whole segment) when no smaller boundary qualifies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from patchkv_agent.core.plan import span_features

__all__ = ["METRICS", "SpanDrift", "token_deviation", "span_drift", "block_deviation", "oracle_boundary",
           "default_profile_layers"]

METRICS = ("cosine", "rel_l2")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[H, N, D]`` view of a per-layer K/V tensor given as ``[H, N, D]`` or ``[1, H, N, D]``."""
    if t.dim() == 4:
        if t.shape[0] != 1:
            raise ValueError(f"expected batch size 1, got a tensor of shape {tuple(t.shape)}")
        return t[0]
    if t.dim() != 3:
        raise ValueError(f"expected a [H, N, D] or [1, H, N, D] tensor, got shape {tuple(t.shape)}")
    return t


def default_profile_layers(num_layers: int) -> tuple[int, ...]:
    """Profiled layers: every layer but layer 0 (whose values depend on the token alone, so never drift).

    Args:
        num_layers: layers of the model.
    Returns:
        ``(1, ..., num_layers - 1)``, or ``(0,)`` for a one-layer model.
    """
    return tuple(range(1, num_layers)) if num_layers > 1 else (0,)


@torch.no_grad()
def token_deviation(old_values: Sequence[torch.Tensor], new_values: Sequence[torch.Tensor],
                    old_positions: np.ndarray, new_positions: np.ndarray, *, layers: Sequence[int],
                    metric: str = "cosine") -> np.ndarray:
    """Per-token deviation of old value rows against new ones, averaged over heads and ``layers``.

    Args:
        old_values: per layer ``[H, N_old, D]`` (or ``[1, H, N_old, D]``) values of the old version.
        new_values: per layer values of the new version, same layout.
        old_positions, new_positions: aligned int arrays: token ``i`` sits at ``old_positions[i]`` in the
            old version and ``new_positions[i]`` in the new one.
        layers: profiled layer indices.
        metric: ``"cosine"`` (``1 - cos``) or ``"rel_l2"``.
    Returns:
        float64 ``[len(positions)]`` deviations (0 = identical).
    Raises:
        ValueError: unknown metric, mismatched positions, empty ``layers`` or a layer out of range.
    """
    if metric not in METRICS:
        raise ValueError(f"unknown deviation metric {metric!r}; choose one of {METRICS}")
    op = np.asarray(old_positions, dtype=np.int64)
    np_ = np.asarray(new_positions, dtype=np.int64)
    if op.shape != np_.shape or op.ndim != 1:
        raise ValueError(f"old_positions and new_positions must be 1-D of one length, got {op.shape} and {np_.shape}")
    if not layers:
        raise ValueError("layers must name at least one profiled layer")
    n_layers = min(len(old_values), len(new_values))
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise ValueError(f"profiled layers {bad} out of range for a {n_layers}-layer model")
    if op.size == 0:
        return np.zeros(0, dtype=np.float64)
    oi, ni = torch.from_numpy(op), torch.from_numpy(np_)
    total = torch.zeros(op.size, dtype=torch.float64)
    for l in layers:
        a = _rows(old_values[l]).index_select(1, oi.to(old_values[l].device)).double().cpu()  # [H, n, D]
        b = _rows(new_values[l]).index_select(1, ni.to(new_values[l].device)).double().cpu()
        if metric == "cosine":
            dev = 1.0 - torch.nn.functional.cosine_similarity(a, b, dim=-1, eps=1e-12)
        else:
            dev = (a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-12)
        total += dev.mean(0)
    return (total / len(layers)).numpy()


@dataclass(frozen=True, kw_only=True)
class SpanDrift:
    """Drift after one edited span: its length features and the token deviations of its segment.

    Attributes:
        prefix_len, edit_len, suffix_len: ``P_k``, ``E_k``, ``S_k`` of :func:`patchkv_agent.core.plan.span_features`.
        deviation: float64 ``[S_k]`` token deviations of the aligned segment after the span, by distance.
    """

    prefix_len: int
    edit_len: int
    suffix_len: int
    deviation: np.ndarray


def span_drift(edit, old_values: Sequence[torch.Tensor], new_values: Sequence[torch.Tensor], *,
               layers: Sequence[int], metric: str = "cosine") -> list[SpanDrift]:
    """Drift after every edited span that is followed by an aligned segment.

    Args:
        edit: :func:`patchkv_agent.core.diff.diff_versions` of the old and new token ids.
        old_values: per layer values of an exact prefill of the old version.
        new_values: per layer values of an exact prefill of the new version.
        layers: profiled layers.
        metric: see :func:`token_deviation`.
    Returns:
        One :class:`SpanDrift` per span with ``S_k > 0``, in new-position order.
    Raises:
        ValueError: as :func:`token_deviation`.
    """
    p, e, s = span_features(edit)
    seg_by_start = {seg.new_start: seg for seg in edit.segments}
    out = []
    for k, sp in enumerate(sorted(edit.spans, key=lambda x: x.new_start)):
        seg = seg_by_start.get(sp.new_end)
        if seg is None or s[k] <= 0:
            continue
        off = np.arange(seg.length, dtype=np.int64)
        dev = token_deviation(old_values, new_values, seg.old_start + off, seg.new_start + off, layers=layers,
                              metric=metric)
        out.append(SpanDrift(prefix_len=int(p[k]), edit_len=int(e[k]), suffix_len=int(s[k]), deviation=dev))
    return out


def block_deviation(deviation: np.ndarray, block_size: int, reduce: str = "max") -> np.ndarray:
    """Per-block deviation of one segment (blocks of ``block_size`` tokens from the segment start).

    Args:
        deviation: token deviations ``[S_k]`` by distance.
        block_size: tokens per block, ``>= 1``.
        reduce: ``"max"`` or ``"mean"`` over the tokens of a block.
    Returns:
        float64 ``[ceil(S_k / block_size)]``.
    Raises:
        ValueError: bad ``block_size`` or ``reduce``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if reduce not in ("max", "mean"):
        raise ValueError(f"reduce must be 'max' or 'mean', got {reduce!r}")
    d = np.asarray(deviation, dtype=np.float64).ravel()
    if d.size == 0:
        return np.zeros(0, dtype=np.float64)
    starts = np.arange(0, d.size, block_size)
    if reduce == "max":
        return np.maximum.reduceat(d, starts)
    return np.add.reduceat(d, starts) / np.diff(np.append(starts, d.size))


def oracle_boundary(block_dev: np.ndarray, *, block_size: int, suffix_len: int, tau_v: float,
                    gamma: float = 1.0) -> int:
    """The oracle dirty-window length ``d*`` of one span (see the module docstring).

    Args:
        block_dev: per-block deviations of the segment, ``[ceil(suffix_len / block_size)]``.
        block_size: tokens per block.
        suffix_len: ``S_k`` (the answer when no smaller boundary qualifies).
        tau_v: deviation threshold.
        gamma: stability coverage in ``(0, 1]``: the share of later blocks that must be ``<= tau_v``.
    Returns:
        ``d*`` in tokens: a multiple of ``block_size`` below ``suffix_len``, or ``suffix_len``.
    Raises:
        ValueError: ``gamma`` outside ``(0, 1]`` or ``block_dev`` of the wrong length.
    """
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    b = np.asarray(block_dev, dtype=np.float64).ravel()
    if b.size != -(-suffix_len // block_size):
        raise ValueError(f"{b.size} block deviations for a {suffix_len}-token segment in blocks of {block_size}")
    if b.size == 0:
        return 0
    ok = (b <= tau_v).astype(np.float64)
    later_ok = np.cumsum(ok[::-1])[::-1]  # blocks j.. that are under tau_v
    later_n = np.arange(b.size, 0, -1, dtype=np.float64)  # blocks j..
    good = later_ok >= gamma * later_n - 1e-9
    j = int(np.argmax(good)) if good.any() else b.size
    return int(min(j * block_size, suffix_len))

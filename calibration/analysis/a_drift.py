"""Figure (a): drift of stale suffix rows by distance from the edit (values, raw keys, RoPE-corrected keys).

Per edited span followed by an aligned segment, by distance from the span in ``bin_size``-token bins, the
cosine similarity against the exact version-1 rows of (i) the stale values, (ii) the stale keys as
stored (rotated for their old positions) and (iii) the stale keys RoPE-corrected by the position shift;
each the mean over layers and KV heads, then over the tokens of the bin. Summary: median and 10-90 %
band over spans per bin. Per-token cosines come from :func:`..drift.span_drift` /
:func:`..drift.token_deviation`; the correction is the kernels' RoPE delta reference.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.diff import Edit
from patchkv_agent.kernels.rope import rope_delta_reference

from ..drift import block_deviation, span_drift, token_deviation
from .inputs import _PCT, _pcts

def _layer_rows(t: torch.Tensor) -> torch.Tensor:
    return t[0] if t.dim() == 4 else t


def corrected_keys(spec, keys: Sequence[torch.Tensor], edit: Edit) -> list[torch.Tensor]:
    """Old keys moved to their new positions: each kept old row rotated by its shift (new - old position).

    Rows the edit drops and rows with zero shift are returned as stored (bit for bit when nothing shifts).

    Args:
        spec: the model's :class:`~patchkv_agent.core.models.ModelSpec` (per-layer RoPE).
        keys: per layer old keys ``[H, N_old, D]`` (or ``[1, H, N_old, D]``), as stored (post-RoPE).
        edit: the diff of the old and new versions.
    Returns:
        Per layer ``[H, N_old, D]`` keys (old row order), in the input dtype.
    Raises:
        ValueError: a row shifts under a RoPE the delta rotation cannot correct (``spec`` says unsupported).
    """
    delta = np.where(edit.old_to_new >= 0, edit.old_to_new - np.arange(edit.old_len, dtype=np.int64), 0)
    shifted = bool(np.any(delta != 0))
    delta_t = torch.from_numpy(delta)
    out = []
    for layer, k in enumerate(keys):
        k = _layer_rows(k)
        rope = spec.rope_for_layer(layer)
        if not shifted or rope.inv_freq is None:
            out.append(k)
            continue
        if not rope.supported:
            raise ValueError(f"layer {layer}: cannot RoPE-correct shifted keys ({rope.reason})")
        out.append(rope_delta_reference(k, delta_t.to(k.device), rope.inv_freq, interleaved=rope.interleaved))
    return out


def _layers(spec, layers: Sequence[int] | None) -> list[int]:
    return list(range(spec.num_layers)) if layers is None else [int(x) for x in layers]


def position_cosines(spec, old_keys, old_values, new_keys, new_values, edit: Edit, old_positions: np.ndarray,
                     new_positions: np.ndarray, *, layers: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Cosine similarity of old rows against new rows at aligned positions (mean over layers and KV heads).

    Args:
        spec: the model spec.
        old_keys, old_values: per layer old K/V (the checkpoint's ``[H, N_old, D]``).
        new_keys, new_values: per layer exact K/V of the new version (``[1, H, N_new, D]`` or ``[H, N_new, D]``).
        edit: the diff (gives each old row's shift for the RoPE correction).
        old_positions, new_positions: aligned int arrays: the same token in the two versions.
        layers: layers averaged over (None: all).
    Returns:
        ``{"value", "key_raw", "key_corrected"}``: float64 ``[len(positions)]`` cosines.
    Raises:
        ValueError: as :func:`.drift.token_deviation` and :func:`corrected_keys`.
    """
    ls = _layers(spec, layers)
    ck = corrected_keys(spec, old_keys, edit)
    old_positions = np.array(old_positions, dtype=np.int64)  # writable copies for torch.from_numpy
    new_positions = np.array(new_positions, dtype=np.int64)
    dev = {"value": token_deviation(old_values, new_values, old_positions, new_positions, layers=ls),
           "key_raw": token_deviation(old_keys, new_keys, old_positions, new_positions, layers=ls),
           "key_corrected": token_deviation(ck, new_keys, old_positions, new_positions, layers=ls)}
    return {k: 1.0 - v for k, v in dev.items()}


def drift_spans(spec, old_keys, old_values, new_keys, new_values, edit: Edit, *, layers: Sequence[int] | None = None,
                bin_size: int = 32) -> list[dict[str, Any]]:
    """Figure (a) for one context: per edited span with a following segment, the binned cosines by distance.

    Args:
        spec: the model spec.
        old_keys, old_values: the version-0 checkpoint's K/V.
        new_keys, new_values: the exact version-1 K/V.
        edit: the diff.
        layers: layers averaged over (None: all).
        bin_size: distance bin in tokens.
    Returns:
        One dict per span: ``P, E, S`` (:func:`patchkv_agent.core.plan.span_features`), ``shift`` (the segment's
        position shift) and, for ``value``, ``key_raw``, ``key_corrected``, the mean cosine per bin
        (``ceil(S / bin_size)`` values, bin ``j`` covering distances ``[j * bin_size, (j + 1) * bin_size)``).
    Raises:
        ValueError: as :func:`position_cosines`.
    """
    ls = _layers(spec, layers)
    ck = corrected_keys(spec, old_keys, edit)
    runs = {"value": span_drift(edit, old_values, new_values, layers=ls),
            "key_raw": span_drift(edit, old_keys, new_keys, layers=ls),
            "key_corrected": span_drift(edit, ck, new_keys, layers=ls)}
    seg_after = {seg.new_start: seg for seg in edit.segments}
    spans = [sp for sp in sorted(edit.spans, key=lambda s: s.new_start) if sp.new_end in seg_after]
    out = []
    for j, sd in enumerate(runs["value"]):
        seg = seg_after[spans[j].new_end]
        row: dict[str, Any] = {"P": sd.prefix_len, "E": sd.edit_len, "S": sd.suffix_len, "shift": int(seg.delta)}
        for name, lst in runs.items():
            row[name] = (1.0 - block_deviation(lst[j].deviation, bin_size, "mean")).tolist()
        out.append(row)
    return out


def summarize_drift(spans: Sequence[dict], bin_size: int) -> dict[str, Any]:
    """Median and 10-90 % band over spans per distance bin.

    Args:
        spans: rows of :func:`drift_spans` (any number of contexts).
        bin_size: their bin size.
    Returns:
        ``{"bin_start": [...], "n_spans": [...], "value"|"key_raw"|"key_corrected": {"p10", "p50", "p90"}}``.
    """
    n_bins = max((len(s["value"]) for s in spans), default=0)
    out: dict[str, Any] = {"bin_start": [j * bin_size for j in range(n_bins)],
                           "n_spans": [sum(len(s["value"]) > j for s in spans) for j in range(n_bins)]}
    for name in ("value", "key_raw", "key_corrected"):
        q = [_pcts([s[name][j] for s in spans if len(s[name]) > j]) for j in range(n_bins)]
        out[name] = {f"p{p}": [row[i] for row in q] for i, p in enumerate(_PCT)}
    return out

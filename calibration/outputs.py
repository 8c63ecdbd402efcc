"""The files of a calibration run: the profile JSON (:func:`write_profile`; read back by
:mod:`patchkv_agent.profiles`), the raw resume rows as JSON Lines (:func:`save_rows`) and the per-token
drift curves as ``.npz`` (:func:`save_drift`).

Boundary: serialization only: takes the profile dict and the profiled pairs that :mod:`.profile`
produced and writes them (parent folders created); computes, selects and validates nothing. No torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from .config import PairProfile

__all__ = ["write_profile", "save_rows", "save_drift"]


def write_profile(profile: dict, path: str | Path) -> Path:
    """Write a profile as indented JSON (parent folders created).

    Args:
        profile: the profile dict (keys starting with ``_`` are dropped).
        path: output file.
    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in profile.items() if not k.startswith("_")}
    path.write_text(json.dumps(clean, indent=1) + "\n", encoding="utf-8")
    return path


def save_rows(profile: dict, path: str | Path) -> Path:
    """Write the raw resume rows of a run (``profile["_rows"]``) as JSON Lines, one row per resume, with a
    ``stage`` field (``window``, ``grid``, ``reference`` or ``precision``), so the selection can be redone offline.

    Args:
        profile: a profile dict from :func:`run_calibration`.
        path: output ``.jsonl``.
    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for stage, rows in (profile.get("_rows") or {}).items():
            for r in rows:
                f.write(json.dumps({"stage": stage, **r}) + "\n")
    return path


def save_drift(pairs: Sequence[PairProfile], path: str | Path, profile: dict | None = None) -> Path:
    """Save the per-token drift curves (for figures) as a compressed ``.npz``.

    Args:
        pairs: profiled pairs.
        path: output ``.npz``.
        profile: optional profile; its ``tau_v``/``gamma``/``drift`` settings are stored alongside.
    Returns:
        The path written. Arrays: ``P, E, S`` per span, ``offsets`` (span ``i`` is
        ``deviation[offsets[i]:offsets[i+1]]``), ``deviation`` (float32), ``pair`` and ``workload`` names,
        ``meta`` (JSON string).
    """
    spans = [(p, sd) for p in pairs for sd in p.spans]
    devs = [sd.deviation.astype(np.float32) for _, sd in spans]
    offsets = np.concatenate([[0], np.cumsum([d.size for d in devs])]).astype(np.int64)
    meta = {k: profile.get(k) for k in ("model", "tau_v", "gamma", "drift")} if profile else {}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, P=np.asarray([sd.prefix_len for _, sd in spans], dtype=np.int64),
        E=np.asarray([sd.edit_len for _, sd in spans], dtype=np.int64),
        S=np.asarray([sd.suffix_len for _, sd in spans], dtype=np.int64), offsets=offsets,
        deviation=np.concatenate(devs) if devs else np.zeros(0, dtype=np.float32),
        pair=np.asarray([p.pair_id for p, _ in spans]), workload=np.asarray([p.workload for p, _ in spans]),
        meta=np.asarray(json.dumps(meta)))
    return path

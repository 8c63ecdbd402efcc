"""Runs of consecutive positions -> the positions: the one helper diff and plan share.

Boundary: numpy only. A run is ``(start, length)``; the diff's aligned segments and the plan's blocks are runs, and
the per-token arrays derived from them (suffix positions, the row lists a KV gather takes) are their expansion.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["expand_runs"]


def expand_runs(starts: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(s, s + n)`` over the runs, in the given order.

    Args:
        starts: first position of each run.
        lengths: tokens per run (``>= 0``; empty runs add nothing), as many as ``starts``.
    Returns:
        int64 ``[sum(lengths)]`` positions (a new, writable array).
    """
    st = np.asarray(starts, dtype=np.int64).ravel()
    ln = np.asarray(lengths, dtype=np.int64).ravel()
    if st.size <= 8:  # few runs (the common edit): one arange each, no index arithmetic over every token
        parts = [np.arange(s, s + n, dtype=np.int64) for s, n in zip(st.tolist(), ln.tolist()) if n > 0]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    first = ln.cumsum() - ln  # (array methods: the np.* wrappers cost a microsecond a call on the resume path)
    return (st - first).repeat(ln) + np.arange(int(ln.sum()), dtype=np.int64)

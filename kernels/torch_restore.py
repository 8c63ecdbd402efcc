"""The optimised torch restore, :func:`torch_dequantize_scatter` (the CPU path when no C compiler is
present).

Boundary: a :class:`~.formats.RunPayload` and destination rows in, decoded and RoPE-shifted rows written
in place; the same result as ``reference.reference_dequantize_scatter`` bit for bit, done in cache-sized
pieces with few fused passes (:func:`_plan`, :func:`_rotate`). The RoPE angle tables
(:func:`_angle_tables`) are shared with the native restore (``native.py``). Knows the decode primitives of
:mod:`.quantizer`; does not know the Triton / native kernels or which path runs (:mod:`.dispatch`); knows
nothing about models, checkpoints or precision policy. The piece sizes (``_PIECE_ELEMS``,
``_MIN_DIRECT_ROWS``, ``_MIN_COPY_ROWS``) are read from this module at call time (tests shrink them).
"""

from __future__ import annotations

import bisect

import numpy as np
import torch

from .formats import FP16, K4V4, RunPayload, V_BITS, check_scatter_args, normalize_tag
from .quantizer import _decode_keys, _decode_values, _float_meta, _key_codes, codes, unpack4
from .reference import reference_dequantize, reference_dequantize_scatter
from .rope import delta_cos_sin, rope_delta_reference

__all__ = ["torch_dequantize_scatter"]

# The torch path of dequantize_scatter works piece by piece, so each piece's intermediates stay in
# cache between its few elementwise passes and the op count per call stays small whatever the run's
# fragmentation. A stretch of at least _MIN_DIRECT_ROWS rows landing on consecutive destination rows
# is decoded and rotated straight into views of the destination, in pieces of at most _PIECE_ELEMS
# elements of [H, rows, D] (2 MiB of fp32); shorter stretches are batched into pieces whose last
# elementwise op writes each stretch's destination rows (no extra copy pass), or, when the
# stretches are very short, into scratch followed by one index_copy_. Angles broadcast when a piece
# has one shift, else come per row from a table.
_PIECE_ELEMS = 1 << 19
_MIN_DIRECT_ROWS = 512
_MIN_COPY_ROWS = 64  # below this mean stretch length a scratch piece is written with index_copy_


def _plan(dst: np.ndarray, delta: np.ndarray | None, max_rows: int, block_size: int) -> list[tuple]:
    """Pieces ``(r0, r1, stretch_starts, one_shift)`` covering run rows ``0..len(dst)`` in order.

    ``stretch_starts`` lists, relative to ``r0``, where runs of consecutive destination rows begin
    (``[0]``: the piece lands on consecutive rows and is written in place); ``one_shift``: the
    piece has a single position shift. Long stretches are cut into near-equal pieces of at most
    ``max_rows`` rows at block boundaries; short ones are grouped up to ``max_rows`` rows.
    """
    r = len(dst)
    min_direct = min(_MIN_DIRECT_ROWS, max_rows)
    brk = (np.flatnonzero(np.diff(dst) != 1) + 1).tolist()
    shift_brk = (np.flatnonzero(np.diff(delta) != 0) + 1).tolist() if delta is not None else []
    spans: list[tuple[int, int, list[int]]] = []
    group: list[int] = []  # stretch starts of the scratch piece being collected
    for s, e in zip([0, *brk], [*brk, r]):
        if e - s < min_direct:
            group.append(s)
            if e - group[0] >= max_rows:
                spans.append((group[0], e, [g - group[0] for g in group]))
                group = []
            continue
        if group:
            spans.append((group[0], s, [g - group[0] for g in group]))
            group = []
        n = -(-(e - s) // max_rows)
        step = -(-(e - s) // n)
        if step > block_size:
            step = -(-step // block_size) * block_size
        spans.extend((a, min(e, a + step), [0]) for a in range(s, e, step))
    if group:
        spans.append((group[0], r, [g - group[0] for g in group]))
    return [(r0, r1, st, not shift_brk or bisect.bisect_right(shift_brk, r0) == bisect.bisect_left(shift_brk, r1))
            for r0, r1, st in spans]


_TRIG: dict = {}  # (frequencies, shifts, layout, device) -> (C, S) tables; the layers of a restore share them


def _angle_tables(shifts: np.ndarray, inv_freq: torch.Tensor, interleaved: bool, dev: torch.device) -> tuple:
    """``(C, S)`` ``[len(shifts), rotary_dim]`` fp32 in the channel layout: ``C = (cos, cos)``,
    ``S = (-sin, sin)`` (interleaved: per pair), with cos/sin exactly as ``rope.delta_cos_sin``."""
    key = (inv_freq.detach().cpu().numpy().tobytes(), inv_freq.dtype, shifts.tobytes(), interleaved, dev)
    hit = _TRIG.get(key)
    if hit is None:
        cos, sin = delta_cos_sin(torch.from_numpy(shifts), inv_freq.to(dev))
        if interleaved:
            hit = torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)
        else:
            hit = torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)
        if len(_TRIG) >= 64:
            _TRIG.clear()
        _TRIG[key] = hit
    return hit


def _rotate(x: torch.Tensor, c: torch.Tensor, s1: torch.Tensor, s2: torch.Tensor, sl: tuple, tmp: torch.Tensor,
            targets: list) -> None:
    """Rotate the first ``rot`` channels of keys ``x`` ``[H, n, D]`` (fp32 scratch, may be
    overwritten) and write rows ``a:b`` to each target ``(a, b, view)`` (any float dtype).

    ``out = x * C + partner(x) * S`` (``C``, ``S`` from :func:`_angle_tables`, one row or one per
    row) gives ``x1 cos - x2 sin`` and ``x2 cos + x1 sin``, rounded exactly as
    ``rope.rope_rotate`` (negating a product is exact). ``sl = (first, second, rot)``: channel
    slices of the pairs' first and second members; ``s1, s2 = S[..., first], S[..., second]``.
    ``tmp``: ``[H, n, rot]``. The final add writes each target directly (no copy pass).
    """
    first, second, rot = sl
    full = rot == x.shape[-1]
    torch.mul(x[..., second], s1, out=tmp[..., first])
    torch.mul(x[..., first], s2, out=tmp[..., second])
    if len(targets) == 1 and targets[0][2].dtype == torch.float32:
        out = targets[0][2]
        if full:
            torch.mul(x, c, out=out).add_(tmp)
        else:
            torch.mul(x[..., :rot], c, out=out[..., :rot]).add_(tmp)
            out[..., rot:].copy_(x[..., rot:])
        return
    xr = x if full else x[..., :rot]
    xr.mul_(c)
    for a, b, view in targets:
        torch.add(xr[:, a:b], tmp[:, a:b], out=view if full else view[..., :rot])
        if not full:
            view[..., rot:].copy_(x[:, a:b, rot:])


def torch_dequantize_scatter(
    payload: RunPayload,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor | None,
    *,
    interleaved: bool = False,
) -> None:
    """Decode a run, rotate its keys by ``delta`` and write it into ``dst[:, dst_rows, :]`` in place.

    The optimised torch path (the CPU path when no C compiler is present): the same result as
    :func:`reference_dequantize_scatter` (decode with :func:`reference_dequantize`, rotate with
    ``rope.rope_delta_reference``, ``index_copy_`` into the destinations), bit for bit; done in
    cache-sized pieces with few fused passes (see ``_plan``).

    Args:
        payload: the run (moved to ``dst_k``'s device if needed).
        dst_k, dst_v: ``[num_kv_heads, N_new, head_dim]``, any float dtype (cast on write).
        dst_rows: int64 ``[R]`` destination rows (any order, not necessarily contiguous).
        delta: int ``[R]`` position shift per row (new minus old position).
        inv_freq: ``[rotary_dim // 2]`` RoPE frequencies, or ``None`` for no RoPE.
        interleaved: RoPE channel pairing (see ``rope.py``).

    Raises:
        ValueError: on mismatched shapes or out-of-range rows (rows on CPU).
    """
    check_scatter_args(payload, dst_k, dst_v, dst_rows, delta, inv_freq)
    r = payload.n_rows
    if r == 0:
        return
    dev, f32 = dst_k.device, torch.float32
    p = payload if payload.k_data.device == dev else payload.to(dev)
    h, d = p.num_kv_heads, p.head_dim
    meta = None if normalize_tag(p.tag) == FP16 else _float_meta(p)
    rows_np = dst_rows.cpu().numpy()
    delta_np = delta.cpu().numpy()
    rotate = inv_freq is not None and bool(delta_np.any())
    pieces = _plan(rows_np, delta_np if rotate else None, max(1, _PIECE_ELEMS // (h * d)), p.block_size)
    n_max = max(pc[1] - pc[0] for pc in pieces)
    if rotate:
        rot = 2 * inv_freq.shape[0]
        half = rot // 2
        sl = (slice(0, rot, 2), slice(1, rot, 2), rot) if interleaved else (slice(0, half), slice(half, rot), rot)
        if all(pc[3] for pc in pieces):
            shifts = np.unique(delta_np[[pc[0] for pc in pieces]])
        else:
            shifts = np.unique(delta_np)
        c_tab, s_tab = _angle_tables(shifts, inv_freq, interleaved, dev)
        angles = {}  # table row -> (C, S[first], S[second]) of a one-shift piece
        xk = torch.empty((h, n_max, d), dtype=f32, device=dev)
        tmp = torch.empty((h, n_max, rot), dtype=f32, device=dev)
    codes = unpack4(p.v_data) if meta is not None and V_BITS[p.tag] == 4 else None  # once per run
    k_codes = _key_codes(p) if meta is not None else None  # K4V4: unpacked once per run
    k_scr = v_scr = None
    for r0, r1, stretches, one_shift in pieces:
        n = r1 - r0
        indexed = len(stretches) > 1 and len(stretches) * _MIN_COPY_ROWS > n
        if indexed or (meta is not None and dst_v.dtype != f32):
            v_scr = torch.empty((h, n_max, d), dtype=f32, device=dev) if v_scr is None else v_scr
        if indexed:  # very short stretches: decode into scratch, then one index_copy_ each
            k_scr = torch.empty((h, n_max, d), dtype=f32, device=dev) if k_scr is None else k_scr
            k_t, v_t = [(0, n, k_scr[:, :n])], [(0, n, v_scr[:, :n])]
        else:  # one target per stretch of consecutive destination rows (one: the piece is direct)
            k_t, v_t = [], []
            for a, b in zip(stretches, [*stretches[1:], n]):
                d0 = int(rows_np[r0 + a])
                k_t.append((a, b, dst_k[:, d0:d0 + b - a]))
                v_t.append((a, b, dst_v[:, d0:d0 + b - a]))
            if meta is not None and len(v_t) > 1:
                v_scr = torch.empty((h, n_max, d), dtype=f32, device=dev) if v_scr is None else v_scr
        if rotate:
            x = xk if n == n_max else xk[:, :n]
            _decode_keys(p, meta, r0, r1, x, k_codes)
            if one_shift:
                u = int(np.searchsorted(shifts, delta_np[r0]))
                if u not in angles:
                    angles[u] = (c_tab[u], s_tab[u, sl[0]], s_tab[u, sl[1]])
                c, s1, s2 = angles[u]
            else:
                u = torch.from_numpy(np.searchsorted(shifts, delta_np[r0:r1])).to(dev)
                c, s = c_tab.index_select(0, u), s_tab.index_select(0, u)
                s1, s2 = s[:, sl[0]], s[:, sl[1]]
            _rotate(x, c, s1, s2, sl, tmp if n == n_max else tmp[:, :n], k_t)
        else:
            for a, b, view in k_t:
                _decode_keys(p, meta, r0 + a, r0 + b, view, k_codes)
        _decode_values(p, meta, r0, r1, v_t, codes, v_scr)
        if indexed:
            idx = dst_rows[r0:r1].to(dev)
            dst_k.index_copy_(1, idx, k_t[0][2].to(dst_k.dtype))
            dst_v.index_copy_(1, idx, v_t[0][2].to(dst_v.dtype))

"""Triton ``dequantize_scatter``: decode a run, RoPE-correct its keys, write rows in place.

Only the ``@triton.jit`` kernel and its thin launcher (check, prepare, launch). Formats live in
``formats.py``, the pure-torch reference in ``reference.py``; the key rotation is exactly
``rope.rope_delta_reference`` (same formula, same fp32 cos/sin from ``rope.delta_cos_sin``, computed in
float64 on the host side once per distinct shift, so large position shifts lose no accuracy). Values
never rotate.

The launcher expects ``delta`` on the CPU (it is read to skip all-zero shifts and to find the
distinct shifts); ``dst_rows`` may live anywhere but is only range-checked on the CPU.
Importing this module imports triton (see ``triton_quantize_gather.py`` for ``TRITON_INTERPRET``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import FP16, K_BITS, V_BITS, RunPayload, check_scatter_args, needs_rotation
from .rope import delta_cos_sin


@triton.jit
def _load_keys(kd_ptr, ks_ptr, kz_ptr, h, r, blk, cols, m, R, D, NB, K_RAW: tl.constexpr, K_BITS: tl.constexpr):
    # keys of run rows r at channels cols ([BLOCK_R, BLOCK_D] each), decoded to fp32
    if K_BITS == 4:  # two codes per byte: channel 2j low nibble, 2j + 1 high
        half_d = D // 2
        byte = tl.load(kd_ptr + h * R * half_d + r[:, None] * half_d + cols // 2, mask=m, other=0)
        x = ((byte.to(tl.int32) >> ((cols % 2) * 4)) & 15).to(tl.float32)
    else:
        x = tl.load(kd_ptr + h * R * D + r[:, None] * D + cols, mask=m, other=0).to(tl.float32)
    if not K_RAW:
        meta = h * NB * D + blk[:, None] * D + cols
        s = tl.load(ks_ptr + meta, mask=m, other=0.0).to(tl.float32)
        z = tl.load(kz_ptr + meta, mask=m, other=0.0).to(tl.float32)
        x = x * s + z
    return x


@triton.jit
def _dequantize_scatter_kernel(
    # pointers
    kd_ptr, vd_ptr,  # payload k, v: [H, R, D] (uint8 / raw float) or [H, R, D // 2] (4-bit packed)
    ks_ptr, kz_ptr,  # ks, kz: [H, NB, D] fp16 (unused when K_RAW)
    vs_ptr, vz_ptr,  # vs, vz: [H, R, NG] fp16 (unused when V_BITS == 16)
    dk_ptr, dv_ptr,  # dst_k, dst_v: [H, N_new, D] any float dtype, any strides
    dst_rows_ptr,  # dst_rows: [R] int64
    didx_ptr,  # didx: [R] int32 row -> index into the cos/sin tables (unused unless ROTATE)
    cos_ptr, sin_ptr,  # cos, sin: [U, HALF] fp32 per distinct shift (unused unless ROTATE)
    # sizes
    R, D, NB, NG, HALF,
    # strides (elements) of the destinations
    stride_dkh, stride_dkn, stride_dkd,
    stride_dvh, stride_dvn, stride_dvd,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # rows per key-scale block of the payload
    BLOCK_R: tl.constexpr,  # run rows per program
    BLOCK_D: tl.constexpr,  # next power of two >= D
    V_GROUP: tl.constexpr,  # value group of the payload
    K_RAW: tl.constexpr,  # keys stored unquantized (FP16 tag)
    V_BITS: tl.constexpr,  # 16 (raw), 8 or 4
    K_BITS: tl.constexpr,  # 16 (raw), 8 or 4
    ROTATE: tl.constexpr,  # apply the RoPE delta rotation to keys
    INTERLEAVED: tl.constexpr,  # pair channels (2i, 2i+1) instead of (i, i + HALF)
):
    h = tl.program_id(1).to(tl.int64)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < R
    d = tl.arange(0, BLOCK_D)
    m = rmask[:, None] & (d < D)[None, :]
    blk = r // BLOCK_SIZE
    dst = tl.load(dst_rows_ptr + r, mask=rmask, other=0)

    # keys: decode, then rotate the first 2 * HALF channels by this row's shift
    k = _load_keys(kd_ptr, ks_ptr, kz_ptr, h, r, blk, d[None, :], m, R, D, NB, K_RAW, K_BITS)
    if ROTATE:
        if INTERLEAVED:
            partner = d ^ 1
            f = d // 2
            first = (d % 2) == 0
        else:
            first = d < HALF
            partner = tl.where(first, d + HALF, d - HALF)
            f = tl.where(first, d, d - HALF)
        in_rot = d < 2 * HALF
        partner = tl.where(in_rot, partner, d)
        kp = _load_keys(kd_ptr, ks_ptr, kz_ptr, h, r, blk, partner[None, :], m, R, D, NB, K_RAW, K_BITS)
        di = tl.load(didx_ptr + r, mask=rmask, other=0)
        cm = m & in_rot[None, :]
        c = tl.load(cos_ptr + di[:, None] * HALF + f[None, :], mask=cm, other=1.0)
        s = tl.load(sin_ptr + di[:, None] * HALF + f[None, :], mask=cm, other=0.0)
        rotated = tl.where(first[None, :], k * c - kp * s, k * c + kp * s)
        k = tl.where(in_rot[None, :], rotated, k)
    kout = dk_ptr + h * stride_dkh + dst[:, None] * stride_dkn + d[None, :] * stride_dkd
    tl.store(kout, k.to(dk_ptr.dtype.element_ty), mask=m)

    # values: decode only
    if V_BITS == 16:
        v = tl.load(vd_ptr + h * R * D + r[:, None] * D + d[None, :], mask=m, other=0).to(tl.float32)
    else:
        if V_BITS == 4:
            half_d = D // 2
            byte = tl.load(vd_ptr + h * R * half_d + r[:, None] * half_d + (d // 2)[None, :], mask=m, other=0)
            q = (byte.to(tl.int32) >> ((d % 2) * 4)[None, :]) & 15
        else:
            q = tl.load(vd_ptr + h * R * D + r[:, None] * D + d[None, :], mask=m, other=0).to(tl.int32)
        meta = h * R * NG + r[:, None] * NG + (d // V_GROUP)[None, :]
        vsc = tl.load(vs_ptr + meta, mask=m, other=0.0).to(tl.float32)
        vze = tl.load(vz_ptr + meta, mask=m, other=0.0).to(tl.float32)
        v = q.to(tl.float32) * vsc + vze
    vout = dv_ptr + h * stride_dvh + dst[:, None] * stride_dvn + d[None, :] * stride_dvd
    tl.store(vout, v.to(dv_ptr.dtype.element_ty), mask=m)


def dequantize_scatter_triton(
    payload: RunPayload,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor | None,
    *,
    interleaved: bool = False,
    block_r: int = 32,
) -> None:
    """Decode ``payload``, rotate keys by ``delta``, write into ``dst[:, dst_rows, :]`` (Triton).

    Args, Raises: as ``torch_restore.torch_dequantize_scatter``; ``block_r``: run rows per program.
    """
    check_scatter_args(payload, dst_k, dst_v, dst_rows, delta, inv_freq)
    r = payload.n_rows
    if r == 0:
        return
    dev = dst_k.device
    p = payload.to(dev, non_blocking=True)
    rows = dst_rows.to(dev, non_blocking=True)
    rotate = needs_rotation(delta, inv_freq)
    if rotate:
        shifts, inverse = torch.unique(delta.cpu(), return_inverse=True)
        cos, sin = delta_cos_sin(shifts, inv_freq.to(dev))
        didx, half = inverse.to(device=dev, dtype=torch.int32), inv_freq.shape[0]
    else:
        cos = sin = didx = rows  # never read
        half = 0
    k_raw = p.tag == FP16
    unused = p.k_data  # stands in for absent scale tensors; never read
    grid = (triton.cdiv(r, block_r), p.num_kv_heads)
    _dequantize_scatter_kernel[grid](
        p.k_data.contiguous(), p.v_data.contiguous(),
        unused if k_raw else p.k_scale.contiguous(), unused if k_raw else p.k_zero.contiguous(),
        unused if k_raw else p.v_scale.contiguous(), unused if k_raw else p.v_zero.contiguous(),
        dst_k, dst_v, rows, didx, cos, sin,
        r, p.head_dim, triton.cdiv(r, p.block_size), triton.cdiv(p.head_dim, p.v_group), half,
        *dst_k.stride(), *dst_v.stride(),
        BLOCK_SIZE=p.block_size, BLOCK_R=block_r, BLOCK_D=max(triton.next_power_of_2(p.head_dim), 2),
        V_GROUP=p.v_group, K_RAW=k_raw, V_BITS=16 if k_raw else V_BITS[p.tag], K_BITS=16 if k_raw else K_BITS[p.tag],
        ROTATE=rotate, INTERLEAVED=interleaved,
    )

"""Triton ``quantize_gather``: gather token rows of one layer and pack them as K8V8 / K8V4 / K4V4.

Only the ``@triton.jit`` kernel and its thin launcher (check, allocate, launch). The format lives in
``formats.py``, the quantizer arithmetic in ``quantizer.py`` and the pure-torch reference in
``reference.py``; the kernel reproduces the reference bit for bit (its divisions are IEEE-rounded,
``div_rn``, and its products are not fused into multiply-adds, as torch's are not). ``FP16`` runs are a plain row gather and use ``index_select``.

Importing this module imports triton; under ``TRITON_INTERPRET=1`` (set before the import) the
kernel runs on CPU tensors, which is how the tests exercise it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import FP16, K_BITS, V_BITS, RunPayload, check_quantize_args, effective_v_group

_REL = 2.0**-10
_TINY = 2.0**-24


@triton.jit
def _scale_zero(mn, mx, QMAX: tl.constexpr):
    # fp16-representable (scale, zero) covering [mn, mx], returned as fp32; mirrors quantizer.scale_zero
    z = (mn - tl.abs(mn) * 0.0009765625 - 5.960464477539063e-08).to(tl.float16).to(tl.float32)
    # IEEE-rounded division (div_rn): a plain `/` compiles to an approximate division (or a multiply by the
    # reciprocal of a constant) on the GPU, and the codes then differ from the torch reference's by one
    s = (tl.div_rn(mx - z, mx * 0.0 + QMAX) * 1.0009765625 + 5.960464477539063e-08).to(tl.float16).to(tl.float32)
    return s, z


@triton.jit
def _codes(x, s, z, QMAX: tl.constexpr):
    q = tl.floor(tl.div_rn(x - z, s) + 0.5)
    return tl.minimum(tl.maximum(q, 0.0), QMAX)


@triton.jit
def _quantize_gather_kernel(
    # pointers
    k_ptr, v_ptr,  # k, v: [H, N, D] source rows, any float dtype, any strides
    rows_ptr,  # rows: [R] int64 source row of each run row
    kq_ptr,  # kq: [H, R, D] uint8 key codes (K_BITS 8) or [H, R, D // 2] packed (K_BITS 4)
    ks_ptr, kz_ptr,  # ks, kz: [H, NB, D] fp16 key scale / zero (per block, per channel)
    vq_ptr,  # vq: [H, R, D] uint8 value codes (V_BITS 8) or [H, R, D // 2] packed (V_BITS 4)
    vs_ptr, vz_ptr,  # vs, vz: [H, R, NG] fp16 value scale / zero (per token, per group)
    # sizes
    R, D, NB, NG,
    # strides (elements) of the sources
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    # meta-parameters
    BLOCK_SIZE: tl.constexpr,  # rows per key-scale block
    BLOCK_R: tl.constexpr,  # next power of two >= BLOCK_SIZE
    BLOCK_D: tl.constexpr,  # next power of two >= D
    V_GROUP: tl.constexpr,  # value group (power of two <= BLOCK_D)
    V_BITS: tl.constexpr,  # 8 or 4
    K_BITS: tl.constexpr,  # 8 or 4
):
    blk = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BLOCK_R)
    r = blk * BLOCK_SIZE + i  # run rows of this block
    rmask = (i < BLOCK_SIZE) & (r < R)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    m = rmask[:, None] & dmask[None, :]
    src = tl.load(rows_ptr + r, mask=rmask, other=0)

    # keys: K_BITS bit, one (scale, zero) per channel over the block's rows
    KQMAX: tl.constexpr = (1 << K_BITS) - 1
    x = tl.load(k_ptr + h * stride_kh + src[:, None] * stride_kn + d[None, :] * stride_kd, mask=m, other=0.0)
    x = x.to(tl.float32)
    mn = tl.where(dmask, tl.min(tl.where(m, x, float("inf")), axis=0), 0.0)
    mx = tl.where(dmask, tl.max(tl.where(m, x, float("-inf")), axis=0), 0.0)
    s, z = _scale_zero(mn, mx, KQMAX)
    q = _codes(x, s[None, :], z[None, :], KQMAX)
    out = h * R * D + r[:, None] * D + d[None, :]
    if K_BITS == 4:  # channel 2j low nibble, 2j + 1 high, as the values
        klo, khi = tl.split(tl.reshape(q.to(tl.int32), (BLOCK_R, BLOCK_D // 2, 2)))
        kj = tl.arange(0, BLOCK_D // 2)
        khalf = D // 2
        kout = h * R * khalf + r[:, None] * khalf + kj[None, :]
        tl.store(kq_ptr + kout, (klo | (khi << 4)).to(tl.uint8), mask=rmask[:, None] & (kj[None, :] < khalf))
    else:
        tl.store(kq_ptr + out, q.to(tl.uint8), mask=m)
    meta = h * NB * D + blk * D + d
    tl.store(ks_ptr + meta, s.to(tl.float16), mask=dmask)
    tl.store(kz_ptr + meta, z.to(tl.float16), mask=dmask)

    # values: one (scale, zero) per row and group of V_GROUP channels (last group may be short)
    QMAX: tl.constexpr = (1 << V_BITS) - 1
    NGP: tl.constexpr = BLOCK_D // V_GROUP
    y = tl.load(v_ptr + h * stride_vh + src[:, None] * stride_vn + d[None, :] * stride_vd, mask=m, other=0.0)
    y = y.to(tl.float32)
    g = tl.arange(0, NGP)
    gmask = rmask[:, None] & (g[None, :] < NG)
    vmn = tl.min(tl.reshape(tl.where(m, y, float("inf")), (BLOCK_R, NGP, V_GROUP)), axis=2)
    vmx = tl.max(tl.reshape(tl.where(m, y, float("-inf")), (BLOCK_R, NGP, V_GROUP)), axis=2)
    vs, vz = _scale_zero(tl.where(gmask, vmn, 0.0), tl.where(gmask, vmx, 0.0), QMAX)
    vq = _codes(tl.reshape(y, (BLOCK_R, NGP, V_GROUP)), vs[:, :, None], vz[:, :, None], QMAX)
    vq = tl.reshape(vq, (BLOCK_R, BLOCK_D)).to(tl.int32)
    gout = h * R * NG + r[:, None] * NG + g[None, :]
    tl.store(vs_ptr + gout, vs.to(tl.float16), mask=gmask)
    tl.store(vz_ptr + gout, vz.to(tl.float16), mask=gmask)
    if V_BITS == 4:
        lo, hi = tl.split(tl.reshape(vq, (BLOCK_R, BLOCK_D // 2, 2)))
        j = tl.arange(0, BLOCK_D // 2)
        half_d = D // 2
        pout = h * R * half_d + r[:, None] * half_d + j[None, :]
        tl.store(vq_ptr + pout, (lo | (hi << 4)).to(tl.uint8), mask=rmask[:, None] & (j[None, :] < half_d))
    else:
        tl.store(vq_ptr + out, vq.to(tl.uint8), mask=m)


def quantize_gather_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    tag: object,
    block_size: int = 32,
    v_group: int = 32,
) -> RunPayload:
    """Gather ``rows`` and encode them as one run with the Triton kernel.

    Args, Returns, Raises: as ``reference.reference_quantize_gather`` (same payload, same device).
    """
    tag = check_quantize_args(k, v, rows, tag, block_size, v_group)
    h, _, d = k.shape
    group = effective_v_group(d, v_group)
    rows = rows.to(k.device)
    r = rows.numel()
    meta = dict(tag=tag, n_rows=r, num_kv_heads=h, head_dim=d, block_size=block_size, v_group=group)
    if tag == FP16:
        kr, vr = k.index_select(1, rows).contiguous(), v.index_select(1, rows).contiguous()
        return RunPayload(**meta, k_data=kr, v_data=vr)
    nb, ng = triton.cdiv(r, block_size), triton.cdiv(d, group)
    u8, f16 = dict(dtype=torch.uint8, device=k.device), dict(dtype=torch.float16, device=k.device)
    kq = torch.empty(h, r, d // 2 if K_BITS[tag] == 4 else d, **u8)
    ks, kz = torch.empty(h, nb, d, **f16), torch.empty(h, nb, d, **f16)
    vq = torch.empty(h, r, d // 2 if V_BITS[tag] == 4 else d, **u8)
    vs, vz = torch.empty(h, r, ng, **f16), torch.empty(h, r, ng, **f16)
    if r:
        block_d = max(triton.next_power_of_2(d), 2)
        _quantize_gather_kernel[(nb, h)](
            k, v, rows, kq, ks, kz, vq, vs, vz,
            r, d, nb, ng,
            *k.stride(), *v.stride(),
            BLOCK_SIZE=block_size, BLOCK_R=triton.next_power_of_2(block_size), BLOCK_D=block_d,
            V_GROUP=group, V_BITS=V_BITS[tag], K_BITS=K_BITS[tag],
            enable_fp_fusion=False,  # no fused multiply-adds: each product rounds as the torch reference's does
        )
    return RunPayload(**meta, k_data=kq, v_data=vq, k_scale=ks, k_zero=kz, v_scale=vs, v_zero=vz)

"""The element arithmetic of the quantized formats, in torch: the quantizer (fp16 scale and zero, codes),
key / value quantization over their groups, 4-bit packing, and the decode primitives that the reference
decode (:mod:`.reference`) and the optimised torch restore (:mod:`.quant`) share.

Boundary: codes and scales in, codes and scales (or decoded fp32 rows) out. Knows the format layouts of
:mod:`.formats`; does not know how rows are gathered into a run, RoPE, destinations or which restore
path runs; knows nothing about models, checkpoints or precision policy. The Triton kernels
(``triton_quantize_gather.py`` / ``triton_dequantize_scatter.py``) and ``native.c`` mirror this arithmetic.

Quantizer (keys and values alike): asymmetric, unsigned codes ``q in [0, qmax]`` with an fp16
scale ``s`` and fp16 zero ``z`` per group, ``x_hat = q * s + z`` (in fp32)::

    z = fp16(min - |min| * 2^-10 - 2^-24)          # rounds to a value <= min
    s = fp16(((max - z) / qmax) * (1 + 2^-10) + 2^-24)   # rounds to a value >= (max - z) / qmax
    q = clamp(floor((x - z) / s + 0.5), 0, qmax)

The nudges make the stored fp16 ``z`` and ``s`` cover ``[min, max]``, so clamping never bites and
the error bound holds against the *stored* scale:  ``|x - x_hat| <= s / 2`` per element (plus
fp32 rounding, ~1e-7 relative to ``|x|``), with ``s ~= (max - min) / qmax``. Inputs must be finite
and within fp16 range (|x| < 6e4).

Groups:
- keys: **per channel over the block's tokens** (KIVI), one ``(s, z)`` per (head, block, channel).
- values: **per token**, groups of ``v_group`` (default 32, a power of two) consecutive channels;
  the last group is shorter when ``head_dim`` is not a multiple (head_dim 80: 32 + 32 + 16).

Keys are scaled per channel, not per token, because key outliers live in fixed channels: a per-token
range is set by the outlier channel and crushes every other channel of the token. On SmolLM2's cached
keys (8 bit, block 32) the relative error is 0.0022 per channel against 0.0080 per token; the 4-bit value
residual is ~0.08 (median). ``test_kernels`` re-checks the per-channel/per-token ordering on synthetic keys
with outlier channels.
"""

from __future__ import annotations

import sys

import torch

from .formats import K_BITS, V_BITS, RunPayload

_REL = 2.0**-10  # > fp16 relative rounding error (2^-11)
_TINY = 2.0**-24  # smallest fp16 subnormal


# ---------------------------------------------------------------------------- quantizer


def scale_zero(mn: torch.Tensor, mx: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 ``(scale, zero)`` covering ``[mn, mx]`` (see the module docstring for the nudges)."""
    mn, mx = mn.float(), mx.float()
    z = (mn - mn.abs() * _REL - _TINY).half()
    s = ((mx - z.float()) / qmax * (1.0 + _REL) + _TINY).half()
    return s, z


def codes(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, qmax: int) -> torch.Tensor:
    """uint8 codes of ``x`` (fp32) under broadcastable fp16 ``s, z``."""
    q = torch.floor((x - z.float()) / s.float() + 0.5)
    return q.clamp_(0, qmax).to(torch.uint8)


def _pad_to(x: torch.Tensor, dim: int, size: int, value: float) -> torch.Tensor:
    extra = size - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, x.new_full(shape, value)], dim=dim)


def quantize_keys(k: torch.Tensor, block_size: int, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys quantized per channel over each block of rows.

    Args:
        k: ``[H, R, D]`` keys, any float dtype.
        block_size: rows per block (the last block may be partial).
        bits: 8 or 4 (``qmax`` 255 or 15).

    Returns:
        ``(codes, scale, zero)``: uint8 ``[H, R, D]`` codes (unpacked), fp16 ``[H, NB, D]`` each.
    """
    h, r, d = k.shape
    qmax = (1 << bits) - 1
    nb = -(-r // block_size)
    bs = min(block_size, max(r, 1))  # a block past the run's rows is one block of its rows: pad no further
    x = k.float()
    mn = _pad_to(x, 1, nb * bs, float("inf")).view(h, nb, bs, d).amin(2)
    mx = _pad_to(x, 1, nb * bs, float("-inf")).view(h, nb, bs, d).amax(2)
    s, z = scale_zero(mn, mx, qmax)
    blk = torch.arange(r, device=k.device) // block_size
    return codes(x, s[:, blk], z[:, blk], qmax), s, z


def quantize_values(v: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token group quantization. ``v: [..., R, D]`` -> codes ``[..., R, D]``, scale/zero ``[..., R, NG]``."""
    d = v.shape[-1]
    ng = -(-d // group)
    qmax = (1 << bits) - 1
    x = v.float()
    mn = _pad_to(x, -1, ng * group, float("inf")).unflatten(-1, (ng, group)).amin(-1)
    mx = _pad_to(x, -1, ng * group, float("-inf")).unflatten(-1, (ng, group)).amax(-1)
    s, z = scale_zero(mn, mx, qmax)
    gid = torch.arange(d, device=v.device) // group
    return codes(x, s[..., gid], z[..., gid], qmax), s, z


def pack4(q: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes ``[..., D]`` (D even) two per byte: channel 2j low nibble, 2j+1 high."""
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack4`: ``[..., D // 2]`` -> ``[..., D]`` codes (a new contiguous tensor).

    On little-endian hosts each byte is widened to int16 and rebuilt as ``lo | hi << 8``, whose two
    bytes are the codes in channel order: five vectorized passes instead of an interleaving copy.
    """
    if sys.byteorder != "little" or p.numel() == 0:
        return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)
    w = p.to(torch.int16)
    hi = torch.bitwise_left_shift(w, 4).bitwise_and_(0x0F00)
    return w.bitwise_and_(15).bitwise_or_(hi).view(torch.uint8)


# ---------------------------------------------------------------------------- decode


def _float_meta(p: RunPayload) -> tuple:
    """fp32 scales and zeros of a quantized run, shaped to broadcast: ``(k_scale, k_zero)``
    ``[H, NB, 1, D]``; ``(v_scale, v_zero)`` ``[H, R, NG, 1]``, or ``[H, R, D]`` (expanded per
    channel, ``gid`` non-None) when head_dim is not a multiple of the value group."""
    gid = None
    vs, vz = p.v_scale.float(), p.v_zero.float()
    if p.head_dim % p.v_group:
        gid = torch.arange(p.head_dim, device=p.v_scale.device) // p.v_group
        vs, vz = vs[..., gid], vz[..., gid]
    else:
        vs, vz = vs[..., None], vz[..., None]
    return p.k_scale.float()[:, :, None], p.k_zero.float()[:, :, None], vs, vz, gid


# Decoding is ``x_hat = q * s + z`` in fp32 with the product rounded before the add. The product of
# an 8-bit (or 4-bit) code and an fp16 scale has at most 8 + 11 significant bits, so it is exact in fp32: a
# fused multiply-add (``torch.addcmul`` may use one) gives the same bits as the two-step formula
# that the Triton kernel evaluates.


def _key_codes(p: RunPayload) -> torch.Tensor:
    """The run's key codes ``[H, R, D]`` (``K4V4``: unpacked, a new tensor; else ``k_data`` itself)."""
    return unpack4(p.k_data) if K_BITS[p.tag] == 4 else p.k_data


def _decode_keys(p: RunPayload, meta: tuple | None, r0: int, r1: int, out: torch.Tensor,
                 codes: torch.Tensor | None = None) -> None:
    """Keys of payload rows ``r0:r1`` decoded into ``out`` ``[H, r1 - r0, D]`` (cast to its dtype).

    Quantized keys take one ``addcmul`` per stretch of whole blocks (scales broadcast over the
    block's rows) plus one per partial block at either end. ``codes``: the run's key codes from
    :func:`_key_codes` when at hand (else taken here: 4-bit keys are then unpacked whole).
    """
    if meta is None:
        out.copy_(p.k_data[:, r0:r1])
        return
    ks, kz = meta[0], meta[1]  # [H, NB, 1, D]
    q, bs = (_key_codes(p) if codes is None else codes), p.block_size
    a = r0
    while a < r1:
        b = a // bs
        if a % bs == 0 and r1 - a >= bs:
            nb = (r1 - a) // bs
            e = a + nb * bs
            shape = (q.shape[0], nb, bs, q.shape[2])
            o = out if e - a == out.shape[1] else out[:, a - r0:e - r0]
            torch.addcmul(kz[:, b:b + nb], q[:, a:e].view(shape), ks[:, b:b + nb], out=o.view(shape))
        else:
            e = min(r1, (b + 1) * bs)
            torch.addcmul(kz[:, b], q[:, a:e], ks[:, b], out=out[:, a - r0:e - r0])
        a = e


def _decode_values(p: RunPayload, meta: tuple | None, r0: int, r1: int, targets: list,
                   codes: torch.Tensor | None = None, scratch: torch.Tensor | None = None) -> None:
    """Values of payload rows ``r0:r1`` decoded into ``targets``: ``(a, b, view)`` puts rows
    ``r0 + a : r0 + b`` into ``view`` ``[H, b - a, D]`` (any float dtype, cast on write).

    ``codes``: the run's unpacked 4-bit codes when at hand; ``scratch``: fp32 ``[H, >= r1 - r0, D]``,
    needed unless there is one fp32 target (the final add then writes each target directly).
    """
    v = p.v_data[:, r0:r1]
    if meta is None:
        for a, b, view in targets:
            view.copy_(v[:, a:b])
        return
    vs, vz = meta[2][:, r0:r1], meta[3][:, r0:r1]
    if V_BITS[p.tag] == 4:
        q = unpack4(v) if codes is None else codes[:, r0:r1]
    else:
        q = v
    n, grouped = r1 - r0, meta[4] is None
    shape = (q.shape[0], n, vs.shape[2], p.v_group) if grouped else q.shape
    if len(targets) == 1 and targets[0][2].dtype == torch.float32:
        torch.mul(q.view(shape), vs, out=targets[0][2].view(shape)).add_(vz)
        return
    o = scratch[:, :n]
    torch.mul(q.view(shape), vs, out=o.view(shape))
    for a, b, view in targets:  # scales and zeros broadcast over the channels of each group
        part = (shape[0], b - a, *shape[2:])
        torch.add(o[:, a:b].view(part), vz[:, a:b], out=view.view(part))

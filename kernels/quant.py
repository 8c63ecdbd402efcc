"""KV transport formats, the run payload, the naive pure-torch references (the oracles of every other
path: ``reference_*``) and the optimised torch restore (``torch_dequantize_scatter``, the CPU path when
no C compiler is present).

Knows nothing about models, checkpoints or precision policy: one layer's ``k, v`` of shape
``[num_kv_heads, N, head_dim]`` (batch squeezed, any float dtype) in, a :class:`RunPayload` out,
and back. The Triton kernels in ``triton_quantize_gather.py`` / ``triton_dequantize_scatter.py``
must agree with the functions here (bit-exact codes under the Triton interpreter), and so must the
native kernels of ``native.c`` (bit for bit); ``dispatch.py`` picks the path.

Formats (a *run* is ``n_rows`` token rows cut into blocks of ``block_size`` rows; the last block
may be partial):

- ``FP16``: "full precision". Rows are stored in the *source dtype as given* (fp32 on a CPU fp32
  model, fp16/bf16 on GPU), so on fp32 models ``FP16`` means "unquantized". Round trip is bit-exact.
- ``K8V8``: keys 8 bit, values 8 bit. ``K8V4``: keys 8 bit, values 4 bit packed two per byte
  (channel ``2j`` in the low nibble, ``2j + 1`` in the high nibble; ``head_dim`` must be even).
- ``K4V4``: keys 4 bit (the same per-channel-over-block groups and quantizer as ``K8*`` with
  ``qmax = 15``), packed two per byte along channels exactly as the 4-bit values are; values as
  ``K8V4``. ``head_dim`` must be even.

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
range is set by the outlier channel and crushes every other channel of the token. The errors measured
when the formats were chosen (per-channel vs per-token keys, round trips, the 4-bit value residual on
SmolLM2) are in docs/RESULTS.md (section "Transport formats"); ``test_kernels`` re-checks the
per-channel/per-token ordering on synthetic keys with outlier channels.

Bytes per (K, V) element pair, metadata included: FP16 4 (fp16/bf16 source; 8 for fp32),
K8V8 2.25, K8V4 1.75, K4V4 1.25 = 0.5 + 0.125 + 0.5 + 0.125 (head_dim 80: 2.275 / 1.775 / 1.275);
i.e. 56 %, 44 % and 31 % of fp16. Metadata: keys 4 B per (channel, block) = 1/8 B per element at
block 32; values 4 B per group = 1/8 B per element at group 32.
"""

from __future__ import annotations

import bisect
import dataclasses
import sys

import numpy as np
import torch

from .rope import delta_cos_sin, rope_delta_reference

FP16 = "FP16"
K8V8 = "K8V8"
K8V4 = "K8V4"
K4V4 = "K4V4"
FORMATS = (K4V4, K8V4, K8V8, FP16)  # ascending precision; precision.Tag uses the same names and order
K_BITS = {K8V8: 8, K8V4: 8, K4V4: 4}  # key bits of the quantized formats
V_BITS = {K8V8: 8, K8V4: 4, K4V4: 4}  # value bits of the quantized formats
DEFAULT_BLOCK_SIZE = 32
DEFAULT_V_GROUP = 32

_REL = 2.0**-10  # > fp16 relative rounding error (2^-11)
_TINY = 2.0**-24  # smallest fp16 subnormal


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPayload:
    """One run of rows of one layer, quantized (or raw, for ``FP16``).

    Shapes (``H`` heads, ``R = n_rows``, ``D = head_dim``, ``NB = ceil(R / block_size)``,
    ``NG = ceil(D / v_group)``):

    - ``FP16``: ``k_data, v_data: [H, R, D]`` in the source dtype; no scales.
    - ``K8V8``: ``k_data: [H, R, D] uint8``, ``k_scale, k_zero: [H, NB, D] fp16``;
      ``v_data: [H, R, D] uint8``, ``v_scale, v_zero: [H, R, NG] fp16``.
    - ``K8V4``: as ``K8V8`` except ``v_data: [H, R, D // 2] uint8`` (two codes per byte).
    - ``K4V4``: as ``K8V4`` except ``k_data: [H, R, D // 2] uint8`` (two 4-bit key codes per byte,
      channel ``2j`` low nibble, ``2j + 1`` high); ``k_scale, k_zero`` still ``[H, NB, D]``.
    """

    tag: str
    n_rows: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    v_group: int
    k_data: torch.Tensor
    v_data: torch.Tensor
    k_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by field name (``None`` fields omitted), e.g. to checksum or save."""
        names = ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def nbytes(self) -> int:
        """Exact bytes of tensor data held (payload + scales + zeros)."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> "RunPayload":
        """A copy with every tensor on ``device`` (``non_blocking`` for pinned host memory)."""
        moved = {n: t.to(device, non_blocking=non_blocking) for n, t in self.tensors().items()}
        return dataclasses.replace(self, **moved)

    def pin_memory(self) -> "RunPayload":
        """A copy in pinned host memory (for non-blocking host-to-device copies)."""
        return dataclasses.replace(self, **{n: t.pin_memory() for n, t in self.tensors().items()})


# ---------------------------------------------------------------------------- validation


def normalize_tag(tag: object) -> str:
    """The format name of ``tag``: a name of :data:`FORMATS` (``"K4V4"``, ``"K8V4"``, ...) or any
    enum whose ``name`` is one (``precision.Tag``).

    Raises:
        ValueError: the tag names no format.
    """
    name = getattr(tag, "name", tag)
    if name not in FORMATS:
        raise ValueError(f"unknown precision tag {tag!r}; expected one of {FORMATS}")
    return name


def check_quantize_args(k, v, rows, tag, block_size, v_group) -> str:
    """Shared argument checks of both quantize paths; returns the normalized tag."""
    tag = normalize_tag(tag)
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"k, v must both be [num_kv_heads, N, head_dim], got {tuple(k.shape)}, {tuple(v.shape)}")
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"k, v must be float tensors, got {k.dtype}, {v.dtype}")
    if rows.dim() != 1 or rows.dtype != torch.int64:
        raise ValueError(f"rows must be int64 [R], got {rows.dtype} {tuple(rows.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if v_group < 1 or v_group & (v_group - 1):
        raise ValueError(f"v_group must be a power of two, got {v_group}")
    if tag in (K8V4, K4V4) and k.shape[-1] % 2:
        raise ValueError(f"{tag} packs two 4-bit codes per byte and needs an even head_dim, got {k.shape[-1]}; "
                         "use K8V8 or FP16 for odd head dims")
    if rows.numel() and rows.device.type == "cpu":
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= k.shape[1]:
            raise ValueError(f"rows span [{lo}, {hi}] outside [0, {k.shape[1]})")
    return tag


def _int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_payload(p: RunPayload) -> str:
    """Check that a run's header and tensors agree (the shapes of :class:`RunPayload`), so no restore path
    reads past a tensor or decodes one format's bytes as another's; returns the normalized tag.

    Raises:
        ValueError: naming the first disagreement ("payload ..."); the torch and native paths raise the same.
    """
    try:
        tag = normalize_tag(p.tag)
    except ValueError as e:
        raise ValueError(f"payload: {e}") from None
    h, r, d, bs, g = p.num_kv_heads, p.n_rows, p.head_dim, p.block_size, p.v_group
    if not all(_int(x) for x in (h, r, d, bs, g)) or not (0 < h < 2**31 and 0 < d < 2**31 and 0 <= r < 2**62):
        raise ValueError(f"payload header is out of range (heads {h}, rows {r}, head_dim {d})")
    if not (0 < bs < 2**31 and 0 < g < 2**31) or g & (g - 1):
        raise ValueError(f"payload block size {bs} or value group {g} is invalid (need >= 1; the group a power of two)")
    if tag == FP16:
        want = {"k_data": ((h, r, d), None), "v_data": ((h, r, d), None)}
    else:
        if (K_BITS[tag] == 4 or V_BITS[tag] == 4) and d % 2:
            raise ValueError(f"payload of format {tag} has an odd head_dim {d}")
        nb, ng, u8, f16 = -(-r // bs), -(-d // g), torch.uint8, torch.float16
        want = {"k_data": ((h, r, d // (8 // K_BITS[tag])), u8), "v_data": ((h, r, d // (8 // V_BITS[tag])), u8),
                "k_scale": ((h, nb, d), f16), "k_zero": ((h, nb, d), f16),
                "v_scale": ((h, r, ng), f16), "v_zero": ((h, r, ng), f16)}
    for name, (shape, dtype) in want.items():
        t = getattr(p, name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"payload of format {tag} lacks its {name} tensor")
        if tuple(t.shape) != shape or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"payload {name} is {t.dtype} {tuple(t.shape)}; a {tag} run of {r} rows, {h} heads, "
                             f"head_dim {d} needs {dtype or 'a float dtype'} {shape}")
    if tag == FP16 and (not p.k_data.is_floating_point() or p.v_data.dtype != p.k_data.dtype):
        raise ValueError(f"payload FP16 data must be one float dtype, got {p.k_data.dtype}, {p.v_data.dtype}")
    return tag


def check_scatter_args(payload, dst_k, dst_v, dst_rows, delta, inv_freq) -> None:
    """Shared argument checks of both dequantize paths (the payload's own consistency included)."""
    check_payload(payload)
    check_destination(payload.num_kv_heads, payload.head_dim, payload.n_rows, dst_k, dst_v, dst_rows, delta, inv_freq)


def check_destination(h, d, r, dst_k, dst_v, dst_rows, delta, inv_freq) -> None:
    """The destination checks of :func:`check_scatter_args`: ``r`` rows of ``h`` heads x ``d`` channels."""
    for name, t in (("dst_k", dst_k), ("dst_v", dst_v)):
        if t.dim() != 3 or t.shape[0] != h or t.shape[2] != d:
            raise ValueError(f"{name} must be [{h}, N_new, {d}] to take this payload, got {tuple(t.shape)}")
    if dst_k.shape != dst_v.shape:
        raise ValueError(f"dst_k {tuple(dst_k.shape)} and dst_v {tuple(dst_v.shape)} differ")
    if dst_rows.shape != (r,) or dst_rows.dtype != torch.int64:
        raise ValueError(f"dst_rows must be int64 [{r}], got {dst_rows.dtype} {tuple(dst_rows.shape)}")
    if delta.shape != (r,) or delta.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"delta must be int [{r}], got {delta.dtype} {tuple(delta.shape)}")
    if inv_freq is not None and (inv_freq.dim() != 1 or 2 * inv_freq.shape[0] > d):
        raise ValueError(f"inv_freq must be [rotary_dim // 2] with rotary_dim <= {d}, got {tuple(inv_freq.shape)}")
    if r and dst_rows.device.type == "cpu":
        lo, hi = (int(x) for x in torch.aminmax(dst_rows))
        if lo < 0 or hi >= dst_k.shape[1]:
            raise ValueError(f"dst_rows span [{lo}, {hi}] outside [0, {dst_k.shape[1]})")


def needs_rotation(delta: torch.Tensor, inv_freq: torch.Tensor | None) -> bool:
    """False when there is no RoPE or every shift is zero (then keys are copied unrotated)."""
    return inv_freq is not None and delta.numel() > 0 and bool((delta != 0).any())


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
    x = k.float()
    mn = _pad_to(x, 1, nb * block_size, float("inf")).view(h, nb, block_size, d).amin(2)
    mx = _pad_to(x, 1, nb * block_size, float("-inf")).view(h, nb, block_size, d).amax(2)
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


def effective_v_group(head_dim: int, v_group: int) -> int:
    """The value group actually used: ``v_group`` clipped to the next power of two >= head_dim."""
    return min(v_group, 1 << max(head_dim - 1, 0).bit_length())


# ---------------------------------------------------------------------------- references


def reference_quantize_gather(
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    tag: object,
    block_size: int = DEFAULT_BLOCK_SIZE,
    v_group: int = DEFAULT_V_GROUP,
) -> RunPayload:
    """Gather ``rows`` of one layer and encode them as one run (the torch reference).

    Args:
        k, v: ``[num_kv_heads, N, head_dim]``, any float dtype, same shape.
        rows: int64 ``[R]`` source row indices (R may be 0 or not a multiple of ``block_size``).
        tag: ``"FP16"``, ``"K8V8"``, ``"K8V4"``, ``"K4V4"`` (or ``precision.Tag``).
        block_size: rows per key-scale block.
        v_group: value group size along head_dim (power of two).

    Returns:
        A :class:`RunPayload` on ``k``'s device.

    Raises:
        ValueError: on bad shapes, dtypes, tag or out-of-range rows (rows on CPU).
    """
    tag = check_quantize_args(k, v, rows, tag, block_size, v_group)
    h, _, d = k.shape
    group = effective_v_group(d, v_group)
    rows = rows.to(k.device)
    kr, vr = k.index_select(1, rows), v.index_select(1, rows)
    meta = dict(tag=tag, n_rows=rows.numel(), num_kv_heads=h, head_dim=d, block_size=block_size, v_group=group)
    if tag == FP16:
        return RunPayload(**meta, k_data=kr.contiguous(), v_data=vr.contiguous())
    kq, ks, kz = quantize_keys(kr, block_size, K_BITS[tag])
    vq, vs, vz = quantize_values(vr, V_BITS[tag], group)
    if K_BITS[tag] == 4:
        kq = pack4(kq)
    if V_BITS[tag] == 4:
        vq = pack4(vq)
    return RunPayload(**meta, k_data=kq, v_data=vq, k_scale=ks, k_zero=kz, v_scale=vs, v_zero=vz)


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


def reference_dequantize(payload: RunPayload) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a run to ``(k, v)`` float32 ``[H, R, D]`` (``FP16``: the stored values, widened).

    Raises:
        ValueError: if the tag is unknown.
    """
    p = payload
    if normalize_tag(p.tag) == FP16:
        return p.k_data.float(), p.v_data.float()
    shape = (p.num_kv_heads, p.n_rows, p.head_dim)
    k = torch.empty(shape, dtype=torch.float32, device=p.k_data.device)
    v = torch.empty_like(k)
    meta = _float_meta(p)
    _decode_keys(p, meta, 0, p.n_rows, k, _key_codes(p))
    _decode_values(p, meta, 0, p.n_rows, [(0, p.n_rows, v)])
    return k, v


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


def reference_dequantize_scatter(
    payload: RunPayload,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor | None,
    *,
    interleaved: bool = False,
) -> None:
    """The oracle of every restore path: decode the whole run, rotate every key row, ``index_copy_`` all.

    Written for clarity, not speed (a full fp32 copy of the run and one rotation pass);
    :func:`torch_dequantize_scatter`, the native kernel and the Triton kernel must equal it (the first
    two bit for bit).

    Args, Raises: as :func:`torch_dequantize_scatter`.
    """
    check_scatter_args(payload, dst_k, dst_v, dst_rows, delta, inv_freq)
    if payload.n_rows == 0:
        return
    p = payload if payload.k_data.device == dst_k.device else payload.to(dst_k.device)
    k, v = reference_dequantize(p)
    if inv_freq is not None and bool((delta != 0).any()):
        k = rope_delta_reference(k, delta.to(k.device), inv_freq.to(k.device), interleaved=interleaved)
    rows = dst_rows.to(dst_k.device)
    dst_k.index_copy_(1, rows, k.to(dst_k.dtype))
    dst_v.index_copy_(1, rows, v.to(dst_v.dtype))


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


# ---------------------------------------------------------------------------- residual for the policy


def value_residual_sq(v: torch.Tensor, group: int = DEFAULT_V_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared 4-bit reconstruction error and squared norm per token, summed over leading dims.

    Args:
        v: ``[..., N, head_dim]`` values (one layer ``[H, N, D]`` or several ``[L, H, N, D]``).
        group: value group size (as in the K8V4 format).

    Returns:
        ``(err_sq, ref_sq)``, float32 ``[N]`` each; add them across layers to aggregate.
    """
    if v.dim() < 2:
        raise ValueError(f"v must be [..., N, head_dim], got {tuple(v.shape)}")
    group = effective_v_group(v.shape[-1], group)
    d = v.shape[-1]
    ng = -(-d // group)
    x = v.float()
    # the quantizer of quantize_values(v, 4, group) on a [..., NG, group] view: scales broadcast instead of
    # gathered to full size and codes kept in fp32, the same fp32 operations (bit-identical sums), ~2x faster
    xg = _pad_to(x, -1, ng * group, 0.0).unflatten(-1, (ng, group))
    if ng * group == d:
        mn, mx = xg.amin(-1), xg.amax(-1)
    else:
        mn = _pad_to(x, -1, ng * group, float("inf")).unflatten(-1, (ng, group)).amin(-1)
        mx = _pad_to(x, -1, ng * group, float("-inf")).unflatten(-1, (ng, group)).amax(-1)
    s, z = scale_zero(mn, mx, 15)
    sf, zf = s.float().unsqueeze(-1), z.float().unsqueeze(-1)
    q = torch.floor((xg - zf) / sf + 0.5).clamp_(0, 15)
    err = (xg - (q * sf + zf)).flatten(-2)[..., :d]
    dims = [i for i in range(v.dim()) if i != v.dim() - 2]
    return err.square().sum(dims), x.square().sum(dims)


def value_residual_4bit(v: torch.Tensor, group: int = DEFAULT_V_GROUP, eps: float = 1e-12) -> torch.Tensor:
    """Normalized per-token 4-bit value residual ``e_i = ||v_i - Q4(v_i)|| / ||v_i||``.

    Norms run over all heads (and layers, for ``[L, H, N, D]``) and channels of token ``i``.
    Typical values ~0.08 (see the module docstring); this is the ``e`` of ``precision.assign_tags``.

    Args:
        v: ``[..., N, head_dim]`` values.
        group: value group size.
        eps: guards all-zero rows (their residual is 0).

    Returns:
        float32 ``[N]`` on ``v``'s device.
    """
    err, ref = value_residual_sq(v, group)
    return (err / ref.clamp_min(eps)).sqrt()



def key_residual_sq(k: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE,
                    bits: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Squared ``bits``-bit key reconstruction error and squared norm per token, summed over leading dims.

    The keys are quantized as the ``K4V4`` format does (per channel over blocks of ``block_size``
    consecutive tokens starting at token 0, the quantizer of :func:`quantize_keys`), so a block of
    a checkpoint's mixed runs sees exactly this error.

    Args:
        k: ``[..., N, head_dim]`` keys (one layer ``[H, N, D]`` or several ``[L, H, N, D]``).
        block_size: tokens per key-scale block.
        bits: key bits (4 for ``K4V4``; 8 gives the ``K8*`` error).

    Returns:
        ``(err_sq, ref_sq)``, float32 ``[N]`` each; add them across layers to aggregate.

    Raises:
        ValueError: ``k`` has fewer than 2 dims, or ``block_size < 1``.
    """
    if k.dim() < 2:
        raise ValueError(f"k must be [..., N, head_dim], got {tuple(k.shape)}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    n, d = k.shape[-2], k.shape[-1]
    qmax = (1 << bits) - 1
    x = k.reshape(-1, n, d).float()
    h, nb = x.shape[0], -(-n // block_size)
    npad = nb * block_size
    # the quantizer of quantize_keys on a [H, NB, block, D] view (scales broadcast, fp32 codes): bit-identical
    if npad == n:
        xb = x.view(h, nb, block_size, d)
        mn, mx = xb.amin(2), xb.amax(2)
    else:
        mn = _pad_to(x, 1, npad, float("inf")).view(h, nb, block_size, d).amin(2)
        mx = _pad_to(x, 1, npad, float("-inf")).view(h, nb, block_size, d).amax(2)
        xb = _pad_to(x, 1, npad, 0.0).view(h, nb, block_size, d)
    s, z = scale_zero(mn, mx, qmax)
    sf, zf = s.float().unsqueeze(2), z.float().unsqueeze(2)
    q = torch.floor((xb - zf) / sf + 0.5).clamp_(0, qmax)
    err = (xb - (q * sf + zf)).view(h, npad, d)[:, :n]
    return err.square().sum((0, 2)), x.square().sum((0, 2))


def key_residual_4bit(k: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE, eps: float = 1e-12) -> torch.Tensor:
    """Normalized per-token 4-bit key residual ``ek_i = ||k_i - Q4K(k_i)|| / ||k_i||``.

    ``Q4K`` is the ``K4V4`` key quantizer (per channel over blocks of ``block_size`` tokens); norms
    run over all heads (and layers, for ``[L, H, N, D]``) and channels of token ``i``. This is the
    ``key_resid`` of ``precision.assign_tags`` (the G4K test of the ``K4V4`` rule).

    Args:
        k: ``[..., N, head_dim]`` keys.
        block_size: tokens per key-scale block (the checkpoint's block size).
        eps: guards all-zero rows (their residual is 0).

    Returns:
        float32 ``[N]`` on ``k``'s device.

    Raises:
        ValueError: as :func:`key_residual_sq`.
    """
    err, ref = key_residual_sq(k, block_size)
    return (err / ref.clamp_min(eps)).sqrt()

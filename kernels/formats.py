"""KV transport formats: the format names and bit widths, the run payload (:class:`RunPayload`) and the
argument checks that every quantize and restore path shares.

Boundary: describes and validates data, computes nothing. Knows each format's tensor layout (shapes,
dtypes, 4-bit packing order) and which arguments a quantize or restore call accepts; does not know the
quantizer arithmetic (:mod:`.quantizer`), the reference paths (:mod:`.reference`), the optimised torch
restore (:mod:`.quant`), the Triton / native kernels or which of them runs (:mod:`.dispatch`); knows
nothing about models, checkpoints or precision policy. One layer's ``k, v`` of shape
``[num_kv_heads, N, head_dim]`` (batch squeezed, any float dtype) is encoded into one
:class:`RunPayload` and back.

Formats (a *run* is ``n_rows`` token rows cut into blocks of ``block_size`` rows; the last block
may be partial):

- ``FP16``: "full precision". Rows are stored in the *source dtype as given* (fp32 on a CPU fp32
  model, fp16/bf16 on GPU), so on fp32 models ``FP16`` means "unquantized". Round trip is bit-exact.
- ``K8V8``: keys 8 bit, values 8 bit. ``K8V4``: keys 8 bit, values 4 bit packed two per byte
  (channel ``2j`` in the low nibble, ``2j + 1`` in the high nibble; ``head_dim`` must be even).
- ``K4V4``: keys 4 bit (the same per-channel-over-block groups and quantizer as ``K8*`` with
  ``qmax = 15``), packed two per byte along channels exactly as the 4-bit values are; values as
  ``K8V4``. ``head_dim`` must be even.

The quantizer and its groups (keys per channel over a block, values per token in groups of
``v_group`` channels) are described in :mod:`.quantizer`.

Bytes per (K, V) element pair, metadata included: FP16 4 (fp16/bf16 source; 8 for fp32),
K8V8 2.25, K8V4 1.75, K4V4 1.25 = 0.5 + 0.125 + 0.5 + 0.125 (head_dim 80: 2.275 / 1.775 / 1.275);
i.e. 56 %, 44 % and 31 % of fp16. Metadata: keys 4 B per (channel, block) = 1/8 B per element at
block 32; values 4 B per group = 1/8 B per element at group 32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

FP16 = "FP16"
K8V8 = "K8V8"
K8V4 = "K8V4"
K4V4 = "K4V4"
FORMATS = (K4V4, K8V4, K8V8, FP16)  # ascending precision; precision.Tag uses the same names and order
K_BITS = {K8V8: 8, K8V4: 8, K4V4: 4}  # key bits of the quantized formats
V_BITS = {K8V8: 8, K8V4: 4, K4V4: 4}  # value bits of the quantized formats
DEFAULT_BLOCK_SIZE = 32
DEFAULT_V_GROUP = 32


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
    if not _int(block_size) or not 1 <= block_size < 2**31:  # the kernels hold it as int32
        raise ValueError(f"block_size must be an int in [1, 2^31), got {str(block_size)[:40]}")
    if not _int(v_group) or not 1 <= v_group < 2**31 or v_group & (v_group - 1):
        raise ValueError(f"v_group must be a power of two below 2^31, got {str(v_group)[:40]}")
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


def effective_v_group(head_dim: int, v_group: int) -> int:
    """The value group actually used: ``v_group`` clipped to the next power of two >= head_dim."""
    return min(v_group, 1 << max(head_dim - 1, 0).bit_length())

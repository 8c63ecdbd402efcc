"""The naive pure-torch references, the oracles of every other path: :func:`reference_quantize_gather`,
:func:`reference_dequantize` and :func:`reference_dequantize_scatter`.

Boundary: one layer's ``k, v`` ``[num_kv_heads, N, head_dim]`` and source rows in, a
:class:`~.formats.RunPayload` out, and back (decoded, RoPE-shifted and written to destination rows).
Written for clarity, not speed. The optimised torch restore (``torch_restore.torch_dequantize_scatter``) and the
native kernels of ``native.c`` must agree with these bit for bit, the Triton kernels in
``triton_quantize_gather.py`` / ``triton_dequantize_scatter.py`` bit-exactly on codes under the Triton
interpreter (to tolerance on restored rows). Builds on :mod:`.formats` (layout, checks),
:mod:`.quantizer` (arithmetic) and ``rope.rope_delta_reference`` (the key rotation); does not know which
path runs (:mod:`.dispatch`); knows nothing about models, checkpoints or precision policy.
"""

from __future__ import annotations

import torch

from .formats import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_V_GROUP,
    FP16,
    K_BITS,
    V_BITS,
    RunPayload,
    check_quantize_args,
    check_scatter_args,
    effective_v_group,
    normalize_tag,
)
from .quantizer import _decode_keys, _decode_values, _float_meta, _key_codes, pack4, quantize_keys, quantize_values
from .rope import rope_delta_reference


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

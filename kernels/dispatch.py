"""Public KV transport functions: Triton kernels on CUDA tensors, torch references on CPU.

This is the module the rest of the library calls. It knows nothing about models or checkpoints.

Backend choice, per call: ``"auto"`` (default) runs Triton when the tensors are on CUDA and the
torch reference otherwise; ``"triton"`` forces the kernels (on CPU tensors this needs the Triton
interpreter, ``TRITON_INTERPRET=1`` set before triton is first imported: that is how the tests run
them); ``"torch"`` forces the references. Set it with the ``PATCHKV_KERNELS`` environment variable,
:func:`set_backend`, or the :func:`backend` context manager. Triton is imported lazily, only when a
kernel is used, so CPU-only installs without a working Triton still run.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from .quant import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_V_GROUP,
    RunPayload,
    reference_dequantize_scatter,
    reference_quantize_gather,
)

BACKENDS = ("auto", "triton", "torch")
_backend: str | None = None  # None: read PATCHKV_KERNELS


def get_backend() -> str:
    """The active backend name (``set_backend`` wins over ``PATCHKV_KERNELS``; default ``auto``).

    Raises:
        ValueError: if ``PATCHKV_KERNELS`` holds an unknown name.
    """
    name = _backend or os.environ.get("PATCHKV_KERNELS", "auto")
    if name not in BACKENDS:
        raise ValueError(f"PATCHKV_KERNELS={name!r}; expected one of {BACKENDS}")
    return name


def set_backend(name: str | None) -> None:
    """Select ``"auto"``, ``"triton"`` or ``"torch"``; ``None`` returns to ``PATCHKV_KERNELS``.

    Raises:
        ValueError: on an unknown name.
    """
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    _backend = name


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Use backend ``name`` inside the ``with`` block, then restore the previous choice."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def _use_triton(t: torch.Tensor) -> bool:
    name = get_backend()
    if name == "torch" or (name == "auto" and not t.is_cuda):
        return False
    if not t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "the triton kernel backend was forced on CPU tensors; set TRITON_INTERPRET=1 before "
            "triton is imported, or use backend 'auto'/'torch' for the torch reference"
        )
    return True


def quantize_gather(
    k: torch.Tensor,
    v: torch.Tensor,
    rows: torch.Tensor,
    tag: object,
    block_size: int = DEFAULT_BLOCK_SIZE,
    v_group: int = DEFAULT_V_GROUP,
) -> RunPayload:
    """Gather token rows of one layer and encode them as one run in format ``tag``.

    Args:
        k, v: ``[num_kv_heads, N, head_dim]``, any float dtype, same shape.
        rows: int64 ``[R]`` source rows (R may be 0 or end mid-block).
        tag: ``"FP16"``, ``"K8V8"`` or ``"K8V4"`` (or a ``precision.Tag``).
        block_size: rows per key-scale block (default 32).
        v_group: value group size along head_dim, a power of two (default 32).

    Returns:
        A :class:`RunPayload` on ``k``'s device (move it with ``.to("cpu")`` / ``.pin_memory()``).

    Raises:
        ValueError: on bad shapes, dtypes, tag, or out-of-range rows (checked when on CPU).
        RuntimeError: if the triton backend is forced on CPU without the interpreter.
    """
    if _use_triton(k):
        from .quantize_gather import quantize_gather_triton

        return quantize_gather_triton(k, v, rows, tag, block_size, v_group)
    return reference_quantize_gather(k, v, rows, tag, block_size, v_group)


def dequantize_scatter(
    payload: RunPayload,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor | None,
    *,
    interleaved: bool = False,
) -> None:
    """Decode a run, RoPE-correct its keys by ``delta``, and write it into ``dst[:, dst_rows, :]``.

    Keys are rotated exactly as ``rope.rope_delta_reference`` (pure angles, no attention scaling);
    values are never rotated. Nothing is rotated when ``inv_freq`` is ``None`` or ``delta`` is all
    zero.

    Args:
        payload: a run from :func:`quantize_gather` (any device; copied to ``dst_k``'s device).
        dst_k, dst_v: ``[num_kv_heads, N_new, head_dim]`` destinations, any float dtype, written
            in place.
        dst_rows: int64 ``[R]`` distinct destination rows, in run order (need not be contiguous).
        delta: int ``[R]`` position shift per row (new minus old), on the CPU.
        inv_freq: ``[rotary_dim // 2]`` RoPE frequencies (``rotary_dim <= head_dim``) or ``None``.
        interleaved: pair channels ``(2i, 2i+1)`` (GLM, GPT-J) instead of ``(i, i + rotary_dim/2)``.

    Raises:
        ValueError: on mismatched shapes or out-of-range rows (checked when on CPU).
        RuntimeError: if the triton backend is forced on CPU without the interpreter.
    """
    if _use_triton(dst_k):
        from .dequantize_scatter import dequantize_scatter_triton

        dequantize_scatter_triton(payload, dst_k, dst_v, dst_rows, delta, inv_freq, interleaved=interleaved)
        return
    reference_dequantize_scatter(payload, dst_k, dst_v, dst_rows, delta, inv_freq, interleaved=interleaved)

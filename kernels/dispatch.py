"""Public KV transport functions: Triton kernels on CUDA, native kernels or torch references on CPU.

This is the module the rest of the library calls. It knows nothing about models or checkpoints.

Backend choice, per call: ``"auto"`` (default) runs Triton when the tensors are on CUDA; on CPU,
``dequantize_scatter`` runs the native one-pass restore (``native.py``: ``native.c`` compiled on
first use) when a C compiler is at hand and the call fits it, else the torch reference, and
``quantize_gather`` likewise its native twin; ``"native"`` forces them;
``"triton"`` forces the kernels (on CPU tensors this needs the Triton interpreter,
``TRITON_INTERPRET=1`` set before triton is first imported: that is how the tests run them);
``"torch"`` forces the references. :func:`scatter_backend` says which path a call would take.
Set the backend with the ``PATCHKV_KERNELS`` environment variable, :func:`set_backend`, or the
:func:`backend` context manager. Triton is imported lazily, only when a
kernel is used, so CPU-only installs without a working Triton still run.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from . import native
from .native import ScatterCall
from .formats import DEFAULT_BLOCK_SIZE, DEFAULT_V_GROUP, FP16, RunPayload, normalize_tag
from .torch_restore import torch_dequantize_scatter
from .reference import reference_dequantize, reference_quantize_gather
from .residual import value_residual_4bit
from .rope import delta_cos_sin, rope_rotate

BACKENDS = ("auto", "triton", "torch", "native")
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
    if name in ("torch", "native") or (name == "auto" and not t.is_cuda):
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
        tag: ``"FP16"``, ``"K8V8"``, ``"K8V4"`` or ``"K4V4"`` (or a ``precision.Tag``).
        block_size: rows per key-scale block (default 32).
        v_group: value group size along head_dim, a power of two (default 32).

    Returns:
        A :class:`RunPayload` on ``k``'s device (move it with ``.to("cpu")`` / ``.pin_memory()``).

    Raises:
        ValueError: on bad shapes, dtypes, tag, or out-of-range rows (checked when on CPU).
        RuntimeError: if the triton backend is forced on CPU without the interpreter, or the
            native one is forced but unavailable or unfit for the sources.
    """
    if _use_triton(k):
        from .triton_quantize_gather import quantize_gather_triton

        return quantize_gather_triton(k, v, rows, tag, block_size, v_group)
    if _use_native(native.supports_quantize(k, v), "CPU fp32/fp16/bf16 sources of one dtype (inner stride 1) "
                   "and head_dim <= 1024"):
        return native.quantize_native(k, v, rows, tag, block_size, v_group)
    return reference_quantize_gather(k, v, rows, tag, block_size, v_group)


def _use_native(fits: bool, needs: str) -> bool:
    """Whether a call that ``fits`` the native kernels runs them: always when the backend is
    ``"native"`` (which raises if they cannot), when available under ``"auto"``."""
    name = get_backend()
    if name == "native":
        if not native.available():
            raise RuntimeError(f"the native kernel backend was forced but is {native.status()}")
        if not fits:
            raise RuntimeError(f"the native kernels take {needs}; use backend 'auto' to fall back to the torch reference")
        return True
    return name == "auto" and fits and native.available()


def scatter_backend(call: ScatterCall) -> str:
    """The path ``call`` takes under the active backend: ``"triton"``, ``"native"`` or ``"torch"``.

    Raises:
        RuntimeError: ``"native"`` is forced but unavailable or unfit for the call (the message
            says why), or ``"triton"`` is forced on CPU without the interpreter.
    """
    if _use_triton(call.dst_k):
        return "triton" if call.src_rows is None else "torch"  # the kernel takes whole runs
    fits = not call.dst_k.is_cuda and native.supports(call)
    if _use_native(fits, "CPU tensors with fp32 destinations (inner stride 1) and head_dim <= 1024"):
        return "native"
    return "torch"


def dequantize_scatter(
    payload: RunPayload,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    dst_rows: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor | None,
    *,
    interleaved: bool = False,
    src_rows: torch.Tensor | None = None,
) -> str:
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
        src_rows: int64 ``[M]`` payload rows to restore (default all ``R``, in order); ``dst_rows``
            and ``delta`` then have ``M`` entries.

    Returns:
        The path taken: ``"triton"``, ``"native"`` or ``"torch"``.

    Raises:
        ValueError: on mismatched shapes or out-of-range rows (checked when on CPU).
        RuntimeError: if a forced backend cannot run the call (see :func:`scatter_backend`).
    """
    return dequantize_scatter_many([ScatterCall(payload, dst_k, dst_v, dst_rows, delta, inv_freq,
                                                interleaved, src_rows)])


def dequantize_scatter_many(calls: list[ScatterCall], shared: dict | None = None) -> str:
    """Run several :func:`dequantize_scatter` calls (e.g. every layer and tag of a restore).

    On the native path they go to ``native.c`` in one multithreaded pass (one thread start per
    restore, not per layer); other paths run them one by one. ``shared``: a dict kept across the calls of one
    restore made in several batches (a layer at a time on a GPU side stream), so the row tensors moved to the
    device and the RoPE angles are computed once per restore (default: per batch).

    Returns:
        The path of the calls (``"native"`` if all took it, else the first other path taken).

    Raises:
        ValueError, RuntimeError: as :func:`dequantize_scatter`.
    """
    paths = [scatter_backend(c) for c in calls]
    fast = [c for c, p in zip(calls, paths) if p == "native"]
    if fast:
        native.scatter_native(fast)
    shared = {} if shared is None else shared  # what the calls share: device copies of rows, RoPE cos/sin
    for c, path in zip(calls, paths):
        if path == "native":
            continue
        if c.src_rows is not None:
            _scatter_selected(c, shared)
        elif path == "triton":
            from .triton_dequantize_scatter import dequantize_scatter_triton

            dequantize_scatter_triton(c.payload, c.dst_k, c.dst_v, c.dst_rows, c.delta, c.inv_freq,
                                      interleaved=c.interleaved)
        else:
            torch_dequantize_scatter(c.payload, c.dst_k, c.dst_v, c.dst_rows, c.delta, c.inv_freq,
                                     interleaved=c.interleaved)
    return next((p for p in paths if p != "native"), "native") if paths else "native"


def _on(t: torch.Tensor, dev: torch.device, shared: dict) -> torch.Tensor:
    """``t`` on ``dev``, copied once per restore (the layers of a restore share their row tensors); a CPU tensor
    bound for a GPU goes through pinned memory, so the copy does not stall the host."""
    key = ("to", id(t), dev)
    got = shared.get(key)
    if got is None:
        if t.device != dev and dev.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        got = shared[key] = t.to(dev, non_blocking=True)
    return got


def _scatter_selected(c: ScatterCall, shared: dict | None = None) -> None:
    """A run restored in part (torch ops on any device): copy it to the destination's device
    (non-blocking: from pinned memory this overlaps other work), keep ``src_rows`` (``FP16``:
    before widening; quantized: after decoding the run whole, as key scales span blocks), rotate,
    ``index_copy_`` into the destinations. ``shared`` (one dict per restore) keeps what several calls share
    (their row tensors on the device, the RoPE angles of one shift vector), so a restore of many layers moves
    and computes those once."""
    shared = {} if shared is None else shared
    m = c.src_rows.numel()
    native._check_selected(c, m)
    if m == 0:
        return
    dev = c.dst_k.device
    p = c.payload if c.payload.k_data.device == dev else c.payload.to(dev, non_blocking=True)
    sel = _on(c.src_rows, dev, shared)
    if normalize_tag(p.tag) == FP16:
        k, v = p.k_data.index_select(1, sel).float(), p.v_data.index_select(1, sel)
    else:
        k, v = reference_dequantize(p)
        k, v = k.index_select(1, sel), v.index_select(1, sel)
    if c.inv_freq is not None:
        key = ("rope", id(c.delta), id(c.inv_freq), dev)
        rot = shared.get(key)
        if rot is None:
            rot = shared[key] = (delta_cos_sin(c.delta, c.inv_freq.to(dev)) if bool((c.delta != 0).any())
                                 else False)
        if rot is not False:
            k = rope_rotate(k, *rot, interleaved=c.interleaved)
    rows = _on(c.dst_rows, dev, shared)
    c.dst_k.index_copy_(1, rows, k.to(c.dst_k.dtype))
    c.dst_v.index_copy_(1, rows, v.to(c.dst_v.dtype))


def value_residual_layers(values: list[torch.Tensor], group: int = DEFAULT_V_GROUP, eps: float = 1e-12) -> torch.Tensor:
    """``residual.value_residual_4bit`` of the layers stacked ``[L, H, N, D]``, without stacking them.

    On CPU with the native kernels (contiguous fp32 layers) one pass of ``native.c`` computes it (sums in
    double: equal to the reference to ~1e-7 relative); elsewhere the torch reference on the stacked layers.

    Args:
        values: per layer ``[H, N, D]`` values of one shape.
        group: value group size.
        eps: guards all-zero rows (their residual is 0).

    Returns:
        float32 ``[N]`` on the values' device.

    Raises:
        RuntimeError: the native backend is forced but unavailable.
    """
    fits = bool(values) and all(v.device.type == "cpu" and v.dtype == torch.float32 and v.dim() == 3
                                and v.is_contiguous() and v.shape == values[0].shape for v in values) \
        and values[0].shape[-1] <= native.MAX_HEAD_DIM
    if not values[0].is_cuda and _use_native(fits, "contiguous fp32 CPU layers of one shape"):
        err, ref = native.value_residual_sq_native(values, group)
        return (err / ref.clamp_min(eps)).sqrt()
    return value_residual_4bit(torch.stack([v.float() for v in values]), group, eps)

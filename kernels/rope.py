"""RoPE delta rotation: the pure-torch reference (and CPU path).

A key cached at old position ``p_old`` carries the rotation ``R(p_old)``. Rotations of one
frequency set compose, ``R(p_new) = R(p_new - p_old) R(p_old)``, so moving a cached key to
``p_new`` is one more rotation by ``delta = p_new - p_old``. This holds for every RoPE whose
frequencies do not depend on the position or sequence length (default, linear, llama3, yarn);
the caller decides support. The attention scaling some RoPE kinds fold into cos/sin (yarn's
mscale) was applied once when the key was formed and must not be applied again: this module
rotates by pure angles.

Layouts (``rotary_dim`` leading channels rotate, the rest pass through):
- half (Llama, Qwen, Gemma): channel ``i`` pairs with ``i + rotary_dim/2``.
- interleaved (GLM, GPT-J): channel ``2i`` pairs with ``2i + 1``.

Knows nothing about models: frequencies and deltas in, rotated rows out.
"""

from __future__ import annotations

import torch


def delta_cos_sin(delta: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos/sin of ``delta * inv_freq``, computed in float64 for accuracy.

    Shifts repeat (one per aligned segment), so the trigonometry runs once per distinct shift.

    Args:
        delta: int tensor ``[R]``, position shift per row.
        inv_freq: float tensor ``[rotary_dim // 2]``.

    Returns:
        ``(cos, sin)``, each float32 ``[R, rotary_dim // 2]`` on ``inv_freq``'s device.
    """
    # the distinct shifts are found where ``delta`` lives (a CPU delta costs the GPU no synchronisation: a unique on
    # the device waits for everything queued before it), then the few angles go to ``inv_freq``'s device
    uniq, inverse = torch.unique(delta, return_inverse=True)
    dev = inv_freq.device
    ang = uniq.to(device=dev, dtype=torch.float64)[:, None] * inv_freq.to(torch.float64)[None, :]
    cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
    inverse = inverse.to(dev, non_blocking=True)
    return cos[inverse], sin[inverse]


def rope_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False) -> torch.Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` channels of float rows ``x`` ``[..., R, D]`` by
    per-row angles given as ``cos``/``sin`` ``[R, rotary_dim // 2]``; other channels pass through.

    Returns:
        A new float tensor like ``x``.
    """
    half = cos.shape[-1]
    rot = 2 * half
    if interleaved:
        x1, x2 = x[..., 0:rot:2], x[..., 1:rot:2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = x[..., :half], x[..., half:rot]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    if rot < x.shape[-1]:
        out = torch.cat((out, x[..., rot:]), dim=-1)
    return out


def rope_delta_reference(
    k: torch.Tensor,
    delta: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    interleaved: bool = False,
) -> torch.Tensor:
    """Rotate key rows by their position shift.

    Args:
        k: ``[..., R, D]`` key rows (any float dtype); rows on dim -2.
        delta: int ``[R]`` shift per row (new position minus old position).
        inv_freq: ``[rotary_dim // 2]`` RoPE frequencies; ``rotary_dim <= D``.
        interleaved: pair channels ``(2i, 2i+1)`` instead of ``(i, i + rotary_dim/2)``.

    Returns:
        A new tensor like ``k`` with the first ``rotary_dim`` channels rotated (computed in fp32,
        cast back to ``k.dtype``).

    Raises:
        ValueError: if shapes disagree.
    """
    half = inv_freq.shape[-1]
    if 2 * half > k.shape[-1]:
        raise ValueError(f"rotary_dim {2 * half} exceeds head_dim {k.shape[-1]}")
    if delta.shape[-1] != k.shape[-2]:
        raise ValueError(f"delta has {delta.shape[-1]} rows, k has {k.shape[-2]}")
    cos, sin = delta_cos_sin(delta, inv_freq.to(k.device))
    return rope_rotate(k.float(), cos, sin, interleaved=interleaved).to(k.dtype)

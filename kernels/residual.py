"""Quantization residuals for the precision policy: per-token 4-bit value and key reconstruction errors
(``value_residual_*`` / ``key_residual_*``), the ``e`` and ``ek`` of ``precision.assign_tags``.

Boundary: one layer's (or several layers') values or keys ``[..., N, head_dim]`` in, float32 ``[N]`` out.
Evaluates the quantizer of :mod:`.quantizer` (the value groups of ``K8V4`` / ``K4V4``, the key blocks of
``K4V4``) on grouped views, bit-identical to quantizing with ``quantize_values`` / ``quantize_keys`` and
decoding; builds no payload and knows no restore path, model or policy thresholds. On SmolLM2's
real values the 4-bit value residual is typically ~0.08 (median 0.083, max 0.13).
"""

from __future__ import annotations

import torch

from .formats import DEFAULT_BLOCK_SIZE, DEFAULT_V_GROUP, effective_v_group
from .quantizer import _pad_to, scale_zero


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

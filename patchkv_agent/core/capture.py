"""Attention statistics in the checkpoint-creation pass (docs/DESIGN.md section 4, checkpoint creation, step 2).

Boundary: this module knows a Hugging Face model only through transformers' attention dispatch
(``AttentionInterface`` / ``AttentionMaskInterface``) and the ``layer_idx`` / ``num_key_value_groups``
attributes of its attention modules. It computes attention exactly as ``sdpa`` does and, for a
sampled set of layers, also the softmax probabilities of the last ``w`` query rows over all keys,
summed over heads, rows and layers per key token. It knows nothing about checkpoints, blocks,
precision or plans: the caller stores :meth:`AttentionCapture.scores` wherever it likes.

Cost: per sampled layer one ``[w, N]`` score matrix per head (never ``N x N``), kept on the model's
device; nothing is synchronised with the host until :meth:`AttentionCapture.scores` is called.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

import numpy as np
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from .models import text_config
from .settings import DEFAULT_CAPTURE_WINDOW

__all__ = ["AttentionCapture", "ActiveCaptures", "ACTIVE", "capture_attention_forward", "default_layers"]


class ActiveCaptures:
    """Which capture records each attention module, only while that capture's ``with`` block runs.

    Process-wide by nature: transformers dispatches attention by a registered name, process-wide, and calls the
    registered function with the attention module alone; so the function is one module-level dispatcher
    (:func:`capture_attention_forward`), several captures (on different models) share its name, and the
    dispatcher finds the capture of a module here. Entries are keyed by ``id(module)``, added when a capture's
    block opens and removed when it exits, so the table holds only the modules inside an open block. What a
    model keeps between passes (its capture per window) lives in its
    :class:`~patchkv_agent.core.runner.ModelRunner`, not here. Entering and leaving are serialised by the
    table's lock; a lookup is one dictionary read.
    """

    def __init__(self) -> None:
        self._by_module: dict[int, AttentionCapture] = {}
        self._lock = threading.Lock()

    def of(self, module: torch.nn.Module) -> "AttentionCapture | None":
        """The capture recording ``module`` now, or None."""
        return self._by_module.get(id(module))

    def enter(self, capture: "AttentionCapture", modules: Sequence[torch.nn.Module]) -> None:
        """Make ``capture`` the recorder of ``modules``.

        Raises:
            RuntimeError: one of them is recorded by another capture (the model is inside another block).
        """
        with self._lock:
            for m in modules:
                if self._by_module.get(id(m), capture) is not capture:
                    raise RuntimeError("this model is already inside another AttentionCapture")
            for m in modules:
                self._by_module[id(m)] = capture

    def leave(self, capture: "AttentionCapture", modules: Sequence[torch.nn.Module]) -> None:
        """Stop ``capture`` recording ``modules`` (a module another capture records is left as it is)."""
        with self._lock:
            for m in modules:
                if self._by_module.get(id(m)) is capture:
                    del self._by_module[id(m)]

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_module)


ACTIVE = ActiveCaptures()  # the process's table (see ActiveCaptures)


def capture_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The registered attention function: ``sdpa_attention_forward``, plus recording for sampled layers.

    Args:
        module: the attention module (``layer_idx``, ``num_key_value_groups``, ``is_causal``).
        query: ``[B, Hq, q, D]``; key, value: ``[B, Hkv, N, D]``.
        attention_mask: None, a 4D boolean mask (True = attend) or a 4D additive float mask.
        **kwargs: passed through to sdpa (``scaling``, ``dropout``, ``is_causal``, ...).
    Returns:
        ``(attn_output, None)`` exactly as ``sdpa_attention_forward``.
    """
    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    cap = ACTIVE.of(module)
    if cap is not None:
        cap._record(module, query, key, attention_mask, kwargs)
    return out


def default_layers(n_layers: int, every: int = 4) -> tuple[int, ...]:
    """Every ``every``-th layer from 0, always including the last one."""
    return tuple(sorted(set(range(0, n_layers, every)) | {n_layers - 1}))


def _window_probs(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, *, window: int,
                  scaling: float | None, causal: bool, position_bias: torch.Tensor | None) -> torch.Tensor:
    """Softmax probabilities of the last ``window`` query rows, summed over heads and rows: ``[B, N]``."""
    b, hq, q_len, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    g = hq // hkv
    w = min(window, q_len)
    scale = scaling if scaling is not None else d**-0.5
    q = query[:, :, q_len - w :, :].float().reshape(b, hkv, g * w, d)  # head h uses kv head h // g
    logits = torch.matmul(q, key.float().transpose(-1, -2)).view(b, hq, w, n) * scale
    if position_bias is not None:
        logits = logits + position_bias[..., q_len - w :, :].float()
    if mask is not None:
        m = mask[..., q_len - w :, :]
        logits = logits.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else logits + m.float()
    elif causal and q_len > 1:  # sdpa's is_causal: upper-left aligned, key j visible to query row i iff j <= i
        rows = torch.arange(q_len - w, q_len, device=key.device)[:, None]
        logits = logits.masked_fill(torch.arange(n, device=key.device)[None, :] > rows, float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num_(0.0)  # fully masked rows (padding) contribute nothing
    return probs.sum(dim=(1, 2))


class AttentionCapture:
    """Context manager: route a model's attention through the capturing sdpa function.

    ``with AttentionCapture(model) as cap: model(ids)`` then ``cap.scores()``. Every forward inside the
    block adds to the statistics (call :meth:`reset` between passes); a later pass with more keys
    extends the accumulator.
    """

    def __init__(self, model: torch.nn.Module, *, window: int = DEFAULT_CAPTURE_WINDOW,
                 layers: tuple[int, ...] | list[int] | None = None,
                 name: str = "patchkv_capture") -> None:
        """Args:
            model: a transformers ``PreTrainedModel`` whose attention goes through ``AttentionInterface``.
            window: the last ``w`` query rows of each pass whose attention is recorded, ``>= 1``.
            layers: layer indices to sample; default every 4th layer from 0 plus the last.
            name: the name registered in ``AttentionInterface`` / ``AttentionMaskInterface``.
        Raises:
            ValueError: if ``window < 1``, a layer index is out of range, or the model has no attention
                module with an integer ``layer_idx`` among the sampled layers.
        """
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.model = model
        self.window = int(window)
        self.name = name
        n_layers = int(text_config(model).num_hidden_layers)
        self.layers = default_layers(n_layers) if layers is None else tuple(sorted({int(i) for i in layers}))
        bad = [i for i in self.layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"layer indices {bad} out of range for a {n_layers}-layer model")
        self._modules = [m for m in model.modules()
                         if isinstance(getattr(m, "layer_idx", None), int) and m.layer_idx in self.layers
                         and hasattr(m, "num_key_value_groups")]
        if not self._modules:
            raise ValueError("no attention module with `layer_idx` and `num_key_value_groups` found for the sampled "
                             "layers; AttentionCapture supports models that dispatch through AttentionInterface")
        self._acc: torch.Tensor | None = None  # [B, N] float32 on the model's device
        self._previous: str | None = None
        self.n_records = 0

    # -- context manager ------------------------------------------------------------------------------------------

    def __enter__(self) -> AttentionCapture:
        AttentionInterface.register(self.name, capture_attention_forward)
        if self.name not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
            AttentionMaskInterface.register(self.name, sdpa_mask)  # the same masks sdpa would get
        ACTIVE.enter(self, self._modules)
        try:
            self._previous = self.model.config._attn_implementation
            self._set_impl(self.name)
        except BaseException:
            ACTIVE.leave(self, self._modules)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        ACTIVE.leave(self, self._modules)
        if self._previous is not None:
            self._set_impl(self._previous)
            self._previous = None

    def _set_impl(self, name: str) -> None:
        if hasattr(self.model, "set_attn_implementation"):
            self.model.set_attn_implementation(name)
        else:  # a bare module tree: set the config the attention modules read
            self.model.config._attn_implementation = name

    # -- statistics -----------------------------------------------------------------------------------------------

    def _record(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> None:
        is_causal = kwargs.get("is_causal")
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        with torch.no_grad():
            mass = _window_probs(query.detach(), key.detach(), attention_mask, window=self.window,
                                 scaling=kwargs.get("scaling"), causal=bool(causal),
                                 position_bias=kwargs.get("position_bias"))
        if self._acc is None:
            self._acc = mass
        else:
            if self._acc.shape[0] != mass.shape[0]:
                raise ValueError(f"batch size changed inside one capture ({self._acc.shape[0]} -> {mass.shape[0]}); "
                                 "call reset() between passes of different batch sizes")
            n = max(self._acc.shape[1], mass.shape[1])
            if self._acc.shape[1] < n:
                self._acc = torch.nn.functional.pad(self._acc, (0, n - self._acc.shape[1]))
            self._acc[:, : mass.shape[1]] += mass
        self.n_records += 1

    def reset(self) -> None:
        """Forget everything recorded so far."""
        self._acc = None
        self.n_records = 0

    def raw_scores(self) -> torch.Tensor | None:
        """Unnormalised attention mass ``[B, N]`` (float32, on the model's device), or None before a pass."""
        return self._acc

    def scores(self, batch_index: int = 0) -> np.ndarray:
        """Attention mass per key token, normalised to sum 1.

        Args:
            batch_index: which sequence of the batch.
        Returns:
            float32 array ``[N]`` (N = the longest key length seen).
        Raises:
            RuntimeError: if no sampled layer ran inside the capture.
        """
        if self._acc is None:
            raise RuntimeError("no attention was recorded: run a forward pass inside `with AttentionCapture(...)`")
        row = self._acc[batch_index].double()
        total = row.sum()
        row = row / total if total > 0 else row
        return row.float().cpu().numpy()

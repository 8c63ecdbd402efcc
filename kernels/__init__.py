"""Triton kernels for KV transport and their pure-torch references.

Knows nothing about models, checkpoints or LangGraph: tensors in, tensors out.
On CUDA the Triton kernels run; on CPU the torch references are the fast path.
"""

from .dispatch import backend, dequantize_scatter, get_backend, quantize_gather, set_backend
from .quant import FORMATS, FP16, K8V4, K8V8, RunPayload, value_residual_4bit, value_residual_sq

__all__ = [
    "FORMATS",
    "FP16",
    "K8V4",
    "K8V8",
    "RunPayload",
    "backend",
    "dequantize_scatter",
    "get_backend",
    "quantize_gather",
    "set_backend",
    "value_residual_4bit",
    "value_residual_sq",
]

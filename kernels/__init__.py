"""Triton kernels for KV transport and their pure-torch references.

Knows nothing about models, checkpoints or LangGraph: tensors in, tensors out.
On CUDA the Triton kernels run; on CPU native twins of both (``native.c``, compiled on first use)
when a C compiler is present, else the torch references.
"""

from .dispatch import (
    ScatterCall,
    backend,
    dequantize_scatter,
    dequantize_scatter_many,
    get_backend,
    quantize_gather,
    scatter_backend,
    set_backend,
    value_residual_layers,
)
from .quant import (
    FORMATS,
    FP16,
    K4V4,
    K8V4,
    K8V8,
    RunPayload,
    key_residual_4bit,
    key_residual_sq,
    value_residual_4bit,
    value_residual_sq,
)

__all__ = [
    "FORMATS",
    "FP16",
    "K4V4",
    "K8V4",
    "K8V8",
    "RunPayload",
    "ScatterCall",
    "backend",
    "dequantize_scatter",
    "dequantize_scatter_many",
    "get_backend",
    "key_residual_4bit",
    "key_residual_sq",
    "quantize_gather",
    "scatter_backend",
    "set_backend",
    "value_residual_4bit",
    "value_residual_layers",
    "value_residual_sq",
]

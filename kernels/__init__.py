"""Triton kernels for KV transport and their pure-torch references.

Knows nothing about models, checkpoints or LangGraph: tensors in, tensors out.
On CUDA the Triton kernels run; on CPU native twins of both (``native.c``, compiled on first use)
when a C compiler is present, else the torch references.

Modules:

- :mod:`.formats`: format names and bit widths, :class:`RunPayload`, the shared argument checks.
- :mod:`.quantizer`: the quantizer, key / value quantization, 4-bit packing, decode primitives.
- :mod:`.reference`: the pure-torch references (``reference_*``), the oracles of every path.
- :mod:`.torch_restore`: the optimised torch restore (``torch_dequantize_scatter``).
- :mod:`.residual`: the 4-bit value / key residuals of the precision policy.
- :mod:`.rope`: the RoPE delta rotation (reference).
- :mod:`.native` (``native.c``), ``triton_quantize_gather`` / ``triton_dequantize_scatter``: the kernels.
- :mod:`.dispatch`: the public entry points; picks the path per call.
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
from .formats import FORMATS, FP16, K4V4, K8V4, K8V8, RunPayload
from .residual import key_residual_4bit, key_residual_sq, value_residual_4bit, value_residual_sq

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

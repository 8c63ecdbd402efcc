"""Triton kernels for KV transport and their pure-torch references.

Knows nothing about models, checkpoints or LangGraph: tensors in, tensors out.
On CUDA the Triton kernels run; on CPU the torch references are the fast path.
"""

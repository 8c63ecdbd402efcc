"""Prepared calls on an OpenAI-compatible serving engine (vLLM, llama.cpp's server).

- :class:`~patchkv_agent.serving.middleware.PatchKVServerMiddleware`: ``create_agent`` middleware for a
  ``ChatOpenAI`` pointed at a server: during each tool wait it predicts the next call with the agent's own
  editors and computes it into the server's prefix cache; each response says what was reused.
- :mod:`~patchkv_agent.serving.adapter`: the interface to one engine; :class:`~patchkv_agent.serving.vllm.VLLMAdapter`
  and :class:`~patchkv_agent.serving.llamacpp.LlamaCppAdapter` implement it.
- :class:`~patchkv_agent.serving.stats.ServerCallStats`: the evidence on every call
  (``response_metadata["patchkv"]``).

Needs ``langchain-openai`` (the ``serve`` extra). Submodules are imported on first use.
"""

from __future__ import annotations

_EXPORTS = {
    "PatchKVServerMiddleware": "middleware",
    "ServerAdapter": "adapter",
    "PrewarmReply": "adapter",
    "adapter_for": "engines",
    "VLLMAdapter": "vllm",
    "LlamaCppAdapter": "llamacpp",
    "ServerCallStats": "stats",
    "ServerError": "http",
    "Endpoint": "http",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

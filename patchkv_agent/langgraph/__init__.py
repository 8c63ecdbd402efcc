"""LangGraph / LangChain integration (see docs/DESIGN.md section 6).

- :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel`: a chat model over the local model that
  reuses KV per graph thread (tools, streaming, async).
- :class:`~patchkv_agent.langgraph.middleware.PatchKVMiddleware`: ``create_agent`` middleware (resume on
  model calls, background offload while tools run); :func:`~patchkv_agent.langgraph.prepared.prepared_middleware`
  builds an agent's editors and the middleware that runs them ahead in one list (in-process or on a server).
- :func:`~patchkv_agent.langgraph.node.patchkv_node`: the same around a node of a hand-built ``StateGraph``.
- :class:`~patchkv_agent.langgraph.checkpointer.PatchKVCheckpointSaver`: wraps any checkpoint saver and
  records the KV handle of each thread version in checkpoint metadata.
- :class:`~patchkv_agent.langgraph.recorder.TraceRecorder`: writes live runs as replayable traces.

The per-thread state lives in :class:`patchkv_agent.runtime.threads.ThreadRegistry`. Submodules import
LangChain / LangGraph; this package imports them lazily.
"""

from __future__ import annotations

_EXPORTS = {
    "PatchKVChatModel": "chat_model",
    "PatchKVMiddleware": "middleware",
    "prepared_middleware": "prepared",
    "patchkv_node": "node",
    "PatchKVCheckpointSaver": "checkpointer",
    "TraceRecorder": "recorder",
    "parse_tool_calls": "tools",
    "thread_key_from_config": "keys",
    "current_thread_key": "keys",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

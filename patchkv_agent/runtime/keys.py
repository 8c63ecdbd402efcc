"""Registry keys: a thread is ``(thread_id, checkpoint_ns)``; context ``i > 0`` of a thread has a key of
its own under the same namespace (:func:`context_key`).

Boundary: plain tuples and strings; knows nothing about KV or the engine.
"""

from __future__ import annotations

from typing import NewType

__all__ = ["ThreadKey", "thread_key", "context_key", "CONTEXT_SUFFIX", "MIN_CONTINUE_SHARE"]

ThreadKey = NewType("ThreadKey", tuple)  # (thread_id: str, checkpoint_ns: str)
def thread_key(thread_id: str, checkpoint_ns: str = "") -> ThreadKey:
    """The registry key of a thread.

    Args:
        thread_id: the LangGraph ``thread_id`` (any string).
        checkpoint_ns: the graph namespace (``""`` for a root graph).

    Returns:
        A ``(thread_id, checkpoint_ns)`` tuple.
    """
    return ThreadKey((str(thread_id), str(checkpoint_ns)))


CONTEXT_SUFFIX = "ctx"  # lane i > 0 of key (tid, ns) is (tid, "ns#ctx<i>"), or "ns+ctx<i>" when ns has a #scope
MIN_CONTINUE_SHARE = 0.25  # a call continues a context that lets it reuse at least this share of its tokens


def context_key(key: ThreadKey, index: int) -> ThreadKey:
    """The registry key of context ``index`` of thread key ``key`` (0: the key itself).

    Args:
        key: a thread key.
        index: the context slot (>= 0).

    Returns:
        ``key`` for 0; ``(thread_id, ns#ctx<index>)`` (``ns+ctx<index>`` when ``ns`` already holds a
        ``#scope``) otherwise: the scope separator keeps a context under its graph namespace.
    """
    if index == 0:
        return key
    sep = "+" if "#" in key[1] else "#"
    return ThreadKey((key[0], f"{key[1]}{sep}{CONTEXT_SUFFIX}{index}"))

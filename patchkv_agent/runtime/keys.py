"""Registry keys: a thread is ``(thread_id, checkpoint_ns)``; context ``i > 0`` of a thread has a key of
its own under the same namespace (:func:`context_key`).

Boundary: plain tuples and strings; knows nothing about KV or the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NewType

__all__ = ["ThreadKey", "thread_key", "context_key", "CONTEXT_SUFFIX", "MIN_CONTINUE_SHARE", "HANDLE_KEYS",
           "MAX_HANDLE_VERSION", "handle_shape_problem", "handle_version"]

HANDLE_KEYS = {"thread_id": str, "checkpoint_ns": str, "version": int, "ids_hash": str}  # ThreadRegistry.handle's
MAX_HANDLE_VERSION = 1 << 62  # context versions a handle may name (store keys and JSON carry them as integers)


def handle_shape_problem(handle: Any) -> str | None:
    """Why ``handle`` does not have the shape :meth:`ThreadRegistry.handle
    <patchkv_agent.runtime.threads.ThreadRegistry.handle>` writes, or None: a mapping whose ``thread_id``,
    ``checkpoint_ns`` and ``ids_hash`` are strings, ``version`` an int in ``[0, 2^62]`` (not a bool) and
    ``kv_ids_hash`` a string or None.

    Args:
        handle: anything (a handle is read from outside the process).

    Returns:
        None, or the problem in words, naming the field.
    """
    if not isinstance(handle, Mapping):
        return f"is a {type(handle).__name__}, not a mapping"
    for k, typ in HANDLE_KEYS.items():
        v = handle.get(k)
        if not isinstance(v, typ) or isinstance(v, bool):
            return f"has {k}={repr(v)[:40]} (need a {typ.__name__})"
    if handle.get("kv_ids_hash") is not None and not isinstance(handle["kv_ids_hash"], str):
        return f"has kv_ids_hash={repr(handle['kv_ids_hash'])[:40]} (need a str or None)"
    if not 0 <= handle["version"] <= MAX_HANDLE_VERSION:
        return f"has version {handle['version']} outside [0, 2^62]"
    return None


def handle_version(handle: Any) -> int:
    """The context version a well-formed handle names (:func:`handle_shape_problem`).

    Raises:
        ValueError: a handle of another shape, naming the field and the fix.
    """
    why = handle_shape_problem(handle)
    if why is not None:
        raise ValueError(f"the KV handle {why}: pass a handle as ThreadRegistry.handle() returns it")
    return int(handle["version"])

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

"""Thread keys from LangGraph run configs, and the key of the model call in progress.

LangGraph gives a node's config ``configurable.checkpoint_ns`` of the *task* (``"llm:<task id>"``, a new
id every step; ``"sub:<id>|llm:<id>"`` inside a subgraph), while a checkpointer sees the graph's
namespace (``""``, ``"sub:<id>"``). Both map here to one stable key: the task's own segment dropped,
task ids stripped (``""``, ``"sub"``). An optional *scope* (``ns#scope``) keeps two LLM nodes of one
graph thread apart.

Knows the shape of LangGraph configs (plain dicts); imports nothing from LangGraph.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Mapping

from ..runtime.threads import ThreadKey, thread_key

_NS_SEP, _NS_END = "|", ":"
_TASK_ID = "__pregel_task_id"
_CURRENT: ContextVar[ThreadKey | None] = ContextVar("patchkv_thread_key", default=None)


def canonical_ns(checkpoint_ns: str, task_id: str | None = None) -> str:
    """The stable namespace of a (task or graph) ``checkpoint_ns``.

    Args:
        checkpoint_ns: LangGraph's namespace string.
        task_id: the running task's id; when the last segment is that task, it is dropped.

    Returns:
        The namespace with task ids (and numeric segments) removed.
    """
    parts = [p for p in (checkpoint_ns or "").split(_NS_SEP) if p]
    if task_id and parts and parts[-1].endswith(_NS_END + str(task_id)):
        parts = parts[:-1]
    return _NS_SEP.join(p.split(_NS_END)[0] for p in parts if not p.isdigit())


def thread_key_from_config(config: Mapping[str, Any] | None, *, scope: str | None = None,
                           default_thread_id: str | None = None) -> ThreadKey | None:
    """The registry key of the thread a run config belongs to.

    Args:
        config: a RunnableConfig (a node's, a checkpointer's, or one passed to ``invoke``).
        scope: optional name that separates several LLM contexts of one graph thread.
        default_thread_id: used when the config has no ``thread_id`` (None: no key).

    Returns:
        ``(thread_id, namespace[#scope])``, or None without a thread id.
    """
    conf = (config or {}).get("configurable") or {}
    tid = conf.get("thread_id", default_thread_id)
    if tid is None:
        return None
    ns = canonical_ns(conf.get("checkpoint_ns", ""), conf.get(_TASK_ID))
    if scope:
        ns = f"{ns}#{scope}"
    return thread_key(str(tid), ns)


def current_thread_key() -> ThreadKey | None:
    """The key set by :func:`using_thread_key` (the middleware or node wrapper), if any."""
    return _CURRENT.get()


@contextlib.contextmanager
def using_thread_key(key: ThreadKey | None) -> Iterator[None]:
    """Make ``key`` the thread of every PatchKV model call inside the block (this context only)."""
    token = _CURRENT.set(key)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def base_ns(ns: str) -> str:
    """A key's namespace without its ``#scope``."""
    return ns.split("#", 1)[0]


def thread_key_from_metadata(metadata: Mapping[str, Any] | None, *, scope: str | None = None,
                             default_thread_id: str | None = None) -> ThreadKey | None:
    """The thread key from a run's callback metadata (``thread_id``, ``langgraph_checkpoint_ns``,
    ``langgraph_node``), for model calls that see no graph config (e.g. ``model.invoke(msgs, config)``).

    Returns:
        The key, or None without a thread id and default.
    """
    meta = metadata or {}
    tid = meta.get("thread_id", default_thread_id)
    if tid is None:
        return None
    ns = meta.get("langgraph_checkpoint_ns", "") or ""
    node = meta.get("langgraph_node")
    parts = [p for p in ns.split(_NS_SEP) if p]
    if node and parts and parts[-1].startswith(f"{node}{_NS_END}"):
        parts = parts[:-1]
    ns = canonical_ns(_NS_SEP.join(parts))
    if scope:
        ns = f"{ns}#{scope}"
    return thread_key(str(tid), ns)

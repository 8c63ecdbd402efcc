"""``patchkv_node``: KV resume and background offload around any LLM node of a hand-built ``StateGraph``.

The wrapped node runs under its graph thread's key (so every
:class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel` call inside, or a direct
``registry.generate(current_thread_key(), ids)``, resumes that thread's previous context version), and
when it returns, the thread's KV is offloaded in the registry's background worker, so that the
checkpoint work overlaps whatever the graph does next (tools, retrieval, a controller editing the
context) and the next call of the node waits for it only if it is not done.

With ``predict_next=``, the node also prepares its next call: the hook (run on a thread of its own after
the node returns, for the registry's ``predict_timeout_s`` at most) gives the ids of the next call's
context up to what is not known yet, and they are computed exactly while the graph goes on
(:meth:`~patchkv_agent.runtime.threads.ThreadRegistry.prepare_async`);
:func:`~patchkv_agent.langgraph.predict.known_prefix_ids` renders a predicted message list to such ids.
Without the hook nothing is prepared.

Knows LangGraph's node calling convention (``(state, config)``) and the registry; no tensors.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

from langchain_core.messages import AIMessage
from langchain_core.runnables import RunnableConfig

from ..runtime.threads import ThreadKey, ThreadRegistry
from .keys import thread_key_from_config, using_thread_key

OFFLOAD_POLICIES = ("tool_calls", "always", "never")


def _wants_config(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "config" in params


def _asks_for_tools(update: Any) -> bool:
    msgs = update.get("messages") if isinstance(update, dict) else None
    if isinstance(msgs, AIMessage):
        msgs = [msgs]
    last = msgs[-1] if isinstance(msgs, list) and msgs else None
    return isinstance(last, AIMessage) and bool(last.tool_calls)


def patchkv_node(fn: Callable, registry: ThreadRegistry, *, scope: str | None = None,
                 offload: str = "tool_calls", predict_next: Callable[[Any, Any], Any] | None = None) -> Callable:
    """Wrap an LLM node ``fn(state)`` or ``fn(state, config)`` (sync or async) for per-thread KV reuse.

    Args:
        fn: the node function; it returns a state update.
        registry: the :class:`~patchkv_agent.runtime.threads.ThreadRegistry` its model uses.
        scope: optional key scope (two LLM nodes of one graph thread with different contexts).
        offload: when to offload after the node returns: ``"tool_calls"`` (the update's last message is
            an AIMessage with tool calls), ``"always"`` (the graph always pauses after this node, e.g. a
            controller or a tool follows), ``"never"``.
        predict_next: ``predict_next(state, update)`` -> the next call's context ids up to the unknown part
            (token ids, a :class:`~patchkv_agent.runtime.state.Prediction`, or None), called on a thread
            of its own (abandoned past the registry's ``predict_timeout_s``; what it raises is recorded)
            whenever the node's update asks for tools (or always, with ``offload="always"``); None:
            nothing is prepared.

    Returns:
        A node ``(state, config) -> update`` (a coroutine function when ``fn`` is one).

    Raises:
        ValueError: an unknown ``offload`` policy, a ``predict_next`` that is not callable.
    """
    if offload not in OFFLOAD_POLICIES:
        raise ValueError(f"offload must be one of {OFFLOAD_POLICIES}, got {offload!r}")
    if predict_next is not None and not callable(predict_next):
        raise ValueError(f"predict_next must be a callable (state, update) -> ids, got {type(predict_next).__name__}")
    pass_config = _wants_config(fn)

    def key_of(config: RunnableConfig) -> ThreadKey | None:
        return thread_key_from_config(config, scope=scope)

    def after(key: ThreadKey | None, state: Any, update: Any) -> None:
        pause = offload == "always" or _asks_for_tools(update)
        if key is not None and predict_next is not None and pause:
            def predict():
                with using_thread_key(key):
                    return predict_next(state, update)

            registry.prepare_async(key, predict)
        if key is not None and (offload == "always" or (offload == "tool_calls" and _asks_for_tools(update))):
            registry.offload_async(key)

    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def anode(state, config: RunnableConfig):
            key = key_of(config)
            with using_thread_key(key):
                update = await (fn(state, config=config) if pass_config else fn(state))
            after(key, state, update)
            return update

        anode.__signature__ = _node_signature()
        return anode

    @functools.wraps(fn)
    def node(state, config: RunnableConfig):
        key = key_of(config)
        with using_thread_key(key):
            update = fn(state, config=config) if pass_config else fn(state)
        after(key, state, update)
        return update

    node.__signature__ = _node_signature()
    return node


def _node_signature() -> inspect.Signature:
    # functools.wraps copies fn's signature into __wrapped__; LangGraph must see (state, config).
    P = inspect.Parameter
    return inspect.Signature([P("state", P.POSITIONAL_OR_KEYWORD),
                              P("config", P.POSITIONAL_OR_KEYWORD, annotation=RunnableConfig)])

"""The next model call's context, predicted while the tools run, by the agent's own editors.

When a ``create_agent`` response asks for tools, everything of the next call except the tool results is
known: the history, the response, and what the agent's context editors will do to them. The editors are
not copied here: :func:`predict_agent_context` calls them (``before_model`` hooks such as
``SummarizationMiddleware``, ``wrap_model_call`` hooks such as ``ContextEditingMiddleware`` with
``ClearToolUsesEdit``) on the predicted state, with placeholder tool results and a handler that captures
the request they would send, so a LangChain upgrade that changes an editor changes the prediction too.
The captured request is rendered by the chat model twice, with two different placeholder contents; the
ids the two renderings share are the prediction (:class:`~patchkv_agent.runtime.state.Prediction`).

- A placeholder's size is the median size of earlier results of the same tool (of any tool, else 400
  characters). When the edit's trigger depends on that size (an empty result and a huge one give
  different edits), the likelier outcome is predicted and ``info["trigger_depends_on_result_size"]``
  says so; for a ``before_model`` editor (a summary) that a result as large as the largest earlier one
  would trigger, the summarized outcome is prepared (``info["<Editor>_depends_on_result_size"]``): a summary prepared in vain costs
  only the wait, a summary missed costs the whole summarized context's prefill.
- A summarizer call whose input is known before the tools return (the messages to summarize hold no
  placeholder) is made during the wait; its response is stored in :class:`PreparedCalls`, a LangChain
  ``BaseCache`` set on the summarizer's model, and served to the real call when its prompt and model
  parameters are the same (greedy decoding only). A summary that needs the pending results is not
  predicted (the chat model refuses a call that would read a placeholder: :class:`PendingToolResult`).

Boundary: LangChain messages, middlewares and caches; the chat model by duck typing (``render``); no
tensors, no registry.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import statistics
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Iterator, Sequence

from langchain_core.caches import BaseCache
from langchain_core.messages import AIMessage, BaseMessage, RemoveMessage, ToolMessage
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from ..runtime.state import Prediction
from .tools import tool_schemas

log = logging.getLogger(__name__)

__all__ = ["PreparedCalls", "PendingToolResult", "predict_agent_context", "known_prefix_ids", "check_not_pending",
           "recording_calls",
           "SAFETY_TOKENS", "DEFAULT_RESULT_CHARS", "PENDING"]

DEFAULT_RESULT_CHARS = 400
PENDING = "pending tool result"  # the text of a placeholder result (after one opening character)
SAFETY_TOKENS = 2  # the prediction stops this many tokens before the first placeholder token (a tokenizer may
#                    merge the last known characters with the result's first ones)
_PENDING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("patchkv_pending_markers", default=())
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("patchkv_recording_calls", default=None)
IN_FLIGHT_WAIT_S = 600.0  # the longest a real call waits for the same call a prediction is making


class PendingToolResult(RuntimeError):
    """A model call made during a prediction would read a tool result that does not exist yet."""


def check_not_pending(messages: Sequence[BaseMessage]) -> None:
    """Raise :class:`PendingToolResult` when a prediction is running and ``messages`` hold a placeholder
    (the chat model calls this before it generates)."""
    markers = _PENDING.get()
    if not markers:
        return
    for m in messages:
        text = m.content if isinstance(m.content, str) else str(m.content)
        if any(mk in text for mk in markers):
            raise PendingToolResult("this call needs the results of tools that are still running")


@contextlib.contextmanager
def recording_calls(markers: tuple[str, ...] = ()) -> Iterator[None]:
    """Inside the block, :class:`PreparedCalls` stores the responses of calls, and calls that read one of
    ``markers`` raise :class:`PendingToolResult`."""
    started: list = []  # (cache, key) of the calls this block began: released when it ends, made or not
    t1, t2 = _RECORDING.set(started), _PENDING.set(tuple(markers))
    try:
        yield
    finally:
        _RECORDING.reset(t1)
        _PENDING.reset(t2)
        for cache, key in started:
            cache._release(key)


class PreparedCalls(BaseCache):
    """A LangChain cache holding only the responses of calls made during a tool wait, each served once.

    Set it as the ``cache`` of the model whose calls a prediction makes (the summarizer's): ``update``
    stores a response only inside :func:`recording_calls` (the prediction), ``lookup`` returns a stored
    response once (same prompt, same model parameters: LangChain's own cache key) and forgets it. A real
    call whose twin the prediction is still making waits for it (the prediction started it earlier, so it
    ends sooner than a second decode would) and is served its response; a prediction that ends without
    the response releases the waiter, which then decodes itself. Any other call passes through
    unchanged. At most ``max_entries`` responses are held (oldest dropped).

    Args:
        max_entries: responses held at most.

    Raises:
        ValueError: ``max_entries`` < 1.
    """

    def __init__(self, max_entries: int = 16):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        self.max_entries = max_entries
        self._held: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._in_flight: dict[tuple[str, str], threading.Event] = {}
        self._lock = threading.Lock()
        self.hits = 0
        self.stored = 0
        self.waited_s = 0.0

    def lookup(self, prompt: str, llm_string: str) -> Any:
        """The stored response of this call (removed), or None; waits for the same call in flight in a
        prediction (see the class docstring)."""
        key = (prompt, llm_string)
        started = _RECORDING.get()
        with self._lock:
            val = self._held.pop(key, None)
            if val is not None:
                self.hits += 1
                return val
            evt = self._in_flight.get(key)
            if started is not None:  # a prediction makes this call: a real twin may wait for it
                if evt is None:
                    self._in_flight[key] = threading.Event()
                    started.append((self, key))
                return None
        if evt is None:
            return None
        t0 = time.perf_counter()
        evt.wait(IN_FLIGHT_WAIT_S)
        with self._lock:
            self.waited_s += time.perf_counter() - t0
            val = self._held.pop(key, None)
            if val is not None:
                self.hits += 1
            return val

    def update(self, prompt: str, llm_string: str, return_val: Any) -> None:
        """Store a response made during a prediction (ignored otherwise) and release its waiters."""
        if _RECORDING.get() is None:
            return
        key = (prompt, llm_string)
        with self._lock:
            self._held[key] = return_val
            self._held.move_to_end(key)
            self.stored += 1
            while len(self._held) > self.max_entries:
                self._held.popitem(last=False)
        self._release(key)

    def _release(self, key: tuple[str, str]) -> None:
        with self._lock:
            evt = self._in_flight.pop(key, None)
        if evt is not None:
            evt.set()

    def clear(self, **kwargs: Any) -> None:
        """Forget every stored response (and release calls waiting for one)."""
        with self._lock:
            self._held.clear()
            keys = list(self._in_flight)
        for key in keys:
            self._release(key)

    def __len__(self) -> int:
        return len(self._held)


def _apply_update(messages: list, update: Sequence) -> list:
    """The ``add_messages`` reducer's effect of a ``before_model`` update on a message list (what the graph
    does with it): ``RemoveMessage(REMOVE_ALL_MESSAGES)`` clears, a ``RemoveMessage`` drops its id, a
    message with a known id replaces it, others are appended."""
    out = list(messages)
    for m in update:
        if isinstance(m, RemoveMessage):
            out = [] if m.id == REMOVE_ALL_MESSAGES else [x for x in out if x.id != m.id]
            continue
        idx = next((i for i, x in enumerate(out) if m.id is not None and x.id == m.id), None)
        if idx is None:
            out.append(m)
        else:
            out[idx] = m
    return out


def _overrides(editor: Any, hook: str) -> bool:
    from langchain.agents.middleware import AgentMiddleware

    mine = getattr(type(editor), hook, None)
    return mine is not None and mine is not getattr(AgentMiddleware, hook, None)


def _result_chars(history: Sequence[BaseMessage], name: str, largest: bool = False) -> int:
    """The median (or largest) size of earlier results of tool ``name`` (of any tool; else the default)."""
    sizes = [len(str(m.content)) for m in history if isinstance(m, ToolMessage) and m.name == name]
    sizes = sizes or [len(str(m.content)) for m in history if isinstance(m, ToolMessage)]
    if not sizes:
        return DEFAULT_RESULT_CHARS
    return max(sizes) if largest else int(statistics.median(sizes))


def _placeholder(marker: str, chars: int) -> str:
    filler = " result" * max(0, (chars - len(marker)) // 7)
    return marker + filler


def _edited(request: Any, editors: Sequence[Any], messages: list) -> Any:
    """The request the ``wrap_model_call`` editors would send for ``messages`` (captured, not sent)."""
    from langchain.agents.middleware import ModelResponse

    captured: dict[str, Any] = {}

    def capture(req: Any) -> Any:
        captured["request"] = req
        return ModelResponse(result=[AIMessage(content="")])

    handler = capture
    for ed in reversed([e for e in editors if _overrides(e, "wrap_model_call")]):
        handler = (lambda h, e: (lambda req: e.wrap_model_call(req, h)))(handler, ed)
    handler(request.override(messages=messages))
    if "request" not in captured:
        raise RuntimeError("an editor answered without calling its handler")
    return captured["request"]


def predict_agent_context(model: Any, request: Any, response: AIMessage, editors: Sequence[Any]) -> Prediction:
    """The next call's context up to its tool results, as the agent's editors will make it.

    Args:
        model: the :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel` that renders the call.
        request: the ``ModelRequest`` of the call that asked for tools (its state, system message, tools and
            tool choice are assumed to hold for the next call).
        response: that call's response (with ``tool_calls``).
        editors: the agent's context editors, in the agent's middleware order (``before_model`` hooks run
            first, then the ``wrap_model_call`` hooks, outermost first).

    Returns:
        A :class:`~patchkv_agent.runtime.state.Prediction`: the ids, or None with the reason (structured
        output, no tool calls, a summary that needs the pending results, an editor that failed).
    """
    if getattr(request, "response_format", None) is not None:
        return Prediction(reason="structured output calls are not predicted")
    calls = list(getattr(response, "tool_calls", None) or [])
    if not calls:
        return Prediction(reason="the response asks for no tool")
    state = dict(getattr(request, "state", None) or {})
    history = list(state.get("messages") or []) + [response]
    # two markers that differ from their first character on: the renderings share only what precedes them
    markers = tuple(f"{c}{PENDING} {uuid.uuid4().hex[:12]}" for c in "[(")
    sizes = [_result_chars(history, c["name"]) for c in calls]
    # how much larger a result of these tools has been: the "larger result" a summary trigger is tried with
    larger = max(_result_chars(history, c["name"], largest=True) / max(1, n) for c, n in zip(calls, sizes))
    info: dict[str, Any] = {"editors": [type(e).__name__ for e in editors], "tool_calls": len(calls),
                            "assumed_result_chars": sizes}
    msgs = history + [ToolMessage(content=_placeholder(f"{markers[0]}{i}", n), tool_call_id=c["id"], name=c["name"])
                      for i, (c, n) in enumerate(zip(calls, sizes))]  # the pending results, of the assumed sizes
    runtime = getattr(request, "runtime", None)
    with recording_calls(markers):
        for ed in editors:
            if not _overrides(ed, "before_model"):
                continue
            name = type(ed).__name__
            try:
                upd = ed.before_model({**state, "messages": msgs}, runtime)
                if not (upd and upd.get("messages")) and larger > 1.0:
                    # would a result as large as the largest earlier one trigger it? Then prepare that outcome:
                    # a summary prepared in vain costs the wait, a summary missed the summarized prefill
                    big = _swap_sizes(msgs, markers[0], larger)
                    upd = ed.before_model({**state, "messages": big}, runtime)
                    if upd and upd.get("messages"):
                        info[f"{name}_depends_on_result_size"] = True
                        msgs = _swap_sizes(_apply_update(big, upd["messages"]), markers[0], 1 / larger)
                        info[name] = "applied (a result larger than the assumed size triggers it)"
                        continue
            except PendingToolResult:
                return Prediction(reason=f"{name} needs the pending tool results (it would summarize them)",
                                  info=info)
            if upd and upd.get("messages"):
                msgs = _apply_update(msgs, upd["messages"])
                info[name] = "applied"
        req = _edited(request, editors, msgs)
        if any(_overrides(e, "wrap_model_call") for e in editors):
            # does the pending results' size decide the edit? (an empty and a huge result)
            def known(r: Any) -> list:
                return [str(m.content) for m in r.messages if not (isinstance(m, ToolMessage)
                                                                   and markers[0] in str(m.content))]

            lo = known(_edited(request, editors, _swap_sizes(msgs, markers[0], 0.0)))
            hi = known(_edited(request, editors, _swap_sizes(msgs, markers[0], 64.0)))
            info["trigger_depends_on_result_size"] = lo != hi
            if lo != hi:
                info["assumed_outcome"] = "edited as for results of the assumed size"
    cleared = sum(1 for m in req.messages if isinstance(m, ToolMessage)
                  and (m.response_metadata or {}).get("context_editing", {}).get("cleared"))
    info["cleared_results"] = cleared
    system = [req.system_message] if getattr(req, "system_message", None) is not None else []
    tools = []
    if req.tools and not (isinstance(req.tool_choice, str) and req.tool_choice == "none"):
        tools = tool_schemas(req.tools)
    final = system + list(req.messages)
    ids_a = model.render(final, tools, None)[1]
    n = _known_tokens(ids_a, model.render(_swap_marker(final, markers[0], markers[1]), tools, None)[1])
    if n < 1:
        return Prediction(reason="the rendered context differs from its first token on", info=info)
    info["prepared_tokens"] = n
    return Prediction(token_ids=ids_a[:n], info=info)


def known_prefix_ids(model: Any, messages: Sequence[BaseMessage], tools: Sequence[Any] | None = None):
    """The ids every continuation of ``messages`` renders to first (for a node's ``predict_next`` hook).

    Renders ``messages`` followed by two different user turns and keeps the ids the two share, less
    :data:`SAFETY_TOKENS`: whatever message comes next (a tool result, a user turn), the next call's
    context starts with these ids.

    Args:
        model: a :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel`.
        messages: the next call's messages before the unknown ones (system message included).
        tools: the tools bound for that call (as given to ``bind_tools``).

    Returns:
        An int64 array (empty when nothing is known).
    """
    from langchain_core.messages import HumanMessage

    schemas = tool_schemas(tools) if tools else []
    a = model.render(list(messages) + [HumanMessage("[a")], schemas, None)[1]
    return a[:_known_tokens(a, model.render(list(messages) + [HumanMessage("(b")], schemas, None)[1])]


def _known_tokens(a, b) -> int:
    """How many leading ids two renderings that differ only in what is unknown share, less
    :data:`SAFETY_TOKENS` (the tokenizer may merge the last known characters with the unknown ones)."""
    m = min(len(a), len(b))
    neq = (a[:m] != b[:m]).nonzero()[0]
    return max(0, (int(neq[0]) if len(neq) else m) - SAFETY_TOKENS)


def _swap_sizes(msgs: list, marker: str, scale: float) -> list:
    """``msgs`` with each placeholder result (``marker`` + index + filler) resized by ``scale``."""
    head = re.compile(re.escape(marker) + r"\d+")
    out = []
    for m in msgs:
        body = str(m.content) if isinstance(m, ToolMessage) else ""
        hit = head.match(body)
        if hit is not None:
            m = m.model_copy(update={"content": _placeholder(hit.group(0), int(len(body) * scale))})
        out.append(m)
    return out


def _swap_marker(msgs: list, old: str, new: str) -> list:
    return [m.model_copy(update={"content": str(m.content).replace(old, new)})
            if isinstance(m, ToolMessage) and old in str(m.content) else m for m in msgs]

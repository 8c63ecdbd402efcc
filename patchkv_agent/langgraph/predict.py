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
  characters), at most what the editors' triggers need to decide (:func:`placeholder_cap`: a result larger
  than every trigger decides nothing more), and all placeholders of one prediction together at most
  :data:`MAX_PENDING_CHARS` characters: a 10 MB tool result is never copied into a prediction. When the edit's trigger depends on that size (an empty result and a huge one give
  different edits), the likelier outcome is predicted and ``info["trigger_depends_on_result_size"]``
  says so; for a ``before_model`` editor (a summary) that a result as large as the largest earlier one
  would trigger, the summarized outcome is prepared (``info["<Editor>_depends_on_result_size"]``): a summary prepared in vain costs
  only the wait, a summary missed costs the whole summarized context's prefill.
- A summarizer call whose input is known before the tools return (the messages to summarize hold no
  placeholder) is made during the wait; its response is stored in :class:`PreparedCalls`, a LangChain
  ``BaseCache`` set on the summarizer's model, and served to the real call of the same thread when its
  prompt and model parameters are the same (greedy decoding only: a sampling model is refused). A summary that needs the pending results is not
  predicted (the chat model refuses a call that would read a placeholder: :class:`PendingToolResult`).

:func:`predict_agent_request` stops at the edited request (the messages, tools and tool choice the next call
will send, with placeholder results); :func:`predict_agent_context` renders it with a PatchKV chat model, and
:mod:`patchkv_agent.serving` renders it with a server's own chat template.

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
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
from langchain_core.caches import BaseCache
from langchain_core.messages import AIMessage, BaseMessage, RemoveMessage, ToolMessage
from langgraph.graph.message import REMOVE_ALL_MESSAGES

from ..runtime.state import Prediction
from .keys import current_thread_key
from .tools import tool_schemas

log = logging.getLogger(__name__)

__all__ = ["PreparedCalls", "PendingToolResult", "PredictedRequest", "predict_agent_request", "predict_agent_context",
           "render_prediction", "known_prefix_ids", "known_tokens", "first_difference", "unexplained_edit", "check_not_pending", "recording_calls", "placeholder_cap",
           "SAFETY_TOKENS", "DEFAULT_RESULT_CHARS", "PENDING", "MAX_PENDING_CHARS"]

DEFAULT_RESULT_CHARS = 400
PENDING = "pending tool result"  # the text of a placeholder result (after one opening character)
SAFETY_TOKENS = 2  # the prediction stops this many tokens before the first placeholder token (a tokenizer may
#                    merge the last known characters with the result's first ones)
_PENDING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("patchkv_pending_markers", default=())
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("patchkv_recording_calls", default=None)
MAX_PENDING_CHARS = 1 << 20  # all placeholder results of one prediction together, at most (characters)
DEFAULT_TRIGGER_CHARS = 1 << 18  # a placeholder's cap when no editor names a token trigger (characters)
CHARS_PER_TOKEN = 4  # LangChain's approximate token count: a trigger of n tokens is decided by ~4n characters
RESULT_SIZE_PROBE = 64.0  # "a huge result": the assumed size times this, capped like any placeholder


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
    response once (same thread, same prompt, same model parameters: LangChain's own cache key plus the
    thread) and forgets it, so one thread's prepared summary is never served to another thread's identical
    prompt. A real call whose twin the prediction is still making waits for it (the prediction started it
    earlier, so it ends sooner than a second decode would) for at most ``max_wait_s`` or, once calls have
    been made, twice the longest one made so far (then it decodes itself); a prediction that ends without
    the response releases the waiter at once. Any other call passes through unchanged. At most
    ``max_entries`` responses are held (oldest dropped).

    Greedy decoding only: a call whose model samples (``temperature`` above 0, or unset on a model whose
    server chooses) raises ``ValueError`` naming the fix, since a stored sample re-served is not a sample.

    Args:
        max_entries: responses held at most.
        max_wait_s: the longest a real call waits for its twin in flight, before any call was timed.

    Raises:
        ValueError: ``max_entries`` < 1 or ``max_wait_s`` < 0; at call time, a sampling model.
    """

    def __init__(self, max_entries: int = 16, max_wait_s: float = 30.0):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_entries must be an int >= 1, got {max_entries!r}")
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, (int, float)) or not max_wait_s >= 0:
            raise ValueError(f"max_wait_s must be a number >= 0, got {max_wait_s!r}")
        self.max_entries = max_entries
        self.max_wait_s = float(max_wait_s)
        self._held: OrderedDict[tuple[str, str, str], Any] = OrderedDict()
        self._in_flight: dict[tuple[str, str, str], tuple[threading.Event, float]] = {}
        self._lock = threading.Lock()
        self._longest_s = 0.0  # the longest call a prediction made (start to update)
        self.hits = 0
        self.stored = 0
        self.waited_s = 0.0
        self.gave_up = 0  # real calls that stopped waiting for a twin and decoded themselves

    def _key(self, prompt: str, llm_string: str) -> tuple[str, str, str]:
        _refuse_sampling(llm_string)
        return (_thread_of_call(), prompt, llm_string)

    def _wait_bound(self) -> float:
        return min(self.max_wait_s, 2.0 * self._longest_s) if self._longest_s > 0 else self.max_wait_s

    def lookup(self, prompt: str, llm_string: str) -> Any:
        """The stored response of this call (removed), or None; waits (bounded) for the same call in flight
        in a prediction (see the class docstring).

        Raises:
            ValueError: the model samples.
        """
        key = self._key(prompt, llm_string)
        started = _RECORDING.get()
        with self._lock:
            val = self._held.pop(key, None)
            if val is not None:
                self.hits += 1
                return val
            flight = self._in_flight.get(key)
            if started is not None:  # a prediction makes this call: a real twin may wait for it
                if flight is None:
                    self._in_flight[key] = (threading.Event(), time.perf_counter())
                    started.append((self, key))
                return None
            bound = self._wait_bound()
        if flight is None:
            return None
        t0 = time.perf_counter()
        done = flight[0].wait(max(0.0, bound - (t0 - flight[1])))  # counted from when the twin started
        with self._lock:
            self.waited_s += time.perf_counter() - t0
            val = self._held.pop(key, None)
            if val is not None:
                self.hits += 1
            elif not done:
                self.gave_up += 1
            return val

    def update(self, prompt: str, llm_string: str, return_val: Any) -> None:
        """Store a response made during a prediction (ignored otherwise) and release its waiters.

        Raises:
            ValueError: the model samples.
        """
        key = self._key(prompt, llm_string)
        if _RECORDING.get() is None:
            return
        with self._lock:
            flight = self._in_flight.get(key)
            if flight is not None:
                self._longest_s = max(self._longest_s, time.perf_counter() - flight[1])
            self._held[key] = return_val
            self._held.move_to_end(key)
            self.stored += 1
            while len(self._held) > self.max_entries:
                self._held.popitem(last=False)
        self._release(key)

    def _release(self, key: tuple[str, str, str]) -> None:
        with self._lock:
            flight = self._in_flight.pop(key, None)
        if flight is not None:
            flight[0].set()

    def clear(self, **kwargs: Any) -> None:
        """Forget every stored response (and release calls waiting for one)."""
        with self._lock:
            self._held.clear()
            keys = list(self._in_flight)
        for key in keys:
            self._release(key)

    def __len__(self) -> int:
        return len(self._held)


_TEMPERATURE = re.compile(r"""['"]temperature['"]\s*[:,]\s*([-+0-9.eE]+|None|null)""")


def _refuse_sampling(llm_string: str) -> None:
    """Raise ``ValueError`` when a LangChain cache key (``llm_string``) names a sampling model: a
    ``temperature`` above 0 (the last one named: call parameters follow the model's), or none at all on a
    serialized model (an OpenAI-compatible server samples at its default then)."""
    found = _TEMPERATURE.findall(llm_string or "")
    value = found[-1] if found else None
    if value is None and '"kwargs"' not in (llm_string or ""):
        return  # a model that names no temperature and is not serialized: it sets its own (PatchKV: greedy)
    try:
        t = float(value) if value not in (None, "None", "null") else None
    except ValueError:
        t = None
    if t is None or t > 0:
        raise ValueError("PreparedCalls serves greedy calls only (a stored sample re-served is not a sample): "
                         f"the model's temperature is {value or 'unset'}; set temperature=0 on the summarizer's "
                         "model, or remove PreparedCalls from its cache")


def _thread_of_call() -> str:
    """The thread id of the call in progress: the PatchKV key's set around it (a prediction's), else the run
    config's (a real call in a graph node)."""
    key = current_thread_key()
    if key is not None:
        return repr((str(key[0]),))
    try:
        from langchain_core.runnables.config import ensure_config

        conf = (ensure_config().get("configurable") or {})
    except Exception:  # noqa: BLE001 - no run config: no thread
        conf = {}
    tid = conf.get("thread_id")
    return "" if tid is None else repr((str(tid),))


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
    sizes = [_content_chars(m) for m in history if isinstance(m, ToolMessage) and m.name == name]
    sizes = sizes or [_content_chars(m) for m in history if isinstance(m, ToolMessage)]
    if not sizes:
        return DEFAULT_RESULT_CHARS
    return max(sizes) if largest else int(statistics.median(sizes))


def _content_chars(m: BaseMessage) -> int:
    """A message's content length in characters, without copying a string content."""
    c = m.content
    return len(c) if isinstance(c, str) else len(str(c))


def placeholder_cap(editors: Sequence[Any]) -> int:
    """The largest placeholder result worth rendering for these editors (characters).

    A trigger of ``n`` tokens is decided by about ``CHARS_PER_TOKEN * n`` characters: a placeholder larger
    than twice the largest token trigger any editor names (``ClearToolUsesEdit.trigger``, a
    ``SummarizationMiddleware`` ``("tokens", n)`` trigger, ...) decides nothing more. Without a named
    trigger: :data:`DEFAULT_TRIGGER_CHARS`. Never above :data:`MAX_PENDING_CHARS`.

    Args:
        editors: the agent's context editors.

    Returns:
        The cap in characters (>= 1).
    """
    triggers: list[int] = []

    def scan(obj: Any, depth: int = 0) -> None:
        if depth > 2 or obj is None:
            return
        t = getattr(obj, "trigger", None)
        for cond in (t if isinstance(t, list) else [t]):
            if isinstance(cond, bool):
                continue
            if isinstance(cond, int):
                triggers.append(cond)
            elif isinstance(cond, tuple) and len(cond) == 2 and cond[0] == "tokens" and isinstance(cond[1], int):
                triggers.append(cond[1])
            elif isinstance(cond, dict) and isinstance(cond.get("tokens"), int):
                triggers.append(cond["tokens"])
        for inner in getattr(obj, "edits", None) or []:
            scan(inner, depth + 1)

    for ed in editors:
        scan(ed)
    cap = 2 * CHARS_PER_TOKEN * max(triggers) if triggers else DEFAULT_TRIGGER_CHARS
    return max(1, min(int(cap), MAX_PENDING_CHARS))


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


@dataclass(frozen=True)
class PredictedRequest:
    """The next call's request as the agent's editors will make it, with placeholder tool results.

    Attributes:
        request: the edited ``ModelRequest`` (messages, system message, tools, tool choice, settings).
        messages: the messages the call sends: the system message (if any) and the request's messages.
        tools: the tools bound for the call (empty when ``tool_choice="none"``).
        markers: two placeholder markers; :meth:`swapped` renders the same request with the second one, so
            the ids two renderings share are what the next call is known to start with.
        info: the prediction's notes (editors applied, results cleared, assumptions made).
        history: the state's messages and the response the prediction started from (before any editor).
    """

    request: Any
    messages: tuple
    tools: tuple
    markers: tuple[str, str]
    info: dict
    history: tuple = ()

    def swapped(self) -> list:
        """``messages`` with every placeholder's marker replaced by the second marker."""
        return _swap_marker(list(self.messages), self.markers[0], self.markers[1])

    def pending_index(self) -> int:
        """The index in ``messages`` of the first placeholder result (``len(messages)`` when an editor cleared
        every one: the whole next context is known)."""
        return next((i for i, m in enumerate(self.messages)
                     if isinstance(m, ToolMessage) and self.markers[0] in str(m.content)), len(self.messages))


def predict_agent_request(request: Any, response: AIMessage, editors: Sequence[Any]) -> "PredictedRequest | Prediction":
    """The next call's request up to its tool results, as the agent's editors will make it.

    Args:
        request: the ``ModelRequest`` of the call that asked for tools (its state, system message, tools and
            tool choice are assumed to hold for the next call).
        response: that call's response (with ``tool_calls``).
        editors: the agent's context editors, in the agent's middleware order (``before_model`` hooks run
            first, then the ``wrap_model_call`` hooks, outermost first).

    Returns:
        A :class:`PredictedRequest`, or a :class:`~patchkv_agent.runtime.state.Prediction` without ids and
        with the reason there is none (structured output, no tool calls, a summary that needs the pending
        results).
    """
    if getattr(request, "response_format", None) is not None:
        return Prediction(reason="structured output calls are not predicted")
    calls = list(getattr(response, "tool_calls", None) or [])
    if not calls:
        return Prediction(reason="the response asks for no tool")
    state = dict(getattr(request, "state", None) or {})
    history = list(state.get("messages") or []) + [response]
    # two markers that differ from their first character on: the renderings share only what precedes them
    markers = (f"[{PENDING} {uuid.uuid4().hex[:12]}", f"({PENDING} {uuid.uuid4().hex[:12]}")
    # each placeholder at most what a trigger needs, all of them together at most MAX_PENDING_CHARS
    cap = min(placeholder_cap(editors), max(1, MAX_PENDING_CHARS // len(calls)))
    sizes = [min(_result_chars(history, c["name"]), cap) for c in calls]
    # how much larger a result of these tools has been: the "larger result" a summary trigger is tried with
    larger = max(min(_result_chars(history, c["name"], largest=True), cap) / max(1, n)
                 for c, n in zip(calls, sizes))
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
                    big = _swap_sizes(msgs, markers[0], larger, cap)
                    upd = ed.before_model({**state, "messages": big}, runtime)
                    if upd and upd.get("messages"):
                        info[f"{name}_depends_on_result_size"] = True
                        msgs = _swap_sizes(_apply_update(big, upd["messages"]), markers[0], 1 / larger, cap)
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

            lo = known(_edited(request, editors, _swap_sizes(msgs, markers[0], 0.0, cap)))
            hi = known(_edited(request, editors, _swap_sizes(msgs, markers[0], RESULT_SIZE_PROBE, cap)))
            info["trigger_depends_on_result_size"] = lo != hi
            if lo != hi:
                info["assumed_outcome"] = "edited as for results of the assumed size"
    cleared = sum(1 for m in req.messages if isinstance(m, ToolMessage)
                  and (m.response_metadata or {}).get("context_editing", {}).get("cleared"))
    info["cleared_results"] = cleared
    system = [req.system_message] if getattr(req, "system_message", None) is not None else []
    tools: list = []
    if req.tools and not (isinstance(req.tool_choice, str) and req.tool_choice == "none"):
        tools = list(req.tools)
    final = tuple(system + list(req.messages))
    return PredictedRequest(request=req, messages=final, tools=tuple(tools), markers=markers, info=info,
                            history=tuple(history))


def predict_agent_context(model: Any, request: Any, response: AIMessage, editors: Sequence[Any]) -> Prediction:
    """The next call's context up to its tool results, as the agent's editors will make it, in the ids of a
    PatchKV chat model.

    Args:
        model: the :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel` that renders the call.
        request: the ``ModelRequest`` of the call that asked for tools.
        response: that call's response (with ``tool_calls``).
        editors: the agent's context editors (see :func:`predict_agent_request`).

    Returns:
        A :class:`~patchkv_agent.runtime.state.Prediction`: the ids, or None with the reason (structured
        output, no tool calls, a summary that needs the pending results, an editor that failed).
    """
    return render_prediction(model, predict_agent_request(request, response, editors))


def render_prediction(model: Any, pred: "PredictedRequest | Prediction") -> Prediction:
    """A :class:`PredictedRequest` in the ids of a PatchKV chat model: the ids its two renderings share, less
    :data:`SAFETY_TOKENS` (a :class:`~patchkv_agent.runtime.state.Prediction` without ids passes through).

    Args:
        model: the :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel` that renders the call.
        pred: what :func:`predict_agent_request` returned.

    Returns:
        The :class:`~patchkv_agent.runtime.state.Prediction`.
    """
    if isinstance(pred, Prediction):
        return pred
    schemas = tool_schemas(list(pred.tools)) if pred.tools else []
    ids_a = model.render(list(pred.messages), schemas, None)[1]
    n = known_tokens(ids_a, model.render(pred.swapped(), schemas, None)[1])
    if n < 1:
        return Prediction(reason="the rendered context differs from its first token on", info=pred.info)
    pred.info["prepared_tokens"] = n
    return Prediction(token_ids=ids_a[:n], info=pred.info)


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
    return a[:known_tokens(a, model.render(list(messages) + [HumanMessage("(b")], schemas, None)[1])]


def known_tokens(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two renderings that differ only in what is unknown share, less
    :data:`SAFETY_TOKENS` (the tokenizer may merge the last known characters with the unknown ones).

    Args:
        a, b: the two renderings' ids (arrays or lists of ints).

    Returns:
        The count (>= 0).
    """
    x, y = np.asarray(a), np.asarray(b)
    m = min(len(x), len(y))
    neq = (x[:m] != y[:m]).nonzero()[0]
    return max(0, (int(neq[0]) if len(neq) else m) - SAFETY_TOKENS)


def _swap_sizes(msgs: list, marker: str, scale: float, cap: int = MAX_PENDING_CHARS) -> list:
    """``msgs`` with each placeholder result (``marker`` + index + filler) resized by ``scale`` (at most
    ``cap`` characters)."""
    head = re.compile(re.escape(marker) + r"\d+")
    out = []
    for m in msgs:
        body = str(m.content) if isinstance(m, ToolMessage) else ""
        hit = head.match(body)
        if hit is not None:
            m = m.model_copy(update={"content": _placeholder(hit.group(0), min(cap, int(len(body) * scale)))})
        out.append(m)
    return out


def _swap_marker(msgs: list, old: str, new: str) -> list:
    return [m.model_copy(update={"content": str(m.content).replace(old, new)})
            if isinstance(m, ToolMessage) and old in str(m.content) else m for m in msgs]


def _fields(m: Any) -> tuple:
    """What of a message the chat templates render (its kind, content, calls, call id and name)."""
    calls = [(c.get("name"), c.get("args"), c.get("id")) for c in (getattr(m, "tool_calls", None) or [])]
    return (getattr(m, "type", None), m.content, calls, getattr(m, "tool_call_id", None), getattr(m, "name", None))


def first_difference(predicted: Sequence[BaseMessage], real: Sequence[BaseMessage], upto: int) -> str | None:
    """Where a real call's messages leave a prediction's, among the first ``upto`` (the known ones).

    Args:
        predicted: the predicted messages (:attr:`PredictedRequest.messages`).
        real: the messages the call sends (its system message first).
        upto: how many leading messages the prediction knows (:meth:`PredictedRequest.pending_index`).

    Returns:
        None when they agree, else ``"message i (kind): <what differs>"``.
    """
    for i in range(min(upto, len(predicted))):
        if i >= len(real):
            return f"message {i}: the call has only {len(real)} messages"
        a, b = _fields(predicted[i]), _fields(real[i])
        if a != b:
            what = next(n for n, x, y in zip(("kind", "content", "tool calls", "tool call id", "name"), a, b) if x != y)
            return f"message {i} ({b[0]}): its {what} differs from the prediction's"
    return None


def unexplained_edit(pred: PredictedRequest, request: Any, editors: Sequence[Any]) -> str | None:
    """Whether a real request that left its prediction was changed by something other than ``editors``.

    A prediction assumes the pending results' sizes; an editor given may decide otherwise on the real ones,
    which is a miss, not a mistake. What the editors cannot explain: a state that no longer extends the
    predicted history while no ``before_model`` editor was given (a summary written by a middleware the
    prediction did not run), or request messages that the ``wrap_model_call`` editors do not make from the
    real state (an edit made by a middleware the prediction did not run).

    Args:
        pred: the prediction.
        request: the real ``ModelRequest`` (after every middleware before the caller).
        editors: the editors the prediction ran.

    Returns:
        None when the editors explain the request, else what they do not explain (one line).
    """
    state = list((getattr(request, "state", None) or {}).get("messages") or [])
    hist = list(pred.history)
    if [_fields(m) for m in state[: len(hist)]] != [_fields(m) for m in hist]:
        if any(_overrides(e, "before_model") for e in editors):
            return None  # a before_model editor given decided differently on the real results
        return "the agent's state was rewritten by a middleware not among editors=[...] (a summary?)"
    wrapped = [e for e in editors if _overrides(e, "wrap_model_call")]
    try:
        again = _edited(request.override(messages=state), wrapped, state)
    except Exception:  # noqa: BLE001 - an editor that fails on a re-run explains nothing either way
        return None
    if [_fields(m) for m in again.messages] != [_fields(m) for m in request.messages]:
        return "the request's messages were edited by a middleware not among editors=[...]"
    return None

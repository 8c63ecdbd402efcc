"""``PatchKVMiddleware``: KV resume and background offload for LangChain >= 1 ``create_agent`` agents.

- ``wrap_model_call``: runs the model call under the graph thread's key, so the
  :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel` resumes that thread's previous context
  version (diff, plan, restore, recompute; from the thread's resident KV when it is still there, so it
  never waits for an offload). When the response asks for tools, the thread's KV is offloaded in the
  registry's background worker at once (for eviction, restarts and other processes; the resident KV
  stays), so the checkpoint work runs while the tools run, outside the model's forward lock.
- *Preparation* (``prepare=True``): when the response asks for tools, the next call's context up to the
  tool results is predicted by the agent's own editors (``editors=[...]``: the ``ContextEditingMiddleware``
  and ``SummarizationMiddleware`` instances the agent runs; :mod:`~patchkv_agent.langgraph.predict`) and
  computed exactly in the registry's worker while the tools run
  (:meth:`~patchkv_agent.runtime.threads.ThreadRegistry.prepare_async`): a next call that starts with it
  appends only the tool results, and its stats say ``prepared: "hit"``. A summarizer call the prediction
  makes is served to the real call through :class:`~patchkv_agent.langgraph.predict.PreparedCalls` (set as
  the cache of the summarizer's ``PatchKVChatModel``; greedy decoding only).
- ``wrap_tool_call``: makes sure the offload has started (idempotent) and times the tool, so the next
  response's ``response_metadata["patchkv"]`` reports ``tool_s`` beside ``offload_s`` /
  ``offload_wait_s`` (``offload_hidden_share``: the part of the offload that the tools hid). Both are
  fields of the stats' :class:`~patchkv_agent.results.CallPart`: the middleware reads the response's stats
  back (:meth:`~patchkv_agent.results.ResumeStats.from_json`), adds its fields there and writes the JSON
  form again.

Use it with a ``PatchKVChatModel`` sharing the same registry. Knows LangChain's middleware interface,
the registry, and the thread keys; no tensors.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Awaitable, Callable

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse
from langchain_core.messages import AIMessage

from ..results import BaseKind, ResumeStats
from ..runtime.threads import ThreadKey, ThreadRegistry
from .chat_model import PatchKVChatModel
from .keys import thread_key_from_config, using_thread_key
from .predict import PredictedRequest, PreparedCalls, predict_agent_request, render_prediction, unexplained_edit


def response_message(result: Any) -> AIMessage | None:
    """The last AIMessage of a model-call result (``ModelResponse``, ``AIMessage`` or extended response)."""
    if isinstance(result, AIMessage):
        return result
    inner = getattr(result, "model_response", result)
    for m in reversed(getattr(inner, "result", None) or []):
        if isinstance(m, AIMessage):
            return m
    return None


def annotate(msg: AIMessage | None, tool_s: float | None, unexplained: Any = None) -> None:
    """Set ``tool_s`` and ``offload_hidden_share`` in the call part of a response's PatchKV stats (the message's
    ``response_metadata["patchkv"]`` becomes the JSON form of the stats with them); metadata that does not read
    as :class:`~patchkv_agent.results.ResumeStats` is left as it is."""
    raw = msg.response_metadata.get("patchkv") if msg is not None else None
    if not isinstance(raw, dict):
        return
    try:
        st = ResumeStats.from_json(raw)
    except (KeyError, TypeError, ValueError):  # not stats a PatchKVChatModel wrote: left as they are
        return
    off, wait, hidden = st.offload_s, st.offload_wait_s or 0.0, None
    if st.base in (BaseKind.RESIDENT, BaseKind.PREPARED):  # resumed without the offload: none of it waited for
        hidden = 1.0
    elif st.base is BaseKind.BACKGROUND and off:
        hidden = max(0.0, 1.0 - wait / off) if off > 0 else 1.0
    note = unexplained(st) if callable(unexplained) else None
    fields = {k: v for k, v in (("tool_s", tool_s), ("offload_hidden_share", hidden), ("prepared_unexplained", note))
              if v is not None}
    if fields:
        msg.response_metadata["patchkv"] = st.with_call(**fields).to_json()


class PatchKVMiddleware(AgentMiddleware):
    """Per-thread KV resume and background offload around ``create_agent`` model calls.

    Args:
        registry: the :class:`~patchkv_agent.runtime.threads.ThreadRegistry` of the agent's ``PatchKVChatModel``.
        scope: optional key scope (separates this agent's context from other LLM contexts of the thread).
        offload: ``"tool_calls"`` (offload when the model asks for tools), ``"always"`` or ``"never"``.
        editors: the agent's context editors (the same middleware instances passed to ``create_agent``, in
            its order), run on the predicted next request; None: the history and response as they are.
        prepare: prepare the next call's context while the tools run (see the module docstring).

    Attributes:
        prepared_calls: the :class:`~patchkv_agent.langgraph.predict.PreparedCalls` cache set on the
            summarizer models of ``editors`` (``hits``: summaries served from the tool wait).

    Raises:
        ValueError: an unknown ``offload`` policy, an editor that is not an ``AgentMiddleware``; at call time,
            a ``PatchKVChatModel`` with another registry.
    """

    def __init__(self, registry: ThreadRegistry, *, scope: str | None = None, offload: str = "tool_calls",
                 editors: Any = None, prepare: bool = True):
        super().__init__()
        if offload not in ("tool_calls", "always", "never"):
            raise ValueError(f"offload must be 'tool_calls', 'always' or 'never', got {offload!r}")
        self.registry, self.scope, self.offload = registry, scope, offload
        self.editors = list(editors or [])
        bad = [type(e).__name__ for e in self.editors if not isinstance(e, AgentMiddleware)]
        if bad:
            raise ValueError(f"editors must be the agent's AgentMiddleware instances, got {bad}")
        self.prepare = bool(prepare)
        self.prepared_calls = PreparedCalls()
        for ed in self.editors:
            self._serve_summaries(ed)
        self._tool_s: dict[ThreadKey, float] = {}
        self._predicted: dict[ThreadKey, PredictedRequest] = {}
        self._lock = threading.Lock()
        self._warned = False
        self._warned_threads: set = set()

    def _serve_summaries(self, editor: Any) -> None:
        """Give a summarizing editor's PatchKV model the :attr:`prepared_calls` cache (a copy of the model:
        the agent's own calls never pay the cache's key)."""
        chat = getattr(editor, "_summary_chat_model", None)
        wrapped = getattr(editor, "_summary_model", None)
        if not isinstance(chat, PatchKVChatModel) or chat.registry is not self.registry:
            return
        if chat.temperature != 0 or chat.cache is not None:
            return  # sampled summaries are not served from a cache; a user's own cache is kept
        if getattr(wrapped, "bound", None) is not chat:
            warnings.warn(f"PatchKVMiddleware: {type(editor).__name__}'s summary model is wrapped in a way this "
                          "version does not know; summaries are predicted but not served from the tool wait",
                          stacklevel=3)
            return
        editor._summary_model = wrapped.model_copy(update={"bound": chat.model_copy(update={"cache": self.prepared_calls})})

    # --------------------------------------------------------------- helpers

    def _key(self, config: Any = None) -> ThreadKey | None:
        if config is None:
            try:
                from langgraph.config import get_config

                config = get_config()
            except RuntimeError:
                config = None
        return thread_key_from_config(config, scope=self.scope)

    def _check_model(self, model: Any) -> None:
        model = getattr(model, "bound", model)  # a RunnableBinding (e.g. model.bind(...))
        if isinstance(model, PatchKVChatModel):
            if model.registry is not self.registry:
                raise ValueError("PatchKVMiddleware and the agent's PatchKVChatModel use different registries; "
                                 "build both from one ThreadRegistry: PatchKVChatModel(registry=reg), "
                                 "PatchKVMiddleware(reg)")
        elif not self._warned:
            self._warned = True
            warnings.warn(f"PatchKVMiddleware: the agent's model is a {type(model).__name__}, not a "
                          "PatchKVChatModel; KV resume and offload do nothing for it", stacklevel=3)

    def _unexplained(self, key: ThreadKey | None, request: Any) -> Callable[[ResumeStats], str | None]:
        """What the editors do not explain of a call that left its prediction (warned once per thread)."""
        with self._lock:
            pred = self._predicted.pop(key, None)

        def check(st: ResumeStats) -> str | None:
            if pred is None or request is None or str(st.prepared) not in ("miss", "partial"):
                return None
            why = unexplained_edit(pred, request, self.editors)
            if why is not None:
                with self._lock:
                    first = key not in self._warned_threads
                    self._warned_threads.add(key)
                if first:
                    warnings.warn(f"PatchKVMiddleware: thread {key[0]!r}'s call left its prediction: {why}; give "
                                  "PatchKVMiddleware the same editor instances the agent runs, or build the list "
                                  "with patchkv_agent.langgraph.prepared_middleware(model, editors=[...])",
                                  stacklevel=5)
            return why

        return check

    def _after(self, key: ThreadKey | None, result: Any, request: Any = None) -> None:
        msg = response_message(result)
        with self._lock:
            tool_s = self._tool_s.pop(key, None)
        annotate(msg, tool_s, self._unexplained(key, request))
        if key is None:
            return
        model = getattr(getattr(request, "model", None), "bound", getattr(request, "model", None))
        if self.prepare and msg is not None and msg.tool_calls and isinstance(model, PatchKVChatModel):
            editors = self.editors

            def predict():
                with using_thread_key(key):  # a summarizer call made here runs in this thread's scope
                    pred = predict_agent_request(request, msg, editors)
                if isinstance(pred, PredictedRequest):
                    with self._lock:
                        self._predicted[key] = pred
                return render_prediction(model, pred)

            self.registry.prepare_async(key, predict)  # before the offload: the offload then leaves the heal to it
        if self.offload == "never":
            return
        if self.offload == "always" or (msg is not None and msg.tool_calls):
            self.registry.offload_async(key)

    def _tool_key(self, request: Any) -> ThreadKey | None:
        runtime = getattr(request, "runtime", None)
        return self._key(getattr(runtime, "config", None))

    def _add_tool_time(self, key: ThreadKey | None, dt: float) -> None:
        with self._lock:
            self._tool_s[key] = self._tool_s.get(key, 0.0) + dt

    # ----------------------------------------------------------------- hooks

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]):
        """Run the model call under the thread's key; offload in the background when it asks for tools."""
        self._check_model(request.model)
        key = self._key()
        with using_thread_key(key):
            result = handler(request)
        self._after(key, result, request)
        return result

    async def awrap_model_call(self, request: ModelRequest,
                               handler: Callable[[ModelRequest], Awaitable[ModelResponse]]):
        """Async twin of :meth:`wrap_model_call`."""
        self._check_model(request.model)
        key = self._key()
        with using_thread_key(key):
            result = await handler(request)
        self._after(key, result, request)
        return result

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]):
        """Run the tool while the thread's offload proceeds; time the tool."""
        key = self._tool_key(request)
        if self.offload != "never":
            self.registry.offload_async(key)
        t0 = time.perf_counter()
        try:
            return handler(request)
        finally:
            self._add_tool_time(key, time.perf_counter() - t0)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]):
        """Async twin of :meth:`wrap_tool_call`."""
        key = self._tool_key(request)
        if self.offload != "never":
            self.registry.offload_async(key)
        t0 = time.perf_counter()
        try:
            return await handler(request)
        finally:
            self._add_tool_time(key, time.perf_counter() - t0)

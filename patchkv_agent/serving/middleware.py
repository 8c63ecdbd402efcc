"""``PatchKVServerMiddleware``: the tool wait prepares the next call on the agent's own serving engine.

For a ``create_agent`` whose model is a ``ChatOpenAI`` pointed at vLLM or llama.cpp's server: when a response
asks for tools, everything of the next call but the tool results is known, and so is what the agent's
context editors will do to it. In a background thread the middleware

1. predicts the next request with the editors' own code (:func:`~patchkv_agent.langgraph.predict.predict_agent_request`,
   the same prediction as in-process; a summary the editors would write is written now and served to the
   real call through :class:`~patchkv_agent.langgraph.predict.PreparedCalls` on the summarizer's model),
2. builds the payload the agent will send (:func:`~patchkv_agent.serving.openai.chat_payload`) and renders it
   with the *server's* chat template twice, with two different placeholder results; the ids the renderings
   share, less a safety margin, are what the next call starts with,
3. sends those ids as token-id prompts with one token to decode (and the call's ``cache_salt``) to the
   same server, address and credentials as the real call, so the real call finds them in the server's
   prefix cache: at a low scheduling priority where the engine has one, in chunks on growing prefixes where
   its adapter asks for them (:attr:`~patchkv_agent.serving.adapter.ServerAdapter.chunk_tokens`), so that
   another thread's call that comes meanwhile waits for one chunk at most.

The real call never waits for it: a preparation still running when the call comes is aborted (the server
keeps the blocks it computed) and the call goes out unchanged. Each response's
``response_metadata["patchkv"]`` is a :class:`~patchkv_agent.serving.stats.ServerCallStats`: the outcome
(hit / partial / miss / unfinished / failed, with the reason), the tokens the server reports cached, the
prewarm's time. A fault anywhere in the preparation (server down, slow, an error status, a malformed or
huge answer, an editor that raises) is recorded as ``failed`` and leaves the call as it would be without
the middleware.

Boundary: LangChain's middleware interface, :mod:`.openai` for the model's payload and address, an adapter
(:mod:`.adapter`) for the server's routes; no tensors, no registry.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from typing import Any, Awaitable, Callable, Sequence

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse

from ..langgraph.keys import thread_key_from_config, using_thread_key
from ..langgraph.predict import (PredictedRequest, PreparedCalls, first_difference, known_tokens,
                                 predict_agent_request, unexplained_edit)
from ..results import PreparedOutcome
from .adapter import ServerAdapter
from .engines import adapter_for
from .http import Endpoint, Exchange, ServerError
from .openai import (RENDER_KEYS, cached_tokens_of, chat_payload, endpoint_of, is_openai_model, salt_of, with_headers,
                     with_salt)
from .stats import ServerCallStats

log = logging.getLogger(__name__)

__all__ = ["PatchKVServerMiddleware"]

MAX_PREPARATIONS = 32  # preparations alive at once, over all threads (a hung editor holds one until it returns)


def prewarm_ends(held: int, n: int, chunk: int | None) -> list[int]:
    """The prefix lengths a prewarm of ``n`` ids sends, one request each, when the server holds the first
    ``held`` already: every ``chunk`` ids past ``held`` (rounded to whole chunks, so each request ends on a
    whole prefix-cache block when ``chunk`` is a multiple of the block), then ``n``; ``[n]`` without chunks.

    Raises:
        ValueError: a negative length, ``held`` past ``n``, or a chunk < 1.
    """
    if not 0 <= held <= n or (chunk is not None and chunk < 1):
        raise ValueError(f"prewarm_ends needs 0 <= held <= n and chunk >= 1, got {held}, {n}, {chunk}")
    if chunk is None:
        return [n]
    first = (held // chunk + 1) * chunk
    return list(range(first, n, chunk)) + [n]


def _header_value(thread: str) -> str:
    """A thread id as a header value (percent-encoded: any id is safe ASCII)."""
    import urllib.parse

    return urllib.parse.quote(thread, safe="")


def _response_message(result: Any):
    from ..langgraph.middleware import response_message

    return response_message(result)


class _Preparation:
    """One thread's preparation of its next call, run in its own daemon thread."""

    def __init__(self, thread: str, endpoint: Endpoint, salt: str | None, timeout_s: float, deadline_s: float):
        self.thread, self.endpoint, self.salt = thread, endpoint, salt
        self.timeout_s, self.deadline_s = timeout_s, deadline_s
        self.t0 = time.perf_counter()
        self.done = threading.Event()
        self.stage = "predicting"
        self.aborted = False
        self.reason: str | None = None
        self.failed = False
        self.adapter: ServerAdapter | None = None
        self.predicted: PredictedRequest | None = None
        self.ids: list[int] | None = None
        self.reused_before: int | None = None
        self.info: dict | None = None
        self.predict_s = self.render_s = self.prewarm_s = None
        self.prewarm_cached: int | None = None
        self.prewarm_requests: int | None = None
        self.t_end: float | None = None
        self._exchange: Exchange | None = None
        self._lock = threading.Lock()

    def exchange(self, *, deadline_s: float | None = None) -> Exchange:
        with self._lock:
            if self.aborted:
                raise ServerError("aborted", "the call came first")
            ex = Exchange(self.endpoint, timeout_s=self.timeout_s, deadline_s=deadline_s or self.deadline_s)
            self._exchange = ex
            return ex

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            ex = self._exchange
        if ex is not None:
            ex.abort()

    def fail(self, reason: str) -> None:
        self.failed, self.reason = True, reason


class PatchKVServerMiddleware(AgentMiddleware):
    """Prepare each next call on the agent's OpenAI-compatible server while its tools run.

    Put it after the editors in ``create_agent``'s middleware list (it must see the request they edited), or
    build the whole list with :func:`patchkv_agent.langgraph.prepared_middleware`.

    Args:
        editors: the agent's context editors (the same ``ContextEditingMiddleware`` /
            ``SummarizationMiddleware`` instances given to ``create_agent``, in its order).
        adapter: ``"auto"`` (ask the server), ``"vllm"``, ``"llama.cpp"`` or a
            :class:`~patchkv_agent.serving.adapter.ServerAdapter`.
        cache_salt: a tenant scope for the server's prefix cache: a string, or a callable of the thread id
            returning one; set on every real call and on its prewarm (None: the call's own ``cache_salt``, if
            its model sets one, travels with its prewarm).
        prepare: prewarm during tool waits (False: only the per-call evidence).
        scope: separates this agent's threads from other contexts of the same graph thread.
        affinity_header: a header that carries the thread id (percent-encoded) on every real call and on its prewarm (e.g.
            ``"x-session-id"``), for a router in front of several replicas that keeps a session on one
            replica (session affinity); a prefix-aware router needs none (the prewarm starts like the call).
        timeout_s: the longest one socket operation of a preparation waits.
        max_prewarm_s: the longest one preparation's server requests take together.
        priority: each prewarm request's scheduling priority on engines that have one (vLLM: lower is
            served earlier, a call's default is 0; it orders waiting requests under
            ``--scheduling-policy priority``); None: none sent.
        chunk_tokens: the most ids one prewarm request adds (None: the adapter's own choice; 0: the whole
            prewarm in one request).
        warn: warn once per thread when calls differ from the predictions in ways the editors did not make.

    Attributes:
        prepared_calls: the :class:`~patchkv_agent.langgraph.predict.PreparedCalls` cache set on the
            summarizer models of ``editors`` (``hits``: summaries served from the tool wait).

    Raises:
        ValueError: an editor that is not an ``AgentMiddleware``; a bad adapter name or salt; non-positive
            time limits.
    """

    def __init__(self, editors: Sequence[Any] | None = None, *, adapter: "str | ServerAdapter" = "auto",
                 cache_salt: "str | Callable[[str], str] | None" = None, prepare: bool = True,
                 scope: str | None = None, affinity_header: str | None = None, timeout_s: float = 10.0,
                 max_prewarm_s: float = 300.0, warn: bool = True, priority: int | None = 1,
                 chunk_tokens: int | None = None):
        super().__init__()
        self.editors = list(editors or [])
        bad = [type(e).__name__ for e in self.editors if not isinstance(e, AgentMiddleware)]
        if bad:
            raise ValueError(f"editors must be the agent's AgentMiddleware instances, got {bad}")
        if not (isinstance(adapter, ServerAdapter) or adapter == "auto"):
            adapter_for(adapter)  # an unknown name fails here, not in the first tool wait
        if cache_salt is not None and not (isinstance(cache_salt, str) or callable(cache_salt)):
            raise ValueError("cache_salt must be a string or a callable of the thread id")
        for name, v in (("timeout_s", timeout_s), ("max_prewarm_s", max_prewarm_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
        if affinity_header is not None and (not isinstance(affinity_header, str) or not affinity_header
                                            or any(c in affinity_header for c in ":\r\n\0 ")):
            raise ValueError(f"affinity_header must be a header name such as 'x-session-id', got {affinity_header!r}")
        for name, v in (("priority", priority), ("chunk_tokens", chunk_tokens)):
            if v is not None and (type(v) is not int or abs(v) >= 1 << 31 or (name == "chunk_tokens" and v < 0)):
                raise ValueError(f"{name} must be None or an int{' >= 0' if name == 'chunk_tokens' else ''}, got {v!r}")
        self.priority, self.chunk_tokens = priority, chunk_tokens
        self.affinity_header = affinity_header
        self.adapter, self.cache_salt, self.prepare = adapter, cache_salt, bool(prepare)
        self.scope, self.timeout_s, self.max_prewarm_s, self.warn = scope, float(timeout_s), float(max_prewarm_s), warn
        self.prepared_calls = PreparedCalls()
        for ed in self.editors:
            self._serve_summaries(ed)
        self._preps: dict[Any, _Preparation] = {}
        self._tool_s: dict[Any, float] = {}
        self._adapters: dict[tuple, ServerAdapter] = {}
        self._warned: set = set()
        self._lock = threading.Lock()
        self._live = 0

    # ---------------------------------------------------------------- set-up

    def _serve_summaries(self, editor: Any) -> None:
        """Give a summarizing editor's OpenAI-compatible model the :attr:`prepared_calls` cache (on a copy)."""
        chat = getattr(editor, "_summary_chat_model", None)
        wrapped = getattr(editor, "_summary_model", None)
        if chat is None or not is_openai_model(chat):
            return
        if getattr(chat, "temperature", None) != 0:
            warnings.warn(f"PatchKVServerMiddleware: {type(editor).__name__}'s model samples (temperature "
                          f"{getattr(chat, 'temperature', None)!r}); its summaries are predicted but not served "
                          "from the tool wait: set temperature=0 on it to serve them", stacklevel=3)
            return
        if chat.cache is not None:
            return  # the user's own cache is kept
        if getattr(wrapped, "bound", None) is not chat:
            warnings.warn(f"PatchKVServerMiddleware: {type(editor).__name__}'s summary model is wrapped in a way "
                          "this version does not know; summaries are predicted but not served", stacklevel=3)
            return
        editor._summary_model = wrapped.model_copy(update={"bound": chat.model_copy(update={"cache": self.prepared_calls})})

    def _key(self, config: Any = None):
        if config is None:
            try:
                from langgraph.config import get_config

                config = get_config()
            except RuntimeError:
                config = None
        return thread_key_from_config(config, scope=self.scope)

    def _salt(self, thread: str) -> str | None:
        if self.cache_salt is None:
            return None
        salt = self.cache_salt(thread) if callable(self.cache_salt) else self.cache_salt
        if not isinstance(salt, str) or not salt:
            raise ValueError(f"cache_salt({thread!r}) must return a non-empty string, got {salt!r}")
        return salt

    def _adapter(self, prep: _Preparation) -> ServerAdapter:
        with self._lock:
            got = self._adapters.get(prep.endpoint.key)
        if got is None:
            got = adapter_for(self.adapter, prep.endpoint, timeout_s=min(self.timeout_s, 5.0))
            with self._lock:
                self._adapters[prep.endpoint.key] = got
        return got

    # ------------------------------------------------------------- the wait

    def _start(self, key: Any, request: Any, message: Any) -> None:
        """Start the preparation of ``key``'s next call in a daemon thread."""
        try:
            endpoint = endpoint_of(request.model)
        except ValueError as e:
            self._set_prep(key, None, f"no server to prepare on: {e}")
            return
        thread = str(key[0])
        if self.affinity_header:
            endpoint = Endpoint(endpoint.root, tuple(sorted({**dict(endpoint.headers),
                                                             self.affinity_header: _header_value(thread)}.items())),
                                endpoint.model)
        prep = _Preparation(thread, endpoint, None, self.timeout_s, self.max_prewarm_s)
        with self._lock:
            old = self._preps.pop(key, None)
            if self._live >= MAX_PREPARATIONS:
                prep.fail(f"{MAX_PREPARATIONS} preparations in flight already")
                prep.done.set()
                self._preps[key] = prep
                start = False
            else:
                self._live += 1
                self._preps[key] = prep
                start = True
        if old is not None:
            old.abort()
        if start:
            threading.Thread(target=self._run, args=(key, prep, request, message), daemon=True,
                             name=f"patchkv-prewarm-{thread[:24]}").start()

    def _set_prep(self, key: Any, prep: _Preparation | None, reason: str) -> None:
        p = prep or _Preparation(str(key[0]), Endpoint("http://unknown"), None, 1.0, 1.0)
        p.fail(reason)
        p.done.set()
        with self._lock:
            self._preps[key] = p

    def _run(self, key: Any, prep: _Preparation, request: Any, message: Any) -> None:
        try:
            self._prepare(key, prep, request, message)
        except ServerError as e:
            prep.fail("the call came first" if e.kind == "aborted" else f"server {e.kind}: {e.detail}")
        except BaseException as e:  # noqa: BLE001 - an editor or the server may raise anything: recorded, contained
            prep.fail(f"{type(e).__name__}: {e}"[:400])
            if not isinstance(e, Exception):
                log.warning("a preparation for thread %s stopped on %s", prep.thread, type(e).__name__)
        finally:
            prep.t_end = time.perf_counter()
            prep.stage = "done"
            prep.done.set()
            with self._lock:
                self._live -= 1

    def _prepare(self, key: Any, prep: _Preparation, request: Any, message: Any) -> None:
        t = time.perf_counter()
        with using_thread_key(key):  # a summarizer call made here is this thread's (PreparedCalls' key)
            pred = predict_agent_request(request, message, self.editors)
        prep.predict_s = time.perf_counter() - t
        if not isinstance(pred, PredictedRequest):
            prep.info = dict(pred.info or {})
            prep.fail(pred.reason or "no prediction")
            return
        prep.predicted, prep.info = pred, pred.info
        if prep.aborted:
            raise ServerError("aborted", "the call came first")
        prep.stage = "rendering"
        t = time.perf_counter()
        adapter = prep.adapter = self._adapter(prep)
        payload = chat_payload(pred.request, list(pred.messages))
        prep.salt = salt_of(payload)
        if prep.salt is not None and not adapter.supports_salt:
            prep.fail(f"{adapter.name}'s server has no cache salt; a salted call is not prewarmed")
            return
        ids_a = adapter.render(prep.exchange(), payload)
        ids_b = adapter.render(prep.exchange(), chat_payload(pred.request, pred.swapped()))
        n = known_tokens(ids_a, ids_b)
        prev_msgs = ([request.system_message] if getattr(request, "system_message", None) is not None else []) \
            + list(request.messages)
        prev = adapter.render(prep.exchange(), chat_payload(request, prev_msgs))
        prep.render_s = time.perf_counter() - t
        if n < 1:
            prep.fail("the rendered context differs from its first token on")
            return
        prep.ids = ids_a[:n]
        prep.reused_before = min(n, known_tokens(prev, prep.ids) + 2)  # known_tokens keeps a 2-token margin
        prep.info = {**pred.info, "prepared_tokens": n}
        if n <= prep.reused_before:
            prep.prewarm_s = 0.0
            return  # nothing past what the server holds already
        prep.stage = "prewarming"
        t = time.perf_counter()
        prep.prewarm_requests = 0
        for end in prewarm_ends(prep.reused_before, n, self._chunk(adapter)):
            left = prep.deadline_s - (time.perf_counter() - prep.t0)
            if left <= 0:
                raise ServerError("timeout", f"over the {prep.deadline_s:g} s of max_prewarm_s")
            reply = adapter.prewarm(prep.exchange(deadline_s=left), prep.endpoint.model, prep.ids[:end], prep.salt,
                                    priority=self.priority)
            prep.prewarm_requests += 1
            if prep.prewarm_cached is None:
                prep.prewarm_cached = reply.cached_tokens  # what the server held when the prewarm came
            prep.prewarm_s = time.perf_counter() - t

    def _chunk(self, adapter: ServerAdapter) -> int | None:
        c = adapter.chunk_tokens if self.chunk_tokens is None else self.chunk_tokens
        return c or None

    # ------------------------------------------------------------- the call

    def _claim(self, key: Any, request: Any) -> tuple[ServerCallStats, _Preparation | None, str | None]:
        """The evidence of the preparation for this call (stats, the preparation when its ids need a token
        check after the call, and the message-level difference found)."""
        with self._lock:
            prep = self._preps.pop(key, None)
        st = ServerCallStats(thread=None if key is None else str(key[0]))
        if prep is None:
            return st, None, None
        now = time.perf_counter()
        common = dict(server=getattr(prep.adapter, "name", None), prepared_info=prep.info,
                      predict_s=prep.predict_s, render_s=prep.render_s, prewarm_s=prep.prewarm_s,
                      prepared_tokens=None if prep.ids is None else len(prep.ids),
                      prepared_reused_before=prep.reused_before, prewarm_cached_tokens=prep.prewarm_cached,
                      prewarm_requests=prep.prewarm_requests)
        if not prep.done.is_set():
            stage = prep.stage
            prep.abort()
            return st.replace(prepared=PreparedOutcome.UNFINISHED, prepared_reason=f"still {stage} when the call "
                              "came (aborted; the server keeps what it computed)",
                              prepared_elapsed_s=now - prep.t0, **common), None, None
        common["prepared_elapsed_s"] = (prep.t_end or now) - prep.t0
        if prep.failed or prep.ids is None:
            return st.replace(prepared=PreparedOutcome.FAILED, prepared_reason=prep.reason, **common), None, None
        where = self._difference(prep, request)
        if where is None:
            return st.replace(prepared=PreparedOutcome.HIT, **common), None, None
        return st.replace(**common), prep, where

    def _difference(self, prep: _Preparation, request: Any) -> str | None:
        """Where the real request leaves the predicted one (messages before the pending results, then the
        fields that decide the rendering), or None."""
        pred = prep.predicted
        real = ([request.system_message] if getattr(request, "system_message", None) is not None else []) \
            + list(request.messages)
        diff = first_difference(list(pred.messages), real, pred.pending_index())
        if diff is not None:
            return diff
        try:
            a, b = chat_payload(pred.request, []), chat_payload(request, [])
        except Exception as e:  # noqa: BLE001 - a model that cannot build a payload: no claim of a hit
            return f"the call's payload could not be built ({type(e).__name__})"
        for k in RENDER_KEYS:
            if a.get(k) != b.get(k):
                return (f"the call's {k} differs from the prediction's: a middleware outside editors=[...] "
                        "changes the request")
        if salt_of(a) != salt_of(b):
            return "the call's cache_salt differs from its prewarm's"
        return None

    def _settle(self, st: ServerCallStats, prep: _Preparation | None, where: str | None, request: Any,
                key: Any) -> ServerCallStats:
        """A mismatch's outcome from the ids: partial when the call leaves the prepared ids after what the
        server held before, else a miss; warn once per thread when editors the middleware was not given
        seem to be at work."""
        if prep is None:
            return st
        outcome, match = PreparedOutcome.MISS, None
        try:
            real = ([request.system_message] if getattr(request, "system_message", None) is not None else []) \
                + list(request.messages)
            ids = prep.adapter.render(Exchange(prep.endpoint, timeout_s=self.timeout_s, deadline_s=self.timeout_s),
                                      chat_payload(request, real))
            match = known_tokens(ids, prep.ids) + 2
            match = min(match, len(prep.ids))
            if match >= len(prep.ids):
                outcome = PreparedOutcome.HIT
            elif match > (prep.reused_before or 0):
                outcome = PreparedOutcome.PARTIAL
        except ServerError as e:
            where = f"{where}; its ids could not be checked ({e.kind})"
        if outcome is not PreparedOutcome.HIT and "message" in where:
            why = unexplained_edit(prep.predicted, request, self.editors)
            if why is not None:
                where = f"{where}: {why}"
                self._warn_once(key, where)
            else:
                sizes = (prep.info or {}).get("assumed_result_chars")
                where = f"{where} (the editors decided otherwise on the real results; the prediction assumed results of {sizes} characters)"
        reason = where if match is None else f"{where}; the ids differ from token {match} on"
        return st.replace(prepared=outcome, prepared_reason=reason, prepared_match_tokens=match)

    def _warn_once(self, key: Any, where: str) -> None:
        with self._lock:
            if not self.warn or key in self._warned:
                return
            self._warned.add(key)
        warnings.warn(f"PatchKVServerMiddleware: thread {key[0]!r}'s call differs from its prediction at {where}; "
                      "give the middleware the same editor instances the agent runs, or build the list with "
                      "patchkv_agent.langgraph.prepared_middleware(model, editors=[...])", stacklevel=4)

    def _before(self, request: ModelRequest) -> tuple[Any, Any, ServerCallStats, Any, str | None]:
        key = self._key()
        if key is None or not is_openai_model(request.model):
            return key, request, ServerCallStats(), None, None
        salt = self._salt(str(key[0]))
        if salt is not None:
            request = with_salt(request, salt)
        if self.affinity_header:
            request = with_headers(request, {self.affinity_header: _header_value(str(key[0]))})
        st, prep, where = self._claim(key, request)
        return key, request, st, prep, where

    def _after(self, key: Any, request: Any, result: Any, st: ServerCallStats, call_s: float) -> None:
        msg = _response_message(result)
        with self._lock:
            tool_s = self._tool_s.pop(key, None)
        if msg is not None and key is not None:
            usage = getattr(msg, "usage_metadata", None) or {}
            st = st.replace(cached_tokens=cached_tokens_of(msg), prompt_tokens=usage.get("input_tokens"),
                            call_s=call_s, tool_s=tool_s)
            msg.response_metadata["patchkv"] = st.to_json()
        if self.prepare and key is not None and msg is not None and msg.tool_calls and is_openai_model(request.model):
            self._start(key, request, msg)

    # ----------------------------------------------------------------- hooks

    def wrap_model_call(self, request: ModelRequest, handler: Callable[[ModelRequest], ModelResponse]):
        """Claim the thread's preparation, make the call, record the evidence, prepare the next call."""
        key, request, st, prep, where = self._before(request)
        t0 = time.perf_counter()
        result = handler(request)
        call_s = time.perf_counter() - t0
        if where is not None:
            st = self._settle(st, prep, where, request, key)
        self._after(key, request, result, st, call_s)
        return result

    async def awrap_model_call(self, request: ModelRequest,
                               handler: Callable[[ModelRequest], Awaitable[ModelResponse]]):
        """Async twin of :meth:`wrap_model_call` (the token check of a mismatch runs in an executor)."""
        import asyncio

        key, request, st, prep, where = self._before(request)
        t0 = time.perf_counter()
        result = await handler(request)
        call_s = time.perf_counter() - t0
        if where is not None:
            st = await asyncio.to_thread(self._settle, st, prep, where, request, key)
        self._after(key, request, result, st, call_s)
        return result

    def _tool_key(self, request: Any):
        return self._key(getattr(getattr(request, "runtime", None), "config", None))

    def _add_tool_time(self, key: Any, dt: float) -> None:
        with self._lock:
            self._tool_s[key] = self._tool_s.get(key, 0.0) + dt

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]):
        """Run the tool (the preparation proceeds meanwhile); time it."""
        key, t0 = self._tool_key(request), time.perf_counter()
        try:
            return handler(request)
        finally:
            self._add_tool_time(key, time.perf_counter() - t0)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Awaitable[Any]]):
        """Async twin of :meth:`wrap_tool_call`."""
        key, t0 = self._tool_key(request), time.perf_counter()
        try:
            return await handler(request)
        finally:
            self._add_tool_time(key, time.perf_counter() - t0)

    # ------------------------------------------------------------- helpers

    def wait_prepared(self, key: Any, timeout: float | None = None) -> bool:
        """Block until the preparation of thread ``key`` (a ``(thread_id, namespace)`` key) is over; for
        tests and benchmarks that model a tool wait long enough to cover it.

        Returns:
            True when none is running (any more).
        """
        with self._lock:
            prep = self._preps.get(key)
        return True if prep is None else prep.done.wait(timeout)

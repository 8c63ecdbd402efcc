"""Agents on a live serving engine, with and without the tool-wait prewarm, side by side.

Each episode is a real ``create_agent`` loop on a ``ChatOpenAI`` pointed at the server (vLLM or llama.cpp's),
whose context LangChain's own editors change as deployments run them: ``ContextEditingMiddleware`` with
``ClearToolUsesEdit`` (``clear``), or ``SummarizationMiddleware`` whose summarizer is a ``ChatOpenAI`` on the
same server (``summarize``). Every model call is real; the agent's *tool calls* come from a research history
(:func:`~patchkv_agent.eval.agent_workloads.research_histories`: the same searches and passages as the
project's agent workloads), because SmolLM2's chat template renders no tools: :func:`scripted_tool_calls`, the
innermost middleware, keeps the model's real output as the call's *next action* (its text and parsed tool
calls, recorded) and hands the agent the history's next tool call instead, so both runs of an episode see
the same transcript and differ only in what the server computed ahead. Tools return the history's passages
after ``tool_latency`` seconds.

A run is an episode under ``mode``: ``prepared`` (:class:`~patchkv_agent.serving.middleware.PatchKVServerMiddleware`
prewarming during each tool wait) or ``unprepared`` (the same middleware with ``prepare=False``: the server's
prefix cache alone, with the same evidence per call). Each run has a cache salt (vLLM) and a nonce in its system
prompt of its own, so no run reuses another's cache. Per call: TTFT (a streamed call's first chunk), the
call's time, the prompt and cached tokens the server reports, the preparation's outcome and times, and
whether the call is *edited* (its prompt leaves the previous call's before the previous call's end) or an
append.

:func:`summarize_server`, :func:`markdown_server` and :func:`plot_server` are pure (rows in).

Boundary: LangChain agents and ``langchain-openai`` over HTTP; the server is started by the caller
(:mod:`.servers`).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ServerEpisode", "EpisodeRun", "scripted_tool_calls", "server_episodes", "run_episode_agent", "run_server_episode", "run_server_bench",
           "summarize_server", "markdown_server", "plot_server", "write_server", "SERVER_TARGETS", "WORKLOADS"]

WORKLOADS = ("clear", "summarize")
TIE_NATS = 1.0  # a greedy flip where the top two tokens were this close is the engine's rounding (see near_tie)
SERVER_TARGETS = {  # the prewarm's targets on a server, reported beside the figures (never asserted)
    "edited_ttft_ratio": 0.3,   # median TTFT of edited prepared calls over unprepared ones, at most
    "hit_rate": 0.95,           # hits among the predictable calls (every call after a tool call)
    "append_ttft_ratio": 1.05,  # append-only calls, prepared over unprepared, at most
}


@dataclass(frozen=True)
class ServerEpisode:
    """One agent run to replay on a server.

    Attributes:
        id: the history's id and the workload.
        workload: ``clear`` or ``summarize``.
        system: the system prompt.
        task: the user's task.
        calls: the history's tool calls (``{"name", "args"}``), in order.
        results: each call's tool result.
        setting: the editor's settings (``trigger`` tokens, ``keep``, ``clear_at_least``).
    """

    id: str
    workload: str
    system: str
    task: str
    calls: tuple
    results: tuple
    setting: tuple


def server_episodes(n: int, workloads: Sequence[str] = WORKLOADS, *, context: int = 4000, calls: int | None = None,
                    seed: int = 0, keep: int | None = None) -> list[ServerEpisode]:
    """``n`` episodes per workload from the research histories, their editors sized for ``context`` tokens.

    Args:
        n: episodes per workload.
        workloads: of :data:`WORKLOADS`.
        context: the context the editors keep the agent near (their triggers scale with it).
        calls: tool calls per episode (default: enough to pass the trigger twice).
        seed: rotates the histories.
        keep: the tool results the editors keep (``clear``: ``keep`` results; ``summarize``: ``2 * keep``
            messages); None: the workloads' own. A longer kept tail is more for an edited call to recompute.

    Returns:
        The episodes (interleaved by workload).

    Raises:
        ValueError: an unknown workload; ``n`` < 1.
    """
    from patchkv_agent.eval.agent_workloads import CLEAR_SETTINGS, SUMMARY_SETTINGS, SYSTEM_PROMPT, research_histories, scale_setting

    bad = [w for w in workloads if w not in WORKLOADS]
    if bad or n < 1 or (keep is not None and not 1 <= keep <= 64):
        raise ValueError(f"workloads must be among {WORKLOADS}, n >= 1 and keep 1-64, got {list(workloads)}, "
                         f"n={n}, keep={keep}")
    per_call = 330  # tokens of a research result, about
    k = calls or max(12, int(1.6 * context / per_call))
    hist = research_histories(n * len(workloads), calls=k, seed=seed)
    out = []
    for i, h in enumerate(hist):
        w = workloads[i % len(workloads)]
        setting = scale_setting((CLEAR_SETTINGS if w == "clear" else SUMMARY_SETTINGS)[0], context)
        if keep is not None:
            setting = (setting[0], keep if w == "clear" else 2 * keep, *setting[2:])
        steps = [m for m in h.messages if m["role"] in ("assistant", "tool")]
        out.append(ServerEpisode(id=f"{h.id}/{w}", workload=w, system=h.system or SYSTEM_PROMPT,
                                 task=h.messages[0]["content"],
                                 calls=tuple({"name": c["name"], "args": dict(c.get("args") or {})}
                                             for m in steps if m["role"] == "assistant" for c in m["tool_calls"][:1]),
                                 results=tuple(m["content"] for m in steps if m["role"] == "tool"),
                                 setting=tuple(setting)))
    return out


def scripted_tool_calls(calls: Sequence[dict]):
    """Innermost ``create_agent`` middleware: keeps each real response as the call's next action and hands
    the agent the next of ``calls`` (``{"name", "args"}`` each) instead, with the real response's metadata and
    usage; after the last one the real response stands.

    Returns:
        The middleware; ``actions`` holds each real response's ``{"text", "tool_calls"}``, ``tokens`` its
        decoded tokens (:func:`decoded_tokens`; empty without logprobs), ``messages`` what the agent got.
    """
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import AIMessage

    class _Scripted(AgentMiddleware):
        def __init__(self):
            super().__init__()
            self.calls, self.actions, self.messages, self.tokens, self._i = list(calls), [], [], [], 0

        def _swap(self, result):
            msg = result.result[-1]
            self.actions.append({"text": msg.content if isinstance(msg.content, str) else str(msg.content),
                                 "tool_calls": [(c["name"], json.dumps(c["args"], sort_keys=True))
                                                for c in msg.tool_calls]})
            self.tokens.append(decoded_tokens(msg.response_metadata))
            if self._i < len(self.calls):
                c = self.calls[self._i]
                self._i += 1
                msg = AIMessage(content="", tool_calls=[{"name": c["name"], "args": c["args"],
                                                         "id": f"call_{self._i}", "type": "tool_call"}],
                                response_metadata=dict(msg.response_metadata), usage_metadata=msg.usage_metadata,
                                id=msg.id)
                result.result[-1] = msg
            self.messages.append(msg)
            return result

        def wrap_model_call(self, request, handler):
            return self._swap(handler(request))

        async def awrap_model_call(self, request, handler):
            return self._swap(await handler(request))

    return _Scripted()


def decoded_tokens(metadata: dict) -> list[tuple[str, float, float | None]]:
    """The tokens a response decoded, from the ``logprobs`` the server returned (``logprobs=True``,
    ``top_logprobs >= 2``): ``(token, logprob, margin)`` each, the margin being the chosen token's logprob
    minus the best other candidate's (None where the server gave no second candidate).

    Args:
        metadata: a response's ``response_metadata``.

    Returns:
        The tokens in order; empty where the response carries no logprobs.
    """
    content = ((metadata or {}).get("logprobs") or {}).get("content") or []
    out = []
    for t in content:
        if not isinstance(t, dict) or not isinstance(t.get("logprob"), (int, float)):
            continue
        others = [c.get("logprob") for c in t.get("top_logprobs") or []
                  if isinstance(c, dict) and c.get("token") != t.get("token") and isinstance(c.get("logprob"), (int, float))]
        out.append((str(t.get("token")), float(t["logprob"]), float(t["logprob"]) - max(others) if others else None))
    return out


def near_tie(a: Sequence[tuple], b: Sequence[tuple], eps: float) -> bool | None:
    """Whether two runs of one call that decoded different tokens parted at a near tie: at the first token
    where they differ, either run's chosen token led its runner-up by less than ``eps`` nats. An engine
    that computes a prefix in other batch splits (a prefix-cache hit versus a longer prefill) rounds
    differently, so greedy decoding may flip there; a flip past ``eps`` is a different decision.

    Args:
        a, b: the runs' :func:`decoded_tokens`.
        eps: the margin (nats) under which a flip is a tie.

    Returns:
        None where the runs decoded the same tokens (or one carries none), else True / False.
    """
    if not a or not b:
        return None
    for (ta, _, ma), (tb, _, mb) in zip(a, b):
        if ta != tb:
            return any(m is not None and m < eps for m in (ma, mb))
    if len(a) == len(b):
        return None
    longer = a if len(a) > len(b) else b  # one run stopped where the other went on: the stop was the choice
    m = longer[min(len(a), len(b))][2]
    return m is not None and m < eps


class _FirstChunk:
    """A callback handler timing each chat-model run's first streamed chunk (the agent's TTFT)."""

    def __init__(self):
        from langchain_core.callbacks import BaseCallbackHandler

        outer = self
        self.t0: dict = {}
        self.ttft: list[float] = []
        self._lock = threading.Lock()

        class H(BaseCallbackHandler):
            def on_chat_model_start(self, serialized, messages, *, run_id, **kw):
                with outer._lock:
                    outer.t0[run_id] = time.perf_counter()

            def on_llm_new_token(self, token, *, run_id, **kw):
                with outer._lock:
                    t = outer.t0.pop(run_id, None)
                    if t is not None:
                        outer.ttft.append(time.perf_counter() - t)

        self.handler = H()


@dataclass
class EpisodeRun:
    """One episode's run: per-call ``rows``, the agent's final ``messages``, the prewarm ``middleware`` (None
    without one), the ``script`` (its ``actions``), the run's ``thread`` id and ``nonce``."""

    rows: list
    messages: list
    middleware: Any
    script: Any
    thread: str
    nonce: str


def run_episode_agent(base_url: str, model: str, episode: ServerEpisode, *, prepare: bool = True,
                      middleware: bool = True, tool_latency: float = 6.0, cover: bool = False, max_tokens: int = 16,
                      adapter: str = "auto", salt: bool = True, timeout_s: float = 10.0, api_key: str = "EMPTY",
                      streaming: bool = True, options: dict | None = None, give_editors: bool = True,
                      extra_middleware: Sequence[Any] = (), nonce: str | None = None, logprobs: bool = True) -> EpisodeRun:
    """Run one episode on the server (see the module docstring).

    Args:
        base_url: the server's OpenAI-compatible base URL.
        model: the served model name.
        episode: the episode.
        prepare: prewarm during tool waits (``prepared``), or not (``unprepared``).
        middleware: run :class:`~patchkv_agent.serving.middleware.PatchKVServerMiddleware` at all (False: the
            agent as it is without this project; its rows then carry no server evidence).
        tool_latency: seconds each tool takes.
        cover: a tool lasts at least until its thread's prewarm is over (a tool wait that covers it).
        max_tokens: tokens each call decodes at most.
        adapter: the prewarm adapter (``auto``, ``vllm``, ``llama.cpp``).
        salt: give the run a cache salt of its own, from the nonce and the mode (engines with salts; llama.cpp's
            has none), so that the two modes' runs of one nonce never reuse each other's blocks.
        timeout_s: the prewarm's socket timeout.
        api_key: sent with every request.
        streaming: stream each call (its first chunk times the TTFT).
        options: more options of the middleware.
        give_editors: give the middleware the agent's editors (False: the mistake it warns about).
        extra_middleware: middleware placed between the editors and the prewarm middleware.
        nonce: the run's nonce (default: a new one).
        logprobs: ask for each decoded token's logprob and runner-up (rows' ``tokens``; :func:`near_tie`).

    Returns:
        The :class:`EpisodeRun`; its rows: ``episode``, ``workload``, ``mode``, ``call``, ``ttft_s``,
        ``call_s``, ``prompt_tokens``, ``cached_tokens``, ``prepared`` and its fields, ``edited``, ``action``, ``tokens``.
    """
    from langchain.agents import create_agent
    from langchain.agents.middleware import ClearToolUsesEdit, ContextEditingMiddleware, SummarizationMiddleware
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    from patchkv_agent.runtime.threads import thread_key
    from patchkv_agent.serving import PatchKVServerMiddleware

    nonce = nonce or uuid.uuid4().hex[:12]
    timer = _FirstChunk()
    llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_tokens=max_tokens,
                     streaming=streaming, stream_usage=True, max_retries=0, callbacks=[timer.handler],
                     **({"logprobs": True, "top_logprobs": 2} if logprobs else {}))
    if episode.workload == "clear":
        trigger, keep, at_least = (list(episode.setting) + [0, 0, 0])[:3]
        editor = ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger=trigger, keep=keep, clear_at_least=at_least)])
    else:
        trigger, keep = episode.setting[:2]
        summarizer = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_tokens=96,
                                max_retries=0)
        editor = SummarizationMiddleware(model=summarizer, trigger=("tokens", trigger), keep=("messages", keep))
    mw = None
    mode = "prepared" if prepare else "unprepared"  # the salt is the run's: its twin of the other mode reuses nothing
    if middleware:
        mw = PatchKVServerMiddleware(editors=[editor] if give_editors else [], prepare=prepare, adapter=adapter,
                                     timeout_s=timeout_s, cache_salt=(f"run-{nonce}-{mode}" if salt else None),
                                     **(options or {}))
    script = scripted_tool_calls(episode.calls)
    results = list(episode.results)
    state = {"n": 0}
    thread = f"{episode.id}/{nonce}"

    @tool("search")
    def search(query: str) -> str:
        """Search the encyclopedia for a passage."""
        t0 = time.perf_counter()
        if cover and mw is not None:
            mw.wait_prepared(thread_key(thread), timeout=600)
        time.sleep(max(0.0, tool_latency - (time.perf_counter() - t0)))
        i = state["n"]
        state["n"] += 1
        return results[i % len(results)]

    stack = [editor, *extra_middleware] + ([mw] if mw is not None else []) + [script]
    agent = create_agent(llm, tools=[search], system_prompt=f"{episode.system}\n(session {nonce})", middleware=stack)
    out = agent.invoke({"messages": [HumanMessage(episode.task)]},
                       {"configurable": {"thread_id": thread}, "recursion_limit": 4 * len(episode.calls) + 10})
    rows = []
    for i, msg in enumerate(script.messages):
        st = dict(msg.response_metadata.get("patchkv") or {})
        rows.append({"episode": episode.id, "workload": episode.workload, "mode": "prepared" if prepare else "unprepared",
                     "call": i, "ttft_s": timer.ttft[i] if i < len(timer.ttft) else None, "call_s": st.get("call_s"),
                     "prompt_tokens": st.get("prompt_tokens"), "cached_tokens": st.get("cached_tokens"),
                     "tool_s": st.get("tool_s"),
                     **{k: st.get(k) for k in ("prepared", "prepared_reason", "prepared_tokens", "prepared_match_tokens",
                                               "prepared_reused_before", "predict_s", "render_s", "prewarm_s", "prewarm_requests",
                                               "prepared_elapsed_s", "server")},
                     "summarized": "SummarizationMiddleware" in (st.get("prepared_info") or {}),
                     "cleared": (st.get("prepared_info") or {}).get("cleared_results"),
                     "action": script.actions[i], "tokens": script.tokens[i]})
    _mark_edits(rows)
    return EpisodeRun(rows=rows, messages=list(out["messages"]), middleware=mw, script=script, thread=thread,
                      nonce=nonce)


def run_server_episode(base_url: str, model: str, episode: ServerEpisode, *, prepare: bool, **kwargs: Any) -> list[dict]:
    """The rows of :func:`run_episode_agent` (its keyword arguments pass through)."""
    return run_episode_agent(base_url, model, episode, prepare=prepare, **kwargs).rows


def _mark_edits(rows: list[dict]) -> None:
    """``edited``: the call's prompt is not the previous prompt plus what was appended, read off the
    unprepared evidence: the prepared ids' overlap with the previous call (``prepared_reused_before``) when
    there was a preparation, else the server's cached tokens against the previous prompt."""
    for i, r in enumerate(rows):
        if i == 0:
            r["edited"] = False
            continue
        before, prev = r.get("prepared_reused_before"), rows[i - 1].get("prompt_tokens")
        if before is not None and prev:
            r["edited"] = before < prev - 8  # the prediction leaves the previous prompt before its end
        else:
            r["edited"] = None  # unknown from this run alone: paired with a prepared run by the summary


def run_server_bench(base_url: str, model: str, episodes: Sequence[ServerEpisode], *, tool_latency: float = 6.0,
                     cover: bool = False, max_tokens: int = 16, adapter: str = "auto", salt: bool = True,
                     threads: int = 1, before_run: Any = None, progress: bool = True,
                     options: dict | None = None) -> list[dict]:
    """Every episode twice, unprepared and prepared, on one server, with one context for both runs (the
    episode's nonce) and nothing reused across runs (a salt per run, or ``before_run`` emptying the cache).

    With ``threads`` = 1 the two runs of an episode follow each other (their order alternates); with more,
    ``threads`` episodes run at once, all unprepared runs first, then all prepared ones (so the two modes never
    share the server at once), the throughput figure of the concurrent phase.

    Args:
        threads: episodes run at once.
        before_run: called before each run (1 thread) or phase (more): e.g. a server's ``erase_cache``.
        options: more options of the prewarm middleware (``chunk_tokens``, ``priority``, ...).
        Others: see :func:`run_episode_agent`.

    Returns:
        All rows, each with ``threads`` and ``episode_s`` (its run's wall time).
    """
    from concurrent.futures import ThreadPoolExecutor

    from tqdm import tqdm

    nonces = {ep.id: uuid.uuid4().hex[:12] for ep in episodes}
    bar = tqdm(total=2 * len(episodes), desc=f"server bench ({threads} thread{'s' if threads > 1 else ''})",
               disable=not progress)
    rows: list[dict] = []
    lock = threading.Lock()

    def one(ep: ServerEpisode, prep: bool) -> None:
        t0 = time.perf_counter()
        got = run_server_episode(base_url, model, ep, prepare=prep, tool_latency=tool_latency, cover=cover,
                                 max_tokens=max_tokens, adapter=adapter, salt=salt, nonce=nonces[ep.id],
                                 options=options)
        for r in got:
            r.update(threads=threads, episode_s=time.perf_counter() - t0)
        with lock:
            rows.extend(got)
            bar.update(1)

    if threads <= 1:
        for i, ep in enumerate(episodes):
            for prep in ((False, True) if i % 2 == 0 else (True, False)):
                if before_run:
                    before_run()
                one(ep, prep)
        for mode in ("prepared", "unprepared"):  # one at a time: the phase is the sum of its runs
            wall = sum(r["episode_s"] for r in rows if r["mode"] == mode and r["call"] == 0)
            for r in rows:
                if r["mode"] == mode:
                    r["phase_s"] = wall
    else:
        for prep in (False, True):
            if before_run:
                before_run()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda ep: one(ep, prep), episodes))
            wall = time.perf_counter() - t0
            for r in rows:
                if r["mode"] == ("prepared" if prep else "unprepared"):
                    r["phase_s"] = wall
    bar.close()
    _pair(rows)
    return rows


def _pair(rows: list[dict]) -> None:
    """Each row meets its twin of the other mode (same episode, call, threads): an unprepared row takes
    ``edited`` from its prepared twin, and both get ``same_action`` (the two runs' next actions agree) and
    ``action_tie`` (where they differ, whether they parted at a near tie: :func:`near_tie` at ``TIE_NATS``)."""
    by = {(r["mode"], r["episode"], r["call"], r.get("threads")): r for r in rows}
    for r in rows:
        other = "unprepared" if r["mode"] == "prepared" else "prepared"
        t = by.get((other, r["episode"], r["call"], r.get("threads")))
        if t is None:
            continue
        if r["mode"] == "unprepared":
            r["edited"] = t.get("edited")
        r["same_action"] = r["action"] == t["action"]
        r["action_tie"] = None if r["same_action"] else near_tie(r.get("tokens"), t.get("tokens"), TIE_NATS)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _p90(xs):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)] if xs else None


def summarize_server(rows: Sequence[dict]) -> dict:
    """Per thread count and call kind (edited / append): calls, median and p90 TTFT of each mode and their
    ratio, prepared outcomes, the hit rate over predictable calls, next actions that agree, cached tokens and
    the tokens the server computed (``uncached_median_*``: a prepared edited call computes about what an
    append computes, the tool result it could not know ahead, which bounds its TTFT from below).

    Returns:
        ``{"by_threads": {n: {...}}, "targets": SERVER_TARGETS}``.
    """
    out: dict[str, Any] = {"by_threads": {}, "targets": SERVER_TARGETS}
    for n in sorted({r.get("threads", 1) for r in rows}):
        rs = [r for r in rows if r.get("threads", 1) == n]
        prep = [r for r in rs if r["mode"] == "prepared"]
        predictable = [r for r in prep if r["call"] > 0]
        outcomes: dict[str, int] = {}
        for r in predictable:
            outcomes[str(r.get("prepared"))] = outcomes.get(str(r.get("prepared")), 0) + 1
        kinds = {}
        for kind, want in (("edited", True), ("append", False)):
            sel = {m: [r for r in rs if r["mode"] == m and r["call"] > 0 and r.get("edited") is want]
                   for m in ("prepared", "unprepared")}
            med = {m: _median([r["ttft_s"] for r in v]) for m, v in sel.items()}
            kinds[kind] = {
                "calls": len(sel["prepared"]),
                **{f"ttft_median_{m}_s": med[m] for m in sel},
                **{f"ttft_p90_{m}_s": _p90([r["ttft_s"] for r in v]) for m, v in sel.items()},
                "ttft_ratio": (med["prepared"] / med["unprepared"]) if med["prepared"] and med["unprepared"] else None,
                "paired_ratio_median": _median([_ratio(r, rs) for r in sel["prepared"]]),
                **{f"cached_share_{m}": _median([(r["cached_tokens"] or 0) / r["prompt_tokens"] for r in v
                                                 if r.get("prompt_tokens")]) for m, v in sel.items()},
                **{f"uncached_median_{m}": _median([r["prompt_tokens"] - (r["cached_tokens"] or 0) for r in v
                                                    if r.get("prompt_tokens")]) for m, v in sel.items()},
                "outcomes": _count(r.get("prepared") for r in sel["prepared"]),
            }
        wall = {m: _median([r["episode_s"] for r in rs if r["mode"] == m and r["call"] == 0]) for m in ("prepared", "unprepared")}
        out["by_threads"][n] = {
            "calls": len(prep), "predictable": len(predictable), "outcomes": outcomes,
            "hit_rate": outcomes.get("hit", 0) / len(predictable) if predictable else None,
            "same_action": _share([r.get("same_action") for r in prep]),
            "action_ties": sum(1 for r in prep if r.get("action_tie")),
            "same_action_or_tie": _share([r.get("same_action") or bool(r.get("action_tie")) for r in prep
                                          if r.get("same_action") is not None]),
            "kinds": kinds,
            "episode_wall_median_s": wall,
            "throughput_calls_per_s": {m: _throughput([r for r in rs if r["mode"] == m]) for m in ("prepared", "unprepared")},
        }
    return out


def _throughput(rows: Sequence[dict]) -> float | None:
    """Calls per second of wall time over a mode's phase (its runs one after another, or at once)."""
    wall = rows[0].get("phase_s") if rows else None
    return len(rows) / wall if wall else None


def _ratio(r: dict, rows: Sequence[dict]) -> float | None:
    twin = next((t for t in rows if t["mode"] == "unprepared" and t["episode"] == r["episode"] and t["call"] == r["call"]
                 and t.get("threads") == r.get("threads")), None)
    if twin is None or not r.get("ttft_s") or not twin.get("ttft_s"):
        return None
    return r["ttft_s"] / twin["ttft_s"]


def _count(xs) -> dict:
    out: dict[str, int] = {}
    for x in xs:
        out[str(x)] = out.get(str(x), 0) + 1
    return out


def _share(xs) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(1 for x in xs if x) / len(xs) if xs else None


def markdown_server(summary: dict, *, engine: str, command: str = "") -> str:
    """The summary as a markdown table (one row per thread count and call kind)."""
    lines = [f"# Prepared calls on {engine}", "", f"`{command}`" if command else "", "",
             "| threads | calls | kind | n | TTFT median unprepared | prepared | ratio | paired ratio | p90 unprep. | p90 prep. "
             "| cached share unprep. / prep. | computed tokens unprep. / prep. | hit rate | same next action |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|"]

    def f(x, d=3):
        return "-" if x is None else f"{x:.{d}f}"

    for n, s in summary["by_threads"].items():
        for kind, k in s["kinds"].items():
            lines.append(f"| {n} | {s['calls']} | {kind} | {k['calls']} | {f(k['ttft_median_unprepared_s'])} s | "
                         f"{f(k['ttft_median_prepared_s'])} s | {f(k['ttft_ratio'], 2)} | {f(k['paired_ratio_median'], 2)} | "
                         f"{f(k['ttft_p90_unprepared_s'])} | {f(k['ttft_p90_prepared_s'])} | "
                         f"{f(k['cached_share_unprepared'], 2)} / {f(k['cached_share_prepared'], 2)} | "
                         f"{f(k.get('uncached_median_unprepared'), 0)} / {f(k.get('uncached_median_prepared'), 0)} | "
                         f"{f(s['hit_rate'], 3)} | {f(s['same_action'], 3)} |")
        lines.append("")
        lines.append(f"{n} thread(s): outcomes {s['outcomes']}; throughput (calls/s) {s['throughput_calls_per_s']}; "
                     f"next actions that differ at a near tie (< {TIE_NATS} nat): {s.get('action_ties', 0)}")
    lines += ["", f"Targets: {summary['targets']}"]
    return "\n".join(lines) + "\n"


def plot_server(rows: Sequence[dict], path: str | Path) -> None:
    """TTFT of each edited and append call, unprepared against prepared (log scale), one panel per kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, (kind, want) in zip(axes, (("edited calls", True), ("append-only calls", False))):
        pairs = [(t["ttft_s"], r["ttft_s"]) for r in rows if r["mode"] == "prepared" and r.get("edited") is want
                 and r["call"] > 0 and r.get("threads", 1) == 1
                 for t in rows if t["mode"] == "unprepared" and t["episode"] == r["episode"] and t["call"] == r["call"]
                 and t.get("threads", 1) == 1 and t.get("ttft_s") and r.get("ttft_s")]
        if pairs:
            xs, ys = zip(*pairs)
            ax.scatter(xs, ys, s=12, alpha=0.7)
            lo, hi = min(xs + ys) * 0.8, max(xs + ys) * 1.2
            ax.plot([lo, hi], [lo, hi], "k--", lw=0.8, label="same")
            ax.plot([lo, hi], [0.3 * lo, 0.3 * hi], "g:", lw=0.8, label="0.3x")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.legend(fontsize=8)
        ax.set_title(f"{kind} ({len(pairs)})")
        ax.set_xlabel("TTFT unprepared (s)")
        ax.set_ylabel("TTFT prepared (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_server(rows: Sequence[dict], out_dir: str | Path, *, engine: str, command: str = "") -> dict:
    """Write ``server_results.jsonl``, ``server_summary.json``, ``server_summary.md`` and ``server_ttft.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "server_results.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
    summary = summarize_server(rows)
    summary.update(engine=engine, command=command)
    (out / "server_summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "server_summary.md").write_text(markdown_server(summary, engine=engine, command=command))
    plot_server(rows, out / "server_ttft.png")
    return summary


# --------------------------------------------------------------------------------------------- command line

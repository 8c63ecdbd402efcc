"""Agent workloads edited by LangChain's own context-editing middlewares (``agent-clear``, ``agent-summarize``,
``agent-offload``): trace files (``docs/TRACES.md``) whose versions are what a ``create_agent`` model saw.

Boundary: builds traces from message histories by running LangChain v1's middleware code on them; no
model, no torch, no tokenizer (token counts come through a ``count_tokens(messages) -> int`` callable on
LangChain messages that the caller supplies, by default LangChain's ``count_tokens_approximately``; a
prediction renders through a ``render(trace messages) -> ids`` callable the caller supplies, and imports
``langgraph/predict.py`` only when it runs).

A *history* is one agent run: a system prompt, the user's task, then steps of (assistant tool call, tool
result). Two kinds ship (``docs/TRACES.md`` names their sources and licences):

- ``research``: scripted runs of the research agent of ``examples/research_agent.py``: its ``search`` tool
  over the packaged QA data (the question's passages, then other questions' passages), one call per
  passage title, 10-40 calls;
- ``public``: public coding-agent trajectories with full tool outputs (mini-SWE-agent and SWE-agent runs,
  ``data/agent_histories.jsonl``), when the data file is present.

Replaying a history call by call (the state after each tool result), each model call's view is one
trace version: the messages after the middleware edited them, plus ``unedited``: the same call had the
context not been edited (the previous view and the messages appended since), which the replay prices as
the *no-edit floor*. The editors, each LangChain's own code:

- ``agent-clear``: ``ContextEditingMiddleware(edits=[ClearToolUsesEdit(trigger, keep, clear_at_least)])``
  (its ``wrap_model_call``, the request's messages edited per call, never the state); settings from
  :data:`CLEAR_SETTINGS` (``clear_at_least`` keeps the context near the trigger, as deployments set it).
- ``agent-summarize``: ``SummarizationMiddleware(model=ExtractiveSummarizer(), trigger, keep)`` (its
  ``before_model``, which rewrites the state: the summary replaces the head for every later call). The
  summarizer is a deterministic fake chat model (:class:`ExtractiveSummarizer`: the first sentence of each
  summarized message), so traces are reproducible without a model.
- ``agent-offload``: ``ContextEditingMiddleware(edits=[OffloadLargeResults(...)])``: a tool result longer
  than ``min_chars``, once the context passes ``trigger``, becomes a preview (its first lines) and the path
  it was saved under, in the format Deep Agents uses for large tool results (:class:`OffloadLargeResults`
  is a LangChain ``ContextEdit``; the middleware running it is LangChain's).
- ``agent-clear-hop``: ``ClearToolUsesEdit`` as deployments run it on long histories: the editor re-fires on
  every call once the state passes its trigger (near the budget) and clears the one result that leaves its
  ``keep`` window, 70-90 % deep (:func:`clear_hop_setting`; the episode is the last run of such calls that
  fits the budget).

Episodes keep the calls from the first one whose view reaches ``min_tokens`` up to ``max_tokens``, at
most ``max_versions`` of them, centred on the edits (a summarization and the append-only calls after it).
``context`` (:func:`build_agent_traces`) builds them for a longer window: the budget becomes ``max_tokens``,
the views start at half of it, the middleware settings (sized for :data:`REFERENCE_CONTEXT` tokens) are
scaled to it, research runs are long enough to fill it, and every version's ``unedited`` twin fits in it.

For the agent-loop benchmark (:func:`build_agent_loop_episodes`), each episode also carries a
:class:`ToolWait` per call after the first: what the agent knows while that call's tools run (the
middleware's state after the previous call, the response that asked for the tools, the tools' names).
:meth:`ToolWait.predict` predicts the next call's context up to the tool results by running the same
middleware object on that state, the response and placeholder results
(:func:`patchkv_agent.langgraph.predict.predict_agent_context`); it never reads the next version.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from .agent_editors import ExtractiveSummarizer, OffloadLargeResults

log = logging.getLogger(__name__)

CLEAR_HOP = "agent-clear-hop"
AGENT_WORKLOADS: tuple[str, ...] = ("agent-clear", "agent-summarize", "agent-offload", CLEAR_HOP)
HISTORY_KINDS: tuple[str, ...] = ("research", "public")
CLEAR_SETTINGS: tuple[tuple[int, ...], ...] = ((2500, 3, 0), (4000, 2, 1500))  # ClearToolUsesEdit (trigger, keep, clear_at_least)
SUMMARY_SETTINGS: tuple[tuple[int, int], ...] = ((2500, 6), (3500, 10))  # (trigger tokens, keep messages)
OFFLOAD_SETTINGS: tuple[tuple[int, int], ...] = ((2500, 2), (3500, 1))  # (trigger tokens, keep results)
REFERENCE_CONTEXT = 4000  # the budget the settings above are sized for (``context`` scales them)
CONTEXT_TRIGGER_SHARE = 0.8  # with ``context``: a scaled trigger's cap (the unedited twin must fit the window)
CLEAR_HOP_TRIGGER_SHARE = 0.8  # agent-clear-hop: the trigger, a share of the budget (near it)
CLEAR_HOP_TAIL_SHARE = 0.2     # the kept results' share of the budget: the edit sits ~80 % deep
CLEAR_HOP_DEPTH = (0.7, 0.9)   # the depths an agent-clear-hop episode's edits lie in (share of the view)
_DATA = Path(__file__).resolve().parent / "data"
SYSTEM_PROMPT = ("You are a research assistant with a `search` tool that returns one encyclopedia passage per "
                 "call. Search for evidence, then answer the user's question with a short phrase.")

CountTokens = Callable[[Sequence[Any]], int]


# --------------------------------------------------------------------------------------------- histories

@dataclass(frozen=True)
class History:
    """One agent run: ``messages`` (trace-format dicts: user task, then assistant call / tool result pairs)."""

    id: str
    source: str
    system: str
    messages: tuple[dict, ...]
    licence: str = ""
    origin: str = ""


def research_histories(n: int, *, calls: int = 24, seed: int = 0) -> list[History]:
    """Scripted runs of the research agent over the packaged QA data (HotpotQA, then 2WikiMQA).

    Each run asks one question; its ``search`` calls query the question's own passage titles first, then
    passages of the following questions (as a search over a shared corpus returns them), one tool result
    per call (2WikiMQA chunks cut to ~1,200 characters at a sentence boundary).

    Args:
        n: runs to build.
        calls: tool calls per run (>= 8).
        seed: rotates the question order.

    Returns:
        Up to ``n`` histories (fewer when the data runs out).
    """
    from .workloads import _pieces, load_qa, split_of  # the QA loader and its passage splitter

    if calls < 8:
        raise ValueError(f"calls must be >= 8 (an agent history has at least 8 tool calls), got {calls}")
    out: list[History] = []
    for dataset in ("hotpotqa", "2wikimqa"):
        data = [ex for ex in load_qa(dataset) if split_of(ex["_id"]) == "eval"]
        if not data:
            continue
        start = seed % len(data)
        data = data[start:] + data[:start]
        for i, ex in enumerate(data):
            if len(out) >= n:
                return out
            msgs: list[dict] = [{"role": "user", "content": f"Find evidence with the search tool to answer this "
                                                            f"question: {ex['input']}"}]
            j, k = 0, i
            while j < calls:
                for p in data[k % len(data)]["passages"]:
                    for piece in _pieces(p["text"])[:2]:
                        if j >= calls:
                            break
                        cid = f"call_{j}"
                        title = p.get("title") or " ".join(piece.split()[:6])
                        msgs.append({"role": "assistant", "content": "",
                                     "tool_calls": [{"id": cid, "name": "search", "args": {"query": title}}]})
                        msgs.append({"role": "tool", "tool_call_id": cid, "content": f"{title}\n{piece}"})
                        j += 1
                k += 1
            out.append(History(id=f"research/{dataset}/{ex['_id']}", source=f"research-agent/{dataset}",
                               system=SYSTEM_PROMPT, messages=tuple(msgs), licence="see SOURCES.md",
                               origin=f"patchkv_agent/eval/data ({dataset})"))
    return out


def public_histories(path: str | Path | None = None) -> list[History]:
    """Public coding-agent trajectories (``data/agent_histories.jsonl``), validated; [] when absent.

    Raises:
        ValueError: a malformed line (named by line number).
    """
    p = Path(path) if path is not None else _DATA / "agent_histories.jsonl"
    if not p.is_file():
        return []
    out = []
    for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            msgs = rec["messages"]
            if not (isinstance(rec["id"], str) and isinstance(msgs, list) and msgs
                    and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in msgs)):
                raise ValueError("id and a non-empty messages list of {role, content} objects are required")
            out.append(History(id=rec["id"], source=str(rec.get("source", "")), system=str(rec.get("system") or ""),
                               messages=tuple(msgs), licence=str(rec.get("licence", "")),
                               origin=str(rec.get("origin", ""))))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{p}:{no}: not an agent history: {e}") from None
    return out


# --------------------------------------------------------------------------------------------- messages

def to_langchain(messages: Iterable[dict]) -> list:
    """Trace-format message dicts -> LangChain messages (ids kept stable: ``m<index>``)."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage

    out = []
    for i, m in enumerate(messages):
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant":
            calls = [{"id": c.get("id") or f"c{i}", "name": c["name"], "args": c.get("args") or {}}
                     for c in m.get("tool_calls") or []]
            out.append(AIMessage(content=content, tool_calls=calls, id=f"m{i}"))
        elif role == "tool":
            out.append(ToolMessage(content=content, tool_call_id=str(m.get("tool_call_id", "")), id=f"m{i}"))
        elif role == "system":
            out.append(SystemMessage(content=content, id=f"m{i}"))
        else:
            out.append(HumanMessage(content=content, id=f"m{i}"))
    return out


def from_langchain(messages: Iterable[Any]) -> list[dict]:
    """LangChain messages -> trace-format message dicts."""
    out = []
    for m in messages:
        kind = getattr(m, "type", "human")
        content = m.content if isinstance(m.content, str) else str(m.content)
        if kind == "ai":
            d: dict[str, Any] = {"role": "assistant", "content": content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.get("id"), "name": c["name"], "args": c.get("args") or {}}
                                   for c in m.tool_calls]
            out.append(d)
        elif kind == "tool":
            out.append({"role": "tool", "tool_call_id": m.tool_call_id, "content": content})
        elif kind == "system":
            out.append({"role": "system", "content": content})
        else:
            out.append({"role": "user", "content": content})
    return out


# --------------------------------------------------------------------------------------------- editors

def _approx(messages) -> int:
    from langchain_core.messages.utils import count_tokens_approximately

    return count_tokens_approximately(messages)


class _Editor:
    """One middleware's view of every model call of a history (call by call, state carried forward)."""

    def __init__(self, workload: str, setting: tuple[int, ...], count: CountTokens, system: str):
        from langchain.agents.middleware import (ClearToolUsesEdit, ContextEditingMiddleware,
                                                 SummarizationMiddleware)

        self.workload, self.setting, self.count = workload, setting, count
        trigger, keep = setting[:2]
        self.system = system
        if workload in ("agent-clear", CLEAR_HOP):
            self.mw = ContextEditingMiddleware(edits=[ClearToolUsesEdit(
                trigger=trigger, keep=keep, clear_at_least=setting[2] if len(setting) > 2 else 0)],
                                               token_counter=self._with_system)
        elif workload == "agent-offload":
            self.mw = ContextEditingMiddleware(edits=[OffloadLargeResults(trigger=trigger, keep=keep)],
                                               token_counter=self._with_system)
        elif workload == "agent-summarize":
            self.mw = SummarizationMiddleware(model=ExtractiveSummarizer(), trigger=("tokens", trigger),
                                              keep=("messages", keep), token_counter=self._with_system)
        else:
            raise ValueError(f"unknown agent workload {workload!r}; choose from {list(AGENT_WORKLOADS)}")
        self.state: list = []

    def _with_system(self, messages) -> int:
        from langchain_core.messages import SystemMessage

        return self.count([SystemMessage(content=self.system), *messages])

    def call(self, appended: list) -> tuple[list, str]:
        """The model's view after ``appended`` joined the state, and what the middleware did."""
        from langchain_core.messages import RemoveMessage

        self.state = self.state + list(appended)
        if self.workload == "agent-summarize":
            update = self.mw.before_model({"messages": self.state}, None)
            if update:
                self.state = [m for m in update["messages"] if not isinstance(m, RemoveMessage)]
                return list(self.state), "summarize"
            return list(self.state), "none"
        from langchain.agents.middleware.types import ModelRequest

        seen: list = []

        def handler(req):
            seen.extend(req.messages)
            return None

        self.mw.wrap_model_call(ModelRequest(model=None, messages=list(self.state)), handler)
        changed = sum(1 for a, b in zip(self.state, seen) if a.content != b.content)
        kind = {"agent-clear": "clear", CLEAR_HOP: "clear", "agent-offload": "offload"}[self.workload]
        return seen, (f"{kind}:{changed}" if changed else "none")


# ----------------------------------------------------------------------------------------- tool waits

class _TraceRenderer:
    """The ``render`` a prediction calls (the chat model's signature): LangChain messages -> trace messages
    (:func:`from_langchain`, as the trace versions are written) -> ids through the caller's ``render``."""

    def __init__(self, render: Callable[[list[dict]], Any]):
        self._render = render

    def render(self, messages, tools=None, response_format=None):
        import numpy as np

        trace = from_langchain(messages)
        return trace, np.asarray(self._render(trace), dtype=np.int64), "plain"


@dataclass(frozen=True)
class ToolWait:
    """What the agent knows while the tools of one model call run: the next call's inputs but the results.

    Attributes:
        middleware: the workload's middleware object, the one that edited the recorded calls (LangChain's
            ``ContextEditingMiddleware`` or ``SummarizationMiddleware``).
        system: the system prompt (``""``: none).
        state: the agent state's messages after the call (LangChain messages; a summary the middleware
            wrote into the state is in them, a request-only edit is not).
        response: the call's response that asked for the tools (an ``AIMessage``; None when the step
            appended no assistant message).
        before: messages the step appended before the response (usually none).
        tools: the names of the tools the response called, in order.
    """

    middleware: Any
    system: str
    state: tuple
    response: Any
    before: tuple = ()
    tools: tuple[str, ...] = ()

    def with_middleware(self, middleware: Any) -> "ToolWait":
        """The same wait under another middleware (e.g. other settings of the editor)."""
        import dataclasses

        return dataclasses.replace(self, middleware=middleware)

    def predict(self, render: Callable[[list[dict]], Any]):
        """The next call's context up to the tool results, as the middleware will make it.

        Runs :func:`~patchkv_agent.langgraph.predict.predict_agent_context` with this wait's middleware
        on ``state + before``, the response and placeholder results (rendered twice with two placeholder
        markers; the ids the two renderings share, less ``SAFETY_TOKENS``, are the prediction).

        Args:
            render: trace-format messages (system message first) -> token ids, as the versions are rendered
                (e.g. ``lambda m: engine.encode_array(plain_messages(m))``).

        Returns:
            A :class:`~patchkv_agent.runtime.state.Prediction` (ids, or None and the reason).
        """
        from langchain.agents.middleware import ModelRequest
        from langchain_core.messages import SystemMessage

        from ..langgraph.predict import predict_agent_context
        from ..runtime.state import Prediction

        if self.response is None or not getattr(self.response, "tool_calls", None):
            return Prediction(reason="the call asked for no tool")
        history = list(self.state) + list(self.before)
        req = ModelRequest(model=None, messages=history, system_message=SystemMessage(self.system) if self.system
                           else None, tools=[], tool_choice=None, state={"messages": history}, runtime=None)
        return predict_agent_context(_TraceRenderer(render), req, self.response, [self.middleware])


@dataclass(frozen=True)
class AgentLoopEpisode:
    """An agent episode for the loop benchmark: the trace and, per version ``k >= 1``, ``waits[k - 1]``:
    what the agent knew while the tools of version ``k - 1``'s call ran."""

    trace: dict
    waits: tuple[ToolWait, ...]


# --------------------------------------------------------------------------------------------- traces

def clear_hop_setting(history: History, budget: int, count_tokens: CountTokens | None = None) -> tuple[int, int, int]:
    """``agent-clear-hop``'s ``ClearToolUsesEdit`` setting for one history and token budget.

    The trigger sits near the budget (:data:`CLEAR_HOP_TRIGGER_SHARE`), ``clear_at_least`` is 0 and ``keep``
    holds the results of about :data:`CLEAR_HOP_TAIL_SHARE` of the budget (the history's median step: an
    assistant call and its results). LangChain's edit works on each request, never on the state, and clears
    the oldest results first: a fixed ``clear_at_least`` would clear the same oldest results on every call
    (no edit after the first), whereas with ``clear_at_least`` 0 each call clears every result but the
    ``keep`` newest, i.e. the one result that left the window since the previous call: one result per hop,
    about 80 % deep.

    Args:
        history: the agent run.
        budget: the context budget (tokens).
        count_tokens: token counter over LangChain messages (None: LangChain's approximate counter).

    Returns:
        ``(trigger, keep, 0)``.
    """
    import statistics

    count = count_tokens or _approx
    msgs = to_langchain(history.messages)
    steps = [count(step) for step in _steps(msgs) if any(getattr(m, "type", "") == "tool" for m in step)]
    hop = statistics.median(steps) if steps else 1
    keep = max(1, round(CLEAR_HOP_TAIL_SHARE * budget / max(1, hop)))
    return int(CLEAR_HOP_TRIGGER_SHARE * budget), int(keep), 0


def scale_setting(setting: tuple[int, ...], context: int | None) -> tuple[int, ...]:
    """A middleware setting sized for :data:`REFERENCE_CONTEXT` tokens, scaled to ``context`` tokens (its
    trigger and ``clear_at_least``; ``keep`` unchanged); None: unchanged.

    The scaled trigger is capped at :data:`CONTEXT_TRIGGER_SHARE` of ``context``: an episode built for a
    window keeps only calls whose *unedited* twin fits in it, so a trigger at the window itself (the
    reference setting ``(4000, 2, 1500)`` scaled to 8,000) would never fire inside it and the workload would
    fall back to its other setting's short views. ``clear_at_least`` stays below the trigger.
    """
    if context is None:
        return tuple(setting)
    f = context / REFERENCE_CONTEXT
    out = list(setting)
    out[0] = min(int(round(setting[0] * f)), int(CONTEXT_TRIGGER_SHARE * context))
    if len(out) > 2:
        out[2] = min(int(round(setting[2] * f)), out[0] // 2)
    return tuple(out)


def _steps(msgs: list) -> Iterable[list]:
    """The history cut into the steps before each model call: the task (and any leading user text), then
    each call's response and its tool results."""
    i = 0
    while i < len(msgs):
        j = i + 1
        while j < len(msgs) and not (getattr(msgs[j - 1], "type", "") == "tool" and getattr(msgs[j], "type", "") != "tool"):
            j += 1
        yield msgs[i:j]
        i = j


@dataclass
class _Call:
    view: list
    kind: str
    unedited: list | None
    tokens: int
    state: tuple         # the middleware's state after the call
    appended: list       # the messages this step appended
    depth: float | None  # where the view first differs from the previous one (share of this view's tokens)


def _walk(history: History, ed: "_Editor", count: CountTokens, max_tokens: int, fit_unedited: bool) -> list[_Call]:
    from langchain_core.messages import SystemMessage

    sysmsg = [SystemMessage(content=history.system)] if history.system else []
    calls: list[_Call] = []
    prev_view: list | None = None
    for appended in _steps(to_langchain(history.messages)):
        view, kind = ed.call(appended)
        unedited = (prev_view + appended) if prev_view is not None else None
        tokens = count(sysmsg + view)
        if tokens > max_tokens or (fit_unedited and unedited is not None and count(sysmsg + unedited) > max_tokens):
            break
        depth = None
        if prev_view is not None:
            d = next((q for q, (a, b) in enumerate(zip(prev_view, view)) if a.content != b.content), None)
            if d is not None:
                depth = count(sysmsg + view[:d]) / max(1, tokens)
        calls.append(_Call(view, kind, unedited, tokens, tuple(ed.state), list(appended), depth))
        prev_view = view
    return calls


def _choose(calls: list[_Call], workload: str, min_tokens: int, max_versions: int) -> list[int] | None:
    """The calls an episode keeps (indices), or None."""
    first = next((k for k, c in enumerate(calls) if c.tokens >= min_tokens), None)
    if first is None:
        return None
    edits = [k for k in range(first + 1, len(calls)) if calls[k].kind != "none"]
    if not edits:
        return None
    if workload == CLEAR_HOP:
        # the last run of one-result hops (after the editor first fired) whose edits lie CLEAR_HOP_DEPTH deep
        lo, hi = CLEAR_HOP_DEPTH
        fired = next(k for k in range(len(calls)) if calls[k].kind != "none")

        def hop(k: int) -> bool:
            c = calls[k]
            return k > fired and c.kind.startswith("clear") and c.depth is not None and lo <= c.depth <= hi \
                and c.tokens >= min_tokens
        end = len(calls) - 1
        while end > fired and not hop(end):
            end -= 1
        start = end
        while start - 1 > fired and hop(start - 1) and end - (start - 1) + 2 <= max_versions:
            start -= 1
        base = start - 1
        if not hop(end) or base < fired or calls[base].tokens < min_tokens:
            return None
        return list(range(base, end + 1))
    # contiguous calls from the one before the first edit (a summarization and the append-only calls after
    # it; a clearing editor's first big clear and the one-result steps after it)
    start = max(first, edits[0] - 1)
    chosen = list(range(start, min(len(calls), start + max_versions)))
    return chosen if len(chosen) >= 2 else None


def _loop_episode(history: History, workload: str, setting: tuple[int, ...] | None, *,
                  count_tokens: CountTokens | None, min_tokens: int, max_tokens: int, max_versions: int,
                  fit_unedited: bool) -> AgentLoopEpisode | None:
    if workload not in AGENT_WORKLOADS:
        raise ValueError(f"unknown agent workload {workload!r}; choose from {list(AGENT_WORKLOADS)}")
    if max_versions < 2:
        raise ValueError(f"max_versions must be >= 2, got {max_versions}")
    count = count_tokens or _approx
    if setting is None:
        if workload != CLEAR_HOP:
            raise ValueError(f"{workload} needs a setting")
        setting = clear_hop_setting(history, max_tokens, count)
    ed = _Editor(workload, setting, count, history.system)
    calls = _walk(history, ed, count, max_tokens, fit_unedited or workload == CLEAR_HOP)
    chosen = _choose(calls, workload, min_tokens, max_versions)
    if chosen is None:
        return None
    sysd = [{"role": "system", "content": history.system}] if history.system else []
    versions, waits = [], []
    for n, k in enumerate(chosen):
        c = calls[k]
        v: dict[str, Any] = {"messages": sysd + from_langchain(c.view), "edit": c.kind if n else "base"}
        if n and c.unedited is not None:
            v["unedited"] = {"messages": sysd + from_langchain(c.unedited)}
        versions.append(v)
        if n:
            waits.append(_wait(ed.mw, history.system, calls[k - 1].state, c.appended))
    trigger, keep = setting[:2]
    trace = {"id": f"{workload}/{history.id}/t{trigger}k{keep}" + (f"c{setting[2]}" if len(setting) > 2 else ""),
             "workload": workload, "edit": workload[len("agent-"):], "versions": versions,
             "meta": {"source": history.source, "history": history.id, "licence": history.licence,
                      "origin": history.origin, "trigger": trigger, "keep": keep,
                      "tokens": [calls[k].tokens for k in chosen], "calls": list(chosen),
                      "edits": [calls[k].kind for k in chosen],
                      "depths": [None] + [calls[k].depth for k in chosen[1:]],
                      "token_counter": "model" if count_tokens else "approximate"}}
    if len(setting) > 2:
        trace["meta"]["clear_at_least"] = setting[2]
    return AgentLoopEpisode(trace=trace, waits=tuple(waits))


def _wait(middleware: Any, system: str, state: tuple, appended: list) -> ToolWait:
    """The :class:`ToolWait` of a step: the messages before its first tool result are known (the last
    assistant message among them is the response)."""
    first = next((i for i, m in enumerate(appended) if getattr(m, "type", "") == "tool"), len(appended))
    known = list(appended[:first])
    resp = next((i for i in range(len(known) - 1, -1, -1) if getattr(known[i], "type", "") == "ai"), None)
    if resp is None or first == len(appended):
        return ToolWait(middleware=middleware, system=system, state=state, response=None, before=tuple(known))
    response = known[resp]
    return ToolWait(middleware=middleware, system=system, state=state, response=response,
                    before=tuple(known[:resp]), tools=tuple(c["name"] for c in response.tool_calls))


def agent_episode(history: History, workload: str, setting: tuple[int, ...] | None = None, *,
                  count_tokens: CountTokens | None = None, min_tokens: int = 2000, max_tokens: int = 8000,
                  max_versions: int = 6, fit_unedited: bool = False) -> dict | None:
    """One trace of ``history`` under ``workload``'s middleware (see the module docstring).

    Args:
        history: the agent run.
        workload: one of :data:`AGENT_WORKLOADS`.
        setting: ``(trigger tokens, keep)`` of the middleware (``ClearToolUsesEdit``: a third element,
            ``clear_at_least``); None: ``agent-clear-hop``'s own (:func:`clear_hop_setting` for
            ``max_tokens``).
        count_tokens: token counter over LangChain messages (system prompt included by the caller's
            template); None: LangChain's approximate counter.
        min_tokens, max_tokens: the versions' token range.
        max_versions: versions kept (>= 2).
        fit_unedited: also keep every version's ``unedited`` twin within ``max_tokens`` (always for
            ``agent-clear-hop``).

    Returns:
        The trace dict (``meta["depths"]``: where each version first differs from the previous one, as a
        share of its tokens; None for none), or None when the history gives fewer than two calls in range
        or no edit happens among them.

    Raises:
        ValueError: an unknown workload, ``max_versions < 2``, or no setting for a workload that needs one.
    """
    ep = _loop_episode(history, workload, setting, count_tokens=count_tokens, min_tokens=min_tokens,
                       max_tokens=max_tokens, max_versions=max_versions, fit_unedited=fit_unedited)
    return None if ep is None else ep.trace


def build_agent_traces(workload: str, *, n: int | None = None, histories: str = "research,public",
                       count_tokens: CountTokens | None = None, min_tokens: int = 2000, max_tokens: int = 8000,
                       max_versions: int = 6, calls: int = 40, seed: int = 0, context: int | None = None) -> list[dict]:
    """Traces of ``workload`` over the chosen histories, every middleware setting in rotation.

    Args:
        workload: one of :data:`AGENT_WORKLOADS`.
        n: episodes at most (None: all that the histories give).
        histories: comma-separated kinds from :data:`HISTORY_KINDS`.
        count_tokens: token counter over LangChain messages (the benchmark passes its model's); None:
            LangChain's approximate counter.
        min_tokens, max_tokens, max_versions: see :func:`agent_episode`.
        calls: tool calls per research-agent history.
        seed: rotates the research questions.
        context: a context budget in tokens (a model's window): replaces ``max_tokens``, the views start at
            half of it, the settings are scaled to it (:func:`scale_setting`), research runs are long
            enough to fill it and every ``unedited`` twin fits in it; None: as given.

    Returns:
        Trace dicts (``docs/TRACES.md``), public and research histories interleaved.

    Raises:
        ValueError: an unknown workload or history kind, or ``context < 1000``.
    """
    return [ep.trace for ep in build_agent_loop_episodes(
        workload, n=n, histories=histories, count_tokens=count_tokens, min_tokens=min_tokens, max_tokens=max_tokens,
        max_versions=max_versions, calls=calls, seed=seed, context=context)]


def build_agent_loop_episodes(workload: str, *, n: int | None = None, histories: str = "research,public",
                              count_tokens: CountTokens | None = None, min_tokens: int = 2000,
                              max_tokens: int = 8000, max_versions: int = 6, calls: int = 40, seed: int = 0,
                              context: int | None = None, progress: bool = False) -> list[AgentLoopEpisode]:
    """:func:`build_agent_traces`'s episodes, each with its :class:`ToolWait` per call after the first.

    Args:
        workload, n, histories, count_tokens, min_tokens, max_tokens, max_versions, calls, seed, context: as
            :func:`build_agent_traces`.
        progress: a tqdm bar over the histories (long ones take seconds each with a model's counter).

    Returns:
        :class:`AgentLoopEpisode` objects (``trace`` equal to :func:`build_agent_traces`'s).

    Raises:
        ValueError: as :func:`build_agent_traces`.
    """
    from tqdm import tqdm

    if workload not in AGENT_WORKLOADS:
        raise ValueError(f"unknown agent workload {workload!r}; choose from {list(AGENT_WORKLOADS)}")
    kinds = [k.strip() for k in histories.split(",") if k.strip()]
    bad = [k for k in kinds if k not in HISTORY_KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown history kinds {bad or histories!r}; choose from {list(HISTORY_KINDS)}")
    if context is not None and context < 1000:
        raise ValueError(f"context must be >= 1000 tokens, got {context}")
    fit = context is not None
    if context is not None:
        max_tokens, min_tokens = context, context // 2
    budget = max_tokens
    if workload == CLEAR_HOP or context is not None:
        calls = max(calls, budget // 40)  # a research step is ~50-400 tokens: enough steps to fill the budget
    settings = {"agent-clear": CLEAR_SETTINGS, "agent-summarize": SUMMARY_SETTINGS,
                "agent-offload": OFFLOAD_SETTINGS, CLEAR_HOP: (None,)}[workload]
    want = n if n is not None else 10 ** 9
    pools = []
    if "public" in kinds:
        pools.append(public_histories())
    if "research" in kinds:
        pools.append(research_histories(max(4, want), calls=calls, seed=seed))
    order = [h for group in _interleave(pools) for h in group]
    out: list[AgentLoopEpisode] = []
    bar = tqdm(order, desc=f"episodes {workload}", unit="history", disable=not progress, file=sys.stderr)
    for i, h in enumerate(bar):
        if len(out) >= want:
            break
        setting = settings[i % len(settings)]
        if setting is not None:
            setting = scale_setting(setting, context)
        ep = _loop_episode(h, workload, setting, count_tokens=count_tokens, min_tokens=min_tokens,
                           max_tokens=max_tokens, max_versions=max_versions, fit_unedited=fit)
        if ep is None:
            log.info("history %s gives no %s episode in %d..%d tokens", h.id, workload, min_tokens, max_tokens)
            continue
        out.append(ep)
    bar.close()
    return out


def _interleave(pools: list[list[History]]) -> Iterable[list[History]]:
    for i in range(max((len(p) for p in pools), default=0)):
        yield [p[i] for p in pools if i < len(p)]

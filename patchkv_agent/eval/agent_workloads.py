"""Agent workloads edited by LangChain's own context-editing middlewares (``agent-clear``, ``agent-summarize``,
``agent-offload``): trace files (``docs/TRACES.md``) whose versions are what a ``create_agent`` model saw.

Boundary: builds traces from message histories by running LangChain v1's middleware code on them; no
model, no torch, no tokenizer (token counts come through a ``count_tokens(messages) -> int`` callable on
LangChain messages that the caller supplies, by default LangChain's ``count_tokens_approximately``).

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

Episodes keep the calls from the first one whose view reaches ``min_tokens`` up to ``max_tokens``, at
most ``max_versions`` of them, centred on the edits (a summarization and the append-only calls after it).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

log = logging.getLogger(__name__)

AGENT_WORKLOADS: tuple[str, ...] = ("agent-clear", "agent-summarize", "agent-offload")
HISTORY_KINDS: tuple[str, ...] = ("research", "public")
CLEAR_SETTINGS: tuple[tuple[int, ...], ...] = ((2500, 3, 0), (4000, 2, 1500))  # ClearToolUsesEdit (trigger, keep, clear_at_least)
SUMMARY_SETTINGS: tuple[tuple[int, int], ...] = ((2500, 6), (3500, 10))  # (trigger tokens, keep messages)
OFFLOAD_SETTINGS: tuple[tuple[int, int], ...] = ((2500, 2), (3500, 1))  # (trigger tokens, keep results)
OFFLOAD_MIN_CHARS = 800
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

@functools.lru_cache(maxsize=None)
def _summarizer_cls():
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.messages import AIMessage
    from langchain_core.outputs import ChatGeneration, ChatResult

    class ExtractiveSummarizer(BaseChatModel):
        """A deterministic fake chat model for ``SummarizationMiddleware``: an extractive summary.

        Reads the messages the middleware formatted into its prompt (``<message type=...>`` blocks) and
        answers with the task's first sentence and one line per summarized message: its first sentence (or
        first line of a tool result), at most ``line_chars`` characters; the calls an assistant made are
        named with their arguments.
        """

        line_chars: int = 160

        @property
        def _llm_type(self) -> str:
            return "extractive-summarizer"

        def _generate(self, messages, stop=None, run_manager=None, **kwargs):
            text = messages[-1].content if messages else ""
            text = text if isinstance(text, str) else str(text)
            lines = []
            for kind, body in re.findall(r'<message type="(\w+)"[^>]*>(.*?)</message>', text, flags=re.S):
                calls = re.findall(r'<tool_call id="[^"]*" name="([^"]*)">(.*?)</tool_call>', body, flags=re.S)
                inner = re.search(r"<content>(.*?)</content>", body, flags=re.S)
                body = inner.group(1) if inner else re.sub(r"<tool_call .*?</tool_call>", "", body, flags=re.S)
                first = _first_sentence(body, self.line_chars)
                if kind == "ai":
                    done = "; ".join(f"called {n}({a.strip()[:80]})" for n, a in calls)
                    first = " ".join(x for x in (first, done) if x)
                if first:
                    lines.append(f"- {kind}: {first}")
            summary = "## SUMMARY OF EARLIER STEPS\n" + "\n".join(lines)
            return ChatResult(generations=[ChatGeneration(message=AIMessage(content=summary))])

    return ExtractiveSummarizer


def _first_sentence(text: str, limit: int) -> str:
    text = " ".join(text.split())
    m = re.search(r"(?<=[.!?])\s", text)
    first = text[: m.start()] if m else text
    return first if len(first) <= limit else first[: limit].rsplit(" ", 1)[0] + " ..."


def ExtractiveSummarizer(**kwargs):  # noqa: N802 - a class built on first use (langchain-core imported lazily)
    """The deterministic summarizer chat model (see the class docstring); ``kwargs`` go to its constructor."""
    return _summarizer_cls()(**kwargs)


@functools.lru_cache(maxsize=None)
def _offload_edit_cls():
    from langchain.agents.middleware.context_editing import ContextEdit
    from langchain_core.messages import ToolMessage

    @dataclass
    class OffloadLargeResults(ContextEdit):
        """A LangChain ``ContextEdit``: once the context passes ``trigger`` tokens, every tool result longer
        than ``min_chars`` characters, except the ``keep`` most recent, becomes a preview (its first
        ``preview_lines`` lines) and the path its full text was saved under, as Deep Agents writes it."""

        trigger: int = 2000
        keep: int = 1
        min_chars: int = OFFLOAD_MIN_CHARS
        preview_lines: int = 5

        def apply(self, messages, *, count_tokens) -> None:
            if count_tokens(messages) <= self.trigger:
                return
            idx = [i for i, m in enumerate(messages) if isinstance(m, ToolMessage)]
            for i in idx[: len(idx) - self.keep] if self.keep else idx:
                m = messages[i]
                if m.response_metadata.get("context_editing", {}).get("offloaded"):
                    continue
                text = m.content if isinstance(m.content, str) else str(m.content)
                if len(text) <= self.min_chars:
                    continue
                path = f"/large_tool_results/{m.tool_call_id}"
                head = "\n".join(text.splitlines()[: self.preview_lines])
                preview = (f"Tool result too large, the result of this tool call {m.tool_call_id} was saved in the "
                           f"filesystem at this path: {path}\nYou can read the result from the filesystem by using "
                           f"the read_file tool, but make sure to only read part of the result at a time.\n"
                           f"Here are the first {self.preview_lines} lines of the result:\n{head}")
                messages[i] = m.model_copy(update={"content": preview, "response_metadata": {
                    **m.response_metadata, "context_editing": {"offloaded": True, "path": path}}})

    return OffloadLargeResults


def OffloadLargeResults(**kwargs):  # noqa: N802 - see ExtractiveSummarizer
    """The large-result offload ``ContextEdit`` (see the class docstring)."""
    return _offload_edit_cls()(**kwargs)


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
        if workload == "agent-clear":
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
        kind = {"agent-clear": "clear", "agent-offload": "offload"}[self.workload]
        return seen, (f"{kind}:{changed}" if changed else "none")


# --------------------------------------------------------------------------------------------- traces

def agent_episode(history: History, workload: str, setting: tuple[int, ...], *, count_tokens: CountTokens | None = None,
                  min_tokens: int = 2000, max_tokens: int = 8000, max_versions: int = 6) -> dict | None:
    """One trace of ``history`` under ``workload``'s middleware (see the module docstring).

    Args:
        history: the agent run.
        workload: one of :data:`AGENT_WORKLOADS`.
        setting: ``(trigger tokens, keep)`` of the middleware (``ClearToolUsesEdit``: a third element,
            ``clear_at_least``).
        count_tokens: token counter over LangChain messages (system prompt included by the caller's
            template); None: LangChain's approximate counter.
        min_tokens, max_tokens: the versions' token range.
        max_versions: versions kept (>= 2).

    Returns:
        The trace dict, or None when the history gives fewer than two calls in range or no edit happens
        among them.
    """
    count = count_tokens or _approx
    ed = _Editor(workload, setting, count, history.system)
    msgs = to_langchain(history.messages)
    from langchain_core.messages import SystemMessage

    sysmsg = [SystemMessage(content=history.system)] if history.system else []
    calls = []  # (view, kind, unedited, tokens)
    prev_view: list | None = None
    i = 0
    while i < len(msgs):  # the task (and any leading user text), then one model call after each tool result
        j = i + 1
        while j < len(msgs) and not (getattr(msgs[j - 1], "type", "") == "tool" and getattr(msgs[j], "type", "") != "tool"):
            j += 1
        appended = msgs[i:j]
        view, kind = ed.call(appended)
        unedited = (prev_view + appended) if prev_view is not None else None
        tokens = count(sysmsg + view)
        if tokens > max_tokens:
            break
        calls.append((view, kind, unedited, tokens))
        prev_view, i = view, j
    first = next((k for k, c in enumerate(calls) if c[3] >= min_tokens), None)
    if first is None:
        return None
    edits = [k for k in range(first + 1, len(calls)) if calls[k][1] != "none"]
    if not edits:
        return None
    # contiguous calls from the one before the first edit (a summarization and the append-only calls after
    # it; a clearing editor's first big clear and the one-result steps after it)
    start = max(first, edits[0] - 1)
    chosen = list(range(start, min(len(calls), start + max_versions)))
    if len(chosen) < 2:
        return None
    sysd = [{"role": "system", "content": history.system}] if history.system else []
    versions = []
    for n, k in enumerate(chosen):
        view, kind, unedited, tokens = calls[k]
        v: dict[str, Any] = {"messages": sysd + from_langchain(view), "edit": kind if n else "base"}
        if n and unedited is not None:
            v["unedited"] = {"messages": sysd + from_langchain(unedited)}
        versions.append(v)
    trigger, keep = setting[:2]
    return {"id": f"{workload}/{history.id}/t{trigger}k{keep}" + (f"c{setting[2]}" if len(setting) > 2 else ""), "workload": workload, "edit": workload[len("agent-"):],
            "versions": versions,
            "meta": {"source": history.source, "history": history.id, "licence": history.licence,
                     "origin": history.origin, "trigger": trigger, "keep": keep,
                     "tokens": [calls[k][3] for k in chosen], "calls": [k for k in chosen],
                     "edits": [calls[k][1] for k in chosen],
                     "token_counter": "model" if count_tokens else "approximate"}}


def build_agent_traces(workload: str, *, n: int | None = None, histories: str = "research,public",
                       count_tokens: CountTokens | None = None, min_tokens: int = 2000, max_tokens: int = 8000,
                       max_versions: int = 6, calls: int = 40, seed: int = 0) -> list[dict]:
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

    Returns:
        Trace dicts (``docs/TRACES.md``), public and research histories interleaved.

    Raises:
        ValueError: an unknown workload or history kind.
    """
    if workload not in AGENT_WORKLOADS:
        raise ValueError(f"unknown agent workload {workload!r}; choose from {list(AGENT_WORKLOADS)}")
    kinds = [k.strip() for k in histories.split(",") if k.strip()]
    bad = [k for k in kinds if k not in HISTORY_KINDS]
    if bad or not kinds:
        raise ValueError(f"unknown history kinds {bad or histories!r}; choose from {list(HISTORY_KINDS)}")
    settings = {"agent-clear": CLEAR_SETTINGS, "agent-summarize": SUMMARY_SETTINGS,
                "agent-offload": OFFLOAD_SETTINGS}[workload]
    want = n if n is not None else 10 ** 9
    pools = []
    if "public" in kinds:
        pools.append(public_histories())
    if "research" in kinds:
        pools.append(research_histories(max(4, want), calls=calls, seed=seed))
    order = [h for group in _interleave(pools) for h in group]
    out: list[dict] = []
    for i, h in enumerate(order):
        if len(out) >= want:
            break
        setting = settings[i % len(settings)]
        tr = agent_episode(h, workload, setting, count_tokens=count_tokens, min_tokens=min_tokens,
                           max_tokens=max_tokens, max_versions=max_versions)
        if tr is None:
            log.info("history %s gives no %s episode in %d..%d tokens", h.id, workload, min_tokens, max_tokens)
            continue
        out.append(tr)
    return out


def _interleave(pools: list[list[History]]) -> Iterable[list[History]]:
    for i in range(max((len(p) for p in pools), default=0)):
        yield [p[i] for p in pools if i < len(p)]

"""``TraceRecorder``: write every context version of a live agent run as traces (``docs/TRACES.md``).

A LangChain callback handler: pass it in the run config (``config={"callbacks": [recorder]}``) of a
graph or agent. Every chat-model call becomes one version of its thread's episode (identical
consecutive versions are kept once). For a :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel`
the version is exactly what the model saw (its ``patchkv_context`` event: messages with the JSON tool
protocol included, so ``patchkv-agent replay`` renders them to the same token ids); for any other chat
model it is the call's messages. Episodes with two or more versions are written as JSON Lines
(:meth:`write`), one per thread key, with ``edit`` named from what changed between versions
(``append`` when each version extends the previous one, else ``live``) and, per version, the optional
fields ``edit`` and ``stats`` (the model call's PatchKV resume stats, when there are any).

Knows LangChain callbacks and the trace format; nothing about models.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler

from .chat_model import CONTEXT_EVENT
from .keys import thread_key_from_metadata
from .tools import to_trace_messages


def edit_kind(old: list[dict], new: list[dict]) -> str:
    """``append`` when ``new`` starts with every message of ``old``; ``same`` when equal; else ``edit``."""
    if old == new:
        return "same"
    if len(new) > len(old) and new[:len(old)] == old:
        return "append"
    return "edit"


class TraceRecorder(BaseCallbackHandler):
    """Collect each thread's context versions from chat-model calls.

    Args:
        workload: the traces' ``workload`` field.
        answers: optional gold answers per thread id (``{"thread-1": ["Paris"]}``).
        include_token_ids: also store the ids the model saw (``token_ids``; replay then uses them, which
            only makes sense on the same model).
    """

    raise_error = False

    def __init__(self, *, workload: str = "live", answers: dict[str, list[str]] | None = None,
                 include_token_ids: bool = False):
        super().__init__()
        self.workload, self.answers, self.include_token_ids = workload, dict(answers or {}), include_token_ids
        self._lock = threading.Lock()
        self._episodes: dict[tuple, list[dict]] = {}
        self._runs: dict[UUID, tuple[tuple, int]] = {}  # model run -> (episode key, version index)

    # ------------------------------------------------------------ callbacks

    def on_chat_model_start(self, serialized: dict, messages: list[list[Any]], *, run_id: UUID,
                            metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """Record the call's messages as the next version of its thread (replaced by the model's own
        rendering if it sends one)."""
        key = thread_key_from_metadata(metadata, default_thread_id="default")
        try:
            version = {"messages": to_trace_messages(messages[0])}
        except TypeError:
            return
        self._add(tuple(key), run_id, version)

    def on_custom_event(self, name: str, data: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """Replace the version of ``run_id`` with what a PatchKVChatModel rendered (and move it to the
        model's thread key)."""
        if name != CONTEXT_EVENT or not isinstance(data, dict):
            return
        version: dict[str, Any] = {"messages": data["messages"]}
        if self.include_token_ids:
            version["token_ids"] = list(data["token_ids"])
        key = tuple(data["thread_key"]) if data.get("thread_key") else ("default", "")
        with self._lock:
            where = self._runs.pop(run_id, None)
            if where is not None:
                eps = self._episodes[where[0]]
                eps.pop(where[1])
                if not eps:
                    self._episodes.pop(where[0])
        self._add(key, run_id, version)

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        """Attach the call's PatchKV stats to its version."""
        with self._lock:
            where = self._runs.get(run_id)
            if where is None:
                return
            try:
                stats = response.generations[0][0].message.response_metadata.get("patchkv")
            except (AttributeError, IndexError):
                stats = None
            if stats:
                self._episodes[where[0]][where[1]]["stats"] = stats

    def _add(self, key: tuple, run_id: UUID, version: dict) -> None:
        with self._lock:
            eps = self._episodes.setdefault(key, [])
            if eps and eps[-1]["messages"] == version["messages"]:
                self._runs[run_id] = (key, len(eps) - 1)
                return
            if eps:
                version["edit"] = edit_kind(eps[-1]["messages"], version["messages"])
            eps.append(version)
            self._runs[run_id] = (key, len(eps) - 1)

    # --------------------------------------------------------------- output

    def episodes(self) -> list[dict[str, Any]]:
        """The recorded traces with two or more versions (trace-format episodes, docs/TRACES.md)."""
        out = []
        with self._lock:
            items = [(k, [dict(v) for v in vs]) for k, vs in self._episodes.items()]
        for (tid, ns), versions in items:
            if len(versions) < 2:
                continue
            edits = {v.get("edit") for v in versions[1:]}
            trace: dict[str, Any] = {"id": f"{tid}/{ns}" if ns else str(tid), "workload": self.workload,
                                     "edit": "append" if edits == {"append"} else "live", "versions": versions}
            if tid in self.answers:
                trace["answers"] = list(self.answers[tid])
            out.append(trace)
        return out

    def write(self, path: str | Path) -> int:
        """Write :meth:`episodes` as JSON Lines (parent folders created).

        Returns:
            The number of traces written.
        """
        eps = self.episodes()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            for t in eps:
                f.write(json.dumps(t, ensure_ascii=False) + "\n")
        return len(eps)

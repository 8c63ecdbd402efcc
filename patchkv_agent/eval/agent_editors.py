"""The two editor pieces the agent workloads need that LangChain does not ship: a deterministic summarizer chat model
for ``SummarizationMiddleware`` (:func:`ExtractiveSummarizer`) and the Deep-Agents-style large-result offload as a
LangChain ``ContextEdit`` (:func:`OffloadLargeResults`).

Boundary: LangChain classes built on first use (langchain-core and langchain are imported lazily), no model, no
torch; :mod:`.agent_workloads` runs them inside LangChain's own middlewares.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

__all__ = ["OFFLOAD_MIN_CHARS", "ExtractiveSummarizer", "OffloadLargeResults"]

OFFLOAD_MIN_CHARS = 800


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

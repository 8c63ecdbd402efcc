"""The evidence each model call carries when the prewarm middleware runs: what was prepared, what the server
reused, and how long each part took (``AIMessage.response_metadata["patchkv"]``).

Boundary: plain data; no LangChain, no HTTP.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ..results import PreparedOutcome

__all__ = ["ServerCallStats"]


@dataclass(frozen=True)
class ServerCallStats:
    """One model call to an OpenAI-compatible server, as the prewarm middleware saw it.

    Attributes:
        server: the adapter's engine name (``vllm``, ``llama.cpp``), None before one was chosen.
        thread: the call's thread id.
        prepared: the tool wait's preparation of this call (a :class:`~patchkv_agent.results.PreparedOutcome`:
            ``hit``: the call starts with the prewarmed ids; ``partial``: it diverges inside them, after what
            the server held before; ``miss``: it diverges before that; ``unfinished``: still running when the
            call came (aborted; the server keeps what it computed); ``failed``: no prewarm, see
            ``prepared_reason``), None when nothing was prepared (the first call, a call after text).
        prepared_reason: why the outcome is not a plain hit (a server error, where the call differs, ...).
        prepared_tokens: the ids the prewarm computed (the predicted context up to the first unknown token).
        prepared_match_tokens: where the call's ids leave the prepared ones (a partial or a miss).
        prepared_reused_before: of the prepared ids, those the previous call's context already held (what a
            prefix cache reuses without a prewarm).
        prepared_info: the prediction's notes (editors applied, results cleared, assumptions made).
        predict_s: the editors' prediction; render_s: the two renderings on the server; prewarm_s: the
            prewarm request; prepared_elapsed_s: from the preparation's start to the call (or to its end).
        prewarm_cached_tokens: what the server found cached when the prewarm came.
        prewarm_requests: the prewarm requests sent (one per chunk).
        cached_tokens: the call's prompt tokens the server reports cached (None: not reported; vLLM needs
            ``--enable-prompt-tokens-details``).
        prompt_tokens: the call's prompt length as the server counted it.
        call_s: the call's wall time (request to full response) in the middleware.
        tool_s: the preceding tools' wall time.
    """

    server: str | None = None
    thread: str | None = None
    prepared: PreparedOutcome | None = None
    prepared_reason: str | None = None
    prepared_tokens: int | None = None
    prepared_match_tokens: int | None = None
    prepared_reused_before: int | None = None
    prepared_info: Mapping[str, Any] | None = field(default=None, compare=False)
    predict_s: float | None = None
    render_s: float | None = None
    prewarm_s: float | None = None
    prepared_elapsed_s: float | None = None
    prewarm_cached_tokens: int | None = None
    prewarm_requests: int | None = None
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    call_s: float | None = None
    tool_s: float | None = None

    def __post_init__(self):
        if self.prepared is not None:
            object.__setattr__(self, "prepared", PreparedOutcome(self.prepared))
        if self.prepared_info is not None:
            object.__setattr__(self, "prepared_info", types.MappingProxyType(dict(self.prepared_info)))

    def replace(self, **changes: Any) -> "ServerCallStats":
        """A copy with ``changes``."""
        return ServerCallStats(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})

    def to_json(self) -> dict:
        """The JSON form (``kind: "server"``; None fields left out; the outcome as its string)."""
        out: dict[str, Any] = {"kind": "server"}
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "prepared_info":
                v = dict(v)
            elif isinstance(v, PreparedOutcome):
                v = str(v)
            out[f.name] = v
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ServerCallStats":
        """Read the JSON form back.

        Raises:
            ValueError: not the JSON form of these stats.
        """
        if not isinstance(data, Mapping) or data.get("kind") != "server":
            raise ValueError("not server-call stats (kind must be 'server')")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


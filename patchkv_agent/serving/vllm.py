"""vLLM's OpenAI-compatible server: ``/tokenize`` renders a chat request, ``/v1/completions`` prewarms.

vLLM's prefix cache keeps whole KV blocks (16 tokens on GPU, 128 on its CPU build by default), keyed by the
ids before them and the request's ``cache_salt``; a prewarm of the ids a call starts with leaves every full
block of them cached for the call. Run the server with ``--enable-prefix-caching`` and, for the cached-token
count in each call's usage, ``--enable-prompt-tokens-details``.

A prewarm is a low-priority request (``priority`` 1; a call's is 0) sent in chunks of
:attr:`VLLMAdapter.chunk_tokens` on growing prefixes: vLLM's CPU build runs a request's whole prefill in one
step, so a call that comes during one long prewarm waits for all of it; with chunks it waits for one at
most, and with ``--scheduling-policy priority`` it goes ahead of a waiting chunk. A server without priority
scheduling serves the priority as FCFS (vLLM 0.32); one that refuses it (HTTP 400 naming ``priority``) is
sent none from then on.

Boundary: vLLM's HTTP routes through :mod:`.http`; no LangChain.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .adapter import PrewarmReply, ServerAdapter, count, token_ids
from .http import Exchange, ServerError

__all__ = ["VLLMAdapter"]


class VLLMAdapter(ServerAdapter):
    """The adapter of vLLM's OpenAI-compatible server (``vllm serve`` / ``vllm.entrypoints.openai.api_server``)."""

    name = "vllm"
    supports_salt = True
    chunk_tokens = 512  # a multiple of the 128-token CPU block and the 16-token GPU block

    def __init__(self) -> None:
        self.refuses_priority = False  # the server answered a prewarm's priority with HTTP 400

    def render(self, exchange: Exchange, payload: Mapping[str, Any]) -> list[int]:
        body: dict[str, Any] = {"messages": payload["messages"], "add_generation_prompt": True}
        if payload.get("model") is not None:
            body["model"] = payload["model"]
        if payload.get("tools"):
            body["tools"] = payload["tools"]
        extra = payload.get("extra_body") or {}
        for k in ("chat_template_kwargs", "chat_template", "add_special_tokens", "continue_final_message"):
            if k in extra:
                body[k] = extra[k]
        out = exchange.post("/tokenize", body)
        ids = token_ids(out.get("tokens"), "/tokenize tokens")
        n = count(out.get("count"), "/tokenize count")
        if n is not None and n != len(ids):
            raise ServerError("malformed", f"/tokenize says count {n} for {len(ids)} tokens")
        return ids

    def prewarm(self, exchange: Exchange, model: str | None, ids: Sequence[int], salt: str | None, *,
                priority: int | None = None) -> PrewarmReply:
        body: dict[str, Any] = {"prompt": list(ids), "max_tokens": 1, "temperature": 0.0}
        if model is not None:
            body["model"] = model
        if salt is not None:
            body["cache_salt"] = salt
        if priority is not None and not self.refuses_priority:
            body["priority"] = priority
        try:
            out = exchange.post("/v1/completions", body)
        except ServerError as e:
            if "priority" not in body or e.status != 400 or "priority" not in e.detail.lower():
                raise
            self.refuses_priority = True  # a server without priority scheduling that says so
            del body["priority"]
            out = exchange.post("/v1/completions", body)
        usage = out.get("usage")
        if not isinstance(usage, dict):
            raise ServerError("malformed", "/v1/completions: no usage in the answer")
        details = usage.get("prompt_tokens_details")
        cached = count(details.get("cached_tokens"), "cached_tokens") if isinstance(details, dict) else None
        return PrewarmReply(prompt_tokens=count(usage.get("prompt_tokens"), "prompt_tokens"), cached_tokens=cached)

    @classmethod
    def detect(cls, exchange_for: Any) -> bool:
        try:
            out = exchange_for().get("/version")
        except ServerError as e:
            if e.kind == "status" or e.kind == "malformed":
                return False
            raise
        return isinstance(out.get("version"), str) and "default_generation_settings" not in out

"""vLLM's OpenAI-compatible server: ``/tokenize`` renders a chat request, ``/v1/completions`` prewarms.

vLLM's prefix cache keeps whole KV blocks (16 tokens on GPU, 128 on its CPU build by default), keyed by the
ids before them and the request's ``cache_salt``; a prewarm of the ids a call starts with leaves every full
block of them cached for the call. Run the server with ``--enable-prefix-caching`` and, for the cached-token
count in each call's usage, ``--enable-prompt-tokens-details``.

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

    def prewarm(self, exchange: Exchange, model: str | None, ids: Sequence[int], salt: str | None) -> PrewarmReply:
        body: dict[str, Any] = {"prompt": list(ids), "max_tokens": 1, "temperature": 0.0}
        if model is not None:
            body["model"] = model
        if salt is not None:
            body["cache_salt"] = salt
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

"""llama.cpp's server (``llama-server``): ``/apply-template`` + ``/tokenize`` render, ``/completion`` prewarms.

The server keeps each slot's last prompt and, with ``cache_prompt`` (its default), reuses its longest common
prefix; a request goes to the slot whose prompt it shares most with, so a prewarm of the ids a call starts
with leaves them in the slot the call then takes. Its OpenAI routes report the reused tokens in
``usage.prompt_tokens_details.cached_tokens``. It has no cache salt: a salted call is never prewarmed.

Boundary: llama.cpp's HTTP routes through :mod:`.http`; no LangChain.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from .adapter import PrewarmReply, ServerAdapter, count, token_ids
from .http import Exchange, ServerError

__all__ = ["LlamaCppAdapter"]


class LlamaCppAdapter(ServerAdapter):
    """The adapter of llama.cpp's ``llama-server``."""

    name = "llama.cpp"
    supports_salt = False

    def render(self, exchange: Exchange, payload: Mapping[str, Any]) -> list[int]:
        body: dict[str, Any] = {"messages": payload["messages"]}
        if payload.get("tools"):
            body["tools"] = payload["tools"]
        extra = payload.get("extra_body") or {}
        if "chat_template_kwargs" in extra:
            body["chat_template_kwargs"] = extra["chat_template_kwargs"]
        prompt = exchange.post("/apply-template", body).get("prompt")
        if not isinstance(prompt, str):
            raise ServerError("malformed", "/apply-template: no prompt string in the answer")
        # the chat route tokenizes the templated prompt with special tokens added and parsed
        out = exchange.post("/tokenize", {"content": prompt, "add_special": True, "parse_special": True})
        return token_ids(out.get("tokens"), "/tokenize tokens")

    def prewarm(self, exchange: Exchange, model: str | None, ids: Sequence[int], salt: str | None, *,
                priority: int | None = None) -> PrewarmReply:
        if salt is not None:
            raise ServerError("unsupported", "llama.cpp's server has no cache salt; a salted call is not prewarmed")
        out = exchange.post("/completion", {"prompt": list(ids), "n_predict": 1, "cache_prompt": True,
                                            "temperature": 0.0})
        timings = out.get("timings") if isinstance(out.get("timings"), dict) else {}
        cached = count(timings.get("cache_n"), "timings.cache_n")
        prompt_n = count(timings.get("prompt_n"), "timings.prompt_n")
        total = (prompt_n + cached) if prompt_n is not None and cached is not None else None
        return PrewarmReply(prompt_tokens=total, cached_tokens=cached)

    @classmethod
    def detect(cls, exchange_for: Any) -> bool:
        try:
            out = exchange_for().get("/props")
        except ServerError as e:
            if e.kind in ("status", "malformed"):
                return False
            raise
        return isinstance(out.get("default_generation_settings"), dict)

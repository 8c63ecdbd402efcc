"""The interface between the prewarm middleware and one kind of serving engine, and what comes back.

An adapter knows one server's routes: how to render a chat request with the server's own chat template into
token ids (:meth:`ServerAdapter.render`), and how to compute a token-id prompt into the server's prefix cache
(:meth:`ServerAdapter.prewarm`). Each engine is one small module: :mod:`.vllm`, :mod:`.llamacpp`.
:func:`~patchkv_agent.serving.engines.adapter_for` picks one by name or asks the server which it is.

Every value read back is checked before it is used (:func:`token_ids`, :func:`count`): a server that answers
with garbage gives a :class:`~patchkv_agent.serving.http.ServerError`, never a wrong prompt.

Boundary: JSON payloads in the OpenAI chat format and :mod:`.http`; no LangChain, no torch.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from .http import Exchange, ServerError

__all__ = ["ServerAdapter", "PrewarmReply", "token_ids", "count", "MAX_PROMPT_TOKENS"]

MAX_PROMPT_TOKENS = 1 << 21  # more ids than any served context holds: a longer list is not a rendering


@dataclass(frozen=True)
class PrewarmReply:
    """What the server said of a prewarm.

    Attributes:
        prompt_tokens: the prompt's length as the server counted it.
        cached_tokens: of those, the tokens it found in its prefix cache (None: not reported).
    """

    prompt_tokens: int | None
    cached_tokens: int | None


class ServerAdapter(abc.ABC):
    """One serving engine's routes for rendering and prewarming.

    Attributes:
        name: the engine's name (``vllm``, ``llama.cpp``), reported in each call's stats.
        supports_salt: the engine scopes its prefix cache by a per-request salt (``cache_salt``); an
            adapter without it never prewarms a salted call.
        chunk_tokens: the most ids one prewarm request adds to what the server holds (None: one request).
            An engine that runs a request's whole prefill in one step makes every call that comes meanwhile
            wait for all of it; prewarmed as requests on growing prefixes, a call waits for one chunk at most.
    """

    name: str = ""
    supports_salt: bool = False
    chunk_tokens: int | None = None

    @abc.abstractmethod
    def render(self, exchange: Exchange, payload: Mapping[str, Any]) -> list[int]:
        """The token ids the server builds for a chat-completions ``payload`` (its chat template, the
        generation prompt appended), as the real call will be rendered.

        Raises:
            ServerError: the server failed or answered something that is not a rendering.
        """

    @abc.abstractmethod
    def prewarm(self, exchange: Exchange, model: str | None, ids: Sequence[int], salt: str | None, *,
                priority: int | None = None) -> PrewarmReply:
        """Compute ``ids`` into the server's prefix cache (one token decoded, greedy).

        Args:
            exchange: a fresh exchange with the server.
            model: the served model name (None: the server's only one).
            ids: the token ids.
            salt: the call's cache salt (None: none).
            priority: the request's scheduling priority where the engine has one (vLLM: lower is served
                earlier, a call's default is 0), None: the engine's default.

        Raises:
            ServerError: the server failed or answered something unreadable.
        """

    @classmethod
    @abc.abstractmethod
    def detect(cls, exchange_for: Any) -> bool:
        """Whether the server behind ``exchange_for()`` (a factory of fresh :class:`Exchange` objects) is
        this engine."""


def token_ids(value: Any, what: str) -> list[int]:
    """``value`` as a list of token ids, checked: a list of non-negative ints below 2**31, at most
    :data:`MAX_PROMPT_TOKENS` long.

    Raises:
        ServerError: (``malformed``) anything else.
    """
    if not isinstance(value, list) or len(value) > MAX_PROMPT_TOKENS:
        raise ServerError("malformed", f"{what}: not a list of at most {MAX_PROMPT_TOKENS} token ids")
    for t in value:
        if type(t) is not int or not 0 <= t < (1 << 31):
            raise ServerError("malformed", f"{what}: {str(t)[:40]!r} is not a token id")
    return value


def count(value: Any, what: str, *, optional: bool = True) -> int | None:
    """``value`` as a token count (a non-negative int below 2**31), or None where absent and ``optional``.

    Raises:
        ServerError: (``malformed``) anything else.
    """
    if value is None and optional:
        return None
    if type(value) is not int or not 0 <= value < (1 << 31):
        raise ServerError("malformed", f"{what}: {str(value)[:40]!r} is not a token count")
    return value

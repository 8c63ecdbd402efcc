"""What an agent's OpenAI-compatible chat model sends: its address, its request payload, its usage.

The prewarm must go where the real call goes and render what the real call renders, so nothing here is
rebuilt by hand: the endpoint comes from the model's own ``base_url``, API key and default headers, and the
payload from its own ``_get_request_payload`` after ``create_agent``'s own binding of the request's tools,
tool choice and settings (:func:`chat_payload`).

Boundary: ``langchain-openai``'s chat models (``ChatOpenAI`` and its subclasses) and LangChain messages; no
HTTP, no torch.
"""

from __future__ import annotations

from typing import Any, Sequence

from .http import Endpoint

__all__ = ["is_openai_model", "endpoint_of", "chat_payload", "cached_tokens_of", "salt_of", "with_salt", "with_headers",
           "RENDER_KEYS"]

# the payload fields that decide the prompt the server renders, or that a middleware changes with the request
RENDER_KEYS = ("model", "tools", "tool_choice", "response_format", "parallel_tool_calls")


def _inner(model: Any) -> tuple[Any, dict]:
    """A model and its bound kwargs (``model.bind(...)`` gives a ``RunnableBinding``)."""
    kwargs: dict = {}
    while hasattr(model, "bound") and hasattr(model, "kwargs"):
        kwargs = {**model.kwargs, **kwargs}
        model = model.bound
    return model, kwargs


def is_openai_model(model: Any) -> bool:
    """Whether ``model`` (or the model a binding wraps) is a ``langchain-openai`` chat-completions model."""
    try:
        from langchain_openai.chat_models.base import BaseChatOpenAI
    except ImportError:  # langchain-openai not installed: no OpenAI-compatible model can be in use
        return False
    inner, _ = _inner(model)
    return isinstance(inner, BaseChatOpenAI) and not getattr(inner, "use_responses_api", False)


def endpoint_of(model: Any) -> Endpoint:
    """The server a chat model's calls go to, with the same credentials.

    Args:
        model: a ``ChatOpenAI`` (or a binding of one).

    Returns:
        The :class:`~patchkv_agent.serving.http.Endpoint`.

    Raises:
        ValueError: the model has no usable base URL (``base_url=`` names the server).
    """
    inner, _ = _inner(model)
    base = getattr(inner, "openai_api_base", None)
    if not base:
        raise ValueError("the agent's chat model has no base_url: the prewarm goes only to a server you run; "
                         "set ChatOpenAI(base_url='http://host:8000/v1', ...)")
    key = getattr(inner, "openai_api_key", None)
    if key is not None and hasattr(key, "get_secret_value"):
        key = key.get_secret_value()
    if callable(key):
        key = None  # a key provider is the client's business; the prewarm sends none rather than call it
    return Endpoint.from_base_url(str(base), api_key=key, headers=getattr(inner, "default_headers", None) or {},
                                  model=getattr(inner, "model_name", None))


def chat_payload(request: Any, messages: Sequence[Any]) -> dict:
    """The chat-completions payload the agent sends for ``request`` with ``messages``: ``create_agent``'s
    binding of its tools, tool choice and model settings, then the model's own ``_get_request_payload``.

    Args:
        request: a ``ModelRequest`` whose model is an OpenAI-compatible chat model.
        messages: the call's messages, system message first.

    Returns:
        The payload (``messages`` as dicts, ``tools``, ``tool_choice``, ``extra_body``, ...).
    """
    model = request.model
    settings = dict(getattr(request, "model_settings", None) or {})
    tools = list(getattr(request, "tools", None) or [])
    if tools:
        bound = model.bind_tools(tools, tool_choice=getattr(request, "tool_choice", None), **settings)
    else:
        bound = model.bind(**settings) if settings else model
    inner, kwargs = _inner(bound)
    return inner._get_request_payload(list(messages), **kwargs)


def salt_of(payload: dict) -> str | None:
    """The ``cache_salt`` a payload carries (in ``extra_body``, or at the top level), if any."""
    extra = payload.get("extra_body") or {}
    salt = extra.get("cache_salt", payload.get("cache_salt"))
    return None if salt is None else str(salt)


def with_salt(request: Any, salt: str) -> Any:
    """``request`` whose model call carries ``cache_salt=salt`` (merged into its ``extra_body`` setting)."""
    inner, kwargs = _inner(request.model)
    settings = dict(getattr(request, "model_settings", None) or {})
    extra = {**(getattr(inner, "extra_body", None) or {}), **(kwargs.get("extra_body") or {}),
             **(settings.get("extra_body") or {}), "cache_salt": salt}
    return request.override(model_settings={**settings, "extra_body": extra})


def with_headers(request: Any, headers: dict) -> Any:
    """``request`` whose model call also sends ``headers`` (merged into its ``extra_headers`` setting)."""
    settings = dict(getattr(request, "model_settings", None) or {})
    return request.override(model_settings={**settings, "extra_headers": {**(settings.get("extra_headers") or {}),
                                                                           **headers}})


def cached_tokens_of(message: Any) -> int | None:
    """The prompt tokens the server reports it found cached for the call that wrote ``message`` (vLLM with
    ``--enable-prompt-tokens-details``, llama.cpp's server: ``usage.prompt_tokens_details.cached_tokens``,
    which ``langchain-openai`` keeps as ``usage_metadata["input_token_details"]["cache_read"]``)."""
    usage = getattr(message, "usage_metadata", None) or {}
    value = (usage.get("input_token_details") or {}).get("cache_read")
    return value if type(value) is int and value >= 0 else None

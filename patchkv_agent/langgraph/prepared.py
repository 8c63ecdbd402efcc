"""``prepared_middleware``: one call that builds an agent's context editors and the middleware that runs those
same editors ahead during tool waits, in-process (a ``PatchKVChatModel``) or on a server (a ``ChatOpenAI``).

Boundary: picks and builds middleware; the in-process path is :mod:`.middleware`, the server path
:mod:`patchkv_agent.serving.middleware` (imported only for a server model).
"""

from __future__ import annotations

from typing import Any

from langchain.agents.middleware import AgentMiddleware

from .chat_model import PatchKVChatModel
from .middleware import PatchKVMiddleware

__all__ = ["prepared_middleware"]


def prepared_middleware(model: Any, editors: Any = (), **options: Any) -> list:
    """The middleware list of an agent whose context editors run ahead during tool waits: the editors in
    their order, then the PatchKV middleware that predicts with those same instances (so they are never
    given twice, or once and forgotten).

    ``create_agent(model, tools, middleware=prepared_middleware(model, editors=[clear, summarize]))``: for a
    :class:`~patchkv_agent.langgraph.chat_model.PatchKVChatModel` the in-process
    :class:`~patchkv_agent.langgraph.middleware.PatchKVMiddleware` (on the model's registry); for a ``ChatOpenAI`` pointed at a server the
    :class:`~patchkv_agent.serving.middleware.PatchKVServerMiddleware`.

    Args:
        model: the agent's chat model (the one given to ``create_agent``).
        editors: the context editors (``ContextEditingMiddleware``, ``SummarizationMiddleware``, ...), in the
            order the agent runs them.
        **options: the middleware's own options (``scope=``, ``offload=``, ``adapter=``, ``cache_salt=`` ...).

    Returns:
        ``[*editors, middleware]``.

    Raises:
        ValueError: a model that is neither a PatchKV chat model nor an OpenAI-compatible one; an editor
            that is not an ``AgentMiddleware``.
    """
    editors = list(editors or [])
    inner = getattr(model, "bound", model)
    if isinstance(inner, PatchKVChatModel):
        mw: AgentMiddleware = PatchKVMiddleware(inner.registry, editors=editors, **options)
    else:
        from ..serving.openai import is_openai_model

        if not is_openai_model(model):
            raise ValueError(f"prepared_middleware needs a PatchKVChatModel or a ChatOpenAI pointed at a server, "
                             f"got a {type(inner).__name__} (install langchain-openai for the server path)")
        from ..serving.middleware import PatchKVServerMiddleware

        mw = PatchKVServerMiddleware(editors=editors, **options)
    return [*editors, mw]

"""Which adapter serves an endpoint: by name, or by asking the server which engine it is.

Boundary: the adapter modules (:mod:`.vllm`, :mod:`.llamacpp`) and :mod:`.http`; no LangChain, no torch.
"""

from __future__ import annotations

from .adapter import ServerAdapter
from .http import Endpoint, Exchange, ServerError

__all__ = ["adapter_for", "ADAPTERS"]


def _adapters() -> dict[str, type[ServerAdapter]]:
    from .llamacpp import LlamaCppAdapter
    from .vllm import VLLMAdapter

    return {"vllm": VLLMAdapter, "llama.cpp": LlamaCppAdapter}


ADAPTERS = ("vllm", "llama.cpp")


def adapter_for(spec: "str | ServerAdapter", endpoint: Endpoint | None = None, *,
                timeout_s: float = 5.0) -> ServerAdapter:
    """The adapter ``spec`` names (``"vllm"``, ``"llama.cpp"``, an instance), or for ``"auto"`` the one whose
    server answers at ``endpoint``.

    Args:
        spec: a name from :data:`ADAPTERS`, ``"auto"`` or a :class:`ServerAdapter`.
        endpoint: the server, for ``"auto"``.
        timeout_s: the longest each probe waits.

    Returns:
        The adapter.

    Raises:
        ValueError: an unknown name, or ``"auto"`` without an endpoint.
        ServerError: ``"auto"`` and no known engine answers (``kind="unknown"`` when one answers but is
            neither, else the probe's own error).
    """
    if isinstance(spec, ServerAdapter):
        return spec
    table = _adapters()
    if spec in table:
        return table[spec]()
    if spec != "auto":
        raise ValueError(f"adapter must be one of {', '.join(ADAPTERS)}, 'auto' or a ServerAdapter, got {spec!r}")
    if endpoint is None:
        raise ValueError("adapter='auto' needs the server's endpoint to ask it which engine it is")
    last: ServerError | None = None
    for cls in table.values():
        try:
            if cls.detect(lambda: Exchange(endpoint, timeout_s=timeout_s, deadline_s=timeout_s, max_bytes=1 << 20)):
                return cls()
        except ServerError as e:
            last = e
    if last is not None and last.kind in ("unreachable", "timeout"):
        raise last
    raise ServerError("unknown", f"the server at {endpoint.root} is neither {' nor '.join(ADAPTERS)}; "
                      "name its adapter (adapter='vllm' / 'llama.cpp') or pass a ServerAdapter")

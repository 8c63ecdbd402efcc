"""A bounded JSON-over-HTTP client for the prewarm path: every byte read back is counted, every wait bounded.

The prewarm talks to a server the agent already trusts with its prompts, but what comes back is still input
from outside the process: a response is read in chunks up to ``max_bytes`` (a declared ``Content-Length``
above it fails before anything is read), each socket operation waits at most ``timeout_s`` and the whole
exchange at most ``deadline_s``, and :meth:`Exchange.abort` shuts the socket down from another thread (the
server sees the client go away and drops the request; vLLM aborts it and keeps the blocks it computed).
Anything that is not a JSON object is a :class:`ServerError` with its ``kind``.

Boundary: the standard library's ``http.client`` and ``json``; no LangChain, no torch.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["ServerError", "Endpoint", "Exchange", "MAX_RESPONSE_BYTES"]

MAX_RESPONSE_BYTES = 16 << 20  # a tokenized 128k-token prompt is ~1 MB of JSON; nothing the prewarm reads is larger
_CHUNK = 64 << 10


class ServerError(RuntimeError):
    """A server exchange that did not give a usable JSON object.

    Attributes:
        kind: ``unreachable``, ``timeout``, ``status`` (an HTTP error status), ``malformed``, ``too_large``,
            ``truncated`` (fewer bytes than declared), ``aborted``; the adapters add ``unsupported`` (a request
            the engine cannot serve) and ``unknown`` (a server that is no known engine).
        status: the HTTP status, where one came back.
    """

    def __init__(self, kind: str, detail: str, status: int | None = None):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.status = kind, detail, status


@dataclass(frozen=True)
class Endpoint:
    """Where a server is and how to talk to it: the same address and credentials as the agent's own calls.

    Attributes:
        root: ``scheme://host:port`` plus any path prefix before the OpenAI routes (``/v1`` stripped).
        headers: headers every request carries (``Authorization`` from the model's API key, its default
            headers).
        model: the model name the server serves.
    """

    root: str
    headers: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    model: str | None = None

    def __post_init__(self):
        u = urllib.parse.urlsplit(self.root)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"a server address must be http(s)://host[:port][/prefix], got {self.root!r}")
        for k, v in self.headers:
            if any(c in f"{k}{v}" for c in "\r\n\0"):
                raise ValueError(f"header {k!r} holds a line break or NUL; fix the model's headers or API key")

    @classmethod
    def from_base_url(cls, base_url: str, *, api_key: str | None = None,
                      headers: Mapping[str, str] | None = None, model: str | None = None) -> "Endpoint":
        """The endpoint of an OpenAI-compatible ``base_url`` (``http://host:8000/v1``).

        Args:
            base_url: the client's base URL; a trailing ``/v1`` is the OpenAI route prefix, not the server's.
            api_key: sent as ``Authorization: Bearer ...`` (``None`` or ``"EMPTY"``: none).
            headers: further headers (the client's default headers).
            model: the served model name.

        Returns:
            The endpoint.

        Raises:
            ValueError: not an http(s) URL; a header with a line break.
        """
        root = base_url.rstrip("/")
        if root.endswith("/v1"):
            root = root[: -len("/v1")]
        hdrs = dict(headers or {})
        if api_key and api_key != "EMPTY":
            hdrs.setdefault("Authorization", f"Bearer {api_key}")
        return cls(root=root, headers=tuple(sorted(hdrs.items())), model=model)

    @property
    def key(self) -> tuple:
        """What identifies the server and its caller (address and credentials), for per-server state."""
        return (self.root, self.headers)


class Exchange:
    """One JSON request to an :class:`Endpoint`, abortable from another thread.

    Args:
        endpoint: the server.
        timeout_s: the longest one socket operation (connect, send, a read) waits.
        deadline_s: the longest the whole exchange takes.
        max_bytes: the largest response body read.
    """

    def __init__(self, endpoint: Endpoint, *, timeout_s: float = 10.0, deadline_s: float = 60.0,
                 max_bytes: int = MAX_RESPONSE_BYTES):
        self.endpoint, self.timeout_s, self.deadline_s, self.max_bytes = endpoint, timeout_s, deadline_s, max_bytes
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._aborted = False

    def abort(self) -> None:
        """Shut the connection down now (idempotent); a request in progress raises ``ServerError("aborted")``."""
        with self._lock:
            self._aborted = True
            conn = self._conn
        sock = getattr(conn, "sock", None) if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    @property
    def aborted(self) -> bool:
        return self._aborted

    def post(self, path: str, body: Mapping[str, Any]) -> dict:
        """POST ``body`` as JSON to ``path`` and return the JSON object that comes back.

        Raises:
            ServerError: unreachable, timed out, an HTTP error status, a body that is not a JSON object, a
                body over ``max_bytes``, or aborted.
        """
        return self._request("POST", path, json.dumps(body, ensure_ascii=False).encode("utf-8"))

    def get(self, path: str) -> dict:
        """GET ``path``; see :meth:`post`."""
        return self._request("GET", path, None)

    def _request(self, method: str, path: str, data: bytes | None) -> dict:
        u = urllib.parse.urlsplit(self.endpoint.root)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        t0 = time.monotonic()
        conn = cls(u.hostname, u.port, timeout=self.timeout_s)
        with self._lock:
            if self._aborted:
                raise ServerError("aborted", "the exchange was aborted before it started")
            self._conn = conn
        headers = {"Content-Type": "application/json", "Accept": "application/json", **dict(self.endpoint.headers)}
        try:
            try:
                conn.connect()
                with self._lock:  # an abort while connecting found no socket to shut down: it is seen here
                    if self._aborted:
                        raise ServerError("aborted", f"{method} {path} was aborted")
                conn.request(method, (u.path.rstrip("/") + path) or "/", body=data, headers=headers)
                resp = conn.getresponse()
            except (socket.timeout, TimeoutError) as e:
                raise ServerError("timeout", f"{method} {path}: no answer within {self.timeout_s:g} s") from e
            except (OSError, http.client.HTTPException) as e:
                if self._aborted:
                    raise ServerError("aborted", f"{method} {path} was aborted") from e
                raise ServerError("unreachable", f"{method} {path}: {type(e).__name__}: {e}") from e
            body = self._read(resp, t0, f"{method} {path}")
        finally:
            with self._lock:
                self._conn = None
            conn.close()
        if resp.status >= 400:
            raise ServerError("status", f"{method} {path}: HTTP {resp.status}: {_snippet(body)}", status=resp.status)
        try:
            out = json.loads(body)
        except (UnicodeDecodeError, ValueError) as e:
            raise ServerError("malformed", f"{method} {path}: not JSON: {_snippet(body)}") from e
        if not isinstance(out, dict):
            raise ServerError("malformed", f"{method} {path}: a JSON {type(out).__name__}, not an object")
        return out

    def _read(self, resp: http.client.HTTPResponse, t0: float, what: str) -> bytes:
        declared = resp.getheader("Content-Length")
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                raise ServerError("malformed", f"{what}: Content-Length {declared[:32]!r}") from None
            if n > self.max_bytes:
                raise ServerError("too_large", f"{what}: declares {n} bytes, more than {self.max_bytes}")
        n = int(declared) if declared is not None else None
        chunks, got = [], 0
        try:
            while True:
                if time.monotonic() - t0 > self.deadline_s:
                    raise ServerError("timeout", f"{what}: over the {self.deadline_s:g} s deadline")
                part = resp.read1(_CHUNK) if hasattr(resp, "read1") else resp.read(_CHUNK)
                if not part:
                    break
                got += len(part)
                if got > self.max_bytes:
                    raise ServerError("too_large", f"{what}: more than {self.max_bytes} bytes")
                chunks.append(part)
        except (socket.timeout, TimeoutError) as e:
            raise ServerError("timeout", f"{what}: the body stalled for {self.timeout_s:g} s") from e
        except (OSError, http.client.HTTPException) as e:
            if self._aborted:
                raise ServerError("aborted", f"{what} was aborted") from e
            raise ServerError("unreachable", f"{what}: {type(e).__name__}: {e}") from e
        if self._aborted:
            raise ServerError("aborted", f"{what} was aborted")
        if n is not None and got != n:
            raise ServerError("truncated", f"{what}: the connection closed after {got} of {n} declared bytes")
        return b"".join(chunks)


def _snippet(body: bytes, n: int = 160) -> str:
    text = body[:n].decode("utf-8", "replace")
    return repr(text) + (" ..." if len(body) > n else "")

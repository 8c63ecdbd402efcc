"""Test helpers for the serving path: a recording, fault-injecting HTTP proxy in front of a real server, a
small scripted agent episode on ``ChatOpenAI``, and the session servers.

:class:`FaultProxy` forwards every request to the upstream server and records it (path, headers, JSON body).
Requests whose path is in ``faults`` get the fault instead (the agent's own chat calls pass through): an
error status, a body that is not JSON or not an object, a huge body (streamed or declared), a connection
closed mid-answer, an answer slower than the client's timeout, or one that never comes (``hang``: held
until the client goes away, which is recorded in ``disconnects``).
"""

from __future__ import annotations

import http.client
import json
import os
import select
import socket
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

PREWARM_PATHS = ("/tokenize", "/v1/completions", "/apply-template", "/completion", "/version", "/props")
FAULTS = ("status500", "status404", "garbage", "nonobject", "huge", "huge_declared", "close", "slow", "hang")


class FaultProxy:
    """A proxy on 127.0.0.1 in front of ``upstream`` (``http://host:port``).

    Attributes:
        url: the proxy's root; ``base_url`` its OpenAI base URL.
        log: ``(path, headers, body)`` of every request (body: parsed JSON or None).
        faults: ``{path: fault}``; a fault from :data:`FAULTS`.
        disconnects: paths whose held request the client abandoned.
    """

    def __init__(self, upstream: str, faults: dict | None = None, slow_s: float = 30.0):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults = dict(faults or {})
        self.slow_s = slow_s
        self.log: list[tuple[str, dict, object]] = []
        self.disconnects: list[str] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def do_GET(self):
                self._handle(b"")

            def do_POST(self):
                self._handle(self._body())

            def _handle(self, raw: bytes):
                path = self.path.split("?")[0]
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    body = None
                with proxy._lock:
                    proxy.log.append((path, dict(self.headers), body))
                fault = proxy.faults.get(path)
                if fault is not None:
                    return proxy._fault(self, fault, path)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=600)
                hdrs = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
                conn.request(self.command, self.path, body=raw or None, headers=hdrs)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.base_url = self.url + "/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _fault(self, h: BaseHTTPRequestHandler, fault: str, path: str) -> None:
        def send(status: int, body: bytes, ctype: str = "application/json", length: int | None = None):
            h.send_response(status)
            h.send_header("Content-Type", ctype)
            h.send_header("Content-Length", str(len(body) if length is None else length))
            h.end_headers()
            h.wfile.write(body)

        try:
            if fault == "status500":
                send(500, b'{"error": "internal"}')
            elif fault == "status404":
                send(404, b'{"detail": "Not Found"}')
            elif fault == "garbage":
                send(200, b"\x00\xffnot json at all <html>", "text/html")
            elif fault == "nonobject":
                send(200, b'[1, 2, 3]')
            elif fault == "huge_declared":
                send(200, b'{"tokens": [', length=1 << 30)  # declares 1 GiB, sends 12 bytes
            elif fault == "huge":  # 1 GiB streamed (never held in memory here), no declared length
                h.send_response(200)
                h.send_header("Content-Type", "application/json")
                h.send_header("Connection", "close")
                h.end_headers()
                chunk = b'{"tokens": [' + b"1, " * 21000
                for _ in range((1 << 30) // len(chunk)):
                    h.wfile.write(chunk)
            elif fault == "close":
                h.send_response(200)
                h.send_header("Content-Length", "1000")
                h.end_headers()
                h.wfile.write(b'{"tok')
                h.close_connection = True
                h.connection.shutdown(2)
            elif fault == "slow":
                time.sleep(self.slow_s)
                send(200, b'{"tokens": [1, 2, 3], "count": 3}')
            elif fault == "hang":
                while True:  # until the client goes away
                    r, _, _ = select.select([h.connection], [], [], 0.2)
                    if r and not h.connection.recv(1, socket.MSG_PEEK):
                        with self._lock:
                            self.disconnects.append(path)
                        return
        except (BrokenPipeError, ConnectionResetError, OSError):
            with self._lock:
                self.disconnects.append(path)

    def requests(self, prefix: str = "") -> list[tuple[str, dict, object]]:
        """Logged requests whose path starts with ``prefix``."""
        with self._lock:
            return [r for r in self.log if r[0].startswith(prefix)]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_engine(name: str):
    """Start the named serving engine on the embedded model; skips (or, with ``PATCHKV_REQUIRE_SERVERS=1``,
    which ``scripts/test.sh`` sets, fails) when it is not set up."""
    from benchmarks import servers

    try:
        if name == "vllm":
            return servers.vllm_server(kv_cache_gib=1.0, max_model_len=8192)
        return servers.llama_server(parallel=4, ctx_per_slot=4096)
    except FileNotFoundError as e:
        if os.environ.get("PATCHKV_REQUIRE_SERVERS") == "1":
            pytest.fail(f"{name} is not set up ({e}); scripts/test.sh runs scripts/serving_setup.sh first")
        pytest.skip(f"{name} is not set up: {e}")

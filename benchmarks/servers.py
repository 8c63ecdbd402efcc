"""Serving engines on loopback for the prepared-call tests and benchmark: vLLM's CPU build and llama.cpp's
``llama-server``, each on the embedded model, as a subprocess that can be paused, killed and restarted.

:func:`vllm_server` runs ``python -m vllm.entrypoints.openai.api_server`` from the virtualenv
``scripts/serving_setup.sh`` makes (``.venv-vllm/``, or ``$PATCHKV_VLLM_PYTHON``) on :func:`~patchkv_agent.loading.model_directory`
(the dequantized SmolLM2 with its tokenizer), with prefix caching, the cached-token count in each usage, and
the hermes tool parser (``tool_choice`` needs it). :func:`llama_server` runs ``build/llama.cpp/bin/llama-server``
(or ``$PATCHKV_LLAMA_SERVER``) on the embedded GGUF. Both log to a file and stop their whole process group.

Knows the two servers' command lines and health routes; nothing about agents.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from .redis_server import free_port

__all__ = ["ServerProcess", "vllm_server", "llama_server", "vllm_python", "llama_binary"]

ROOT = Path(__file__).resolve().parents[1]  # the checkout (benchmarks/ sits at its top)


def vllm_python() -> Path | None:
    """The python of vLLM's virtualenv (``$PATCHKV_VLLM_PYTHON``, else ``.venv-vllm/`` of the checkout), if any."""
    env = os.environ.get("PATCHKV_VLLM_PYTHON")
    p = Path(env) if env else ROOT / ".venv-vllm" / "bin" / "python"
    return p if p.exists() else None


def llama_binary() -> Path | None:
    """llama.cpp's ``llama-server`` (``$PATCHKV_LLAMA_SERVER``, else ``build/llama.cpp/bin/``), if built."""
    env = os.environ.get("PATCHKV_LLAMA_SERVER")
    p = Path(env) if env else ROOT / "build" / "llama.cpp" / "bin" / "llama-server"
    return p if p.exists() else None


class ServerProcess:
    """A server subprocess on 127.0.0.1 that is ready when ``health`` answers 200.

    Args:
        argv: the command line (``{port}`` in it is replaced by the port).
        name: the engine (``vllm``, ``llama.cpp``).
        model: the served model name (what a client passes as ``model``).
        health: the path that answers 200 once the server serves.
        env: extra environment.
        startup_s: how long :meth:`start` waits.
        log_path: where stdout and stderr go (default: a temporary file).

    Attributes:
        base_url: the OpenAI-compatible base URL (``http://127.0.0.1:<port>/v1``).

    Raises:
        RuntimeError: the server did not become ready within ``startup_s`` (it is stopped; the message
            holds the end of its log).
    """

    def __init__(self, argv: Sequence[str], *, name: str, model: str, health: str, env: dict | None = None,
                 startup_s: float = 600.0, log_path: str | None = None, port: int | None = None):
        self.port = port or free_port()
        self.argv = [a.replace("{port}", str(self.port)) for a in argv]
        self.name, self.model, self.health, self.startup_s = name, model, health, startup_s
        self.env = {**os.environ, **(env or {})}
        self.log_path = log_path or tempfile.mkstemp(prefix=f"patchkv-{name}-", suffix=".log")[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.root = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        """Start the server (again, on the same port, after :meth:`stop`) and wait until it is ready.

        Raises:
            RuntimeError: it is running already (a second start would orphan the first process), or it did
                not become ready.
        """
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is running already (pid {self.proc.pid}): stop() it before starting it again")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self.ready():
                return
            time.sleep(0.5)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready within {self.startup_s:g} s; log {self.log_path}:\n{tail}")

    def ready(self) -> bool:
        """Whether the health route answers 200 now."""
        try:
            with urllib.request.urlopen(self.root + self.health, timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def erase_cache(self) -> None:
        """Empty the server's prefix cache, so that a run reuses nothing of an earlier one (llama.cpp: every
        slot erased; vLLM scopes runs by ``cache_salt`` instead, and this does nothing for it).

        Raises:
            RuntimeError: the server refused.
        """
        if self.name != "llama.cpp":
            return
        import json

        with urllib.request.urlopen(self.root + "/slots", timeout=10) as r:
            slots = json.load(r)
        for slot in slots:
            req = urllib.request.Request(f"{self.root}/slots/{int(slot['id'])}?action=erase", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=10) as r:
                if r.status != 200:
                    raise RuntimeError(f"llama.cpp refused to erase slot {slot['id']}: HTTP {r.status}")

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self) -> None:
        """Stop the server's processes (SIGSTOP): connections hang, as with a server that stopped answering."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Continue after :meth:`pause`."""
        self._signal(signal.SIGCONT)

    def stop(self) -> None:
        """Terminate the server's process group (then kill it after 20 s)."""
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def vllm_server(model_dir: str | Path | None = None, *, python: str | Path | None = None, model: str = "smollm2",
                kv_cache_gib: float = 2.0, max_model_len: int = 8192, scheduling_policy: str = "priority",
                extra_args: Sequence[str] = (),
                startup_s: float = 600.0, log_path: str | None = None) -> ServerProcess:
    """vLLM's OpenAI-compatible server on the embedded model (or ``model_dir``).

    Args:
        model_dir: a model directory (default: :func:`~patchkv_agent.loading.model_directory`).
        python: vLLM's python (default: :func:`vllm_python`).
        model: the served model name.
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE``.
        max_model_len: the longest context it serves.
        scheduling_policy: ``priority`` (a call, priority 0, goes ahead of a waiting prewarm, priority 1) or
            ``fcfs``.
        extra_args: more arguments (``--block-size 16`` ...).
        startup_s, log_path: see :class:`ServerProcess`.

    Raises:
        FileNotFoundError: no vLLM virtualenv (``bash scripts/serving_setup.sh vllm`` makes one).
        RuntimeError: it did not start.
    """
    py = Path(python) if python else vllm_python()
    if py is None or not py.exists():
        raise FileNotFoundError("no vLLM virtualenv: run `bash scripts/serving_setup.sh vllm` (or set PATCHKV_VLLM_PYTHON)")
    if model_dir is None:
        from patchkv_agent.loading import model_directory

        model_dir = model_directory()
    argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--served-model-name",
            model, "--host", "127.0.0.1", "--port", "{port}", "--enable-prefix-caching",
            "--enable-prompt-tokens-details", "--enforce-eager", "--max-model-len", str(max_model_len),
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-stats", "--scheduling-policy", scheduling_policy, *extra_args]
    env = {"VLLM_CPU_KVCACHE_SPACE": f"{kv_cache_gib:g}", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    return ServerProcess(argv, name="vllm", model=model, health="/health", env=env, startup_s=startup_s,
                         log_path=log_path)


def llama_server(gguf: str | Path | None = None, *, binary: str | Path | None = None, model: str = "smollm2",
                 parallel: int = 4, ctx_per_slot: int = 8192, threads: int | None = None,
                 extra_args: Sequence[str] = (), startup_s: float = 120.0, log_path: str | None = None) -> ServerProcess:
    """llama.cpp's ``llama-server`` on the embedded GGUF (or ``gguf``).

    Args:
        gguf: a GGUF file (default: the embedded model's).
        binary: the server (default: :func:`llama_binary`).
        model: the model alias it reports.
        parallel: slots (concurrent sequences, each with its own prefix).
        ctx_per_slot: the context of each slot (the server runs with its host prompt cache off and a slot
            save path, so :meth:`ServerProcess.erase_cache` can empty it).
        threads: CPU threads (default: llama.cpp's).
        extra_args, startup_s, log_path: see :func:`vllm_server`.

    Raises:
        FileNotFoundError: no server binary (``bash scripts/serving_setup.sh llama.cpp`` builds it).
        RuntimeError: it did not start.
    """
    exe = Path(binary) if binary else llama_binary()
    if exe is None or not exe.exists():
        raise FileNotFoundError("no llama-server: run `bash scripts/serving_setup.sh llama.cpp` (or set PATCHKV_LLAMA_SERVER)")
    if gguf is None:
        from patchkv_agent.loading import ensure_embedded

        gguf = ensure_embedded()
    slots = tempfile.mkdtemp(prefix="patchkv-llama-slots-")  # lets erase_cache() empty the slots between runs
    argv = [str(exe), "-m", str(gguf), "--alias", model, "--host", "127.0.0.1", "--port", "{port}",
            "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot), "--jinja", "--no-webui",
            "--cache-ram", "0", "--slot-save-path", slots,
            *(["--threads", str(threads)] if threads else []), *extra_args]
    return ServerProcess(argv, name="llama.cpp", model=model, health="/health", startup_s=startup_s,
                         log_path=log_path)

"""Shared helpers of the KV store tests: synthetic checkpoints and a throwaway redis-server on loopback."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import numpy as np
import pytest
import torch

from patchkv_agent.core.checkpoint import Checkpoint, build_mixed

REDIS_SKIP = ("Redis tier tests skipped: redis-server is not on PATH (Debian: apt-get install redis-server; "
              ".ci/run installs it)")
REDIS_CLIENT_SKIP = "Redis tier tests skipped: the redis client is missing (pip install 'patchkv-agent[redis]')"


def make_ckpt(seed: int = 0, n: int = 40, layers: int = 2, heads: int = 2, head_dim: int = 16,
              fingerprint: str = "llama:test", dtype: torch.dtype = torch.float32, mixed: bool = True) -> Checkpoint:
    """A synthetic checkpoint (random K/V, mixed-precision runs) whose token ids depend on ``seed``."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads, n, head_dim, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(heads, n, head_dim, generator=g).to(dtype) for _ in range(layers)]
    rng = np.random.default_rng(seed)
    scores = rng.random(n).astype(np.float32)
    scores /= scores.sum()
    m = build_mixed(keys, values, scores, block_size=8) if mixed else None
    return Checkpoint(token_ids=rng.integers(0, 200, n).astype(np.int64), keys=keys, values=values,
                      fingerprint=fingerprint, scores=scores, mixed=m, stats={"offload_s": 0.1, "source": "test"})


def assert_same_checkpoint(a: Checkpoint, b: Checkpoint) -> None:
    assert np.array_equal(a.token_ids, b.token_ids) and a.fingerprint == b.fingerprint
    assert (a.scores is None) == (b.scores is None)
    if a.scores is not None:
        assert np.array_equal(a.scores, b.scores)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert (a.mixed is None) == (b.mixed is None)
    if a.mixed is not None:
        assert a.mixed.checksums == b.mixed.checksums and a.mixed.runs == b.mixed.runs
        assert np.array_equal(a.mixed.tags, b.mixed.tags)
        for la, lb in zip(a.mixed.payloads, b.mixed.payloads, strict=True):
            for tag in la:
                ta, tb = la[tag].tensors(), lb[tag].tensors()
                assert ta.keys() == tb.keys() and all(torch.equal(ta[f], tb[f]) for f in ta)


def assert_same_payload(a, b) -> None:
    """Two :class:`~patchkv_agent.kernels.quant.RunPayload` s are identical: metadata, and every stored
    tensor's shape, dtype and bytes (bit for bit, so NaN payloads and signed zeros compare too)."""
    assert (a.tag, a.n_rows, a.num_kv_heads, a.head_dim, a.block_size, a.v_group) == \
        (b.tag, b.n_rows, b.num_kv_heads, b.head_dim, b.block_size, b.v_group)
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name, t in ta.items():
        u = tb[name]
        assert t.shape == u.shape and t.dtype == u.dtype, name
        assert t.numel() == 0 or torch.equal(t.contiguous().view(torch.uint8), u.contiguous().view(torch.uint8)), name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server subprocess on 127.0.0.1 with persistence off; ``url`` to connect."""

    def __init__(self):
        if shutil.which("redis-server") is None:
            pytest.skip(REDIS_SKIP)
        try:
            import redis
        except ImportError:
            pytest.skip(REDIS_CLIENT_SKIP)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    pytest.skip(f"redis-server did not start on port {self.port}: Redis tier tests skipped")
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

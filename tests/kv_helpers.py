"""Shared helpers of the KV store tests: synthetic checkpoints and a throwaway redis-server on loopback
(:class:`benchmarks.redis_server.RedisProcess`, or the test skips)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from patchkv_agent.core.checkpoint import Checkpoint, build_mixed
from patchkv_agent.core.provenance import CheckpointProvenance
from patchkv_agent.runtime.kvstore import CheckpointKey, encode_checkpoint
from benchmarks.redis_server import RedisProcess, redis_server_path

REDIS_SKIP = ("Redis tier tests skipped: no redis-server in the venv's bin/ or on PATH (bash scripts/bootstrap.sh "
              "installs one with the test extra; with PATCHKV_REQUIRE_SERVERS=1, as scripts/test.sh sets, this fails)")
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
                      fingerprint=fingerprint, scores=scores, mixed=m, provenance=CheckpointProvenance(offload_s=0.1))


def assert_same_checkpoint(a: Checkpoint, b: Checkpoint) -> None:
    assert np.array_equal(a.token_ids, b.token_ids) and a.fingerprint == b.fingerprint
    assert a.provenance == b.provenance
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
    """Two :class:`~patchkv_agent.kernels.formats.RunPayload` s are identical: metadata, and every stored
    tensor's shape, dtype and bytes (bit for bit, so NaN payloads and signed zeros compare too)."""
    assert (a.tag, a.n_rows, a.num_kv_heads, a.head_dim, a.block_size, a.v_group) == \
        (b.tag, b.n_rows, b.num_kv_heads, b.head_dim, b.block_size, b.v_group)
    ta, tb = a.tensors(), b.tensors()
    assert ta.keys() == tb.keys()
    for name, t in ta.items():
        u = tb[name]
        assert t.shape == u.shape and t.dtype == u.dtype, name
        assert t.numel() == 0 or torch.equal(t.contiguous().view(torch.uint8), u.contiguous().view(torch.uint8)), name


def put_entry(store, ckpt: Checkpoint, thread: str = "t", version: int = 1):
    """Put ``ckpt`` under its key for (``thread``, ``version``); returns ``(key, put result)``."""
    key = store.key_for(ckpt, thread_id=thread, version=version)
    return key, store.put(key, ckpt)


def payload_bytes(ckpt: Checkpoint) -> int:
    """The bytes of ``ckpt``'s encoded blobs (what a store's budget counts)."""
    meta, _ = encode_checkpoint(ckpt, CheckpointKey.of(ckpt, deployment="d", thread_id="t", version=0))
    return sum(b["nbytes"] for b in meta["blobs"])


def start_redis() -> RedisProcess:
    """A redis-server on 127.0.0.1 with persistence off (``url`` to connect, ``stop()``); skips the test when
    redis-server or the client is missing, or the server does not answer within 10 s, and fails instead with
    ``PATCHKV_REQUIRE_SERVERS=1`` (``scripts/test.sh`` sets it)."""
    def missing(reason: str):
        if os.environ.get("PATCHKV_REQUIRE_SERVERS") == "1":
            pytest.fail(f"{reason} (PATCHKV_REQUIRE_SERVERS=1: a missing server fails)")
        pytest.skip(reason)

    if redis_server_path() is None:
        missing(REDIS_SKIP)
    try:
        import redis  # noqa: F401
    except ImportError:
        missing(REDIS_CLIENT_SKIP)
    try:
        return RedisProcess(startup_s=10)
    except RuntimeError as e:
        missing(f"{e}: Redis tier tests skipped")


def plan_settings(**fields):
    """RecoverySettings for planner tests: the given fields over the defaults, with the reader rule off unless
    asked for (a plan's readers need the edit's words, which most hand-made edits lack)."""
    from patchkv_agent.core.settings import RecoverySettings

    return RecoverySettings(**{"readers": "none", **fields})

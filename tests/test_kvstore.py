"""One conformance suite that every KV store tier passes (memory, disk, Redis), plus tier-specific checks.

The Redis tier runs against a real redis-server on loopback (started here) and skips with a clear
message only when redis-server or the client is not installed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
import uuid

import pytest
import torch

from kv_helpers import RedisServer, assert_same_checkpoint, make_ckpt
from patchkv_agent.runtime.kvstore import (
    CheckpointKey,
    CheckpointMissing,
    CorruptCheckpoint,
    DiskStore,
    ForeignCheckpoint,
    MemoryStore,
    decode_checkpoint,
    encode_checkpoint,
)


@pytest.fixture(scope="module")
def redis_server():
    srv = RedisServer()
    yield srv
    srv.stop()


class Tier:
    """How to open a tier, and how to damage its stored bytes the way real faults do."""

    def __init__(self, name, request, tmp_path):
        self.name, self.request, self.tmp_path = name, request, tmp_path
        self.persistent = name != "memory"
        self.prefix = f"t{uuid.uuid4().hex}"  # not id(self): ids are reused, the server outlives a test

    def open(self, deployment="dep", **kw):
        if self.name == "memory":
            return MemoryStore(deployment=deployment, **kw)
        if self.name == "disk":
            return DiskStore(self.tmp_path / "kv", deployment=deployment, fsync=False, **kw)
        from patchkv_agent.runtime.kvstore import RedisStore

        srv = self.request.getfixturevalue("redis_server")
        return RedisStore(srv.url, deployment=deployment, prefix=self.prefix, **kw)

    def flip_byte(self, store, key, ckpt):
        if self.name == "memory":  # the held checkpoint's bytes change after publication
            ckpt.values[1].view(-1).view(torch.uint8)[7] ^= 0x10
        elif self.name == "disk":
            p, off = store.path_of(key), store.data_offset(key)
            data = bytearray(p.read_bytes())
            data[off + (len(data) - off) // 2] ^= 0x01
            p.write_bytes(bytes(data))
        else:
            name = store.blob_keys(key)[-1]
            raw = bytearray(store.client.get(name))
            raw[0] ^= 0x01
            store.client.set(name, bytes(raw))

    def truncate(self, store, key):
        if self.name == "disk":
            p = store.path_of(key)
            p.write_bytes(p.read_bytes()[:-5])
        else:
            name = store.blob_keys(key)[2]
            store.client.set(name, store.client.get(name)[:-3])

    def transplant(self, store, src, dst):
        """Put ``src``'s stored entry where ``dst``'s would be (a mis-copied file, a tampered key)."""
        if self.name == "disk":
            store.path_of(src).rename(store.path_of(dst))
        else:  # the metadata hash lands under dst's name, indexed as dst's
            store.client.rename(store.meta_key(src), store.meta_key(dst))
            meta = json.loads(store.client.hget(store.meta_key(dst), "meta"))
            store.client.hset(f"{store.ns}:idx", dst.digest,
                              store._record(dst, 1, meta["store"]["gen"], len(meta["blobs"])))
            store.client.zadd(f"{store.ns}:lru", {dst.digest: 10**9})


@pytest.fixture(params=["memory", "disk", "redis"])
def tier(request, tmp_path):
    return Tier(request.param, request, tmp_path)


def _put(store, ckpt, thread="t", version=1):
    key = store.key_for(ckpt, thread_id=thread, version=version)
    return key, store.put(key, ckpt)


# ----------------------------------------------------------------------------- conformance


def test_put_get_contains_delete_roundtrip(tier):
    s = tier.open()
    c = make_ckpt(0)
    key, r = _put(s, c)
    assert r.stored and r.nbytes > c.nbytes and r.evicted == ()  # K/V + mixed runs + ids + scores
    assert s.contains(key) and key in s and s.keys() == [key] and s.nbytes() == r.nbytes
    assert_same_checkpoint(s.get(key), c)
    assert s.delete(key) and not s.contains(key) and s.nbytes() == 0 and s.keys() == []
    with pytest.raises(CheckpointMissing, match="deleted"):
        s.get(key)
    assert not s.delete(key)


def test_missing_key_says_never_stored(tier):
    s = tier.open()
    key = s.key_for(make_ckpt(1), thread_id="nobody", version=3)
    with pytest.raises(CheckpointMissing, match="never stored") as e:
        s.get(key)
    assert e.value.key == key and not s.contains(key)


def test_overwrite_same_key_replaces_and_counts_once(tier):
    s = tier.open()
    c = make_ckpt(2)
    key, r1 = _put(s, c)
    c2 = dataclasses.replace(c, stats={"source": "second"}, mixed=None)
    r2 = s.put(key, c2)
    assert s.keys() == [key] and s.nbytes() == r2.nbytes < r1.nbytes
    got = s.get(key)
    assert got.mixed is None and got.stats["source"] == "second"


def test_lru_eviction_order_under_budget(tier):
    cks = [make_ckpt(10 + i) for i in range(4)]
    n = _probe_bytes(cks[0])
    s = tier.open(budget_bytes=2 * n + n // 2)
    a, _ = _put(s, cks[0], "a")
    b, _ = _put(s, cks[1], "b")
    s.get(a)  # a is now more recent than b
    c, r = _put(s, cks[2], "c")
    assert r.evicted == (b,) and s.keys() == [a, c] and s.nbytes() <= s.budget_bytes
    with pytest.raises(CheckpointMissing, match="evicted"):
        s.get(b)
    d, r = _put(s, cks[3], "d")
    assert r.evicted == (a,) and s.keys() == [c, d]
    assert s.stats.evictions == 2 and s.stats.evicted_keys == [b, a]
    assert s.why_missing(a) and "evicted" in s.why_missing(a)


def test_checkpoint_larger_than_budget_is_refused_with_reason(tier):
    s = tier.open(budget_bytes=1000)
    key, r = _put(s, make_ckpt(3))
    assert not r.stored and "exceed" in r.reason and s.nbytes() == 0
    with pytest.raises(CheckpointMissing, match="exceed"):
        s.get(key)


def test_flipped_byte_is_detected_before_use(tier):
    s = tier.open()
    c = make_ckpt(4)
    key, _ = _put(s, c)
    tier.flip_byte(s, key, c)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        s.get(key)
    assert s.stats.corrupt == 1


def test_truncated_blob_is_detected(tier):
    if tier.name == "memory":
        pytest.skip("the memory tier holds tensors, not byte strings that can be cut short")
    s = tier.open()
    key, _ = _put(s, make_ckpt(5))
    tier.truncate(s, key)
    with pytest.raises(CorruptCheckpoint, match="expected"):
        s.get(key)


def test_entry_of_another_thread_is_refused(tier):
    if tier.name == "memory":
        pytest.skip("the memory tier indexes objects by key: no bytes can land under another key")
    s = tier.open()
    c = make_ckpt(6)
    ka, _ = _put(s, c, "thread-a")
    kb = s.key_for(c, thread_id="thread-b", version=1)
    tier.transplant(s, ka, kb)
    with pytest.raises(ForeignCheckpoint, match="thread"):
        s.get(kb)


def test_deployments_are_isolated(tier):
    s1, s2 = tier.open("alpha"), tier.open("beta")
    key, _ = _put(s1, make_ckpt(7))
    assert s2.keys() == [] and s2.nbytes() == 0
    with pytest.raises(ValueError, match="deployment 'alpha'.*store.key_for"):
        s2.get(key)
    with pytest.raises(TypeError, match="CheckpointKey"):
        s1.get(("t", 1))


def test_survives_reopen(tier):
    if not tier.persistent:
        pytest.skip("the memory tier lives and dies with its process")
    s = tier.open()
    cks = [make_ckpt(20), make_ckpt(21)]
    a, _ = _put(s, cks[0], "a")
    b, _ = _put(s, cks[1], "b")
    s.get(a)
    s.close()
    s2 = tier.open()  # a new process would see the same
    assert s2.keys() == [b, a] and s2.nbytes() == s.nbytes()
    assert_same_checkpoint(s2.get(b), cks[1])


def test_concurrent_access_from_threads(tier):
    cks = [make_ckpt(30 + i, n=24) for i in range(8)]
    budget = 4 * max(_probe_bytes(c) for c in cks)
    s = tier.open(budget_bytes=budget)
    errors: list[BaseException] = []

    def worker(i):
        try:
            for v in range(6):
                key = s.key_for(cks[i], thread_id=f"t{i}", version=v)
                s.put(key, cks[i])
                try:
                    assert_same_checkpoint(s.get(key), cks[i])
                except CheckpointMissing as e:  # evicted by another thread in between: said so
                    assert "evicted" in e.reason
                if v % 2:
                    s.delete(key)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert s.nbytes() <= budget
    held = s.keys()
    assert s.nbytes() == sum(_probe_bytes(cks[int(k.thread_id[1:])]) for k in held)
    for k in held:
        assert_same_checkpoint(s.get(k), cks[int(k.thread_id[1:])])
    assert s.stats.evictions > 0


# ----------------------------------------------------------------------------- codec


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mixed", [True, False])
def test_codec_roundtrip_dtypes(dtype, mixed):
    c = make_ckpt(40, dtype=dtype, mixed=mixed and dtype == torch.float32)
    c = dataclasses.replace(c, scores=None) if not mixed else c
    key = CheckpointKey.of(c, deployment="d", thread_id="t", version=2)
    meta, blobs = encode_checkpoint(c, key)
    json.dumps(meta)  # JSON-safe
    assert_same_checkpoint(decode_checkpoint(meta, {k: bytes(v) for k, v in blobs.items()}, key), c)


def test_codec_refuses_mismatched_key_and_damaged_metadata():
    c = make_ckpt(41)
    key = CheckpointKey.of(c, deployment="d", thread_id="t", version=2)
    with pytest.raises(ValueError, match="CheckpointKey.of"):
        encode_checkpoint(c, dataclasses.replace(key, ids_hash="0" * 16))
    meta, blobs = encode_checkpoint(c, key)
    raw = {k: bytes(v) for k, v in blobs.items()}
    bad = json.loads(json.dumps(meta))
    bad["blobs"][3]["shape"] = [1, 2, 3]
    with pytest.raises(CorruptCheckpoint, match="metadata checksum"):
        decode_checkpoint(bad, raw, key)
    with pytest.raises(ForeignCheckpoint, match="version"):
        decode_checkpoint(meta, raw, dataclasses.replace(key, version=3))
    with pytest.raises(ForeignCheckpoint, match="model"):
        decode_checkpoint(meta, raw, dataclasses.replace(key, fingerprint="llama:other"))
    del raw["k.1"]
    with pytest.raises(CorruptCheckpoint, match="k.1 .*missing"):
        decode_checkpoint(meta, raw, key)


# ----------------------------------------------------------------------------- tier-specific


def test_memory_tier_spills_evictions_to_disk(tmp_path):
    cks = [make_ckpt(50 + i) for i in range(3)]
    n = _probe_bytes(cks[0])
    disk = DiskStore(tmp_path, deployment="dep", fsync=False)
    mem = MemoryStore(deployment="dep", budget_bytes=n + n // 2, spill=disk)
    keys = [_put(mem, c, f"t{i}")[0] for i, c in enumerate(cks)]
    assert mem.keys() == keys[2:] and disk.keys() == keys[:2]
    assert all(mem.contains(k) for k in keys)
    assert_same_checkpoint(mem.get(keys[0]), cks[0])  # served by the spill tier
    with pytest.raises(ValueError, match="deployment"):
        MemoryStore(deployment="other", spill=disk)


def _probe_bytes(ckpt):
    meta, _ = encode_checkpoint(ckpt, CheckpointKey.of(ckpt, deployment="d", thread_id="t", version=0))
    return sum(b["nbytes"] for b in meta["blobs"])


def test_disk_publish_is_atomic_and_cleans_interrupted_writes(tmp_path):
    s = DiskStore(tmp_path, deployment="dep", fsync=False)
    key, _ = _put(s, make_ckpt(60))
    stale = s.dir / f".tmp-{key.digest}-dead.kv"
    stale.write_bytes(b"half")  # a crashed put: never visible
    os.utime(stale, (0, 0))
    s2 = DiskStore(tmp_path, deployment="dep", fsync=False)
    assert s2.keys() == [key] and not stale.exists()
    assert sorted(p.name for p in s.dir.iterdir() if not p.name.startswith(".")) == [s.path_of(key).name]


def test_disk_appended_bytes_are_a_wrong_length(tmp_path):
    s = DiskStore(tmp_path, deployment="dep", fsync=False)
    key, _ = _put(s, make_ckpt(61))
    with open(s.path_of(key), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(CorruptCheckpoint, match="wrong length"):
        s.get(key)


def test_redis_budget_and_lru_are_shared_by_processes(redis_server):
    from patchkv_agent.runtime.kvstore import RedisStore

    c0, c1 = make_ckpt(70), make_ckpt(71)
    n = _probe_bytes(c0)
    w1 = RedisStore(redis_server.url, deployment="shared", prefix="lru", budget_bytes=n + n // 2)
    w2 = RedisStore(redis_server.url, deployment="shared", prefix="lru", budget_bytes=n + n // 2)
    k0, _ = _put(w1, c0, "a")
    assert w2.keys() == [k0]
    k1, r = _put(w2, c1, "b")
    assert r.evicted == (k0,)
    with pytest.raises(CheckpointMissing, match="evicted"):
        w1.get(k0)  # the other worker learns why
    assert_same_checkpoint(w1.get(k1), c1)
    w1.clear()
    assert w2.keys() == []


def test_redis_ttl_expiry_says_expired(redis_server):
    from patchkv_agent.runtime.kvstore import RedisStore

    s = RedisStore(redis_server.url, deployment="ttl", prefix="ttl", ttl_s=60)
    key, _ = _put(s, make_ckpt(72))
    assert 0 < s.client.ttl(s.meta_key(key)) <= 60
    assert all(0 < s.client.ttl(b) <= 60 for b in s.blob_keys(key))
    for name in [s.meta_key(key), *s.blob_keys(key)]:
        s.client.pexpire(name, 1)
    time.sleep(0.05)
    with pytest.raises(CheckpointMissing, match="expired"):
        s.get(key)
    assert s.keys() == [] and s.nbytes() == 0


def test_redis_without_client_names_the_install(monkeypatch):
    import builtins

    real = builtins.__import__

    def fake(name, *a, **k):
        if name == "redis":
            raise ImportError("no redis")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake)
    from patchkv_agent.runtime.kvstore.redis_tier import RedisStore

    with pytest.raises(ImportError, match=r"pip install 'patchkv-agent\[redis\]'"):
        RedisStore()

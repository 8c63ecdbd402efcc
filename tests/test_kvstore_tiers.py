"""Tier-specific checks of the KV stores (the conformance suite of every tier is ``test_kvstore.py``): the
memory tier's spill, the disk tier's atomic publish and crash safety, the Redis tier's shared budget,
expiry, namespaces and index.

Redis runs against a real redis-server on loopback (the ``redis_server`` fixture of conftest.py) and skips
with a clear message only when redis-server or the client is not installed.

Hardening: the disk replace never loses both copies; Redis namespaces are unambiguous and ``clear``
deletes exactly its own keys; damaged index records are rebuilt from verified metadata.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
import uuid

import pytest

from kv_helpers import assert_same_checkpoint, make_ckpt, payload_bytes, put_entry
from patchkv_agent.runtime.kvstore import CheckpointMissing, CorruptCheckpoint, DiskStore, MemoryStore, encode_checkpoint
from patchkv_agent.runtime.kvstore.codec import meta_checksum


# ----------------------------------------------------------------------------- tier-specific


def test_memory_tier_spills_evictions_to_disk(tmp_path):
    cks = [make_ckpt(50 + i) for i in range(3)]
    n = payload_bytes(cks[0])
    disk = DiskStore(tmp_path, deployment="dep", fsync=False)
    mem = MemoryStore(deployment="dep", budget_bytes=n + n // 2, spill=disk)
    keys = [put_entry(mem, c, f"t{i}")[0] for i, c in enumerate(cks)]
    assert mem.keys() == keys[2:] and disk.keys() == keys[:2]
    assert all(mem.contains(k) for k in keys)
    assert_same_checkpoint(mem.get(keys[0]), cks[0])  # served by the spill tier
    with pytest.raises(ValueError, match="deployment"):
        MemoryStore(deployment="other", spill=disk)


def test_disk_publish_is_atomic_and_cleans_interrupted_writes(tmp_path):
    s = DiskStore(tmp_path, deployment="dep", fsync=False)
    key, _ = put_entry(s, make_ckpt(60))
    stale = s.dir / f".tmp-{key.digest}-dead.kv"
    stale.write_bytes(b"half")  # a crashed put: never visible
    os.utime(stale, (0, 0))
    s2 = DiskStore(tmp_path, deployment="dep", fsync=False)
    assert s2.keys() == [key] and not stale.exists()
    assert sorted(p.name for p in s.dir.iterdir() if not p.name.startswith(".")) == [s.path_of(key).name]


def test_disk_appended_bytes_are_a_wrong_length(tmp_path):
    s = DiskStore(tmp_path, deployment="dep", fsync=False)
    key, _ = put_entry(s, make_ckpt(61))
    with open(s.path_of(key), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(CorruptCheckpoint, match="wrong length"):
        s.get(key)


def test_redis_budget_and_lru_are_shared_by_processes(redis_server):
    from patchkv_agent.runtime.kvstore import RedisStore

    c0, c1 = make_ckpt(70), make_ckpt(71)
    n = payload_bytes(c0)
    w1 = RedisStore(redis_server.url, deployment="shared", prefix="lru", budget_bytes=n + n // 2)
    w2 = RedisStore(redis_server.url, deployment="shared", prefix="lru", budget_bytes=n + n // 2)
    k0, _ = put_entry(w1, c0, "a")
    assert w2.keys() == [k0]
    k1, r = put_entry(w2, c1, "b")
    assert r.evicted == (k0,)
    with pytest.raises(CheckpointMissing, match="evicted"):
        w1.get(k0)  # the other worker learns why
    assert_same_checkpoint(w1.get(k1), c1)
    w1.clear()
    assert w2.keys() == []


def test_redis_ttl_expiry_says_expired(redis_server):
    from patchkv_agent.runtime.kvstore import RedisStore

    s = RedisStore(redis_server.url, deployment="ttl", prefix="ttl", ttl_s=60)
    key, _ = put_entry(s, make_ckpt(72))
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


# ----------------------------------------------------------------------------- disk: crashes


def _crash_in_child(store, key, ckpt, when: str) -> None:
    """Run ``store.put(key, ckpt)`` in a forked child that dies (SIGKILL, no cleanup) ``when`` = ``before``
    or ``after`` the atomic swap of a replace."""
    from patchkv_agent.runtime.kvstore import disk as D

    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            real = D.DiskStore._swap

            def swap(tmp, final):
                if when == "after":
                    real(tmp, final)
                os.kill(os.getpid(), signal.SIGKILL)

            D.DiskStore._swap = staticmethod(swap)
            store.put(key, ckpt)
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


@pytest.mark.parametrize("when", ["before", "after"])
def test_disk_crash_between_replace_steps_never_loses_both_copies(tmp_path, when):
    """A crash during a disk replace never leaves the entry reported as never stored (with both valid copies
    garbage-collected later): the new copy is written and fsynced before one atomic swap; recovery on open
    rolls back what a crash left before the swap."""
    s = DiskStore(tmp_path, deployment="dep")
    old = make_ckpt(110)
    key, _ = put_entry(s, old)
    new = dataclasses.replace(old, provenance=old.provenance.replace(offload_s=0.2))  # same key, new content
    _crash_in_child(s, key, new, when)
    leftovers = [p.name for p in s.dir.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == (1 if when == "before" else 0)
    s2 = DiskStore(tmp_path, deployment="dep")  # the restarted process
    assert s2.recovered["tmp_removed"] == len(leftovers)
    assert not [p for p in s2.dir.iterdir() if p.name.startswith(".tmp-")]
    assert s2.keys() == [key]
    got = s2.get(key)
    assert got.provenance.offload_s == (0.1 if when == "before" else 0.2)
    assert_same_checkpoint(dataclasses.replace(got, provenance=old.provenance), old)


def test_disk_half_done_replace_of_the_previous_layout_is_restored(tmp_path):
    """The previous layout's replace renamed the old entry aside, then the new one into place; a crash in
    between left only ``.tmp-<digest>-<uuid>-old``. Opening the store now restores that copy."""
    s = DiskStore(tmp_path, deployment="dep", fsync=False)
    c = make_ckpt(111)
    key = s.key_for(c, thread_id="legacy", version=4)
    meta, blobs = encode_checkpoint(c, key)
    aside = s.dir / f".tmp-{key.digest}-{uuid.uuid4().hex}-old"
    aside.mkdir()
    (aside / "meta.json").write_text(json.dumps(meta))
    with open(aside / "data.bin", "wb") as f:
        for spec in meta["blobs"]:
            f.write(memoryview(blobs[spec["name"]]))
    plain = s.dir / s.key_for(make_ckpt(112), thread_id="legacy2", version=1).digest  # an untouched old entry
    k2 = s.key_for(make_ckpt(112), thread_id="legacy2", version=1)
    m2, b2 = encode_checkpoint(make_ckpt(112), k2)
    plain.mkdir()
    (plain / "meta.json").write_text(json.dumps(m2))
    (plain / "data.bin").write_bytes(b"".join(bytes(memoryview(b2[x["name"]])) for x in m2["blobs"]))
    s2 = DiskStore(tmp_path, deployment="dep", fsync=False)
    assert s2.recovered["legacy_restored"] == 1 and s2.recovered["legacy_migrated"] == 1
    assert sorted(s2.keys(), key=lambda k: k.thread_id) == [key, k2]
    assert_same_checkpoint(s2.get(key), c)
    assert_same_checkpoint(s2.get(k2), make_ckpt(112))
    assert not aside.exists() and not plain.exists()


def test_disk_bit_flip_in_metadata_is_quarantined_on_open(tmp_path):
    """A flipped bit in an entry's metadata, found by the next process's scan: quarantined (moved aside,
    counted), the reason recorded for whoever asks for the key; the other entries are untouched."""
    s = DiskStore(tmp_path, deployment="dep", fsync=False)
    bad, _ = put_entry(s, make_ckpt(113), "bad")
    good, _ = put_entry(s, make_ckpt(114), "good")
    from patchkv_agent.runtime.kvstore import disk as D

    p = s.path_of(bad)
    raw = bytearray(p.read_bytes())
    raw[D.HEADER.size + 40] ^= 0x80
    p.write_bytes(bytes(raw))
    s2 = DiskStore(tmp_path, deployment="dep", fsync=False)
    assert s2.keys() == [good] and s2.stats.quarantined == 1
    assert [q.name[:32] for q in (s2.dir / ".quarantine").iterdir()] == [bad.digest]
    with pytest.raises(CheckpointMissing, match="quarantined as corrupt .*header checksum"):
        s2.get(bad)


# ----------------------------------------------------------------------------- Redis: isolation and index


def _all_keys(store):
    return {k.decode() for k in store.client.scan_iter(count=1000)}


def test_redis_namespaces_are_unambiguous(redis_server):
    """Prefix "p" + deployment "x:y" and prefix "p:x" + deployment "y" share no keys, LRU or budget (as a
    namespace of f"{prefix}:{deployment}" would make them)."""
    from patchkv_agent.runtime.kvstore import RedisStore

    a = RedisStore(redis_server.url, prefix="p", deployment="x:y")
    b = RedisStore(redis_server.url, prefix="p:x", deployment="y")
    assert a.ns != b.ns
    ka, _ = put_entry(a, make_ckpt(120), "same-thread")
    kb, _ = put_entry(b, make_ckpt(121), "same-thread")
    assert a.keys() == [ka] and b.keys() == [kb] and a.nbytes() == b.nbytes() == payload_bytes(make_ckpt(120))
    assert not any(set(n) & set("*?[]") for n in _all_keys(a))  # no key ever holds a glob character
    a.clear()
    b.clear()


def test_redis_clear_deletes_exactly_its_own_keys(redis_server):
    """RedisStore(deployment="*").clear() deletes no other deployment's entries (as a glob built from the
    deployment name would): clear() deletes the keys its namespace index lists, nothing else."""
    from patchkv_agent.runtime.kvstore import RedisStore

    prefix = f"clr{uuid.uuid4().hex[:8]}"
    other = RedisStore(redis_server.url, prefix=prefix, deployment="prod")
    ko, _ = put_entry(other, make_ckpt(122), "keep-me")
    before = _all_keys(other)
    star = RedisStore(redis_server.url, prefix=prefix, deployment="*")
    ks, _ = put_entry(star, make_ckpt(123), "mine")
    qmark = RedisStore(redis_server.url, prefix=prefix[:-1] + "?", deployment="prod")
    put_entry(qmark, make_ckpt(124), "mine-too")
    star.clear()
    qmark.clear()
    assert _all_keys(other) == before  # exactly what was there before the other two namespaces
    assert_same_checkpoint(other.get(ko), make_ckpt(122))
    assert star.keys() == [] and not [k for k in _all_keys(other) if k.startswith(star.ns + ":")]
    other.clear()
    assert not [k for k in _all_keys(other) if k.startswith(other.ns + ":")]


def test_redis_damaged_index_records_are_rebuilt_from_verified_metadata(redis_server):
    """A damaged ``:keys`` record makes none of keys(), nbytes(), a budgeted put or ThreadRegistry.expect()
    raise (which would orphan the entry just written)."""
    from patchkv_agent.runtime.kvstore import RedisStore

    cks = [make_ckpt(125 + i) for i in range(3)]
    n = payload_bytes(cks[0])
    s = RedisStore(redis_server.url, prefix=f"idx{uuid.uuid4().hex[:8]}", deployment="d", budget_bytes=3 * n)
    k0, _ = put_entry(s, cks[0], "a")
    k1, _ = put_entry(s, cks[1], "b")
    for h in ("keys", "idx"):  # the old key hash and the new index record: garbage, then wrong JSON
        s.client.hset(f"{s.ns}:{h}", k0.digest, b"\xff\xfe not json")
        s.client.hset(f"{s.ns}:{h}", k1.digest, b"0000000000000000 {\"key\": 5}")
    assert s.keys() == [k0, k1] and s.nbytes() == 2 * n  # rebuilt from each entry's verified metadata
    k2, r = put_entry(s, cks[2], "c")
    assert r.stored and r.evicted == () and s.keys() == [k0, k1, k2]
    s.client.hset(f"{s.ns}:idx", k0.digest, b"garbage")
    s.client.hset(s.meta_key(k0), "meta", b"{broken")  # both damaged: the entry is quarantined
    assert s.keys() == [k1, k2] and s.stats.quarantined == 1
    with pytest.raises(CheckpointMissing, match="quarantined"):
        s.get(k0)
    s.client.set(f"{s.ns}:clock", b"not a number")  # the use clock too
    assert_same_checkpoint(s.get(k1), cks[1])
    assert s.keys() == [k2, k1]
    s.clear()


def test_redis_fields_outside_every_checksum_are_not_trusted(redis_server, monkeypatch):
    """The hash fields ``nblobs``, ``gen`` and ``nbytes`` are not trusted (used unchecked, a damaged nblobs of
    3e6 would cost 11 s of MGET and then an IndexError): blob names and counts come from checksummed
    metadata; a hostile but checksummed blob table is refused before any blob is fetched."""
    from patchkv_agent.runtime.kvstore import RedisStore

    s = RedisStore(redis_server.url, prefix=f"fld{uuid.uuid4().hex[:8]}", deployment="d")
    c = make_ckpt(130)
    key, _ = put_entry(s, c)
    asked = []
    real = s.client.mget
    monkeypatch.setattr(s.client, "mget", lambda names, *a: asked.append(len(names)) or real(names, *a))
    s.client.hset(s.meta_key(key), mapping={"nblobs": 3_000_000, "gen": "zzz", "nbytes": -5})
    assert_same_checkpoint(s.get(key), c)
    assert asked == [len(encode_checkpoint(c, key)[0]["blobs"])]
    meta = json.loads(s.client.hget(s.meta_key(key), "meta"))
    meta["blobs"] = meta["blobs"] * 100
    meta["meta_xxh3"] = meta_checksum(meta)
    s.client.hset(s.meta_key(key), "meta", json.dumps(meta))
    with pytest.raises(CorruptCheckpoint, match="blob table"):
        s.get(key)
    assert asked == [len(meta["blobs"]) // 100]  # no MGET for the hostile table
    s.clear()

"""One conformance suite that every KV store tier passes (memory, disk, Redis): the store's contract, the
integrity checks that hold on every tier, and the codec. Tier-specific checks (spill, disk
crashes, Redis sharing, namespaces and index) are in ``test_kvstore_tiers.py``.

The Redis tier runs against a real redis-server on loopback (the ``redis_server`` fixture of conftest.py)
and skips with a clear message only when redis-server or the client is not installed.

Integrity: every byte read back is verified (metadata included) and a broken entry is quarantined; sizes
come from verified data only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import uuid

import pytest
import torch

from kv_helpers import assert_same_checkpoint, make_ckpt, payload_bytes, put_entry
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
from patchkv_agent.runtime.kvstore.codec import meta_checksum


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

    def rewrite_meta(self, store, key, fn=None, raw_fn=None, fix_checksum=True):
        """Replace ``key``'s stored metadata: ``fn`` edits the dict (its checksum recomputed when
        ``fix_checksum``: a hostile writer, not a bit flip), or ``raw_fn`` edits the stored bytes. Every
        other layer (the disk header's length and checksum) is kept consistent, so only the metadata's own
        checks can catch it."""
        if self.name == "memory":
            meta = store._entries[key][1]
            new = fn(json.loads(json.dumps(meta)))
            if fix_checksum:
                new["meta_xxh3"] = meta_checksum(new)
            meta.clear()
            meta.update(new)
            return
        raw = self.meta_bytes(store, key)
        if raw_fn is not None:
            new_raw = raw_fn(raw)
        else:
            new = fn(json.loads(raw))
            if fix_checksum:
                new["meta_xxh3"] = meta_checksum(new)
            new_raw = json.dumps(new).encode()
        if self.name == "disk":
            import xxhash

            from patchkv_agent.runtime.kvstore import disk as D

            p = store.path_of(key)
            data = p.read_bytes()[store.data_offset(key):]
            p.write_bytes(D.HEADER.pack(D.MAGIC, len(new_raw), xxhash.xxh3_64_intdigest(new_raw)) + new_raw + data)
        else:
            store.client.hset(store.meta_key(key), "meta", new_raw)

    def meta_bytes(self, store, key) -> bytes:
        if self.name == "disk":
            from patchkv_agent.runtime.kvstore import disk as D

            off = store.data_offset(key)
            return store.path_of(key).read_bytes()[D.HEADER.size:off]
        return store.client.hget(store.meta_key(key), "meta")

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


# ----------------------------------------------------------------------------- conformance


def test_put_get_contains_delete_roundtrip(tier):
    s = tier.open()
    c = make_ckpt(0)
    key, r = put_entry(s, c)
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
    key, r1 = put_entry(s, c)
    c2 = dataclasses.replace(c, provenance=c.provenance.replace(offload_s=0.2), mixed=None)
    r2 = s.put(key, c2)
    assert s.keys() == [key] and s.nbytes() == r2.nbytes < r1.nbytes
    got = s.get(key)
    assert got.mixed is None and got.provenance == c2.provenance


def test_lru_eviction_order_under_budget(tier):
    cks = [make_ckpt(10 + i) for i in range(4)]
    n = payload_bytes(cks[0])
    s = tier.open(budget_bytes=2 * n + n // 2)
    a, _ = put_entry(s, cks[0], "a")
    b, _ = put_entry(s, cks[1], "b")
    s.get(a)  # a is now more recent than b
    c, r = put_entry(s, cks[2], "c")
    assert r.evicted == (b,) and s.keys() == [a, c] and s.nbytes() <= s.budget_bytes
    with pytest.raises(CheckpointMissing, match="evicted"):
        s.get(b)
    d, r = put_entry(s, cks[3], "d")
    assert r.evicted == (a,) and s.keys() == [c, d]
    assert s.stats.evictions == 2 and s.stats.evicted_keys == [b, a]
    assert s.why_missing(a) and "evicted" in s.why_missing(a)


def test_checkpoint_larger_than_budget_is_refused_with_reason(tier):
    s = tier.open(budget_bytes=1000)
    key, r = put_entry(s, make_ckpt(3))
    assert not r.stored and "exceed" in r.reason and s.nbytes() == 0
    with pytest.raises(CheckpointMissing, match="exceed"):
        s.get(key)


def test_flipped_byte_is_detected_before_use(tier):
    s = tier.open()
    c = make_ckpt(4)
    key, _ = put_entry(s, c)
    tier.flip_byte(s, key, c)
    with pytest.raises(CorruptCheckpoint, match="checksum"):
        s.get(key)
    assert s.stats.corrupt == 1


def test_truncated_blob_is_detected(tier):
    if tier.name == "memory":
        pytest.skip("the memory tier holds tensors, not byte strings that can be cut short")
    s = tier.open()
    key, _ = put_entry(s, make_ckpt(5))
    tier.truncate(s, key)
    with pytest.raises(CorruptCheckpoint, match="expected"):
        s.get(key)


def test_entry_of_another_thread_is_refused(tier):
    if tier.name == "memory":
        pytest.skip("the memory tier indexes objects by key: no bytes can land under another key")
    s = tier.open()
    c = make_ckpt(6)
    ka, _ = put_entry(s, c, "thread-a")
    kb = s.key_for(c, thread_id="thread-b", version=1)
    tier.transplant(s, ka, kb)
    with pytest.raises(ForeignCheckpoint, match="thread"):
        s.get(kb)


def test_deployments_are_isolated(tier):
    s1, s2 = tier.open("alpha"), tier.open("beta")
    key, _ = put_entry(s1, make_ckpt(7))
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
    a, _ = put_entry(s, cks[0], "a")
    b, _ = put_entry(s, cks[1], "b")
    s.get(a)
    s.close()
    s2 = tier.open()  # a new process would see the same
    assert s2.keys() == [b, a] and s2.nbytes() == s.nbytes()
    assert_same_checkpoint(s2.get(b), cks[1])


def test_concurrent_access_from_threads(tier):
    cks = [make_ckpt(30 + i, n=24) for i in range(8)]
    budget = 4 * max(payload_bytes(c) for c in cks)
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
    assert s.nbytes() == sum(payload_bytes(cks[int(k.thread_id[1:])]) for k in held)
    for k in held:
        assert_same_checkpoint(s.get(k), cks[int(k.thread_id[1:])])
    assert s.stats.evictions > 0


# ----------------------------------------------------------------------------- integrity


def _non_utf8(raw: bytes) -> bytes:
    b = bytearray(raw)
    b[len(b) // 2] |= 0x80  # one flipped high bit: not UTF-8 any more
    return bytes(b)


def _set(path, value):
    def fn(meta):
        obj = meta
        for p in path[:-1]:
            obj = obj[p]
        obj[path[-1]] = value
        return meta
    return fn


# (name, raw edit, dict edit, recompute the metadata checksum): bit flips and hostile rewrites
DAMAGE = {
    "non_utf8": (_non_utf8, None, False),
    "bad_json": (lambda raw: raw[: len(raw) // 2], None, False),
    "not_an_object": (lambda raw: b"[1, 2, 3]", None, False),
    "size_without_checksum": (None, _set(["blobs", 0, "nbytes"], 10**12), False),
    "negative_size": (None, _set(["blobs", 0, "nbytes"], -(10**12)), True),
    "wrong_types": (None, _set(["n_layers"], "2"), True),
    "shape_of_strings": (None, _set(["blobs", 2, "shape"], ["2", "40", "16"]), True),
    "huge_blob_table": (None, lambda m: {**m, "blobs": m["blobs"] * 1000}, True),
    "key_of_wrong_type": (None, _set(["key", "version"], "1"), True),
    "unknown_dtype": (None, _set(["blobs", 2, "dtype"], "object"), True),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_metadata_is_refused_quarantined_and_never_breaks_the_next_call(tier, damage):
    """One flipped bit in an entry's metadata raises no UnicodeDecodeError out of get (on this call or a
    later one), and no unchecked metadata field drives sizes or reads: CorruptCheckpoint, the entry is
    quarantined and counted, the next call is a plain miss that says why, the store keeps working."""
    raw_fn, fn, fix = DAMAGE[damage]
    if tier.name == "memory" and raw_fn is not None:
        pytest.skip("the memory tier holds its metadata as a dict, not as bytes")
    s = tier.open()
    c, other = make_ckpt(80), make_ckpt(81)
    key, _ = put_entry(s, c, "victim")
    okey, r = put_entry(s, other, "bystander")
    tier.rewrite_meta(s, key, fn=fn, raw_fn=raw_fn, fix_checksum=fix)
    with pytest.raises(CorruptCheckpoint):
        s.get(key)
    assert s.stats.quarantined == 1 and s.stats.corrupt == 1
    with pytest.raises(CheckpointMissing, match="quarantined as corrupt") as e:
        s.get(key)  # the broken entry is out of service, not left to fail the next call the same way
    assert not s.contains(key) and s.keys() == [okey] and s.nbytes() == r.nbytes
    assert_same_checkpoint(s.get(okey), other)
    k2, r2 = put_entry(s, c, "victim", version=2)  # the thread carries on
    assert r2.stored
    assert_same_checkpoint(s.get(k2), c)
    if tier.persistent:
        assert tier.open().keys() == [okey, k2]  # nothing of it survives a reopen either


def test_quarantine_spares_an_entry_another_writer_replaced_meanwhile(tier, monkeypatch):
    """Neighbour of the quarantine: when another process re-puts the key between the damaged read and the
    quarantine, the fresh entry stays (and reads back); only the damaged bytes are taken out."""
    if not tier.persistent:
        pytest.skip("only persistent tiers are shared with other writers")
    s, other = tier.open(), tier.open()
    c = make_ckpt(85)
    key, _ = put_entry(s, c)
    tier.rewrite_meta(s, key, fn=_set(["n_layers"], "2"), fix_checksum=True)
    real = type(s)._read

    def read_then_replaced(self, k):
        try:
            return real(self, k)
        finally:
            other.put(k, c)  # the other writer's fresh copy lands before the quarantine

    monkeypatch.setattr(type(s), "_read", read_then_replaced)
    with pytest.raises(CorruptCheckpoint):
        s.get(key)
    monkeypatch.undo()
    assert s.stats.quarantined == 0
    assert_same_checkpoint(s.get(key), c)
    assert_same_checkpoint(tier.open().get(key), c)


def test_damaged_size_records_cannot_evict_valid_entries_or_disable_the_budget(tier):
    """One damaged size field (disk ``nbytes``, Redis ``:size``) evicts no valid entry on the next put, and a
    negative one leaves the budget on: sizes come from verified records only."""
    if tier.name == "memory":
        pytest.skip("the memory tier's sizes never leave the process (nothing stored to damage)")
    cks = [make_ckpt(90 + i) for i in range(10)]
    n = payload_bytes(cks[0])
    s = tier.open(budget_bytes=6 * n + n // 2)  # room for everything below but the last puts
    keys = [put_entry(s, c, f"t{i}")[0] for i, c in enumerate(cks[:3])]
    for bad, victim in ((10**15, keys[0]), (-(10**15), keys[1])):
        _damage_size(tier, s, victim, bad)
        s2 = tier.open(budget_bytes=s.budget_bytes)  # a fresh process reads the damaged record
        k, r = put_entry(s2, cks[3 + (bad < 0)], f"new{bad < 0}")
        assert r.stored and set(r.evicted) <= {victim}, r.evicted  # no valid entry pays for the damage
        for other in keys[2:]:
            assert_same_checkpoint(s2.get(other), cks[keys.index(other)])
    for i, c in enumerate(cks[5:]):  # the budget still holds
        put_entry(s2, c, f"more{i}")
        assert s2.nbytes() <= s2.budget_bytes and len(s2.keys()) <= 6
    assert s2.stats.evictions > 0


def _damage_size(tier, store, key, value):
    """Set every size field the tier keeps for ``key`` to ``value`` (as a flipped bit would: no checksum fixed)."""
    if tier.name == "disk":
        tier.rewrite_meta(store, key, fn=_set(["blobs", 0, "nbytes"], value), fix_checksum=False)
        return
    c = store.client
    for h in (f"{store.ns}:size", f"{store.ns}:idx"):  # the old size hash and the index record
        rec = c.hget(h, key.digest)
        if rec is None or h.endswith(":size"):
            c.hset(h, key.digest, value)
        else:
            check, body = rec.split(b" ", 1)
            body = json.loads(body)
            body["nbytes"] = value
            c.hset(h, key.digest, check + b" " + json.dumps(body, sort_keys=True).encode())


def test_a_fifo_in_place_of_an_entry_never_blocks(tier, tmp_path):
    """A FIFO in place of a metadata file never hangs DiskStore() while it scans."""
    if tier.name != "disk":
        pytest.skip("only the disk tier reads files")
    s = tier.open()
    c = make_ckpt(100)
    key, _ = put_entry(s, c, "fifo")
    for p in (s.path_of(key), s.dir / "0123456789abcdef0123456789abcdef" / "meta.json"):
        p.parent.mkdir(exist_ok=True)
        if p.exists():
            p.unlink()
        os.mkfifo(p)
    box = {}
    t = threading.Thread(target=lambda: box.update(s2=tier.open()), daemon=True)
    t.start()
    t.join(20)
    hung = t.is_alive()
    if hung:  # unblock the old code's reader so the test process can go on
        for p in (s.path_of(key), s.dir / "0123456789abcdef0123456789abcdef" / "meta.json"):
            with contextlib.suppress(OSError):
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not hung, "DiskStore() blocked on a FIFO"
    s2 = box["s2"]
    assert s2.keys() == []
    with pytest.raises(CorruptCheckpoint, match="not a regular file"):
        s.get(key)  # the instance that indexed it reads it: refused without blocking, then quarantined
    assert not os.path.lexists(s.path_of(key)) and s.stats.quarantined == 1


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

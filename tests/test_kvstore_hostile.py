"""Hostile sizes and links in the KV stores: what a planted entry, index record or link costs.

- Declared sizes: a disk entry of a few KiB declaring a GiB (a sparse file), one declaring more than the
  host's memory, and an old-layout directory with a sparse 16 GiB ``data.bin``. Declared sizes are checked
  against the file, the budget, this host's memory and the requesting model (``EntryLimits``) before anything
  is allocated, refused entries are quarantined, and ``DiskStore()`` still opens;
- Budgets: one planted entry (disk) or self-consistent Redis index record declaring a TiB evicts nothing
  valid (an over-budget size is quarantined or rebuilt from verified metadata), and 100k junk digests in
  Redis ``:lru`` are pruned in batches, not one round trip each;
- Links: a ``.quarantine`` symlink, and ``.gone`` or deployment-directory links, never redirect deletes or
  writes out of the store: it refuses links inside itself and works relative to its own directory
  descriptors.

What decoding a hostile checkpointer database costs is tested in ``test_serde.py``.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path

import pytest
import xxhash

from kv_helpers import assert_same_checkpoint, make_ckpt, payload_bytes, put_entry
from patchkv_agent.runtime.kvstore import CheckpointMissing, CorruptCheckpoint, DiskStore, StoreUnavailable
from patchkv_agent.runtime.kvstore import disk as D
from patchkv_agent.runtime.kvstore.base import host_memory_bytes
from patchkv_agent.runtime.kvstore.codec import EntryLimits, encode_checkpoint, entry_nbytes, meta_checksum

LIMITS = EntryLimits(num_layers=2, num_kv_heads=2, head_dim=16, max_positions=4096)  # make_ckpt's shape
BIG_READ = 64 << 20


def _hostile_meta(ckpt, key, tokens: int) -> dict:
    """``ckpt``'s metadata rewritten to declare ``tokens`` positions: no mixed-precision runs, every shape
    consistent with every other, the checksum resealed (what a hostile writer can produce)."""
    meta, _ = encode_checkpoint(ckpt, key)
    meta = json.loads(json.dumps(meta))
    meta["blobs"] = [b for b in meta["blobs"] if not b["name"].startswith(("p.", "mixed."))]
    meta["mixed"] = None
    for spec in meta["blobs"]:
        shape = [tokens] if len(spec["shape"]) == 1 else [spec["shape"][0], tokens, spec["shape"][2]]
        spec["shape"] = shape
        spec["nbytes"] = {"int64": 8, "float32": 4}[spec["dtype"]]
        for d in shape:
            spec["nbytes"] *= d
    meta["meta_xxh3"] = meta_checksum(meta)
    return meta


def _plant_sparse(store: DiskStore, key, meta: dict) -> int:
    """Write ``meta`` as ``key``'s entry file and extend it (sparse: no data written) to the length the
    metadata makes; returns that blob length."""
    raw = json.dumps(meta).encode()
    n = entry_nbytes(meta)
    p = store.path_of(key)
    with open(p, "wb") as f:
        f.write(D.HEADER.pack(D.MAGIC, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw)
        f.truncate(D.HEADER.size + len(raw) + n)
    return n


@pytest.fixture
def no_big_reads(monkeypatch):
    """Every read of a store file larger than 64 MiB fails the test (as a MemoryError would)."""
    seen = []
    for name in ("_read_fd", "_read_exact"):
        real = getattr(D, name, None)
        if real is None:
            continue

        def guard(fd, n, *a, _real=real, **k):
            seen.append(n)
            if n > BIG_READ:
                raise MemoryError(f"test: {n} bytes read from a store file")
            return _real(fd, n, *a, **k)

        monkeypatch.setattr(D, name, guard)
    return seen


# ------------------------------------------------------------------ 1: sizes before allocation


@pytest.mark.parametrize("how", ["model limits", "budget", "host memory"])
def test_a_sparse_entry_declaring_more_than_can_be_needed_is_quarantined_unread(tmp_path, no_big_reads, how):
    c = make_ckpt(1)
    host = host_memory_bytes()
    if how == "host memory" and host is None:
        pytest.skip("this platform does not report its memory")
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False,
                  budget_bytes=10 * payload_bytes(c) if how == "budget" else None)
    key, _ = put_entry(s, c)
    other, _ = put_entry(s, make_ckpt(2), "bystander")
    tokens = {"model limits": 1 << 21, "budget": 1 << 21, "host memory": host // 512 + (1 << 20)}[how]
    n = _plant_sparse(s, key, _hostile_meta(c, key, tokens))  # ~1 GiB (or more than this host holds)
    assert os.stat(s.path_of(key)).st_blocks * 512 < 1 << 20  # a few KiB on disk
    with pytest.raises(CorruptCheckpoint, match={"model limits": "does not fit this model: .* positions",
                                                 "budget": "more than the disk store's whole budget",
                                                 "host memory": "more than this host's memory"}[how]):
        s.get(key, limits=LIMITS if how == "model limits" else None)
    assert max(no_big_reads, default=0) < BIG_READ and n > BIG_READ  # refused before the data was read
    assert s.stats.quarantined == 1 and not os.path.lexists(s.path_of(key))
    with pytest.raises(CheckpointMissing, match="quarantined"):
        s.get(key)  # the next resume does not read it again
    assert_same_checkpoint(s.get(other, limits=LIMITS), make_ckpt(2))


def test_a_memory_error_while_reading_is_corrupt_and_quarantined(tmp_path, monkeypatch):
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    key, _ = put_entry(s, make_ckpt(3))

    def oom(*a, **k):
        raise MemoryError

    monkeypatch.setattr(D, "decode_checkpoint", oom)
    with pytest.raises(CorruptCheckpoint, match="more memory than this process has"):
        s.get(key)
    monkeypatch.undo()
    assert s.stats.quarantined == 1
    with pytest.raises(CheckpointMissing, match="quarantined"):
        s.get(key)


def test_the_resume_path_refuses_an_entry_larger_than_the_model_needs(tmp_path, no_big_reads):
    from benchmarks.tiny import tiny_engine
    from patchkv_agent.runtime.kvstore import load_for_resume

    eng = tiny_engine(seed=0)
    ckpt = eng.checkpoint(list(range(3, 43)))
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    key = s.key_for(ckpt, thread_id="t", version=1)
    s.put(key, ckpt)
    meta = _hostile_meta(ckpt, key, eng.spec.max_positions * 64)  # the model's layers, heads and head_dim
    _plant_sparse(s, key, meta)
    got, reason = load_for_resume(eng, s, key)
    assert got is None and "does not fit this model" in reason and "positions" in reason, reason
    assert max(no_big_reads, default=0) < BIG_READ and s.stats.quarantined == 1


def test_an_old_layout_directory_with_a_sparse_data_file_never_breaks_opening(tmp_path, no_big_reads, monkeypatch):
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    good, _ = put_entry(s, make_ckpt(4), "good")
    c = make_ckpt(5)
    key = s.key_for(c, thread_id="legacy", version=1)
    meta = _hostile_meta(c, key, 1 << 24)  # 16 GiB of K/V
    legacy = s.dir / key.digest
    legacy.mkdir()
    (legacy / "meta.json").write_text(json.dumps(meta))
    with open(legacy / "data.bin", "wb") as f:
        f.truncate(entry_nbytes(meta))
    assert entry_nbytes(meta) > 8 << 30
    warned = []
    monkeypatch.setattr(D.log, "warning", lambda msg, *a: warned.append(msg % a))
    s2 = DiskStore(tmp_path / "kv", deployment="d", fsync=False)  # and again: never raises
    s3 = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    assert not legacy.exists() and s2.recovered["legacy_migrated"] == 0
    assert any("not migrated" in w and "holes" in w for w in warned), warned
    assert max(no_big_reads, default=0) < BIG_READ
    assert s3.keys() == [good] and not os.path.lexists(s3.path_of(key))
    assert_same_checkpoint(s3.get(good), make_ckpt(4))


# ------------------------------------------------------------------ 2: planted sizes never evict valid entries


def test_a_planted_disk_entry_declaring_a_tebibyte_evicts_nothing(tmp_path, no_big_reads):
    cks = [make_ckpt(10 + i) for i in range(4)]
    n = payload_bytes(cks[0])
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False, budget_bytes=4 * n + n // 2)
    keys = [put_entry(s, c, f"t{i}")[0] for i, c in enumerate(cks[:3])]
    planted = s.key_for(make_ckpt(99), thread_id="planted", version=1)
    _plant_sparse(s, planted, _hostile_meta(make_ckpt(99), planted, 1 << 31))  # ~1 TiB declared
    os.utime(s.path_of(planted), ns=(2 * 10**18, 2 * 10**18))  # the most recently used
    s2 = DiskStore(tmp_path / "kv", deployment="d", fsync=False, budget_bytes=s.budget_bytes)
    k, r = put_entry(s2, cks[3], "new")
    assert r.stored and r.evicted == (), r.evicted
    assert s2.keys() == [*keys, k] and s2.stats.quarantined == 1
    for key, c in zip(keys, cks):
        assert_same_checkpoint(s2.get(key), c)


def _record(store, key, nbytes):
    meta = json.loads(store.client.hget(store.meta_key(key), "meta"))
    return store._record(key, nbytes, meta["store"]["gen"], len(meta["blobs"]))


def test_a_self_consistent_redis_record_declaring_2_to_50_bytes_evicts_nothing(redis_server):
    from patchkv_agent.runtime.kvstore import RedisStore

    cks = [make_ckpt(20 + i) for i in range(4)]
    n = payload_bytes(cks[0])
    s = RedisStore(redis_server.url, prefix=f"big{uuid.uuid4().hex[:8]}", deployment="d", budget_bytes=4 * n + n // 2)
    keys = [put_entry(s, c, f"t{i}")[0] for i, c in enumerate(cks[:3])]
    for bad, victim in ((1 << 50, keys[0]), (s.budget_bytes + 1, keys[1])):  # checksummed: only its size lies
        s.client.hset(f"{s.ns}:idx", victim.digest, _record(s, victim, bad))
    k, r = put_entry(s, cks[3], "new")
    assert r.stored and r.evicted == (), r.evicted
    assert s.nbytes() == 4 * n  # the records were rebuilt from the verified metadata
    for key, c in zip([*keys, k], cks):
        assert_same_checkpoint(s.get(key), c)
    # an entry whose verified metadata itself declares more than the budget: quarantined, never paid for
    planted = s.key_for(make_ckpt(98), thread_id="planted", version=1)
    meta = _hostile_meta(make_ckpt(98), planted, 1 << 31)
    meta["store"] = {"gen": "0123456789ab"}
    meta["meta_xxh3"] = meta_checksum(meta)
    s.client.hset(s.meta_key(planted), "meta", json.dumps(meta))
    s.client.hset(f"{s.ns}:idx", planted.digest, s._record(planted, entry_nbytes(meta), "0123456789ab", 3))
    s.client.zadd(f"{s.ns}:lru", {planted.digest: 10**12})
    k5, r5 = put_entry(s, make_ckpt(24), "newer")
    assert r5.stored and set(r5.evicted) <= {keys[0]}, r5.evicted  # the budget's own LRU eviction only
    assert s.stats.quarantined == 1 and planted not in s.keys()
    with pytest.raises(CheckpointMissing, match="quarantined"):
        s.get(planted)
    s.clear()


def test_redis_junk_digests_in_the_lru_are_pruned_in_a_few_round_trips(redis_server, monkeypatch):
    import redis

    from patchkv_agent.runtime.kvstore import RedisStore

    c = make_ckpt(30)
    s = RedisStore(redis_server.url, prefix=f"junk{uuid.uuid4().hex[:8]}", deployment="d",
                   budget_bytes=4 * payload_bytes(c))
    junk = {uuid.uuid4().hex: i for i in range(20_000)}
    s.client.zadd(f"{s.ns}:lru", junk)
    s.client.zadd(f"{s.ns}:lru", {b"not a digest": 1})
    sends = []
    real = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command",
                        lambda self, *a, **k: sends.append(1) or real(self, *a, **k))
    key, r = put_entry(s, c)
    monkeypatch.undo()
    assert r.stored and len(sends) < 200, len(sends)  # was one round trip (a MULTI/EXEC) per junk digest
    assert s.client.zcard(f"{s.ns}:lru") == 1 and s.keys() == [key]
    assert_same_checkpoint(s.get(key), c)
    s.clear()


def test_a_redis_blob_longer_than_its_metadata_says_is_never_fetched(redis_server, monkeypatch):
    from patchkv_agent.runtime.kvstore import RedisStore

    s = RedisStore(redis_server.url, prefix=f"len{uuid.uuid4().hex[:8]}", deployment="d")
    c = make_ckpt(31)
    key, _ = put_entry(s, c)
    s.client.append(s.blob_keys(key)[-1], b"\0" * (1 << 20))
    fetched = []
    real = s.client.mget
    monkeypatch.setattr(s.client, "mget", lambda names, *a: fetched.append(names) or real(names, *a))
    with pytest.raises(CorruptCheckpoint, match="wrong length"):
        s.get(key)
    assert fetched == [] and s.stats.quarantined == 1
    s.clear()


# ------------------------------------------------------------------ 9: links inside the store


def _victim(tmp_path) -> Path:
    v = tmp_path / "victim"
    v.mkdir()
    for i in range(20):  # names a quarantine would write, and others
        (v / f"{'0' * 32}-{i}.kv").write_text("precious")
        (v / f"notes-{i}.txt").write_text("precious")
    return v


def _intact(v: Path) -> bool:
    return sorted(p.name for p in v.iterdir()) == sorted(
        [f"{'0' * 32}-{i}.kv" for i in range(20)] + [f"notes-{i}.txt" for i in range(20)]) and \
        all(p.read_text() == "precious" for p in v.iterdir())


@pytest.mark.parametrize("special", [".quarantine", ".gone"])
def test_a_linked_special_directory_is_refused_on_open_and_never_written_through(tmp_path, special):
    v = _victim(tmp_path)
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    bad, _ = put_entry(s, make_ckpt(40), "bad")
    for i in range(20):  # enough quarantined entries that pruning runs
        k, _ = put_entry(s, make_ckpt(41), f"q{i}")
        s.quarantine(k, "test")
    (s.dir / special).rename(tmp_path / "aside")
    (s.dir / special).symlink_to(v)  # swapped while the store is open
    p = s.path_of(bad)
    raw = bytearray(p.read_bytes())
    raw[-3] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint):
        s.get(bad)  # quarantined (the tombstone written), pruning run
    assert not os.path.lexists(p)
    s.delete(put_entry(s, make_ckpt(42), "gone")[0])  # another tombstone
    assert _intact(v)
    with pytest.raises(StoreUnavailable, match=rf"{special} is a symbolic link .*remove the link \(rm "):
        DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    assert _intact(v)


def test_a_linked_deployment_directory_is_refused(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    put_entry(s, make_ckpt(43))
    real = s.dir.rename(tmp_path / "kv" / "real")
    s.dir.symlink_to(outside)
    with pytest.raises(StoreUnavailable, match="is a symbolic link .*remove the link"):
        DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    assert list(outside.iterdir()) == [] and real.is_dir()


def test_a_deployment_directory_swapped_for_a_link_while_open_is_never_read_or_written_through(tmp_path):
    """Swapped after the store opened: the next put and get refuse (naming the fix), and nothing reaches
    the link's target; the entries stay where the store wrote them."""
    v = _victim(tmp_path)
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    ckpt = make_ckpt(44)
    key, _ = put_entry(s, ckpt, "kept")
    real = s.dir.rename(tmp_path / "kv" / "real")
    s.dir.symlink_to(v)
    for op in (lambda: s.put(key, ckpt), lambda: s.get(key), lambda: s.delete(key)):
        with pytest.raises(StoreUnavailable, match="the directory was replaced .*open a new DiskStore"):
            op()
    assert _intact(v) and (real / s.path_of(key).name).is_file()


def test_a_swap_between_the_check_and_the_write_lands_in_the_directory_the_store_opened(tmp_path, monkeypatch):
    """The race the check cannot close (the swap right after it): every step of a put is relative to the
    directory descriptor the store opened, so the entry lands there and the link's target is untouched."""
    v = _victim(tmp_path)
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=True)
    real = tmp_path / "kv" / "real"
    publish = D.DiskStore._publish

    def swap_then_publish(self, *a, **kw):  # the attacker wins the race: after the put's check, before its writes
        self.dir.rename(real)
        self.dir.symlink_to(v)
        return publish(self, *a, **kw)

    monkeypatch.setattr(D.DiskStore, "_publish", swap_then_publish)
    ckpt = make_ckpt(45)
    key, put = put_entry(s, ckpt, "raced")
    assert put.stored and _intact(v)
    assert (real / s.path_of(key).name).is_file() and not list(real.glob(".tmp-*"))
    monkeypatch.undo()
    os.unlink(s.dir)
    real.rename(s.dir)  # the name leads to the store's directory again: it works on
    assert_same_checkpoint(s.get(key), ckpt)


def test_recovery_removes_only_the_temporaries_the_store_names(tmp_path):
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    key, _ = put_entry(s, make_ckpt(44))
    mine = s.dir / f".tmp-{key.digest}-{uuid.uuid4().hex}.kv"
    mine.write_bytes(b"half")
    other = s.dir / ".tmp-not-ours"
    other.write_text("someone else's")
    s2 = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    assert not mine.exists() and other.read_text() == "someone else's" and s2.keys() == [key]


# ------------------------------------------------------------------ declared sizes cost at most a small multiple


def _traced_peak(fn):
    """(result or raised exception, peak bytes Python allocated while ``fn`` ran)."""
    import tracemalloc

    tracemalloc.start()
    try:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - returned for the test to judge
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_sparse_entry_within_every_limit_is_verified_before_its_data_is_allocated(tmp_path, no_big_reads):
    host = host_memory_bytes()
    if host is not None and host < 8 << 30:
        pytest.skip("the planted entry must fit this host's memory to reach the read")
    c = make_ckpt(6)
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)  # no budget, no model limits
    key, _ = put_entry(s, c)
    n = _plant_sparse(s, key, _hostile_meta(c, key, 1 << 22))  # 1.2 GiB declared, a few KiB on disk
    assert n > 1 << 30 and os.stat(s.path_of(key)).st_blocks * 512 < 1 << 20
    err, peak = _traced_peak(lambda: s.get(key))
    assert isinstance(err, CorruptCheckpoint) and "failed its checksum" in str(err), err
    assert max(no_big_reads, default=0) < BIG_READ  # the 1.2 GiB buffer was never allocated
    assert peak < 64 << 20, peak  # one bounded chunk at a time
    assert s.stats.corrupt == 1 and s.stats.quarantined == 1 and not os.path.lexists(s.path_of(key))
    with pytest.raises(CheckpointMissing, match="quarantined"):
        s.get(key)


def test_metadata_over_the_byte_or_value_cap_is_refused_unparsed():
    from patchkv_agent.runtime.kvstore.codec import MAX_META_BYTES, MAX_META_VALUES, parse_meta

    long_text = json.dumps({"x": "a" * (6 << 20)}).encode()  # one value, 6 MiB
    many = b"[" + b"{}," * (1 << 20) + b"{}]"  # 3 MiB: 2^20 commas, 1 + 2^20 + 1 brackets (~70 MiB parsed)
    assert len(long_text) > MAX_META_BYTES > len(many) and 1 + many.count(b",") > MAX_META_VALUES
    for raw, why in ((long_text, f"has {len(long_text)} bytes \\(more than {MAX_META_BYTES}"),
                     (many, f"holds up to {(1 << 21) + 3} JSON values \\(more than {MAX_META_VALUES}")):
        err, peak = _traced_peak(lambda: parse_meta(raw, "entry metadata"))
        assert isinstance(err, CorruptCheckpoint), err
        assert re.search(why, str(err)), str(err)
        assert peak < 2 * len(raw) + (1 << 20), peak
    ok = {"blobs": [{"name": f"k.{i}", "shape": [2, 40, 16]} for i in range(1000)]}  # a big real table parses
    assert parse_meta(json.dumps(ok).encode()) == ok


def test_a_disk_entry_with_oversized_metadata_is_quarantined_unread(tmp_path, no_big_reads):
    s = DiskStore(tmp_path / "kv", deployment="d", fsync=False)
    key, _ = put_entry(s, make_ckpt(7))
    other, _ = put_entry(s, make_ckpt(8), "bystander")
    raw = b"[" + b"{}," * ((5 << 20) // 3) + b"{}]"  # 5 MiB of metadata, ~110 MiB if parsed
    with open(s.path_of(key), "wb") as f:
        f.write(D.HEADER.pack(D.MAGIC, len(raw), xxhash.xxh3_64_intdigest(raw)) + raw)
    err, peak = _traced_peak(lambda: s.get(key))
    assert isinstance(err, CorruptCheckpoint) and f"metadata length of {len(raw)} bytes" in str(err), err
    assert max(no_big_reads) == D.HEADER.size and peak < 1 << 20, (no_big_reads, peak)
    assert s.stats.quarantined == 1 and not os.path.lexists(s.path_of(key))
    assert_same_checkpoint(s.get(other), make_ckpt(8))


def test_a_redis_metadata_hash_over_the_cap_is_never_fetched(redis_server, monkeypatch):
    from patchkv_agent.runtime.kvstore import RedisStore

    s = RedisStore(redis_server.url, prefix=f"meta{uuid.uuid4().hex[:8]}", deployment="d")
    key, _ = put_entry(s, make_ckpt(9))
    other, _ = put_entry(s, make_ckpt(10), "bystander")
    s.client.hset(s.meta_key(key), "meta", b"[" + b"{}," * ((5 << 20) // 3) + b"{}]")
    fetched = []
    real = s.client.hget
    monkeypatch.setattr(s.client, "hget", lambda name, field: fetched.append((name, field)) or real(name, field))
    with pytest.raises(CorruptCheckpoint, match=r"metadata hash holds \d+ bytes, more than \d+ .*refused unread"):
        s.get(key)
    assert (s.meta_key(key), "meta") not in fetched and s.stats.quarantined == 1
    assert not s.client.exists(s.meta_key(key))
    with pytest.raises(CheckpointMissing):
        s.get(key)
    assert_same_checkpoint(s.get(other), make_ckpt(10))
    s.clear()

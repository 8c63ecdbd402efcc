"""The shared Redis tier: a thread offloaded by one worker process resumes on another.

Keys, under the namespace ``<prefix>:<deployment>`` with both parts escaped (``%`` -> ``%25``, ``:`` ->
``%3A``; glob characters ``* ? [ ] \\``, spaces and control characters likewise), so the namespace is
unambiguous (``prefix="p", deployment="x:y"`` and ``prefix="p:x", deployment="y"`` never share a key) and
no key ever contains a glob character::

    :meta:<digest>              hash: meta = the codec's JSON, its checksum covering the blob generation
    :blob:<digest>:<gen>:<i>    binary string: blob i of the entry (a K/V tensor, a payload run's data)
    :lru                        sorted set: digest -> use clock (least recently used first)
    :clock                      counter behind the use clock (repaired if damaged)
    :idx                        hash: digest -> "<xxh3> <json of key, blob bytes, gen, blob count>"
    :names                      set: every meta and blob key of the namespace (what ``clear`` deletes)
    :gone                       hash: digest -> why the entry is gone (evicted, deleted, too large, expired,
                                quarantined)

Nothing read back is trusted unverified: the metadata hash is checked against its checksum (which covers
the generation, hence the blob names, and the blob table, hence every size and the blob count); an index
record is checked against its own checksum and against the key's digest; a damaged index record is rebuilt
from the entry's verified metadata, or, when that is damaged too, the entry is quarantined (deleted,
counted, its reason recorded). Budgets count sizes from verified records only; a record (even a
self-consistent one) declaring more than the whole budget or this host's memory is quarantined, never a
reason to evict others. Before a blob is fetched, the verified metadata is checked against the budget, this
host's memory and the requesting model (:class:`~.codec.EntryLimits`), and every blob value's length
(``STRLEN``) against the length its metadata makes; the metadata's own length (``HSTRLEN``) is checked
against :data:`~.codec.MAX_META_BYTES` before it is fetched, and an index record longer than
:data:`MAX_RECORD_BYTES` is treated as damaged, so nothing fetched is parsed at more than a small multiple
of its stored length. Scanning the index is pipelined in batches, and
members of ``:lru`` that are not entries (junk digests, expired entries) are pruned in batches, so a
hundred thousand of them cost a few round trips, not one each.

``put`` writes the blobs under a fresh generation and the metadata and index in one MULTI/EXEC
transaction, so another client sees the old entry or the whole new one. With ``ttl_s`` the metadata and
blobs expire together; every ``get`` refreshes them. Budget and LRU order are shared by every process of
the deployment (they live on the server); concurrent evictions from two processes are idempotent.
``clear`` deletes exactly the keys in the namespace's ``:names`` index plus its fixed keys, never a key
matched by a pattern. Connection and server errors become :class:`~.base.StoreUnavailable`.

Knows the codec and redis-py; nothing about engines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import uuid
from typing import Any, Iterator

import xxhash

from ...core.checkpoint import Checkpoint, CorruptCheckpoint
from .base import CheckpointMissing, KVStore, StoreUnavailable
from .codec import (MAX_ENTRY_BYTES, MAX_META_BYTES, CheckpointKey, check_meta, decode_checkpoint, entry_nbytes, meta_checksum,
                    parse_meta)

log = logging.getLogger(__name__)

GONE_TTL_S = 7 * 24 * 3600
_DIGEST = re.compile(r"[0-9a-f]{32}")
_GEN = re.compile(r"[0-9a-f]{12}")
_ESCAPE = set('%:*?[]\\{}') | {chr(c) for c in range(33)} | {"\x7f"}
MAX_BLOBS = 1 << 20
BATCH = 1000  # members per pipelined batch when the index is scanned or pruned
MAX_RECORD_BYTES = 1 << 16  # an index record longer than this is damaged (rebuilt from the verified metadata)
_OVERSIZE = b"\xff oversize "  # what _hget_meta returns for a metadata value too long to fetch
_WRONG_TYPE = b"\xff wrong type"  # ... and for a name that holds no hash


def escape_part(text: str) -> str:
    """A namespace part with ``%``, ``:``, glob characters, braces, whitespace and control characters
    percent-escaped (so parts joined by ``:`` are unambiguous and free of glob characters)."""
    return "".join(f"%{ord(c):02X}" if c in _ESCAPE else c for c in text)


def namespace(prefix: str, deployment: str) -> str:
    """The key namespace of ``deployment`` under ``prefix`` (both escaped, joined by ``:``)."""
    return f"{escape_part(prefix)}:{escape_part(deployment)}"


def _redis():
    try:
        import redis
    except ImportError as e:  # misconfiguration: name the fix
        raise ImportError("RedisStore needs the redis client: pip install 'patchkv-agent[redis]' "
                          "(or pip install redis)") from e
    return redis


class RedisStore(KVStore):
    """Checkpoints on a Redis server.

    Args:
        url: ``redis://host:port/db`` (ignored when ``client`` is given).
        client: an existing ``redis.Redis`` (binary responses: ``decode_responses=False``).
        deployment: the namespace (part of every key, escaped).
        prefix: key prefix of this deployment's entries (escaped).
        budget_bytes: blob bytes the deployment may hold on the server (None: unbounded).
        ttl_s: seconds an entry lives after its last put or get (None: no expiry).
        timeout_s: socket connect/read timeout.

    Raises:
        ImportError: redis-py is not installed (the message names the pip install).
        ValueError: an empty prefix, or a bad ``ttl_s``.
    """

    tier = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, client=None, deployment: str = "default",
                 prefix: str = "patchkv", budget_bytes: int | None = None, ttl_s: int | None = None,
                 timeout_s: float = 5.0):
        super().__init__(deployment=deployment, budget_bytes=budget_bytes)
        if not prefix:
            raise ValueError("prefix must be a non-empty string")
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 second or None, got {ttl_s}")
        redis = _redis()
        self._errors = (redis.exceptions.RedisError, OSError)
        self._response_error = redis.exceptions.ResponseError
        self.client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.ttl_s = ttl_s
        self.prefix = str(prefix)
        self.ns = namespace(self.prefix, self.deployment)

    @contextlib.contextmanager
    def _io(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._errors as e:
            raise StoreUnavailable(f"Redis unavailable while {what}: {type(e).__name__}: {e}") from e

    # key names
    def meta_key(self, key: CheckpointKey) -> str:
        """The Redis hash holding ``key``'s metadata (for inspection and fault-injection tests)."""
        return f"{self.ns}:meta:{key.digest}"

    def _k(self, what: str) -> str:
        return f"{self.ns}:{what}"

    def blob_keys(self, key: CheckpointKey) -> list[str]:
        """The Redis keys of ``key``'s blobs, in the blob table's order, from its verified metadata (empty
        when there is no entry or its metadata is damaged)."""
        with self._io("listing blobs"):
            raw = self._hget_meta(self.meta_key(key))
        try:
            meta = self._verified_meta(raw, key)
        except CorruptCheckpoint:
            return []
        return [] if meta is None else self._blob_names(key.digest, meta["store"]["gen"], len(meta["blobs"]))

    def _blob_names(self, digest: str, gen: str, nblobs: int) -> list[str]:
        return [f"{self.ns}:blob:{digest}:{gen}:{i}" for i in range(nblobs)]

    # ------------------------------------------------------------------ verified reads

    def _hget_meta(self, mk: str) -> bytes | None:
        return self._hget_meta_on(self.client, mk)

    def _hget_meta_on(self, conn, mk: str) -> bytes | None:
        """The ``meta`` field of the hash ``mk`` read through ``conn`` (the client, or a watching pipeline),
        its length checked first (``HSTRLEN``): a value over :data:`~.codec.MAX_META_BYTES`, or something
        other than a hash under the name, is never fetched; a marker that :meth:`_verified_meta` refuses
        stands in for it.

        Args:
            conn: the client or a pipeline in immediate (watch) mode.
            mk: the metadata hash's name.

        Returns:
            The stored bytes, a refusal marker, or None when there is no entry.
        """
        try:
            n = conn.hstrlen(mk, "meta")
            if n > MAX_META_BYTES:
                return _OVERSIZE + str(n).encode()  # declared in Redis, never fetched
            return conn.hget(mk, "meta")
        except self._response_error as e:
            if "WRONGTYPE" in str(e):
                return _WRONG_TYPE  # something else under the entry's name: damaged
            raise

    def _verified_meta(self, raw: bytes | None, key: CheckpointKey | None) -> dict | None:
        """The metadata stored for ``key`` after its checksum and fields were checked (None: no entry)."""
        if raw is None:
            return None
        if raw.startswith(_OVERSIZE):
            raise CorruptCheckpoint(f"metadata hash holds {raw[len(_OVERSIZE):].decode()} bytes, more than "
                                    f"{MAX_META_BYTES} (damaged, refused unread)")
        meta = parse_meta(raw, "metadata hash")
        check_meta(meta, key)
        store = meta.get("store")
        if not isinstance(store, dict) or not _GEN.fullmatch(str(store.get("gen", ""))):
            raise CorruptCheckpoint("metadata hash lacks a valid blob generation")
        return meta

    def _record(self, key: CheckpointKey, nbytes: int, gen: str, nblobs: int) -> bytes:
        body = json.dumps({"key": json.loads(key.to_json()), "nbytes": nbytes, "gen": gen, "nblobs": nblobs},
                          sort_keys=True).encode()
        return xxhash.xxh3_64_hexdigest(body).encode() + b" " + body

    def _parse_record(self, digest: str, rec: bytes | None) -> tuple[CheckpointKey, int, str, int] | None:
        """(key, nbytes, gen, nblobs) of an index record, or None when it is absent or damaged (a size over the
        whole budget counts as damaged: the record is then rebuilt from the entry's verified metadata)."""
        if rec is None or len(rec) > MAX_RECORD_BYTES:
            return None
        try:
            check, body = bytes(rec).split(b" ", 1)
            if xxhash.xxh3_64_hexdigest(body).encode() != check:
                return None
            r = json.loads(body)
            key = CheckpointKey(**r["key"])
            n, gen, nb = r["nbytes"], r["gen"], r["nblobs"]
            ok = (key.digest == digest and isinstance(n, int) and 0 <= n <= MAX_ENTRY_BYTES and isinstance(gen, str)
                  and _GEN.fullmatch(gen) and isinstance(nb, int) and 0 <= nb <= MAX_BLOBS
                  and isinstance(key.version, int))
            ok = ok and (self.budget_bytes is None or n <= self.budget_bytes)  # else rebuilt from the metadata
            return (key, n, gen, nb) if ok else None
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
            return None

    def _repair(self, digest: str, key: CheckpointKey | None) -> tuple[CheckpointKey, int] | None:
        """Rebuild ``digest``'s damaged index record from its verified metadata; quarantine the entry when
        that is damaged too. Returns (key, verified nbytes), or None when the entry is gone."""
        mk = f"{self.ns}:meta:{digest}"
        raw = self._hget_meta(mk)
        try:
            meta = self._verified_meta(raw, key)
        except CorruptCheckpoint as e:
            meta, why = None, str(e)
        else:
            why = None
        if meta is not None:
            stored = check_meta(meta, None)
            if stored.digest == digest:
                n = entry_nbytes(meta)
                self.client.hset(self._k("idx"), digest,
                                 self._record(stored, n, meta["store"]["gen"], len(meta["blobs"])))
                log.warning("Redis store %s: rebuilt the damaged index record of %s", self.ns, stored.describe())
                return stored, n
            why = "metadata hash holds another key"
        if raw is None and why is None:  # no entry at all: drop the stale index parts
            self._unindex(digest)
            return None
        self._drop_digest(digest, None, f"quarantined as corrupt (index record and metadata damaged: {why})")
        self.stats.quarantined += 1
        return None

    # ------------------------------------------------------------------ hooks

    def _tick(self) -> int:
        """The next use-clock value (a damaged counter is reset past the highest recorded use)."""
        try:
            return int(self.client.incr(self._k("clock")))
        except self._response_error:
            top = self.client.zrange(self._k("lru"), -1, -1, withscores=True)
            self.client.set(self._k("clock"), int(top[0][1]) + 1 if top else 1)
            log.warning("Redis store %s: the use clock was damaged; reset", self.ns)
            return int(self.client.incr(self._k("clock")))

    def _write(self, key, meta, blobs, ckpt) -> None:
        d, gen = key.digest, uuid.uuid4().hex[:12]
        meta = {**meta, "store": {"gen": gen}}
        meta["meta_xxh3"] = meta_checksum(meta)
        names = self._blob_names(d, gen, len(meta["blobs"]))
        n = sum(int(s["nbytes"]) for s in meta["blobs"])
        with self._io(f"writing {key.describe()}"):
            old = self._entry_blob_names(d, key)
            clock = self._tick()
            mk = self.meta_key(key)
            pipe = self.client.pipeline(transaction=True)
            for name, spec in zip(names, meta["blobs"]):
                pipe.set(name, memoryview(blobs[spec["name"]]), ex=self.ttl_s)
            pipe.delete(mk)
            pipe.hset(mk, "meta", json.dumps(meta))
            if self.ttl_s is not None:
                pipe.expire(mk, self.ttl_s)
            pipe.zadd(self._k("lru"), {d: clock})
            pipe.hset(self._k("idx"), d, self._record(key, n, gen, len(names)))
            pipe.hdel(self._k("gone"), d)
            pipe.sadd(self._k("names"), mk, *names)
            stale = [x for x in old if x not in set(names)]
            if stale:
                pipe.delete(*stale)
                pipe.srem(self._k("names"), *stale)
            pipe.execute()

    def _entry_blob_names(self, digest: str, key: CheckpointKey | None) -> list[str]:
        """Every blob key of ``digest``'s entry: from the verified index record or metadata, else (both
        damaged) the namespace's ``:names`` members of that digest."""
        rec = self._parse_record(digest, self.client.hget(self._k("idx"), digest))
        if rec is not None:
            return self._blob_names(digest, rec[2], rec[3])
        raw = self._hget_meta(f"{self.ns}:meta:{digest}")
        if raw is None:
            return []
        try:
            meta = self._verified_meta(raw, key)
            return self._blob_names(digest, meta["store"]["gen"], len(meta["blobs"]))
        except CorruptCheckpoint:
            pass
        head = f"{self.ns}:blob:{digest}:".encode()
        return [m.decode() for m in self.client.sscan_iter(self._k("names"), count=1000) if m.startswith(head)]

    def _read(self, key) -> Checkpoint:
        mk = self.meta_key(key)
        for _ in range(3):  # again if the entry was replaced between the two reads
            with self._io(f"reading {key.describe()}"):
                raw = self._suspect = self._hget_meta(mk)  # the metadata whose entry is judged
                if raw is None:
                    self._index_pop(key)
                    raise CheckpointMissing(key, self._tomb_get(key) or f"checkpoint of {key.describe()} left "
                                            "the Redis store (evicted or expired)")
                meta = self._verified_meta(raw, key)
                self._admit(meta, key)  # the model's shape, the budget, this host: before any fetch
                names = self._blob_names(key.digest, meta["store"]["gen"], len(meta["blobs"]))
                if names:  # every value's length before the values themselves: none larger than declared
                    pipe = self.client.pipeline(transaction=False)
                    for name in names:
                        pipe.strlen(name)
                    lens = pipe.execute()
                    wrong = [(spec, got) for spec, got in zip(meta["blobs"], lens) if got != spec["nbytes"]]
                    if wrong:
                        if self._hget_meta(mk) != raw:
                            continue
                        spec, got = wrong[0]
                        if got == 0:
                            raise CorruptCheckpoint(f"blob {spec['name']} of {key.describe()} is missing from "
                                                    "Redis")
                        raise CorruptCheckpoint(f"blob {spec['name']} of {key.describe()} holds {got} bytes in "
                                                f"Redis, expected {spec['nbytes']} (truncated or wrong length)")
                values = self.client.mget(names) if names else []
                if any(v is None for v in values):
                    if self._hget_meta(mk) != raw:
                        continue
                    missing = meta["blobs"][[v is None for v in values].index(True)]["name"]
                    raise CorruptCheckpoint(f"blob {missing} of {key.describe()} is missing from Redis")
                if self.ttl_s is not None:
                    pipe = self.client.pipeline(transaction=False)
                    for n in [mk, *names]:
                        pipe.expire(n, self.ttl_s)
                    pipe.execute()
            return decode_checkpoint(meta, {s["name"]: v for s, v in zip(meta["blobs"], values)}, key)
        raise CheckpointMissing(key, f"checkpoint of {key.describe()} kept changing while read")

    def _remove(self, key) -> None:
        with self._io(f"removing {key.describe()}"):
            self._delete_entry(key.digest, key)

    def _quarantine(self, key, reason: str) -> bool:
        """Delete the damaged entry, unless another writer replaced it since it was read (checked and
        deleted in one transaction)."""
        suspect, self._suspect = getattr(self, "_suspect", None), None
        mk = self.meta_key(key)
        with self._io(f"quarantining {key.describe()}"):
            names = [mk, *self._entry_blob_names(key.digest, key)]

            def drop(pipe) -> bool:
                if suspect is not None and self._hget_meta_on(pipe, mk) != suspect:
                    return False  # replaced meanwhile: the new entry is not the damaged one
                pipe.multi()
                pipe.delete(*names)
                pipe.srem(self._k("names"), *names)
                return True

            return self.client.transaction(drop, mk, value_from_callable=True)

    def _delete_entry(self, digest: str, key: CheckpointKey | None) -> None:
        names = [f"{self.ns}:meta:{digest}", *self._entry_blob_names(digest, key)]
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(*names)
        pipe.srem(self._k("names"), *names)
        pipe.execute()

    def _drop_digest(self, digest: str, key: CheckpointKey | None, reason: str) -> None:
        """Delete an entry and its index parts by digest, recording ``reason`` (quarantine of a damaged one)."""
        self._delete_entry(digest, key)
        self._unindex(digest)
        self.client.hset(self._k("gone"), digest, f"checkpoint {digest} was {reason}")
        self.client.expire(self._k("gone"), GONE_TTL_S)
        log.warning("Redis store %s: entry %s %s", self.ns, digest, reason[:300])

    def _unindex(self, digest: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(self._k("lru"), digest)
        pipe.hdel(self._k("idx"), digest)
        pipe.execute()

    # bookkeeping lives on the server, shared by every process of the deployment

    def _index_get(self, key: CheckpointKey) -> int | None:
        with self._io("looking up a key"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(self._k("idx"), key.digest)
            pipe.exists(self.meta_key(key))
            rec, exists = pipe.execute()
            if rec is None:
                return None
            parsed = self._parse_record(key.digest, rec)
            if not exists:  # the entry expired: drop it from the index and say so
                self._expire(key.digest, key, parsed)
                return None
            if parsed is None:
                fixed = self._repair(key.digest, key)
                return None if fixed is None else fixed[1]
            return parsed[1]

    def _expire(self, digest: str, key: CheckpointKey, parsed) -> None:
        names = self._blob_names(digest, parsed[2], parsed[3]) if parsed is not None else []
        pipe = self.client.pipeline(transaction=True)
        pipe.zrem(self._k("lru"), digest)
        pipe.hdel(self._k("idx"), digest)
        pipe.srem(self._k("names"), f"{self.ns}:meta:{digest}", *names)
        pipe.execute()
        self._tomb_put(key, f"checkpoint of {key.describe()} expired from the Redis store (TTL {self.ttl_s} s)")

    def _index_put(self, key: CheckpointKey, nbytes: int) -> None:
        pass  # done inside _write's transaction

    def _index_touch(self, key: CheckpointKey) -> None:
        with self._io("updating recency"):
            self.client.zadd(self._k("lru"), {key.digest: self._tick()}, xx=True)

    def _index_pop(self, key: CheckpointKey) -> None:
        with self._io("updating the index"):
            self._unindex(key.digest)

    def _index_items(self) -> list[tuple[CheckpointKey, int]]:
        with self._io("listing keys"):
            members = self.client.zrange(self._k("lru"), 0, -1)
            bad = [m for m in members if not _DIGEST.fullmatch(m.decode("ascii", "replace"))]
            digests = [m.decode() for m in members if _DIGEST.fullmatch(m.decode("ascii", "replace"))]
            self._prune(bad, [], [])
            recs: list = []
            alive: list = []
            for i in range(0, len(digests), BATCH):  # one round trip per batch, never one per member
                chunk = digests[i:i + BATCH]
                pipe = self.client.pipeline(transaction=False)
                pipe.hmget(self._k("idx"), chunk)
                for d in chunk:
                    pipe.exists(f"{self.ns}:meta:{d}")
                got, *ok = pipe.execute()
                recs += got
                alive += ok
            out, junk, expired = [], [], []
            for d, rec, ok in zip(digests, recs, alive):
                parsed = self._parse_record(d, rec)
                if not ok:
                    if parsed is not None:
                        expired.append((d, parsed))  # expired: pruned with its reason
                    else:
                        junk.append(d)  # no entry and no usable record: nothing to say why
                    continue
                if parsed is None:
                    fixed = self._repair(d, None)
                    if fixed is not None:
                        out.append(fixed)
                    continue
                out.append((parsed[0], parsed[1]))
            self._prune([], junk, expired)
        return out

    def _prune(self, bad: list[bytes], junk: list[str], expired: list) -> None:
        """Remove, in pipelined batches: ``bad`` members of ``:lru`` (not digests), ``junk`` digests (no entry,
        no usable record) from ``:lru`` and ``:idx``, and ``expired`` ``(digest, parsed record)`` entries from
        the index with a tombstone saying they expired."""
        for i in range(0, len(bad), BATCH):
            self.client.zrem(self._k("lru"), *bad[i:i + BATCH])
        for i in range(0, len(junk), BATCH):
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(self._k("lru"), *junk[i:i + BATCH])
            pipe.hdel(self._k("idx"), *junk[i:i + BATCH])
            pipe.execute()
        if junk:
            log.warning("Redis store %s: pruned %d index members without an entry", self.ns, len(junk))
        pipe, pending = None, 0
        for n, (d, p) in enumerate(expired):
            if pipe is None:
                pipe = self.client.pipeline(transaction=False)
            names = [f"{self.ns}:meta:{d}", *self._blob_names(d, p[2], p[3])]
            pipe.zrem(self._k("lru"), d)
            pipe.hdel(self._k("idx"), d)
            pipe.srem(self._k("names"), *names)
            pipe.hset(self._k("gone"), d, f"checkpoint of {p[0].describe()} expired from the Redis store "
                                          f"(TTL {self.ttl_s} s)")
            pending += len(names) + 3
            if pending >= 16 * BATCH or n == len(expired) - 1:  # bounded pipelines, few round trips
                pipe.expire(self._k("gone"), GONE_TTL_S)
                pipe.execute()
                pipe, pending = None, 0

    def _tomb_put(self, key: CheckpointKey, reason: str) -> None:
        with self._io("recording a removal"):
            self.client.hset(self._k("gone"), key.digest, reason)
            self.client.expire(self._k("gone"), GONE_TTL_S)

    def _tomb_get(self, key: CheckpointKey) -> str | None:
        with self._io("looking up a removal"):
            r = self.client.hget(self._k("gone"), key.digest)
        return None if r is None else bytes(r).decode("utf-8", "replace")

    def _tomb_pop(self, key: CheckpointKey) -> None:
        with self._io("updating the index"):
            self.client.hdel(self._k("gone"), key.digest)

    def clear(self) -> None:
        """Remove every entry and the index of this deployment: exactly the keys its ``:names`` index lists
        and its fixed keys, never keys matched by a pattern (tests, resets)."""
        with self._lock, self._io("clearing"):
            names = [m for m in self.client.sscan_iter(self._k("names"), count=1000)]
            for i in range(0, len(names), 1000):
                self.client.delete(*names[i:i + 1000])
            self.client.delete(*(self._k(x) for x in ("lru", "clock", "idx", "gone", "names")))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "ttl_s": self.ttl_s, "namespace": self.ns}

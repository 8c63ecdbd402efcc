"""The shared Redis tier: a thread offloaded by one worker process resumes on another.

Keys, under ``<prefix>:<deployment>`` (one prefix per deployment, so deployments sharing a server never
see each other's entries)::

    :meta:<digest>              hash: meta (the codec's JSON), gen, nblobs, nbytes
    :blob:<digest>:<gen>:<i>    binary string: blob i of the entry (a K/V tensor, a payload run's data)
    :lru                        sorted set: digest -> use clock (least recently used first)
    :clock                      counter behind the use clock
    :size, :keys                hashes: digest -> blob bytes / the key's JSON
    :gone                       hash: digest -> why the entry is gone (evicted, deleted, too large, expired)

``put`` writes the blobs under a fresh generation and the metadata and index in one MULTI/EXEC
transaction, so another client sees the old entry or the whole new one. With ``ttl_s`` the metadata and
blobs expire together; every ``get`` refreshes them. Budget and LRU order are shared by every process of
the deployment (they live on the server); concurrent evictions from two processes are idempotent.
Connection and server errors become :class:`~.base.StoreUnavailable`.

Knows the codec and redis-py; nothing about engines.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from typing import Any, Iterator

from ...core.checkpoint import Checkpoint, CorruptCheckpoint
from .base import CheckpointMissing, KVStore, StoreUnavailable
from .codec import CheckpointKey, check_meta, decode_checkpoint

GONE_TTL_S = 7 * 24 * 3600


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
        deployment: the namespace (part of every key).
        prefix: key prefix of this deployment's entries.
        budget_bytes: blob bytes the deployment may hold on the server (None: unbounded).
        ttl_s: seconds an entry lives after its last put or get (None: no expiry).
        timeout_s: socket connect/read timeout.

    Raises:
        ImportError: redis-py is not installed (the message names the pip install).
    """

    tier = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, client=None, deployment: str = "default",
                 prefix: str = "patchkv", budget_bytes: int | None = None, ttl_s: int | None = None,
                 timeout_s: float = 5.0):
        super().__init__(deployment=deployment, budget_bytes=budget_bytes)
        redis = _redis()
        self._errors = (redis.exceptions.RedisError, OSError)
        self.client = client if client is not None else redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s must be >= 1 second or None, got {ttl_s}")
        self.ttl_s = ttl_s
        self.ns = f"{prefix}:{self.deployment}"

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

    def blob_keys(self, key: CheckpointKey) -> list[str]:
        """The Redis keys of ``key``'s blobs, in the blob table's order (empty when there is no entry)."""
        with self._io("listing blobs"):
            gen, nblobs = self.client.hmget(self.meta_key(key), "gen", "nblobs")
        return [] if gen is None else self._blob_names(key.digest, gen.decode(), int(nblobs))

    def _blob_names(self, digest: str, gen: str, nblobs: int) -> list[str]:
        return [f"{self.ns}:blob:{digest}:{gen}:{i}" for i in range(nblobs)]

    # ------------------------------------------------------------------ hooks

    def _write(self, key, meta, blobs, ckpt) -> None:
        d, gen = key.digest, uuid.uuid4().hex[:12]
        names = self._blob_names(d, gen, len(meta["blobs"]))
        with self._io(f"writing {key.describe()}"):
            old = self.blob_keys(key)
            clock = self.client.incr(f"{self.ns}:clock")
            pipe = self.client.pipeline(transaction=True)
            for name, spec in zip(names, meta["blobs"]):
                pipe.set(name, memoryview(blobs[spec["name"]]), ex=self.ttl_s)
            mk = self.meta_key(key)
            pipe.delete(mk)
            pipe.hset(mk, mapping={"meta": json.dumps(meta), "gen": gen, "nblobs": len(names),
                                   "nbytes": sum(int(s["nbytes"]) for s in meta["blobs"])})
            if self.ttl_s is not None:
                pipe.expire(mk, self.ttl_s)
            pipe.zadd(f"{self.ns}:lru", {d: clock})
            pipe.hset(f"{self.ns}:size", d, sum(int(s["nbytes"]) for s in meta["blobs"]))
            pipe.hset(f"{self.ns}:keys", d, key.to_json())
            pipe.hdel(f"{self.ns}:gone", d)
            if old:
                pipe.delete(*old)
            pipe.execute()

    def _read(self, key) -> Checkpoint:
        for _ in range(2):  # once more if the entry was replaced between the two reads
            with self._io(f"reading {key.describe()}"):
                h = self.client.hgetall(self.meta_key(key))
                if not h:
                    self._index_pop(key)
                    raise CheckpointMissing(key, self._tomb_get(key) or f"checkpoint of {key.describe()} left "
                                            "the Redis store (evicted or expired)")
                try:
                    meta = json.loads(h[b"meta"])
                    names = self._blob_names(key.digest, h[b"gen"].decode(), int(h[b"nblobs"]))
                except (KeyError, ValueError):
                    raise CorruptCheckpoint(f"metadata hash of {key.describe()} is damaged") from None
                check_meta(meta, key)
                values = self.client.mget(names) if names else []
                if any(v is None for v in values):
                    if self.client.hget(self.meta_key(key), "gen") != h[b"gen"]:
                        continue
                    missing = meta["blobs"][[v is None for v in values].index(True)]["name"]
                    raise CorruptCheckpoint(f"blob {missing} of {key.describe()} is missing from Redis")
                if self.ttl_s is not None:
                    pipe = self.client.pipeline(transaction=False)
                    for n in [self.meta_key(key), *names]:
                        pipe.expire(n, self.ttl_s)
                    pipe.execute()
            return decode_checkpoint(meta, {s["name"]: v for s, v in zip(meta["blobs"], values)}, key)
        raise CheckpointMissing(key, f"checkpoint of {key.describe()} kept changing while read")

    def _remove(self, key) -> None:
        with self._io(f"removing {key.describe()}"):
            names = self.blob_keys(key)
            self.client.delete(self.meta_key(key), *names)

    # bookkeeping lives on the server, shared by every process of the deployment

    def _index_get(self, key: CheckpointKey) -> int | None:
        with self._io("looking up a key"):
            pipe = self.client.pipeline(transaction=False)
            pipe.hget(f"{self.ns}:size", key.digest)
            pipe.exists(self.meta_key(key))
            n, exists = pipe.execute()
            if n is None:
                return None
            if not exists:  # the entry expired: drop it from the index and say so
                self._index_pop(key)
                self._tomb_put(key, f"checkpoint of {key.describe()} expired from the Redis store "
                                    f"(TTL {self.ttl_s} s)")
                return None
            return int(n)

    def _index_put(self, key: CheckpointKey, nbytes: int) -> None:
        pass  # done inside _write's transaction

    def _index_touch(self, key: CheckpointKey) -> None:
        with self._io("updating recency"):
            clock = self.client.incr(f"{self.ns}:clock")
            self.client.zadd(f"{self.ns}:lru", {key.digest: clock}, xx=True)

    def _index_pop(self, key: CheckpointKey) -> None:
        with self._io("updating the index"):
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(f"{self.ns}:lru", key.digest)
            pipe.hdel(f"{self.ns}:size", key.digest)
            pipe.hdel(f"{self.ns}:keys", key.digest)
            pipe.execute()

    def _index_items(self) -> list[tuple[CheckpointKey, int]]:
        with self._io("listing keys"):
            digests = [d.decode() for d in self.client.zrange(f"{self.ns}:lru", 0, -1)]
            if not digests:
                return []
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(f"{self.ns}:size", digests)
            pipe.hmget(f"{self.ns}:keys", digests)
            for d in digests:
                pipe.exists(f"{self.ns}:meta:{d}")
            sizes, keys, *alive = pipe.execute()
        out = []
        for d, n, kj, ok in zip(digests, sizes, keys, alive):
            if n is None or kj is None:
                continue
            key = CheckpointKey.from_json(kj)
            if ok:
                out.append((key, int(n)))
            else:
                self._index_get(key)  # expired: pruned with its reason
        return out

    def _tomb_put(self, key: CheckpointKey, reason: str) -> None:
        with self._io("recording a removal"):
            self.client.hset(f"{self.ns}:gone", key.digest, reason)
            self.client.expire(f"{self.ns}:gone", GONE_TTL_S)

    def _tomb_get(self, key: CheckpointKey) -> str | None:
        with self._io("looking up a removal"):
            r = self.client.hget(f"{self.ns}:gone", key.digest)
        return None if r is None else r.decode()

    def _tomb_pop(self, key: CheckpointKey) -> None:
        with self._io("updating the index"):
            self.client.hdel(f"{self.ns}:gone", key.digest)

    def clear(self) -> None:
        """Remove every entry and the index of this deployment (tests, resets)."""
        with self._lock, self._io("clearing"):
            names = list(self.client.scan_iter(match=f"{self.ns}:*", count=1000))
            if names:
                self.client.delete(*names)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

    def summary(self) -> dict[str, Any]:
        return {**super().summary(), "ttl_s": self.ttl_s, "namespace": self.ns}

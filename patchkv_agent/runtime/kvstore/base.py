"""The abstract KV checkpoint store every tier implements, with its byte budget and LRU eviction.

A store holds checkpoints of one *deployment* under :class:`~.codec.CheckpointKey` s. The base class
owns the contract and the bookkeeping (budget, least-recently-used order, eviction, the record of
why a key is gone); a tier implements how entries are written, read and removed, and may keep the
bookkeeping elsewhere (Redis keeps it on the server so several processes share it).

Contract (``tests/test_kvstore.py`` checks it for every tier):

- ``put`` publishes atomically: a reader sees the whole entry or none, never a part.
- ``get`` returns a checkpoint only after every byte read back (metadata included) matched the checksum
  written with it and the entry matched the requested key (and, given :class:`~.codec.EntryLimits`, the
  requesting model's shape); otherwise it raises
  :class:`~patchkv_agent.core.checkpoint.CorruptCheckpoint` (:class:`~.codec.ForeignCheckpoint` for another
  key's content) and *quarantines* the entry (removes it, counts it in ``stats.quarantined`` and records
  why), so a broken entry never breaks the next call: that one gets :class:`CheckpointMissing` saying it was
  quarantined. No parse, decode or type error of stored bytes, and no ``MemoryError`` while reading one,
  leaves ``get`` as anything else. Declared sizes are checked before anything is allocated: an entry larger
  than the whole budget or this host's memory, or (with limits) of another shape than the model's, is
  refused unread and quarantined. A key that
  is not there raises :class:`CheckpointMissing` whose ``reason`` says whether it was evicted, never
  stored, too large, quarantined or expired. A tier that cannot be reached raises :class:`StoreUnavailable`.
- With ``budget_bytes`` set, after every ``put`` the blob bytes held are within the budget; the least
  recently used entries (``get`` and ``put`` count as uses) are evicted first, never the one just put.
  Sizes are derived from verified metadata (shapes and dtypes under the metadata checksum), never from a
  size field no checksum covers, so a damaged record can neither evict valid entries nor switch the
  budget off; an entry whose size is over the whole budget (or this host's memory) is quarantined, never
  a reason to evict others.
- Every method is safe to call from many OS threads (one re-entrant lock per store instance).

Knows checkpoints through :mod:`.codec` only; nothing about engines or models.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ...core.checkpoint import Checkpoint, CorruptCheckpoint
from .codec import CheckpointKey, EntryLimits, ForeignCheckpoint, blob_nbytes, encode_checkpoint, entry_nbytes

MAX_TOMBSTONES = 4096
QUARANTINED = "quarantined"

log = logging.getLogger(__name__)

# what a damaged stored entry can raise while it is parsed (the decode guard turns these into CorruptCheckpoint)
DECODE_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RecursionError)


def host_memory_bytes() -> int | None:
    """Physical memory of this host in bytes (None when the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


class CheckpointMissing(KeyError):
    """No entry under the key; ``reason`` says why (evicted, never stored, too large, expired)."""

    def __init__(self, key: CheckpointKey, reason: str):
        super().__init__(reason)
        self.key, self.reason = key, reason

    def __str__(self) -> str:
        return self.reason


class StoreUnavailable(RuntimeError):
    """The tier cannot be reached (Redis down, disk unreadable); callers fall back to exact recomputation."""


@dataclass(frozen=True, kw_only=True)
class PutResult:
    """What a ``put`` did.

    Attributes:
        stored: False when the checkpoint alone exceeds the budget (nothing is kept under the key).
        nbytes: blob bytes of the entry.
        evicted: keys evicted to make room, oldest first.
        reason: why it was not stored, or None.
    """

    stored: bool
    nbytes: int
    evicted: tuple[CheckpointKey, ...] = ()
    reason: str | None = None


@dataclass
class StoreStats:
    """Counters of one store instance (not shared across processes)."""

    puts: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    evictions: int = 0
    refused: int = 0
    quarantined: int = 0
    evicted_keys: list[CheckpointKey] = field(default_factory=list)


class KVStore(ABC):
    """A tier of KV checkpoints of one deployment.

    Args:
        deployment: the namespace; keys of other deployments are refused with ``ValueError``.
        budget_bytes: blob bytes the tier may hold (None: unbounded).

    Raises:
        ValueError: a negative budget or an empty deployment name.
    """

    tier = "abstract"
    _suspect = None  # what a tier's _read judged last (its _quarantine spares an entry replaced since)

    def __init__(self, *, deployment: str = "default", budget_bytes: int | None = None):
        if not deployment:
            raise ValueError("deployment must be a non-empty name")
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0 or None, got {budget_bytes}")
        self.deployment = str(deployment)
        self.budget_bytes = budget_bytes
        self.stats = StoreStats()
        self._lock = threading.RLock()
        self._lru: OrderedDict[CheckpointKey, int] = OrderedDict()  # oldest first
        self._tombs: OrderedDict[str, str] = OrderedDict()
        self._limits: EntryLimits | None = None  # of the get in progress (under the lock)
        self._host_memory = host_memory_bytes()

    # ---------------------------------------------------------------- public API

    def key_for(self, ckpt: Checkpoint, *, thread_id: str, version: int, checkpoint_ns: str = "") -> CheckpointKey:
        """The key of ``ckpt`` as ``version`` of ``thread_id`` in this store's deployment."""
        return CheckpointKey.of(ckpt, deployment=self.deployment, thread_id=thread_id, version=version,
                                checkpoint_ns=checkpoint_ns)

    def check_key(self, key: CheckpointKey) -> None:
        """Refuse a key this store cannot hold.

        Raises:
            TypeError: not a :class:`CheckpointKey`.
            ValueError: a key of another deployment (build it with :meth:`key_for`).
        """
        if not isinstance(key, CheckpointKey):
            raise TypeError(f"expected a CheckpointKey, got {type(key).__name__}; build one with store.key_for(...)")
        if key.deployment != self.deployment:
            raise ValueError(f"key of deployment {key.deployment!r} passed to the {self.tier} store of deployment "
                             f"{self.deployment!r}; open a store for that deployment or build the key with "
                             "store.key_for(...)")

    def put(self, key: CheckpointKey, ckpt: Checkpoint) -> PutResult:
        """Store ``ckpt`` under ``key`` (replacing an entry of the same key), then evict beyond the budget.

        Args:
            key: from :meth:`key_for`.
            ckpt: the checkpoint (the memory tier keeps a reference: do not mutate it afterwards).

        Returns:
            A :class:`PutResult` (``stored`` False when the checkpoint alone exceeds the budget).

        Raises:
            ValueError: ``key`` is of another deployment or does not describe ``ckpt``.
            StoreUnavailable: the tier cannot be reached.
        """
        self.check_key(key)
        meta, blobs = encode_checkpoint(ckpt, key)
        n = blob_nbytes(meta)
        with self._lock:
            if self.budget_bytes is not None and n > self.budget_bytes:
                reason = f"not stored: {n} B exceed the {self.tier} budget of {self.budget_bytes} B"
                if self._index_get(key) is not None:
                    self._drop(key)
                self._tomb_put(key, reason)
                self.stats.refused += 1
                return PutResult(stored=False, nbytes=n, reason=reason)
            self._write(key, meta, blobs, ckpt)
            self._index_put(key, n)
            self._tomb_pop(key)
            self.stats.puts += 1
            evicted = self._evict(keep=key)
        return PutResult(stored=True, nbytes=n, evicted=tuple(evicted))

    def get(self, key: CheckpointKey, *, limits: EntryLimits | None = None) -> Checkpoint:
        """The checkpoint under ``key``, verified.

        Args:
            key: from :meth:`key_for`.
            limits: what the requesting model can need (``EntryLimits.of(engine.spec)``); an entry of
                another shape is refused before its blobs are read (None: any shape, still bounded by the
                budget and this host's memory).

        Returns:
            The checkpoint (fresh tensors, or the held one in the memory tier).

        Raises:
            CheckpointMissing: no entry (``reason`` says why).
            CorruptCheckpoint: damaged bytes (``ForeignCheckpoint``: another key's content), a declared size
                over the budget or this host's memory, a shape that does not fit ``limits``, or a
                ``MemoryError`` while it was read; the entry is quarantined.
            StoreUnavailable: the tier cannot be reached.
            ValueError: a key of another deployment.
        """
        self.check_key(key)
        with self._lock:
            if self._index_get(key) is None:
                self.stats.misses += 1
                raise CheckpointMissing(key, self._tomb_get(key) or
                                        f"no checkpoint of {key.describe()} in the {self.tier} store "
                                        "(never stored, deleted, or expired)")
            self._index_touch(key)
            self._limits = limits
            try:
                try:
                    ckpt = self._read(key)
                    if limits is not None:  # a tier that holds checkpoints (or does not call _admit)
                        limits.check_checkpoint(ckpt, key.describe())
                except (CheckpointMissing, CorruptCheckpoint, StoreUnavailable):
                    raise
                except MemoryError:  # declared sizes beyond what this process can hold: never raised out
                    raise CorruptCheckpoint(f"entry of {key.describe()} cannot be read: it needs more memory "
                                            "than this process has (declared sizes out of range)") from None
                except DECODE_ERRORS as e:  # a stored-entry parse error the tier did not name: damage
                    raise CorruptCheckpoint(f"entry of {key.describe()} cannot be read: {type(e).__name__}: "
                                            f"{str(e)[:200]}") from None
                finally:
                    self._limits = None
            except CheckpointMissing:
                self.stats.misses += 1
                raise
            except CorruptCheckpoint as e:
                self.stats.corrupt += 1
                self.quarantine(key, str(e), foreign=isinstance(e, ForeignCheckpoint))
                raise
            self.stats.hits += 1
            return ckpt

    def contains(self, key: CheckpointKey) -> bool:
        """Whether an entry is stored under ``key`` (its bytes are not verified here)."""
        self.check_key(key)
        with self._lock:
            return self._index_get(key) is not None

    __contains__ = contains

    def delete(self, key: CheckpointKey) -> bool:
        """Remove the entry under ``key``; returns whether there was one."""
        self.check_key(key)
        with self._lock:
            if self._index_get(key) is None:
                return False
            self._drop(key)
            self._tomb_put(key, f"checkpoint of {key.describe()} was deleted")
            return True

    def quarantine(self, key: CheckpointKey, reason: str, *, foreign: bool = False) -> None:
        """Take a damaged or foreign entry out of service: remove it (the disk tier moves it aside), count it,
        and record ``reason`` for the next lookup. Never raises for an unreachable tier (logged, one line)."""
        with self._lock:
            try:
                if self._quarantine(key, reason) is False:
                    return  # another writer replaced the entry since it was read: the new one stays
                self.stats.quarantined += 1
                self._index_pop(key)
                self._tomb_put(key, f"checkpoint of {key.describe()} was {QUARANTINED} as "
                                    f"{'foreign' if foreign else 'corrupt'} ({reason[:300]})")
            except StoreUnavailable as e:
                log.warning("could not quarantine %s in the %s store: %s", key.describe(), self.tier,
                            str(e).splitlines()[0][:300])

    def nbytes(self) -> int:
        """Blob bytes held (what the budget counts)."""
        with self._lock:
            return sum(n for _, n in self._index_items())

    def keys(self) -> list[CheckpointKey]:
        """Keys held, least recently used first."""
        with self._lock:
            return [k for k, _ in self._index_items()]

    def why_missing(self, key: CheckpointKey) -> str | None:
        """The recorded reason ``key`` is gone (evicted, deleted, too large), or None."""
        with self._lock:
            return self._tomb_get(key)

    def summary(self) -> dict[str, Any]:
        """Tier, entries, bytes, budget and this instance's counters."""
        s = self.stats
        return {"tier": self.tier, "deployment": self.deployment, "entries": len(self.keys()),
                "nbytes": self.nbytes(), "budget_bytes": self.budget_bytes, "puts": s.puts, "hits": s.hits,
                "misses": s.misses, "corrupt": s.corrupt, "quarantined": s.quarantined, "evictions": s.evictions,
                "refused": s.refused}

    def close(self) -> None:
        """Release connections or files (the entries stay in persistent tiers)."""

    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- eviction

    def _evict(self, keep: CheckpointKey) -> list[CheckpointKey]:
        if self.budget_bytes is None:
            return []
        evicted = []
        items = []
        for k, n in self._index_items():
            over = None if k == keep else self._oversize(n)
            if over:  # impossible or planted: taken out, never paid for by evicting valid entries
                self.stats.corrupt += 1
                self._suspect = None  # judged by its index record, not by a read of this instance
                self.quarantine(k, f"its size record {over}")
            else:
                items.append((k, n))
        total = sum(n for _, n in items)
        for k, n in items:
            if total <= self.budget_bytes:
                break
            if k == keep:
                continue
            # the reason first, then the removal, then the count: a tier that fails half-way (Redis gone
            # mid-eviction) never leaves an entry removed without a record of why
            self._tomb_put(k, f"checkpoint of {k.describe()} was evicted from the {self.tier} store "
                              f"(least recently used, budget {self.budget_bytes} B)")
            self._on_evict(k)
            self._drop(k)
            total -= n
            evicted.append(k)
            self.stats.evictions += 1
            self.stats.evicted_keys.append(k)
            del self.stats.evicted_keys[:-MAX_TOMBSTONES]
        return evicted

    def _oversize(self, nbytes: int) -> str | None:
        """Why an entry of ``nbytes`` blob bytes cannot be genuine here (over the whole budget, which no
        ``put`` stores, or over this host's memory), or None."""
        if self.budget_bytes is not None and nbytes > self.budget_bytes:
            return (f"declares {nbytes} B, more than the {self.tier} store's whole budget of {self.budget_bytes} B "
                    "(no put stores that)")
        if self._host_memory is not None and nbytes > self._host_memory:
            return f"declares {nbytes} B, more than this host's memory ({self._host_memory} B)"
        return None

    def _admit(self, meta: Mapping[str, Any], key: CheckpointKey) -> int:
        """For a tier's ``_read``: the verified size of an entry whose metadata ``check_meta`` accepted, after
        checking it against the budget, this host's memory and the requesting model (the ``limits`` of the
        ``get`` in progress), before any blob is read or allocated.

        Raises:
            CorruptCheckpoint: it does not fit (the entry is then quarantined by ``get``).
        """
        n = entry_nbytes(meta)
        if self._limits is not None:
            self._limits.check_meta(meta, key.describe())
        over = self._oversize(n)
        if over:
            raise CorruptCheckpoint(f"the entry of {key.describe()} {over}")
        return n

    def _drop(self, key: CheckpointKey) -> None:
        self._remove(key)
        self._index_pop(key)

    def _on_evict(self, key: CheckpointKey) -> None:
        """Called under the lock before ``key`` is evicted (the memory tier spills here)."""

    # ---------------------------------------------------------------- tier hooks

    @abstractmethod
    def _write(self, key: CheckpointKey, meta: dict[str, Any], blobs: Mapping[str, np.ndarray],
               ckpt: Checkpoint) -> None:
        """Publish the entry atomically (replacing one of the same key)."""

    @abstractmethod
    def _read(self, key: CheckpointKey) -> Checkpoint:
        """Read and verify the entry (raise CheckpointMissing if it vanished meanwhile)."""

    @abstractmethod
    def _remove(self, key: CheckpointKey) -> None:
        """Remove the entry's data (idempotent)."""

    def _quarantine(self, key: CheckpointKey, reason: str) -> bool:
        """Take a damaged entry's data out of service (default: remove it); False when the tier found it
        replaced by another writer since it was read (nothing removed)."""
        self._remove(key)
        return True

    # bookkeeping: in-process by default; a shared tier overrides all of these.

    def _index_get(self, key: CheckpointKey) -> int | None:
        return self._lru.get(key)

    def _index_put(self, key: CheckpointKey, nbytes: int) -> None:
        self._lru[key] = nbytes
        self._lru.move_to_end(key)

    def _index_touch(self, key: CheckpointKey) -> None:
        self._lru.move_to_end(key)

    def _index_pop(self, key: CheckpointKey) -> None:
        self._lru.pop(key, None)

    def _index_items(self) -> list[tuple[CheckpointKey, int]]:
        return list(self._lru.items())

    def _tomb_put(self, key: CheckpointKey, reason: str) -> None:
        self._tombs[key.digest] = reason
        self._tombs.move_to_end(key.digest)
        while len(self._tombs) > MAX_TOMBSTONES:
            self._tombs.popitem(last=False)

    def _tomb_get(self, key: CheckpointKey) -> str | None:
        return self._tombs.get(key.digest)

    def _tomb_pop(self, key: CheckpointKey) -> None:
        self._tombs.pop(key.digest, None)

"""KV checkpoint stores: one abstract interface, three tiers, and a resume that falls back safely.

- :class:`KVStore`: put / get / contains / delete / nbytes / keys, a byte budget with LRU eviction
  over verified sizes, every byte read back verified (metadata included) and broken entries
  quarantined, one lock per instance (``base``).
- :class:`MemoryStore` (in-process, the default; can spill evictions to another tier),
  :class:`DiskStore` (one file per entry swapped in by one rename, crash recovery on open, survives
  restarts, shared by processes on one host),
  :class:`RedisStore` (shared by worker processes; needs ``pip install 'patchkv-agent[redis]'``).
- :class:`CheckpointKey`: (deployment, thread, namespace, version, model fingerprint, token-ids hash);
  an entry is only ever returned for the exact key it was stored under (``codec``); :class:`EntryLimits`:
  what the requesting model can need, checked before an entry's blobs are read (``get(key, limits=...)``).
- :func:`resume_from_store`: selective recovery from the stored checkpoint, or the exact result with
  ``stats["fallback"]`` saying why (``resume``).

Knows checkpoints and the engine's public ``resume``; nothing about LangGraph.
"""

from __future__ import annotations

from ...core.checkpoint import CorruptCheckpoint
from .base import CheckpointMissing, KVStore, PutResult, StoreUnavailable
from .codec import CheckpointKey, EntryLimits, ForeignCheckpoint, decode_checkpoint, encode_checkpoint, ids_hash
from .disk import DiskStore
from .memory import MemoryStore
from .resume import load_for_resume, resume_from_store


def __getattr__(name: str):
    if name == "RedisStore":  # lazy: redis-py is an optional dependency
        from .redis_tier import RedisStore

        return RedisStore
    raise AttributeError(f"module 'patchkv_agent.runtime.kvstore' has no attribute {name!r}")


__all__ = ["KVStore", "MemoryStore", "DiskStore", "RedisStore", "CheckpointKey", "EntryLimits", "PutResult",
           "CheckpointMissing",
           "CorruptCheckpoint", "ForeignCheckpoint", "StoreUnavailable", "encode_checkpoint", "decode_checkpoint",
           "ids_hash", "load_for_resume", "resume_from_store"]

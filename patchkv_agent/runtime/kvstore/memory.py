"""The in-process CPU tier (the default): checkpoints held by reference, checksums verified on every read.

No copy is made: the entry is the immutable :class:`~patchkv_agent.core.checkpoint.Checkpoint` itself plus the
checksums of its bytes taken at ``put``; ``get`` re-hashes the tensors in place, so a byte changed
after publication (a stray in-place write, bad RAM) is refused instead of served. Entries evicted by
the budget can spill to another tier (typically a :class:`~.disk.DiskStore`), where ``get`` finds them.

Knows the abstract store; nothing about files, Redis or engines.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from ...core.checkpoint import Checkpoint
from .base import CheckpointMissing, KVStore, StoreUnavailable
from .codec import CheckpointKey, EntryLimits, verify_blobs

log = logging.getLogger(__name__)


class MemoryStore(KVStore):
    """Checkpoints in this process's memory.

    Args:
        deployment: the namespace.
        budget_bytes: blob bytes held at most (None: unbounded).
        spill: a store of the same deployment that takes evicted entries (None: evicted entries are dropped).
        verify: re-check checksums on every ``get`` (xxh3, a few GB/s).

    Raises:
        ValueError: ``spill`` belongs to another deployment.
    """

    tier = "memory"

    def __init__(self, *, deployment: str = "default", budget_bytes: int | None = None,
                 spill: KVStore | None = None, verify: bool = True):
        super().__init__(deployment=deployment, budget_bytes=budget_bytes)
        if spill is not None and spill.deployment != self.deployment:
            raise ValueError(f"spill store is of deployment {spill.deployment!r}, not {self.deployment!r}")
        self.spill = spill
        self.verify = verify
        self._entries: dict[CheckpointKey, tuple[Checkpoint, dict[str, Any], Mapping[str, np.ndarray]]] = {}

    def get(self, key: CheckpointKey, *, limits: EntryLimits | None = None) -> Checkpoint:
        """As :meth:`KVStore.get`; an entry spilled by eviction is read from the spill tier.

        Args:
            key: from :meth:`key_for`.
            limits: what the requesting model can need (passed on to the spill tier too).

        Returns:
            The held checkpoint (checksums re-verified), or the spill tier's copy.

        Raises:
            CheckpointMissing, CorruptCheckpoint, StoreUnavailable, ValueError: as :meth:`KVStore.get`.
        """
        try:
            return super().get(key, limits=limits)
        except CheckpointMissing as e:
            if self.spill is None:
                raise
            try:
                return self.spill.get(key, limits=limits)
            except CheckpointMissing as e2:
                raise CheckpointMissing(key, f"{e.reason}; {self.spill.tier} tier: {e2.reason}") from None

    def contains(self, key: CheckpointKey) -> bool:
        return super().contains(key) or (self.spill is not None and self.spill.contains(key))

    __contains__ = contains

    def _write(self, key, meta, blobs, ckpt) -> None:
        self._entries[key] = (ckpt, meta, blobs)

    def _read(self, key) -> Checkpoint:
        ckpt, meta, blobs = self._entries[key]
        if self.verify:
            verify_blobs(meta, blobs, key)
        return ckpt

    def _remove(self, key) -> None:
        self._entries.pop(key, None)

    def _on_evict(self, key) -> None:
        if self.spill is None:
            return
        try:
            self.spill.put(key, self._entries[key][0])
        except StoreUnavailable as e:  # the entry is lost; the tombstone says it was evicted
            log.warning("spill of %s to the %s tier failed: %s", key.describe(), self.spill.tier,
                        str(e).splitlines()[0][:300])

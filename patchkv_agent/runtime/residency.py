"""Where a registry's KV lives beyond the resident version: its store entries and the byte budgets.

:class:`ResidencyMixin` holds the :class:`~patchkv_agent.runtime.threads.ThreadRegistry` methods that put a
thread's checkpoint into the store (one entry per thread: a new one replaces the old), delete superseded
entries off the resume path, and evict least recently used threads beyond the resident and offload
budgets (an eviction offloads or drops the resident KV, and drops a thread's preparation; a dropped
version's next resume is exact and says why).

Boundary: mixed into the registry (uses its tables, locks, worker and store); knows the store interface
and the thread records, not the engine's resume.
"""

from __future__ import annotations

import logging
from typing import Iterator

from ..core.fallback import Fallback, FallbackKind
from ..results import BaseKind
from .keys import ThreadKey
from .kvstore import CheckpointKey, StoreUnavailable
from .lifecycle import checked
from .state import ThreadState, kv_bytes

log = logging.getLogger(__name__)

__all__ = ["ResidencyMixin"]


class ResidencyMixin:
    """The store and budget methods of :class:`~patchkv_agent.runtime.threads.ThreadRegistry` (see the module
    docstring); not used on its own."""

    def _set_store_entry(self, th: ThreadState, key: CheckpointKey | None, version: int = 0,
                         source: BaseKind | None = None) -> None:
        """Make ``key`` the thread's store entry (caller holds ``th.lock``); its previous entry is deleted."""
        old = th.store_key
        th.store_key, th.store_version, th.store_source = key, version, source
        if old is not None and old != key:
            self._delete_quietly(old)

    def _put_store(self, th: ThreadState, ckpt, version: int, source: BaseKind | None) -> None:
        """Put ``ckpt`` as ``version`` of ``th`` into the store (caller holds ``th.lock``).

        Not stored (larger than the whole budget, tier unreachable): the thread has no KV and its next
        resume is exact, saying why.
        """
        key = self.store.key_for(ckpt, thread_id=th.key[0], version=version, checkpoint_ns=th.key[1])
        try:
            put = self.store.put(key, ckpt)
            reason = put.reason
        except StoreUnavailable as e:
            put, reason = None, f"store unavailable: {e}"
        if put is not None and put.stored:
            self._set_store_entry(th, key, version, source)
            if put.evicted:
                self.events.append({"event": "store_evict", "key": th.key, "version": version,
                                    "evicted": [(k.thread_id, k.checkpoint_ns, k.version) for k in put.evicted]})
        else:
            self._set_store_entry(th, None)
            th.lost = Fallback(FallbackKind.STORE_REFUSED, f"checkpoint of context version {version} was not kept "
                               f"by the {self.store.tier} store ({reason})")
            self.events.append({"event": "store_refused", "key": th.key, "version": version, "reason": reason})

    def _delete_quietly(self, key: CheckpointKey) -> None:
        try:
            self.store.delete(key)
        except StoreUnavailable as e:  # the tier's budget or expiry removes it eventually; one line, no traceback
            log.warning("could not delete %s from the %s store: %s", key.describe(), self.store.tier,
                        str(e).splitlines()[0][:300])

    def _submit_delete(self, key: CheckpointKey) -> None:
        try:
            self._executor.submit(self._delete_quietly, key)
        except RuntimeError:  # the worker is shut down (close()): delete here
            self._delete_quietly(key)


    def _victims(self, keep: ThreadKey) -> Iterator[ThreadState]:
        with self._lock:
            order = [t for k, t in self._threads.items() if k != keep]
        yield from order

    def _enforce_resident_budget(self, keep: ThreadKey) -> None:
        """Evict least recently used resident KV (other than ``keep``'s) beyond the budget: offloads are
        queued on the background worker, drops take effect at once."""
        total = self.resident_bytes()
        for th in self._victims(keep):
            if total <= self.resident_budget_bytes:
                break
            if th.resident is None or not th.lock.acquire(blocking=False):
                continue
            try:
                with checked(th, "evict"):
                    if th.resident is None or th.streams or (th.pending is not None and not th.pending.done()):
                        continue
                    total -= kv_bytes(th.resident)
                    prep, th.preparation = th.preparation, None
                    if prep is not None:
                        prep.stop.set()
                        if prep.result is not None:
                            total -= kv_bytes(prep.result)
                    if self.on_evict == "offload":
                        th.pending = self._submit_offload(th, BaseKind.EVICTED)
                        self.events.append({"event": "evict_offload", "key": th.key, "version": th.version})
                    else:
                        th.lost = Fallback(FallbackKind.EVICTED, f"resident KV of context version {th.version} was "
                                           f"evicted (resident budget {self.resident_budget_bytes} B) without an "
                                           "offload")
                        th.resident, th.checkpoint = None, None
                        self.events.append({"event": "evict_drop", "key": th.key, "version": th.version})
            finally:
                th.lock.release()

    def _enforce_offload_budget(self, keep: ThreadKey) -> None:
        if self.offload_budget_bytes is None:
            return
        for th in self._victims(keep):
            if self.offloaded_bytes() <= self.offload_budget_bytes:
                return
            if th.checkpoint is None or not th.lock.acquire(blocking=False):
                continue
            try:
                with checked(th, "drop checkpoint"):
                    if th.checkpoint is None:
                        continue
                    if th.resident is None and th.checkpoint_version == th.version:
                        th.lost = Fallback(FallbackKind.BUDGET_DROPPED, f"checkpoint of context version "
                                           f"{th.version} was dropped (offload budget {self.offload_budget_bytes} B)")
                    self.events.append({"event": "drop_checkpoint", "key": th.key, "version": th.checkpoint_version})
                    th.checkpoint = None
            finally:
                th.lock.release()

"""Where a registry's KV lives beyond the resident version, and the background jobs that move it there.

A :class:`Residency` owns the registry's background worker (a thread pool) and what runs on it for the KV:

- *offloads* (:meth:`Residency.offload`): a thread's resident KV written as a
  :class:`~patchkv_agent.core.checkpoint.Checkpoint` (``engine.checkpoint_from``: quantization and copies, no
  forward, so outside the forward lock), held in this process or put into the store (one entry per thread: a new
  one replaces the old); installed only if the thread still holds the version it was written from;
- *heals*: an offload of a selective resume's version first recomputes its approximate rows exactly
  (``engine.heal``, one forward under the forward lock, while the agent's tool runs and the model is idle) and
  installs the exact KV as the thread's resident state, so an approximation never outlives the call it sped up;
  the job owns its heal event, which a resume waits on (:meth:`Residency.wait_heal`);
- *store deletes* of superseded entries, off the resume path;
- the *byte budgets*: least recently used threads beyond the resident budget are evicted (offloaded, or dropped
  with the reason recorded for the next resume; never a thread with an open stream or a pending job), and
  checkpoints beyond the offload budget dropped.

The preparation's compute stage (:mod:`.preparation`) runs on the same worker (:attr:`Residency.worker`).

Boundary: the thread records (through :mod:`.lifecycle`'s checked transitions), the table, the store interface
and the engine's ``heal`` / ``checkpoint_from``; not the resume.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..core.fallback import Fallback, FallbackKind
from ..results import BaseKind
from .keys import ThreadKey
from .kvstore import CheckpointKey, KVStore, StoreUnavailable
from .lifecycle import checked, is_offloaded, transition
from .state import ThreadState, kv_bytes
from .table import ThreadTable

log = logging.getLogger(__name__)

__all__ = ["Residency"]


class Residency:
    """The offload worker, the store entries and the byte budgets of one registry (see the module docstring).

    Args:
        engine: the :class:`~patchkv_agent.engine.PatchKVEngine`.
        table: the registry's :class:`~patchkv_agent.runtime.table.ThreadTable`.
        events: the registry's event list (evictions, drops, heals, discarded offloads are appended).
        store: the tier offloaded checkpoints go to (None: held in this process).
        resident_budget_bytes: resident K/V held across all threads.
        offload_budget_bytes: offloaded checkpoint bytes held in this process (None: unlimited).
        on_evict: ``"offload"`` or ``"drop"``.
        heal: recompute a selective resume's approximate rows in its offload.
        workers: background worker threads.

    Attributes:
        worker: the thread pool the jobs run on (offloads, heals, store deletes, preparations' compute).
    """

    def __init__(self, engine: Any, table: ThreadTable, events: list[dict[str, Any]], *, store: KVStore | None,
                 resident_budget_bytes: int, offload_budget_bytes: int | None, on_evict: str, heal: bool,
                 workers: int) -> None:
        self.engine, self.table, self.events, self.store = engine, table, events, store
        self.resident_budget_bytes, self.offload_budget_bytes = resident_budget_bytes, offload_budget_bytes
        self.on_evict, self.heal = on_evict, heal
        self.worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="patchkv-offload")

    def close(self) -> None:
        """Finish the queued jobs and stop the worker."""
        self.worker.shutdown(wait=True)

    # --------------------------------------------------------------- offload

    def offload(self, th: ThreadState, release: bool = False) -> Future | None:
        """Start writing ``th``'s resident KV in the worker (see
        :meth:`ThreadRegistry.offload_async <patchkv_agent.runtime.threads.ThreadRegistry.offload_async>`).

        Returns:
            The pending (or finished) offload's future, or None when nothing was started.
        """
        with transition(th, "offload"):
            if th.pending is not None and not th.pending.done():
                return th.pending
            if th.resident is None:
                return None
            if is_offloaded(th):  # this version's KV is written already: nothing to write again
                if release:
                    th.resident = None
                return th.pending
            th.pending = self.submit_offload(th, BaseKind.BACKGROUND, release)
            return th.pending

    def submit_offload(self, th: ThreadState, source: BaseKind, release: bool = False) -> Future:
        """Queue an offload job of ``th``'s current version (caller holds ``th.lock``). The job owns its heal
        event (set once its heal stage is over; None: nothing to heal): a job that runs late, after its
        thread moved on, sets only its own event, never the one a newer job's resume is waiting on."""
        prep = th.preparation
        preparing = prep is not None and prep.version == th.version  # it recomputes what the next call uses
        healing = (threading.Event() if self.heal and not preparing and th.resident is not None
                   and th.resident.approx_rows else None)
        th.healing = healing
        return self.worker.submit(self._offload_job, th, th.version, source, release, healing)

    def wait_heal(self, th: ThreadState) -> float:
        """Wait until the heal stage of ``th``'s pending job is over (a resume wants the exact base); returns
        the seconds waited."""
        with th.lock:
            evt, fut = th.healing, th.pending
        if evt is None or evt.is_set() or fut is None or fut.done():
            return 0.0
        t0 = time.perf_counter()
        while not evt.wait(0.05):
            if fut.done():  # the job ended (or failed) before its heal stage: nothing to wait for
                break
        return time.perf_counter() - t0

    def wait_pending(self, th: ThreadState) -> float:
        """Wait for ``th``'s pending offload (a failure is logged: the job recorded it); returns the seconds
        waited."""
        fut = th.pending
        if fut is None or fut.done():
            return 0.0
        t0 = time.perf_counter()
        try:
            fut.result()
        except Exception:  # the job recorded the failure in th.lost / kept the resident KV
            log.exception("background offload of thread %s failed", th.key)
        return time.perf_counter() - t0

    def _offload_job(self, th: ThreadState, version: int, source: BaseKind, release: bool = False,
                     healing: threading.Event | None = None) -> float | None:
        """Write ``version``'s resident KV as a checkpoint: a snapshot under the thread lock, the checkpoint
        (quantization, copies; no forward, so no forward lock) outside it, then installed only if the
        thread still holds that state. ``"evicted"`` (and ``release``) offloads then drop the resident KV;
        the others keep it (the next resume uses it), the checkpoint serving restarts, other processes and
        eviction."""
        with th.lock:
            if th.version != version or th.resident is None:
                if healing is not None:
                    healing.set()
                return None
            snap = th.resident
        t0 = time.perf_counter()
        if healing is not None:
            try:
                if snap.approx_rows:  # recompute the approximate rows while the model is idle (a tool runs)
                    healed = self.engine.heal(snap)
                    with transition(th, "heal"):
                        if th.version == version and th.resident is snap:
                            th.resident = snap = healed
                            th.heal_stats = (healed.stats.heal_s, healed.stats.healed_rows)
                            self.events.append({"event": "heal", "key": th.key, "version": version,
                                                "rows": healed.stats.healed_rows, "heal_s": healed.stats.heal_s})
            finally:
                healing.set()
            with th.lock:
                if th.version != version or th.resident is not snap:
                    self.events.append({"event": "offload_discarded", "key": th.key, "version": version})
                    return None
        ckpt = self.engine.checkpoint_from(snap)
        with transition(th, "offload: install"):
            if th.version != version or th.resident is not snap:  # the thread moved on: nothing to install
                self.events.append({"event": "offload_discarded", "key": th.key, "version": version})
                return None
            if self.store is None:
                th.checkpoint, th.checkpoint_version, th.checkpoint_source = ckpt, version, source
            else:
                self.put_store(th, ckpt, version, source)
            if source == BaseKind.EVICTED or release:
                th.resident = None
            dt = time.perf_counter() - t0
        self.enforce_offload_budget(keep=th.key)
        return dt

    # ----------------------------------------------------------------- store

    def set_store_entry(self, th: ThreadState, key: CheckpointKey | None, version: int = 0,
                        source: BaseKind | None = None) -> None:
        """Make ``key`` the thread's store entry (caller holds ``th.lock``); its previous entry is deleted."""
        old = th.store_key
        th.store_key, th.store_version, th.store_source = key, version, source
        if old is not None and old != key:
            self._delete_quietly(old)

    def put_store(self, th: ThreadState, ckpt, version: int, source: BaseKind | None) -> None:
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
            self.set_store_entry(th, key, version, source)
            if put.evicted:
                self.events.append({"event": "store_evict", "key": th.key, "version": version,
                                    "evicted": [(k.thread_id, k.checkpoint_ns, k.version) for k in put.evicted]})
        else:
            self.set_store_entry(th, None)
            th.lost = Fallback(FallbackKind.STORE_REFUSED, f"checkpoint of context version {version} was not kept "
                               f"by the {self.store.tier} store ({reason})")
            self.events.append({"event": "store_refused", "key": th.key, "version": version, "reason": reason})

    def find_stored(self, key: ThreadKey, version: int, ids: set[str]) -> tuple[CheckpointKey | None, str]:
        """The store's most recently used entry of ``version`` of thread ``key`` written by this model for
        tokens hashing to one of ``ids``, or ``(None, why not)``: an entry of other tokens under that thread
        and version (planted, or left by another writer) is never picked."""
        if self.store is None:
            return None, ""
        try:
            keys = self.store.keys()
        except StoreUnavailable as e:  # one line, no traceback: the resume says so anyway
            log.warning("store unavailable while looking up thread %s version %d: %s", key, version,
                        str(e).splitlines()[0][:300])
            return None, f"; the {self.store.tier} store was unreachable"
        fp = self.engine.spec.fingerprint
        hits = [k for k in keys if (k.thread_id, k.checkpoint_ns, k.version, k.fingerprint) == (*key, version, fp)]
        bound = [k for k in hits if k.ids_hash in ids]
        if bound:
            return bound[-1], ""
        if hits:
            return None, (f"; the {self.store.tier} store's entry of that version holds other tokens "
                          f"(ids {hits[-1].ids_hash}), so it is not used")
        return None, f"; the {self.store.tier} store holds no checkpoint of it either"

    def _delete_quietly(self, key: CheckpointKey) -> None:
        try:
            self.store.delete(key)
        except StoreUnavailable as e:  # the tier's budget or expiry removes it eventually; one line, no traceback
            log.warning("could not delete %s from the %s store: %s", key.describe(), self.store.tier,
                        str(e).splitlines()[0][:300])

    def submit_delete(self, key: CheckpointKey) -> None:
        """Delete a superseded store entry in the worker (here, once the worker is shut down)."""
        try:
            self.worker.submit(self._delete_quietly, key)
        except RuntimeError:  # the worker is shut down (close()): delete here
            self._delete_quietly(key)

    # --------------------------------------------------------------- budgets

    def enforce_resident_budget(self, keep: ThreadKey) -> None:
        """Evict least recently used resident KV (other than ``keep``'s) beyond the budget: offloads are
        queued on the background worker, drops take effect at once."""
        total = self.table.resident_bytes()
        for th in self.table.others(keep):
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
                        th.pending = self.submit_offload(th, BaseKind.EVICTED)
                        self.events.append({"event": "evict_offload", "key": th.key, "version": th.version})
                    else:
                        th.lost = Fallback(FallbackKind.EVICTED, f"resident KV of context version {th.version} was "
                                           f"evicted (resident budget {self.resident_budget_bytes} B) without an "
                                           "offload")
                        th.resident, th.checkpoint = None, None
                        self.events.append({"event": "evict_drop", "key": th.key, "version": th.version})
            finally:
                th.lock.release()

    def enforce_offload_budget(self, keep: ThreadKey) -> None:
        """Drop least recently used checkpoints (other than ``keep``'s) beyond the offload budget."""
        if self.offload_budget_bytes is None:
            return
        for th in self.table.others(keep):
            if self.table.offloaded_bytes() <= self.offload_budget_bytes:
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

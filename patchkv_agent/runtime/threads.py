"""Per-thread context versions and their KV: resident after decode, offloaded while the thread waits.

A :class:`ThreadRegistry` holds, for every thread key (``thread_id``, ``checkpoint_ns``), the thread's current
context version (token ids, a monotone version number) and the KV of that version in one of two places:

- *resident*: the last resume's K/V (what a decode leaves on the accelerator), or
- *offloaded*: a :class:`~patchkv_agent.core.checkpoint.Checkpoint` written by ``engine.checkpoint_from``, which
  can run in a background worker while the agent waits for a tool (:meth:`ThreadRegistry.offload_async`);
  held in this process, or, with ``store=``, put into a :class:`~patchkv_agent.runtime.kvstore.KVStore` tier
  (memory, disk, Redis) under a :class:`~patchkv_agent.runtime.kvstore.CheckpointKey` (deployment, thread,
  namespace, version, model fingerprint, token-ids hash), where the tier's byte budget and LRU eviction
  apply. A resume from the tier goes through :func:`~patchkv_agent.runtime.kvstore.resume_from_store`: an
  evicted, corrupt or missing entry gives the exact result with ``stats["fallback"]`` saying why. A thread
  keeps one entry (its latest offloaded version); a registry opened on a persistent tier after a restart
  finds it again through :meth:`ThreadRegistry.expect`.

:meth:`ThreadRegistry.stream` / :meth:`ThreadRegistry.generate` resume a thread's next version: no KV -> ``exact``
(and, when the KV existed once but is gone, ``stats["fallback"]`` says why); KV -> ``engine.resume(checkpoint, ids,
strategy)``. A thread whose KV is still resident resumes from it directly
(:meth:`~patchkv_agent.engine.PatchKVEngine.as_checkpoint`: full precision, the statistics its last resume took),
never waiting for an offload: an offload exists for memory pressure, other processes and restarts, not for the next
call of a live thread, so a pending one finishes later for those (or is discarded when the thread has moved on).
Resident KV beyond ``resident_budget_bytes`` is evicted least-recently-used first (never a thread with an open
stream): offloaded, or dropped with the reason recorded for the next resume. An offload needs no forward (the
statistics come from the resume), so it runs outside the forward lock and never delays another thread's resume.

*Healing* (``heal=True``, the default): a selective resume leaves approximate rows (restored ones, and every row
computed while they were in view). Carried forward, they would shape every later call of the thread. So an offload
first recomputes those rows exactly (:meth:`~patchkv_agent.engine.PatchKVEngine.heal`, one forward under the forward
lock, while the agent's tool runs and the model is idle), installs the exact KV as the thread's resident state and
checkpoints that: an approximation never outlives the call it sped up. A resume that arrives while its thread is
healing waits for the heal (``heal_wait_s``).

*Several contexts per thread* (``contexts=4``): a summarizer, a router or a sub-agent calling the same model under
the same graph thread has a context of its own. A thread key holds up to ``contexts`` recent contexts (each a thread
of the registry under the key ``(thread_id, ns#ctxN)``); a call continues the one it shares the most with (the
longest common prefix, or, when no context shares half of itself, the most tokens the diff can reuse) and opens a
new one when none shares a quarter of the new version, so two callers on one key never overwrite each other's KV.
:meth:`handle`, :meth:`offload_async` and :meth:`wait` act on the context the key's last call used.

*Preparation* (:meth:`ThreadRegistry.prepare_async`): while a thread's tools run, its predicted next context (the
predictor runs on a thread of its own, ``predict_timeout_s`` at most; a model call it makes runs behind every real
call and stops with it: :mod:`.background`) is computed exactly in the worker, in chunks that give way to foreground
forwards; the next resume starts from it when the call's context continues it (base ``"prepared"``); its stats say
whether the preparation was a hit, partial, a miss, unfinished or failed. :meth:`phase` tells where a thread's KV is
(:class:`~patchkv_agent.runtime.lifecycle.Phase`, :mod:`.lifecycle`).

Locking: one lock per thread (state transitions of that thread; an offload holds it only to take its snapshot and to
install the result, not while it quantizes and copies), the engine's ``forward_lock`` for the model forward (one
forward at a time per model, shared with every other registry and direct caller of that engine), one short registry
lock for the tables. A thread lock may be held while taking the forward lock, never the reverse. Threads never share
KV: a thread resumes only from its own checkpoint.

Knows the engine's public methods (``resume``, ``checkpoint_from``), the store interface, and nothing about
LangGraph. The preparation's methods live in :mod:`.preparation`, the store entries and budgets in :mod:`.residency`
(mixins of :class:`ThreadRegistry`), the per-thread record and its phases in :mod:`.state`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..core.diff import Edit, diff_versions
from ..core.fallback import Fallback, FallbackKind
from ..core.sampling import Sampler
from ..engine import PatchKVEngine
from ..results import BaseKind, ResumeResult
from ..strategies import Strategy
from .background import check_not_stopped, prediction_stop, resume_in_background
from .keys import MIN_CONTINUE_SHARE, ThreadKey, context_key, handle_version, thread_key
from .kvstore import CheckpointKey, KVStore, StoreUnavailable, ids_hash, load_for_resume, resume_from_store
from .lifecycle import Job, Location, is_offloaded, transition, view_of
from .preparation import PreparationMixin
from .residency import ResidencyMixin
from .state import ThreadState, ckpt_bytes, kv_bytes, shared_prefix
from .stream import TokenStream, run_stream

log = logging.getLogger(__name__)

DEFAULT_RESIDENT_BUDGET = 1 << 30
DEFAULT_PREPARE_CHUNK, DEFAULT_PREPARE_CHUNK_CPU = 256, 64  # rows per background preparation forward: GPU, CPU
DEFAULT_PREDICT_TIMEOUT = 30.0  # seconds a preparation's predictor may run (ThreadRegistry(predict_timeout_s=))


class ThreadRegistry(PreparationMixin, ResidencyMixin):
    """Context versions and KV per agent thread over one :class:`PatchKVEngine`.

    Args:
        engine: the engine (one model; one forward at a time through it).
        resident_budget_bytes: resident K/V held across all threads; beyond it the least recently
            used other threads are evicted (``on_evict``).
        offload_budget_bytes: offloaded checkpoint bytes across all threads (None: unlimited); beyond
            it the least recently used other threads' checkpoints are dropped (the next resume of such a
            thread is exact and says so).
        on_evict: ``"offload"`` (write a checkpoint of the evicted version) or ``"drop"``.
        workers: background offload workers.
        store: the tier offloaded checkpoints go to (None: held in this process, ``offload_budget_bytes``
            applies). The tier's own budget and eviction apply; the caller owns (and closes) it.
        heal: recompute a selective resume's approximate rows in the offload window (see the module
            docstring); False keeps them (the next call then builds on them: ``approx_rows`` in its stats).
        contexts: contexts kept apart per thread key (1: one context per key, each call diffs against
            the key's last one).
        prepare_chunk_tokens: rows per background forward of a preparation (:meth:`prepare_async`): the
            most a foreground forward waits for (None: 256 on an accelerator, 64 on a CPU: ~0.2 s of SmolLM2).
        predict_timeout_s: seconds a preparation's predictor may run (on its own thread, never the
            worker's) before it is abandoned and the preparation fails with the reason; None: no limit.

    Raises:
        ValueError: a bad ``on_evict``, budget, ``contexts`` or ``predict_timeout_s``, or
            ``offload_budget_bytes`` together with ``store`` (give the budget to the store).
    """

    def __init__(self, engine: PatchKVEngine, *, resident_budget_bytes: int = DEFAULT_RESIDENT_BUDGET,
                 offload_budget_bytes: int | None = None, on_evict: str = "offload", workers: int = 1,
                 store: KVStore | None = None, heal: bool = True, contexts: int = 4,
                 prepare_chunk_tokens: int | None = None,
                 predict_timeout_s: float | None = DEFAULT_PREDICT_TIMEOUT):
        if on_evict not in ("offload", "drop"):
            raise ValueError(f"on_evict must be 'offload' or 'drop', got {on_evict!r}")
        if isinstance(contexts, bool) or not isinstance(contexts, int) or not 1 <= contexts <= 64:
            raise ValueError(f"contexts must be an int in 1..64 (contexts kept per thread key), got {contexts!r}")
        c = prepare_chunk_tokens if prepare_chunk_tokens is not None else (
            DEFAULT_PREPARE_CHUNK_CPU if engine.device.type == "cpu" else DEFAULT_PREPARE_CHUNK)
        t = predict_timeout_s
        if isinstance(c, bool) or not isinstance(c, int) or c < 1:
            raise ValueError(f"prepare_chunk_tokens must be an int >= 1, got {c!r}")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf")):
            raise ValueError(f"predict_timeout_s must be a finite number of seconds > 0 or None, got {t!r}")
        if resident_budget_bytes < 0 or (offload_budget_bytes is not None and offload_budget_bytes < 0):
            raise ValueError("budgets must be >= 0 bytes")
        if store is not None and offload_budget_bytes is not None:
            raise ValueError("offload_budget_bytes applies to checkpoints held in this process; with a store, "
                             "set the budget on the store (budget_bytes=)")
        self.engine = engine
        self.store = store
        self.resident_budget_bytes = resident_budget_bytes
        self.offload_budget_bytes = offload_budget_bytes
        self.on_evict = on_evict
        self.heal, self.contexts = bool(heal), contexts
        self.prepare_chunk_tokens = c
        self.predict_timeout_s = None if predict_timeout_s is None else float(predict_timeout_s)
        self._active: dict[ThreadKey, ThreadKey] = {}  # thread key -> the context its last call used
        self.forward_lock = engine.forward_lock  # the engine's: one forward at a time per model, across registries
        self._lock = threading.Lock()
        self._threads: OrderedDict[ThreadKey, ThreadState] = OrderedDict()  # least recently used first
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="patchkv-offload")
        self.events: list[dict[str, Any]] = []  # evictions and drops, for inspection

    # ----------------------------------------------------------------- tables

    def _thread(self, key: ThreadKey, create: bool = True) -> ThreadState | None:
        with self._lock:
            th = self._threads.get(key)
            if th is None and create:
                th = self._threads[key] = ThreadState(key=key)
            if th is not None:
                self._threads.move_to_end(key)
                th.last_used = time.monotonic()
            return th

    def _known(self, key: ThreadKey | None) -> ThreadState | None:
        """The record of ``key``'s active context (touched as used), or None for None or an unknown key."""
        return self._thread(self.active(key), create=False) if key is not None else None

    def _peek(self, key: ThreadKey) -> ThreadState | None:
        with self._lock:
            return self._threads.get(key)

    def active(self, key: ThreadKey | None) -> ThreadKey | None:
        """The context key the last call of thread key ``key`` used (``key`` itself before any call)."""
        if key is None:
            return None
        with self._lock:
            return self._active.get(key, key)

    def _choose_context(self, key: ThreadKey, ids: np.ndarray) -> tuple[ThreadKey, Edit | None]:
        """The context of ``key`` that a call with ``ids`` continues (or a new one): see the module docstring.

        Returns:
            ``(context key, diff)``: the diff of the chosen context's resident ids into ``ids`` when the choice
            had to diff (an edit near the head), so the resume reuses it instead of diffing again; else None.
        """
        if self.contexts == 1:
            return key, None
        lanes: list[tuple[ThreadKey, np.ndarray, float]] = []
        free: ThreadKey | None = None
        for i in range(self.contexts):
            ck = context_key(key, i)
            th = self._peek(ck)
            tok = th.token_ids if th is not None else None
            if tok is None or len(tok) == 0:
                if free is None and (th is None or (th.resident is None and th.store_key is None
                                                    and th.checkpoint is None and th.lost is None)):
                    free = ck
                continue
            lanes.append((ck, tok, th.last_used))
        if not lanes:  # the key's first call (or one after a restart: its version and reason are there)
            return key, None
        for ck, _, _ in lanes:  # the context whose prepared next version this call continues
            prep = self._peek(ck).preparation
            pids = prep.ids if prep is not None else None
            if pids is not None and len(pids) <= len(ids) and shared_prefix(pids, ids) == len(pids):
                return ck, None
        shared = [shared_prefix(tok, ids) for _, tok, _ in lanes]
        best = int(np.argmax(shared))
        if shared[best] * 2 >= len(lanes[best][1]):  # continues (appends to / edits the back half of) it
            return lanes[best][0], None
        # an edit near the head, or another caller: how much is reusable. Each lane is diffed against what a
        # resume from it would restore (its resident ids, decoded tokens included), so the chosen lane's diff
        # is the resume's own and is handed on to it
        reuse, edits = [], []
        for (ck, tok, _), p in zip(lanes, shared):
            th = self._peek(ck)
            resident = th.resident if th is not None else None
            base_ids = resident.context_ids if resident is not None else tok
            try:
                e = diff_versions(base_ids, ids)
            except ValueError:
                reuse.append(p)
                edits.append(None)
                continue
            reuse.append(int(e.prefix_len + e.suffix_len))
            edits.append(e)
        best = int(np.argmax(reuse))
        if reuse[best] >= MIN_CONTINUE_SHARE * len(ids):
            return lanes[best][0], edits[best]
        if free is not None:
            return free, None
        return min(lanes, key=lambda lane: lane[2])[0], None  # the least recently used context is replaced

    def keys(self) -> list[ThreadKey]:
        """Known thread keys, least recently used first."""
        with self._lock:
            return list(self._threads)

    def resident_bytes(self) -> int:
        """K/V bytes held resident across threads (prepared next contexts included)."""
        with self._lock:
            threads = list(self._threads.values())
        total = 0
        for t in threads:
            if t.resident is not None:
                total += kv_bytes(t.resident)
            prep = t.preparation
            if prep is not None and prep.result is not None:
                total += kv_bytes(prep.result)
        return total

    def offloaded_bytes(self) -> int:
        """Checkpoint bytes held in this process across threads (a store's bytes: ``store.nbytes()``)."""
        with self._lock:
            return sum(ckpt_bytes(t.checkpoint) for t in self._threads.values() if t.checkpoint is not None)

    def handle(self, key: ThreadKey) -> dict[str, Any] | None:
        """The KV handle of a thread's current version, JSON-serialisable (no tensors).

        Returns:
            ``{"thread_id", "checkpoint_ns", "version", "ids_hash", "tokens", "kv", "kv_ids_hash"}`` with
            ``kv`` one of ``"resident"``, ``"offloaded"``, ``"offloading"``, ``"none"`` and ``kv_ids_hash``
            the hash of the tokens the KV holds (the context and the tokens decoded after it; None without
            KV): what :meth:`expect` binds a store entry to; None for an unknown thread.
        """
        key = self.active(key)
        th = self._thread(key, create=False)
        if th is None or th.token_ids is None:
            return None
        view = view_of(th)
        if view.location is Location.RESIDENT:
            kv = "resident" if view.job is Job.IDLE else "offloading"
        else:
            kv = "offloaded" if view.location is Location.OFFLOADED else "none"
        kv_ids = None  # the tokens of the KV (what an offload of it is stored under)
        if th.resident is not None:
            kv_ids = ids_hash(th.resident.context_ids)
        elif th.checkpoint is not None and th.checkpoint_version == th.version:
            kv_ids = ids_hash(th.checkpoint.token_ids)
        elif th.store_key is not None and th.store_version == th.version:
            kv_ids = th.store_key.ids_hash
        return {"thread_id": key[0], "checkpoint_ns": key[1], "version": th.version,
                "ids_hash": ids_hash(th.token_ids), "tokens": int(len(th.token_ids)), "kv": kv, "kv_ids_hash": kv_ids}

    def handles(self, thread_id: str) -> list[dict[str, Any]]:
        """Handles of every key of ``thread_id`` (all namespaces)."""
        return [h for k in self.keys() if k[0] == str(thread_id) and (h := self.handle(k)) is not None]

    def expect(self, key: ThreadKey, handle: dict[str, Any]) -> None:
        """Note that a persisted graph checkpoint refers to ``handle``'s context version of ``key``.

        When this registry holds no KV of that version (a new process or registry), the thread's version
        counter continues from the handle's. With a store holding an entry of that version of the thread
        written by this model for the handle's tokens (its ``kv_ids_hash``, or its context's ``ids_hash``:
        a persistent tier after a restart), the next resume starts from it; otherwise (no entry, or only
        entries of other tokens under that thread and version) it is exact with ``stats["fallback"]``
        saying why. A registry that already holds the version (or a later one) ignores the call.
        """
        v = handle_version(handle)  # a handle comes from outside the process: its shape is checked
        th = self._thread(key)
        bound = {h for h in (handle.get("kv_ids_hash"), handle.get("ids_hash")) if isinstance(h, str)}
        found, why = self._find_stored(key, v, bound) if self.store is not None else (None, "")
        with transition(th, "expect", restart=True):
            if th.version >= v:
                return
            th.version, th.token_ids = v, None
            th.resident, th.checkpoint = None, None
            self._set_store_entry(th, found, v, BaseKind.RESTART)
            th.lost = None if found is not None else Fallback(
                FallbackKind.NOT_HELD,
                f"the graph checkpoint refers to KV of context version {v} "
                f"(ids {str(handle.get('ids_hash'))[:64]}) that this process does not hold (restart or new registry)"
                + why)

    def _find_stored(self, key: ThreadKey, version: int, ids: set[str]) -> tuple[CheckpointKey | None, str]:
        """The store's most recently used entry of ``version`` of thread ``key`` written by this model for
        tokens hashing to one of ``ids``, or ``(None, why not)``: an entry of other tokens under that thread
        and version (planted, or left by another writer) is never picked."""
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

    def fork(self, src: ThreadKey, dst: ThreadKey) -> bool:
        """Start thread ``dst`` from ``src``'s current version and KV (shared, read-only tensors): the context
        ``src``'s last call used (:meth:`active`).

        ``dst``'s previous state, if any, is replaced. A pending offload of ``src`` is waited for.

        Returns:
            False when ``src`` has no context version.
        """
        s = self._known(src)  # the context src's last call used (a summarizer's lane is another context)
        if s is None:
            return False
        self._wait_pending(s)
        d = self._thread(dst)
        with s.lock:
            if s.token_ids is None:
                return False
            snapshot = (s.version, s.token_ids, s.resident, s.checkpoint, s.checkpoint_version, s.checkpoint_source)
            skey = s.store_key if s.store_key is not None and s.store_version == s.version else None
            ssource = s.store_source
        stored, reason = None, None
        if skey is not None:  # dst gets its own entry: each thread owns (and replaces) exactly one
            stored, reason = load_for_resume(self.engine, self.store, skey)
        self._wait_pending(d)
        with d.lock:
            (d.version, d.token_ids, d.resident, d.checkpoint, d.checkpoint_version, d.checkpoint_source) = snapshot
            d.lost, d.pending = None, None
            if stored is not None:
                self._put_store(d, stored, d.version, ssource)
            else:
                self._set_store_entry(d, None)
                if reason is not None:
                    d.lost = reason
        self._enforce_resident_budget(keep=dst)
        return True

    def forget(self, thread_id: str) -> None:
        """Drop every key of ``thread_id`` (e.g. when the graph thread is deleted)."""
        for k in self.keys():
            if k[0] == str(thread_id):
                th = self._thread(k, create=False)
                if th is not None:
                    if th.preparation is not None:
                        th.preparation.stop.set()
                    self._wait_pending(th)
                    with th.lock, self._lock:
                        self._threads.pop(k, None)
                        self._active.pop(k, None)
                    with transition(th, "forget"):
                        self._set_store_entry(th, None)

    def close(self) -> None:
        """Stop preparations, finish pending offloads and stop the worker (a store stays open: its owner
        closes it)."""
        with self._lock:
            threads = list(self._threads.values())
        for th in threads:
            prep = th.preparation
            if prep is not None:
                prep.stop.set()
        self._executor.shutdown(wait=True)

    # ---------------------------------------------------------------- resume

    def stream(self, key: ThreadKey | None, token_ids, *, strategy: "str | Strategy" = "patchkv",
               max_new_tokens: int = 16, sampler: Sampler | None = None) -> TokenStream:
        """Resume ``key``'s next context version and return a token stream over it (greedy unless ``sampler``).

        Args:
            key: the thread key (None: a one-off exact resume, nothing kept).
            token_ids: the new context version's ids.
            strategy: the strategy when the thread has KV (``exact`` always recomputes): a name, or a
                :class:`~patchkv_agent.strategies.Strategy` built with its options
                (``PatchKVStrategy(kappa=0.1)``; ``engine.strategy(name, options)`` from a mapping).
            max_new_tokens: tokens to draw at most.
            sampler: a :class:`~patchkv_agent.core.sampling.Sampler` (sampling parameters, a logits processor
                such as a grammar); None: greedy.

        Returns:
            A :class:`TokenStream`; its ``result.stats`` holds the engine's part and the registry's
            :class:`~patchkv_agent.results.RuntimePart` (``thread_id``, ``checkpoint_ns``, ``version``,
            ``base_version``, ``base``: a :class:`~patchkv_agent.results.BaseKind`, ``requested_strategy``,
            ``offload_wait_s``, the preparation's ``prepared*``; resumed from a store, also ``store_tier``,
            ``store_get_s`` and ``store_key``), and ``fallback`` says why a base it expected was not used.

        Raises:
            ValueError: bad ids, ``max_new_tokens`` or strategy (the engine's validator:
                :class:`~patchkv_agent.core.inputs.InvalidInput`).
        """
        # the public boundary's one validation: the request is checked and resolved here, before any state
        # changes, and every layer below runs it as it is
        req = self.engine.request(token_ids, strategy, max_new_tokens)
        ids, max_new_tokens, strat = req.ids, req.max_new_tokens, req.strategy
        strategy = strat.name
        exact_req = req.with_strategy(self.engine.strategy("exact")).prefill_only()
        stop = prediction_stop()  # a prediction's own call (a summary): behind every real call (.background)
        check_not_stopped(stop)
        if key is None:
            if stop is not None:
                res = resume_in_background(self.engine, None, exact_req, stop, self.prepare_chunk_tokens)
            else:
                with self.forward_lock:
                    res = self.engine.resume_request(None, exact_req)
            res.stats = res.stats.with_runtime(base=BaseKind.NONE, requested_strategy=strategy, offload_wait_s=0.0)
            return TokenStream(self.engine, res, max_new_tokens, sampler, stop=stop)
        primary, (key, edit) = key, self._choose_context(key, ids)
        req = dataclasses.replace(req, edit=edit).prefill_only()
        with self._lock:
            self._active[primary] = key
        th = self._thread(key)
        taken = self._take_preparation(th, req)  # detached once; its diff (a partial call planned one) goes on
        prepared, req = taken.base, dataclasses.replace(req, edit=taken.edit) if taken.edit is not None else req
        # a heal in progress gives the exact base this resume wants (a prepared base is exact already)
        heal_wait_s = 0.0 if prepared is not None else self._wait_heal(th)
        with th.lock:
            resident = th.resident is not None or prepared is not None
        # a resident thread resumes from its resident KV: a pending offload is not waited for
        wait_s = 0.0 if resident and strat.uses_checkpoint else self._wait_pending(th)
        with transition(th, "resume"):
            base_heal = th.heal_stats
            base_approx = th.resident.approx_rows if th.resident is not None else None
            if not strat.uses_checkpoint:  # no base needed (exact): do not write one
                base, base_version, source, skey = None, None, BaseKind.NONE, None
                fallback = None
            elif prepared is not None:
                base, base_version, skey = self.engine.as_checkpoint(prepared), th.version, None
                source = BaseKind.PREPARED
                fallback = None
            else:
                base, base_version, source, skey = self._base(th)
                fallback = th.lost if base is None and skey is None else None
            if stop is not None:  # exact, in chunks from the resident rows it shares
                res = resume_in_background(self.engine, th.resident, req, stop, self.prepare_chunk_tokens)
            elif skey is not None:  # the store read runs outside the forward lock
                res = resume_from_store(self.engine, self.store, skey, req, forward_lock=self.forward_lock)
                if res.stats.fallback is not None:  # nothing of the stored checkpoint was used
                    base_version, source = None, BaseKind.NONE  # evicted, corrupt, missing: exact, reason recorded
            else:
                with self.forward_lock:
                    if base is None:
                        res = self.engine.resume_request(None, exact_req)
                    else:
                        res = self.engine.resume_request(base, req)
            th.version += 1
            th.token_ids, th.lost, th.heal_stats = ids, None, None
            th.resident = dataclasses.replace(res, cache=None, output_ids=[])
            th.checkpoint, th.pending = None, None  # superseded by the resident version
            stale = th.store_key
            th.store_key = None
            version = th.version
            th.streams += 1  # until the stream's commit: see TokenStream.close
        if stale is not None:  # superseded too: free its share of the store's budget, off the critical path
            self._submit_delete(stale)
        heal_s, healed_rows = base_heal or (None, None)
        prep_stats = taken.runtime_fields(len(ids), res.stats.recompute_tokens, source is BaseKind.PREPARED)
        res.stats = res.stats.with_runtime(
            thread_id=key[0], checkpoint_ns=primary[1], version=version, base_version=base_version,
            base=source, requested_strategy=strategy, offload_wait_s=wait_s, context=key[1], heal_wait_s=heal_wait_s,
            base_approx_rows=base_approx if source is BaseKind.RESIDENT else None,
            base_heal_s=heal_s, base_healed_rows=healed_rows, **prep_stats)
        if res.stats.fallback is None and fallback is not None:  # the base it expected is gone: say why
            res.stats = res.stats.with_engine(fallback=fallback)
        self._enforce_resident_budget(keep=key)
        return TokenStream(self.engine, res, max_new_tokens, sampler,
                           commit=functools.partial(self._commit, th, version), stop=stop)

    def generate(self, key: ThreadKey | None, token_ids, *, strategy: "str | Strategy" = "patchkv",
                 max_new_tokens: int = 16, sampler: Sampler | None = None) -> ResumeResult:
        """Resume ``key``'s next context version and decode greedily (see :meth:`stream`).

        Returns:
            The :class:`~patchkv_agent.engine.ResumeResult` (``output_ids`` filled, ``cache`` holding the
            context and the decoded tokens except the last).
        """
        s = self.stream(key, token_ids, strategy=strategy, max_new_tokens=max_new_tokens, sampler=sampler)
        for _ in s:
            pass
        return s.result

    async def agenerate(self, key: ThreadKey | None, token_ids, *, strategy: "str | Strategy" = "patchkv",
                        max_new_tokens: int = 16, sampler: Sampler | None = None) -> ResumeResult:
        """Async twin of :meth:`generate` (runs in the default executor)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: self.generate(key, token_ids, strategy=strategy,
                                                                      max_new_tokens=max_new_tokens, sampler=sampler))

    def _base(self, th: ThreadState):
        """Where to resume ``th`` from: ``(checkpoint, version, source, store_key)``.

        The resident KV when it is still there (a zero-copy full-precision view: nothing is ever written
        on the critical path), else a checkpoint in this process, else the thread's store entry of its
        current version (``checkpoint`` None, ``store_key`` set), else nothing.
        """
        if th.resident is not None:
            return self.engine.as_checkpoint(th.resident), th.version, BaseKind.RESIDENT, None
        if th.checkpoint is not None:
            return th.checkpoint, th.checkpoint_version, th.checkpoint_source, None
        if th.store_key is not None and th.store_version == th.version:
            return None, th.version, th.store_source, th.store_key
        return None, None, BaseKind.NONE, None

    def _commit(self, th: ThreadState, version: int, res: ResumeResult, cache) -> None:
        """Make the decoded tokens' KV part of the thread's resident version (if still current)."""
        out = res.output_ids
        keys, values, ids = res.keys, res.values, res.context_ids
        if len(out) > 1 and cache is not None:
            n = len(ids) + len(out) - 1
            try:
                ks = [layer.keys for layer in cache.layers]
                vs = [layer.values for layer in cache.layers]
            except AttributeError:
                ks = vs = []
            if ks and all(k.shape[-2] == n for k in ks) and all(v.shape[-2] == n for v in vs):
                keys, values = ks, vs
                ids = np.concatenate([ids, np.asarray(out[:-1], dtype=np.int64)])
        with transition(th, "commit"):
            th.streams = max(0, th.streams - 1)
            if th.version != version or th.resident is None:
                return
            exact = res.exact_rows
            if exact is None or exact >= len(res.context_ids):  # decoded over an exact context: exact too
                exact = len(ids)
            th.resident = dataclasses.replace(res, cache=None, output_ids=[], context_ids=ids, keys=keys,
                                              values=values, exact_rows=exact)
        self._enforce_resident_budget(keep=th.key)

    # --------------------------------------------------------------- offload

    def offload_async(self, key: ThreadKey | None, *, release: bool = False) -> Future | None:
        """Start writing the thread's resident KV to a checkpoint (or its store entry) in the background worker.

        The resident KV stays: a later resume of this thread starts from it at once and never waits for
        the offload, which serves eviction, restarts and other processes (a thread that has moved on by
        the time the checkpoint is ready gets nothing installed). Nothing happens for an unknown thread, a
        thread without resident KV, or one whose offload is already pending (that future is returned) or
        done for the current version (the finished future, if any, is returned; ``release`` still drops
        the resident KV).

        Args:
            key: the thread key.
            release: also drop the resident KV once the checkpoint is installed (a thread that will idle
                for long: a human in the loop, a slow job); its next resume then reads the checkpoint.

        Returns:
            The offload's future (its result: the offload seconds, or None when there was nothing to do),
            or None when nothing was started.
        """
        th = self._known(key)
        if th is None:
            return None
        with transition(th, "offload"):
            if th.pending is not None and not th.pending.done():
                return th.pending
            if th.resident is None:
                return None
            if is_offloaded(th):  # this version's KV is written already: nothing to write again
                if release:
                    th.resident = None
                return th.pending
            th.pending = self._submit_offload(th, BaseKind.BACKGROUND, release)
            return th.pending

    def offload(self, key: ThreadKey | None, *, release: bool = False) -> float | None:
        """Synchronous :meth:`offload_async`: returns the offload seconds (None when nothing to do)."""
        fut = self.offload_async(key, release=release)
        return fut.result() if fut is not None else None

    async def aoffload(self, key: ThreadKey | None, *, release: bool = False) -> float | None:
        """Async twin of :meth:`offload`."""
        fut = self.offload_async(key, release=release)
        return await asyncio.wrap_future(fut) if fut is not None else None

    def wait(self, key: ThreadKey | None) -> float:
        """Wait for a pending offload of ``key``; returns the seconds waited."""
        th = self._thread(self.active(key), create=False) if key is not None else None
        return self._wait_pending(th) if th is not None else 0.0

    def _submit_offload(self, th: ThreadState, source: BaseKind, release: bool = False) -> Future:
        """Queue an offload job of ``th``'s current version (caller holds ``th.lock``). The job owns its heal
        event (set once its heal stage is over; None: nothing to heal): a job that runs late, after its
        thread moved on, sets only its own event, never the one a newer job's resume is waiting on."""
        prep = th.preparation
        preparing = prep is not None and prep.version == th.version  # it recomputes what the next call uses
        healing = (threading.Event() if self.heal and not preparing and th.resident is not None
                   and th.resident.approx_rows else None)
        th.healing = healing
        return self._executor.submit(self._offload_job, th, th.version, source, release, healing)

    def _wait_heal(self, th: ThreadState) -> float:
        """Wait until the heal stage of ``th``'s pending job is over (a resume wants the exact base)."""
        with th.lock:
            evt, fut = th.healing, th.pending
        if evt is None or evt.is_set() or fut is None or fut.done():
            return 0.0
        t0 = time.perf_counter()
        while not evt.wait(0.05):
            if fut.done():  # the job ended (or failed) before its heal stage: nothing to wait for
                break
        return time.perf_counter() - t0

    def _wait_pending(self, th: ThreadState) -> float:
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
                self._put_store(th, ckpt, version, source)
            if source == BaseKind.EVICTED or release:
                th.resident = None
            dt = time.perf_counter() - t0
        self._enforce_offload_budget(keep=th.key)
        return dt


__all__ = ["ThreadRegistry", "ThreadKey", "TokenStream", "thread_key", "ids_hash", "run_stream"]

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

*Several contexts per thread* (``contexts=4``): a thread key holds up to ``contexts`` recent contexts (each a
thread of the registry under the key ``(thread_id, ns#ctxN)``), so a summarizer or a sub-agent calling the same
model under one graph thread never overwrites the agent's KV (:meth:`.table.ThreadTable.choose_context`).
:meth:`handle`, :meth:`offload_async` and :meth:`wait` act on the context the key's last call used.

*Preparation* (:meth:`ThreadRegistry.prepare_async`): while a thread's tools run, its predicted next context (the
predictor runs on a thread of its own, ``predict_timeout_s`` at most; a model call it makes runs behind every real
call and stops with it: :mod:`.background`) is computed exactly in the worker, in chunks that give way to foreground
forwards; the next resume starts from it when the call's context continues it (base ``"prepared"``); its stats say
whether the preparation was a hit, partial, a miss, unfinished or failed. :meth:`phase` tells where a thread's KV is
(:class:`~patchkv_agent.runtime.lifecycle.Phase`, :mod:`.lifecycle`).

Locking: one lock per thread (state transitions of that thread; an offload holds it only to take its snapshot and to
install the result, not while it quantizes and copies), the engine's ``forward_lock`` for the model forward (one
forward at a time per model, shared with every other registry and direct caller of that engine), the short table
lock of the :class:`~.table.ThreadTable`. A thread lock may be held while taking the forward lock, never the reverse.
Threads never share KV: a thread resumes only from its own checkpoint.

The registry is a facade over four objects, one job each:

- :class:`~.table.ThreadTable` (:mod:`.table`): what a thread holds: the per-thread records
  (:class:`~.state.ThreadState`, their locks), the active context of each key, the context choice;
- :class:`~.calls.CallPath` (:mod:`.calls`): how a call is served, top to bottom: validate, resolve the strategy,
  choose the context, take the preparation, wait for a heal, pick the base, resume, install, record the stats,
  commit the decoded tokens;
- :class:`~.residency.Residency` (:mod:`.residency`): where the KV lives beyond the resident version and the
  background jobs that move it there: offloads and their heal stage, store entries, the byte budgets;
- :class:`~.preparation.Preparations` (:mod:`.preparation`): the tool-wait preparations of next contexts
  (:mod:`.background`: a prediction's own model calls).

Knows the engine's public methods, the store interface, and nothing about LangGraph.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Callable

from ..core.fallback import Fallback, FallbackKind
from ..core.sampling import Sampler
from ..engine import PatchKVEngine
from ..results import BaseKind, ResumeResult
from ..strategies import Strategy
from .calls import CallPath
from .keys import ThreadKey, handle_version, thread_key
from .kvstore import KVStore, ids_hash, load_for_resume
from .lifecycle import Job, Location, Phase, transition, view_of
from .preparation import Preparations
from .residency import Residency
from .state import Prediction
from .stream import TokenStream, run_stream
from .table import ThreadTable

DEFAULT_RESIDENT_BUDGET = 1 << 30
DEFAULT_PREPARE_CHUNK, DEFAULT_PREPARE_CHUNK_CPU = 256, 64  # rows per background preparation forward: GPU, CPU
DEFAULT_PREDICT_TIMEOUT = 30.0  # seconds a preparation's predictor may run (ThreadRegistry(predict_timeout_s=))


class ThreadRegistry:
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

    Attributes:
        table: the :class:`~patchkv_agent.runtime.table.ThreadTable` (the records).
        call_path: the :class:`~patchkv_agent.runtime.calls.CallPath` (how :meth:`stream` serves a call).
        residency: the :class:`~patchkv_agent.runtime.residency.Residency` (offloads, heals, store, budgets).
        preparations: the :class:`~patchkv_agent.runtime.preparation.Preparations`.
        events: evictions, drops, heals, discarded offloads and preparations, for inspection.

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
        self.forward_lock = engine.forward_lock  # the engine's: one forward at a time per model, across registries
        self.events: list[dict[str, Any]] = []  # evictions, drops, heals, preparations: for inspection
        self.table = ThreadTable(contexts)
        self.residency = Residency(engine, self.table, self.events, store=store,
                                   resident_budget_bytes=resident_budget_bytes,
                                   offload_budget_bytes=offload_budget_bytes, on_evict=on_evict, heal=self.heal,
                                   workers=workers)
        self.preparations = Preparations(engine, self.table, self.residency, self.events, chunk_tokens=c,
                                         predict_timeout_s=self.predict_timeout_s)
        self.call_path = CallPath(engine, self.table, self.residency, self.preparations, chunk_tokens=c)

    # ----------------------------------------------------------------- tables

    def active(self, key: ThreadKey | None) -> ThreadKey | None:
        """The context key the last call of thread key ``key`` used (``key`` itself before any call)."""
        return self.table.active(key)

    def keys(self) -> list[ThreadKey]:
        """Known thread keys, least recently used first."""
        return self.table.keys()

    def resident_bytes(self) -> int:
        """K/V bytes held resident across threads (prepared next contexts included)."""
        return self.table.resident_bytes()

    def offloaded_bytes(self) -> int:
        """Checkpoint bytes held in this process across threads (a store's bytes: ``store.nbytes()``)."""
        return self.table.offloaded_bytes()

    def phase(self, key: ThreadKey | None) -> Phase:
        """Where the KV of ``key``'s active context is now (a :class:`~patchkv_agent.runtime.lifecycle.Phase`:
        the view of the thread's parts, :func:`~patchkv_agent.runtime.lifecycle.view_of`)."""
        th = self.table.peek(self.table.active(key)) if key is not None else None
        if th is None:
            return Phase.NONE
        with th.lock:
            return view_of(th).phase

    def handle(self, key: ThreadKey) -> dict[str, Any] | None:
        """The KV handle of a thread's current version, JSON-serialisable (no tensors).

        Returns:
            ``{"thread_id", "checkpoint_ns", "version", "ids_hash", "tokens", "kv", "kv_ids_hash"}`` with
            ``kv`` one of ``"resident"``, ``"offloaded"``, ``"offloading"``, ``"none"`` and ``kv_ids_hash``
            the hash of the tokens the KV holds (the context and the tokens decoded after it; None without
            KV): what :meth:`expect` binds a store entry to; None for an unknown thread.
        """
        key = self.active(key)
        th = self.table.get(key, create=False)
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
        th = self.table.get(key)
        bound = {h for h in (handle.get("kv_ids_hash"), handle.get("ids_hash")) if isinstance(h, str)}
        found, why = self.residency.find_stored(key, v, bound)
        with transition(th, "expect", restart=True):
            if th.version >= v:
                return
            th.version, th.token_ids = v, None
            th.resident, th.checkpoint = None, None
            self.residency.set_store_entry(th, found, v, BaseKind.RESTART)
            th.lost = None if found is not None else Fallback(
                FallbackKind.NOT_HELD,
                f"the graph checkpoint refers to KV of context version {v} "
                f"(ids {str(handle.get('ids_hash'))[:64]}) that this process does not hold (restart or new registry)"
                + why)

    def fork(self, src: ThreadKey, dst: ThreadKey) -> bool:
        """Start thread ``dst`` from ``src``'s current version and KV (shared, read-only tensors): the context
        ``src``'s last call used (:meth:`active`).

        ``dst``'s previous state, if any, is replaced. A pending offload of ``src`` is waited for.

        Returns:
            False when ``src`` has no context version.
        """
        s = self.table.known(src)  # the context src's last call used (a summarizer's lane is another context)
        if s is None:
            return False
        self.residency.wait_pending(s)
        d = self.table.get(dst)
        with s.lock:
            if s.token_ids is None:
                return False
            snapshot = (s.version, s.token_ids, s.resident, s.checkpoint, s.checkpoint_version, s.checkpoint_source)
            skey = s.store_key if s.store_key is not None and s.store_version == s.version else None
            ssource = s.store_source
        stored, reason = None, None
        if skey is not None:  # dst gets its own entry: each thread owns (and replaces) exactly one
            stored, reason = load_for_resume(self.engine, self.store, skey)
        self.residency.wait_pending(d)
        with d.lock:
            (d.version, d.token_ids, d.resident, d.checkpoint, d.checkpoint_version, d.checkpoint_source) = snapshot
            d.lost, d.pending = None, None
            if stored is not None:
                self.residency.put_store(d, stored, d.version, ssource)
            else:
                self.residency.set_store_entry(d, None)
                if reason is not None:
                    d.lost = reason
        self.residency.enforce_resident_budget(keep=dst)
        return True

    def forget(self, thread_id: str) -> None:
        """Drop every key of ``thread_id`` (e.g. when the graph thread is deleted)."""
        for k in self.keys():
            if k[0] == str(thread_id):
                th = self.table.get(k, create=False)
                if th is not None:
                    if th.preparation is not None:
                        th.preparation.stop.set()
                    self.residency.wait_pending(th)
                    with th.lock:
                        self.table.remove(th)
                    with transition(th, "forget"):
                        self.residency.set_store_entry(th, None)

    def close(self) -> None:
        """Stop preparations, finish pending offloads and stop the worker (a store stays open: its owner
        closes it)."""
        for th in self.table.records():
            prep = th.preparation
            if prep is not None:
                prep.stop.set()
        self.residency.close()

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
        return self.call_path.stream(key, token_ids, strategy, max_new_tokens, sampler)

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
        th = self.table.known(key)
        return self.residency.offload(th, release) if th is not None else None

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
        th = self.table.known(key)
        return self.residency.wait_pending(th) if th is not None else 0.0

    # ----------------------------------------------------------- preparation

    def prepare_async(self, key: ThreadKey | None, predict: "Callable[[], Prediction | Any]", *,
                      chunk_tokens: int | None = None) -> Future | None:
        """Compute the thread's predicted next context exactly in the background, while its tools run
        (:meth:`Preparations.prepare_async <patchkv_agent.runtime.preparation.Preparations.prepare_async>`
        says how, and how the next call uses it).

        Args:
            key: the thread key (its active context).
            predict: the predictor (called once, on its own thread; whatever it raises, ``BaseException``
                included, becomes ``prepared_reason``).
            chunk_tokens: rows per background forward (default: :attr:`prepare_chunk_tokens`).

        Returns:
            The job's future (one per thread version: a second call for the same version returns the
            first one's), or None for an unknown thread or one without a context version.

        Raises:
            ValueError: ``chunk_tokens`` < 1.
        """
        return self.preparations.prepare_async(key, predict, chunk_tokens=chunk_tokens)

    def wait_prepared(self, key: ThreadKey | None, timeout: float | None = None) -> float:
        """Wait until the preparation of ``key``'s current version is over (done, failed or stopped).

        Args:
            key: the thread key (its active context).
            timeout: seconds at most (None: no limit).

        Returns:
            The seconds waited (0.0 when nothing is being prepared).
        """
        return self.preparations.wait_prepared(key, timeout)


__all__ = ["ThreadRegistry", "ThreadKey", "TokenStream", "thread_key", "ids_hash", "run_stream"]

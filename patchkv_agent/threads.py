"""Per-thread context versions and their KV: resident after decode, offloaded while the thread waits.

A :class:`ThreadRegistry` holds, for every thread key (``thread_id``, ``checkpoint_ns``), the thread's
current context version (token ids, a monotone version number) and the KV of that version in one of
two places:

- *resident*: the last resume's K/V (what a decode leaves on the accelerator), or
- *offloaded*: a :class:`~patchkv_agent.store.Checkpoint` written by ``engine.checkpoint_from``, which
  can run in a background worker while the agent waits for a tool (:meth:`ThreadRegistry.offload_async`).

:meth:`ThreadRegistry.stream` / :meth:`ThreadRegistry.generate` resume a thread's next version: no KV
-> ``exact`` (and, when the KV existed once but is gone, ``stats["fallback"]`` says why); KV ->
``engine.resume(checkpoint, ids, strategy)``. A resume waits for a pending offload of its thread. Resident
KV beyond ``resident_budget_bytes`` is evicted least-recently-used first: offloaded, or dropped with the
reason recorded for the next resume.

Locking: one lock per thread (state transitions of that thread), one lock for the model forward (one
forward at a time per model), one short registry lock for the tables. A thread lock may be held while
taking the forward lock, never the reverse. Threads never share KV: a thread resumes only from its own
checkpoint.

Knows the engine's public methods (``resume``, ``checkpoint_from``) and nothing about LangGraph.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NewType

import numpy as np
import torch

from .engine import PatchKVEngine, ResumeResult

log = logging.getLogger(__name__)

ThreadKey = NewType("ThreadKey", tuple)  # (thread_id: str, checkpoint_ns: str)
DEFAULT_RESIDENT_BUDGET = 1 << 30


def thread_key(thread_id: str, checkpoint_ns: str = "") -> ThreadKey:
    """The registry key of a thread.

    Args:
        thread_id: the LangGraph ``thread_id`` (any string).
        checkpoint_ns: the graph namespace (``""`` for a root graph).

    Returns:
        A ``(thread_id, checkpoint_ns)`` tuple.
    """
    return ThreadKey((str(thread_id), str(checkpoint_ns)))


def ids_hash(token_ids) -> str:
    """A short stable hash of a token-id sequence (blake2b of its int64 bytes, 16 hex digits)."""
    return hashlib.blake2b(np.asarray(token_ids, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def _as_ids(token_ids) -> np.ndarray:
    if isinstance(token_ids, torch.Tensor):
        return token_ids.detach().cpu().reshape(-1).numpy().astype(np.int64)
    return np.asarray(list(token_ids), dtype=np.int64)


def _kv_bytes(res: ResumeResult) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(res.keys, res.values))


def _ckpt_bytes(ckpt) -> int:
    return int(getattr(ckpt, "nbytes", 0) or 0)


@dataclass(eq=False)
class _Thread:
    key: ThreadKey
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0                   # context versions seen so far (the current one is `version`)
    token_ids: np.ndarray | None = None
    resident: ResumeResult | None = None   # KV of `version` (context + decoded tokens), cache dropped
    checkpoint: Any = None                 # offloaded KV of `checkpoint_version`
    checkpoint_version: int = 0
    checkpoint_source: str = ""            # "background", "on_path", "evicted"
    pending: Future | None = None
    lost: str | None = None                # why the KV of `version` is gone (next resume says so)
    last_used: float = 0.0


class TokenStream:
    """Greedy decode of one resumed thread version, one token per ``next()``.

    ``result`` is available at once (first-token logits, context, resume stats); ``result.output_ids``
    grows as tokens are drawn. The stream ends at ``max_new_tokens`` or after an EOS token (included);
    :meth:`close` (or exhaustion) commits the decoded tokens' KV as the thread's resident state. Each
    decode step takes the registry's forward lock; the thread lock is not held between steps.
    """

    def __init__(self, registry: "ThreadRegistry", th: _Thread | None, version: int, result: ResumeResult,
                 max_new_tokens: int):
        self._registry, self._th, self._version = registry, th, version
        self.result = result
        self.max_new_tokens = max_new_tokens
        self._cache = result.cache
        self._pos = len(result.context_ids)
        self._decode_s = 0.0
        self._done = False
        result.output_ids = []

    @property
    def stats(self) -> dict[str, Any]:
        """The resume stats (``result.stats``), with ``decode_s`` once the stream has ended."""
        return self.result.stats

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> int:
        out = self.result.output_ids
        eos = self._registry.engine.eos_ids
        if self._done or len(out) >= self.max_new_tokens or (out and out[-1] in eos):
            self.close()
            raise StopIteration
        t0 = time.perf_counter()
        if not out:
            tok = int(self.result.logits.argmax())
        else:
            eng = self._registry.engine
            with self._registry.forward_lock, torch.no_grad():
                logits = eng.model(input_ids=torch.tensor([[out[-1]]], device=eng.device),
                                   position_ids=torch.tensor([[self._pos]], device=eng.device),
                                   cache=self._cache, use_cache=True).logits[0, -1]
            self._pos += 1
            tok = int(logits.argmax())
        self._decode_s += time.perf_counter() - t0
        out.append(tok)
        return tok

    def close(self) -> None:
        """End the stream early (or after exhaustion) and commit the thread's resident state."""
        if self._done:
            return
        self._done = True
        self.result.stats["decode_s"] = self._decode_s
        self.result.stats["output_tokens"] = len(self.result.output_ids)
        if self._th is not None:
            self._registry._commit(self._th, self._version, self.result, self._cache)


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

    Raises:
        ValueError: a bad ``on_evict`` or budget.
    """

    def __init__(self, engine: PatchKVEngine, *, resident_budget_bytes: int = DEFAULT_RESIDENT_BUDGET,
                 offload_budget_bytes: int | None = None, on_evict: str = "offload", workers: int = 1):
        if on_evict not in ("offload", "drop"):
            raise ValueError(f"on_evict must be 'offload' or 'drop', got {on_evict!r}")
        if resident_budget_bytes < 0 or (offload_budget_bytes is not None and offload_budget_bytes < 0):
            raise ValueError("budgets must be >= 0 bytes")
        self.engine = engine
        self.resident_budget_bytes = resident_budget_bytes
        self.offload_budget_bytes = offload_budget_bytes
        self.on_evict = on_evict
        self.forward_lock = threading.RLock()
        self._lock = threading.Lock()
        self._threads: OrderedDict[ThreadKey, _Thread] = OrderedDict()  # least recently used first
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="patchkv-offload")
        self.events: list[dict[str, Any]] = []  # evictions and drops, for inspection

    # ----------------------------------------------------------------- tables

    def _thread(self, key: ThreadKey, create: bool = True) -> _Thread | None:
        with self._lock:
            th = self._threads.get(key)
            if th is None and create:
                th = self._threads[key] = _Thread(key=key)
            if th is not None:
                self._threads.move_to_end(key)
                th.last_used = time.monotonic()
            return th

    def keys(self) -> list[ThreadKey]:
        """Known thread keys, least recently used first."""
        with self._lock:
            return list(self._threads)

    def resident_bytes(self) -> int:
        """K/V bytes held resident across threads."""
        with self._lock:
            return sum(_kv_bytes(t.resident) for t in self._threads.values() if t.resident is not None)

    def offloaded_bytes(self) -> int:
        """Checkpoint bytes held across threads."""
        with self._lock:
            return sum(_ckpt_bytes(t.checkpoint) for t in self._threads.values() if t.checkpoint is not None)

    def handle(self, key: ThreadKey) -> dict[str, Any] | None:
        """The KV handle of a thread's current version, JSON-serialisable (no tensors).

        Returns:
            ``{"thread_id", "checkpoint_ns", "version", "ids_hash", "tokens", "kv"}`` with ``kv`` one of
            ``"resident"``, ``"offloaded"``, ``"offloading"``, ``"none"``; None for an unknown thread.
        """
        th = self._thread(key, create=False)
        if th is None or th.token_ids is None:
            return None
        if th.resident is not None:
            kv = "offloading" if th.pending is not None and not th.pending.done() else "resident"
        elif th.checkpoint is not None and th.checkpoint_version == th.version:
            kv = "offloaded"
        else:
            kv = "none"
        return {"thread_id": key[0], "checkpoint_ns": key[1], "version": th.version,
                "ids_hash": ids_hash(th.token_ids), "tokens": int(len(th.token_ids)), "kv": kv}

    def handles(self, thread_id: str) -> list[dict[str, Any]]:
        """Handles of every key of ``thread_id`` (all namespaces)."""
        return [h for k in self.keys() if k[0] == str(thread_id) and (h := self.handle(k)) is not None]

    def expect(self, key: ThreadKey, handle: dict[str, Any]) -> None:
        """Note that a persisted graph checkpoint refers to ``handle``'s context version of ``key``.

        When this registry holds no KV of that version (a new process or registry), the thread's version
        counter continues from the handle's and the next resume is exact with ``stats["fallback"]``
        saying why. A registry that already holds the version (or a later one) ignores the call.
        """
        v = int(handle.get("version", 0))
        th = self._thread(key)
        with th.lock:
            if th.version >= v:
                return
            th.version, th.token_ids = v, None
            th.resident, th.checkpoint = None, None
            th.lost = (f"exact recompute: the graph checkpoint refers to KV of context version {v} "
                       f"(ids {handle.get('ids_hash')}) that this process does not hold (restart or new registry)")

    def fork(self, src: ThreadKey, dst: ThreadKey) -> bool:
        """Start thread ``dst`` from ``src``'s current version and KV (shared, read-only tensors).

        ``dst``'s previous state, if any, is replaced. A pending offload of ``src`` is waited for.

        Returns:
            False when ``src`` has no context version.
        """
        s = self._thread(src, create=False)
        if s is None:
            return False
        self._wait_pending(s)
        d = self._thread(dst)
        with s.lock:
            if s.token_ids is None:
                return False
            snapshot = (s.version, s.token_ids, s.resident, s.checkpoint, s.checkpoint_version, s.checkpoint_source)
        self._wait_pending(d)
        with d.lock:
            (d.version, d.token_ids, d.resident, d.checkpoint, d.checkpoint_version, d.checkpoint_source) = snapshot
            d.lost, d.pending = None, None
        self._enforce_resident_budget(keep=dst)
        return True

    def forget(self, thread_id: str) -> None:
        """Drop every key of ``thread_id`` (e.g. when the graph thread is deleted)."""
        for k in self.keys():
            if k[0] == str(thread_id):
                th = self._thread(k, create=False)
                if th is not None:
                    self._wait_pending(th)
                    with th.lock, self._lock:
                        self._threads.pop(k, None)

    def close(self) -> None:
        """Finish pending offloads and stop the worker."""
        self._executor.shutdown(wait=True)

    # ---------------------------------------------------------------- resume

    def stream(self, key: ThreadKey | None, token_ids, *, strategy: str = "patchkv", max_new_tokens: int = 16,
               **options) -> TokenStream:
        """Resume ``key``'s next context version and return a greedy token stream over it.

        Args:
            key: the thread key (None: a one-off exact resume, nothing kept).
            token_ids: the new context version's ids.
            strategy: the strategy when the thread has KV (``exact`` always recomputes).
            max_new_tokens: greedy tokens to draw.
            **options: strategy options (``dirty_window=``, ``kappa=`` ...).

        Returns:
            A :class:`TokenStream`; its ``result.stats`` holds the engine's resume stats plus
            ``thread_id``, ``checkpoint_ns``, ``version``, ``base_version``, ``base`` (where the base KV
            came from), ``requested_strategy``, ``offload_wait_s``, ``offload_on_path_s`` and ``fallback``.

        Raises:
            ValueError: bad ids or strategy (from the engine).
        """
        ids = _as_ids(token_ids)
        if key is None:
            with self.forward_lock:
                res = self.engine.resume(None, ids, strategy="exact", max_new_tokens=0)
            res.stats.update(thread_id=None, checkpoint_ns=None, version=None, base_version=None, base="none",
                             requested_strategy=strategy, offload_wait_s=0.0, offload_on_path_s=0.0)
            return TokenStream(self, None, 0, res, max_new_tokens)
        th = self._thread(key)
        wait_s = self._wait_pending(th)
        with th.lock:
            if strategy == "exact":  # no base needed: do not write one
                base, base_version, source, on_path = None, None, "none", 0.0
                fallback = None
            else:
                base, base_version, source, on_path = self._base(th)
                fallback = th.lost if base is None else None
            with self.forward_lock:
                if base is None:
                    res = self.engine.resume(None, ids, strategy="exact", max_new_tokens=0)
                else:
                    res = self.engine.resume(base, ids, strategy=strategy, max_new_tokens=0, **options)
            th.version += 1
            th.token_ids, th.lost = ids, None
            th.resident = dataclasses.replace(res, cache=None, output_ids=[])
            th.checkpoint, th.pending = None, None  # superseded by the resident version
            version = th.version
        res.stats.update(thread_id=key[0], checkpoint_ns=key[1], version=version, base_version=base_version,
                         base=source, requested_strategy=strategy, offload_wait_s=wait_s,
                         offload_on_path_s=on_path)
        if res.stats.get("fallback") is None and fallback is not None:
            res.stats["fallback"] = fallback
        self._enforce_resident_budget(keep=key)
        return TokenStream(self, th, version, res, max_new_tokens)

    def generate(self, key: ThreadKey | None, token_ids, *, strategy: str = "patchkv", max_new_tokens: int = 16,
                 **options) -> ResumeResult:
        """Resume ``key``'s next context version and decode greedily (see :meth:`stream`).

        Returns:
            The :class:`~patchkv_agent.engine.ResumeResult` (``output_ids`` filled, ``cache`` holding the
            context and the decoded tokens except the last).
        """
        s = self.stream(key, token_ids, strategy=strategy, max_new_tokens=max_new_tokens, **options)
        for _ in s:
            pass
        return s.result

    async def agenerate(self, key: ThreadKey | None, token_ids, **kwargs) -> ResumeResult:
        """Async twin of :meth:`generate` (runs in the default executor)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, lambda: self.generate(key, token_ids, **kwargs))

    def _base(self, th: _Thread):
        """The checkpoint to resume ``th`` from (writing one on the critical path if only resident KV exists)."""
        if th.checkpoint is not None and (th.resident is None or th.checkpoint_version == th.version):
            return th.checkpoint, th.checkpoint_version, th.checkpoint_source, 0.0
        if th.resident is not None:
            t0 = time.perf_counter()
            with self.forward_lock:
                ckpt = self.engine.checkpoint_from(th.resident)
            th.checkpoint, th.checkpoint_version, th.checkpoint_source = ckpt, th.version, "on_path"
            return ckpt, th.version, "on_path", time.perf_counter() - t0
        return None, None, "none", 0.0

    def _commit(self, th: _Thread, version: int, res: ResumeResult, cache) -> None:
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
        with th.lock:
            if th.version != version or th.resident is None:
                return
            th.resident = dataclasses.replace(res, cache=None, output_ids=[], context_ids=ids, keys=keys,
                                              values=values)
        self._enforce_resident_budget(keep=th.key)

    # --------------------------------------------------------------- offload

    def offload_async(self, key: ThreadKey | None) -> Future | None:
        """Start writing the thread's resident KV to a checkpoint in the background worker.

        A later resume of this thread waits for it. Nothing happens for an unknown thread, a thread
        without resident KV, or one whose offload is already pending (that future is returned).

        Args:
            key: the thread key.

        Returns:
            The offload's future (its result: the offload seconds, or None when there was nothing to do),
            or None when nothing was started.
        """
        if key is None:
            return None
        th = self._thread(key, create=False)
        if th is None:
            return None
        with th.lock:
            if th.pending is not None and not th.pending.done():
                return th.pending
            if th.resident is None:
                return None
            th.pending = self._executor.submit(self._offload_job, th, th.version, "background")
            return th.pending

    def offload(self, key: ThreadKey | None) -> float | None:
        """Synchronous :meth:`offload_async`: returns the offload seconds (None when nothing to do)."""
        fut = self.offload_async(key)
        return fut.result() if fut is not None else None

    async def aoffload(self, key: ThreadKey | None) -> float | None:
        """Async twin of :meth:`offload`."""
        fut = self.offload_async(key)
        return await asyncio.wrap_future(fut) if fut is not None else None

    def wait(self, key: ThreadKey | None) -> float:
        """Wait for a pending offload of ``key``; returns the seconds waited."""
        th = self._thread(key, create=False) if key is not None else None
        return self._wait_pending(th) if th is not None else 0.0

    def _wait_pending(self, th: _Thread) -> float:
        fut = th.pending
        if fut is None or fut.done():
            return 0.0
        t0 = time.perf_counter()
        try:
            fut.result()
        except Exception:  # the job recorded the failure in th.lost / kept the resident KV
            log.exception("background offload of thread %s failed", th.key)
        return time.perf_counter() - t0

    def _offload_job(self, th: _Thread, version: int, source: str) -> float | None:
        with th.lock:
            if th.version != version or th.resident is None:
                return None
            t0 = time.perf_counter()
            with self.forward_lock:
                ckpt = self.engine.checkpoint_from(th.resident)
            th.checkpoint, th.checkpoint_version, th.checkpoint_source = ckpt, version, source
            th.resident = None
            dt = time.perf_counter() - t0
        self._enforce_offload_budget(keep=th.key)
        return dt

    # -------------------------------------------------------------- budgets

    def _victims(self, keep: ThreadKey) -> Iterator[_Thread]:
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
                if th.resident is None or (th.pending is not None and not th.pending.done()):
                    continue
                total -= _kv_bytes(th.resident)
                if self.on_evict == "offload":
                    th.pending = self._executor.submit(self._offload_job, th, th.version, "evicted")
                    self.events.append({"event": "evict_offload", "key": th.key, "version": th.version})
                else:
                    th.lost = (f"exact recompute: resident KV of context version {th.version} was evicted "
                               f"(resident budget {self.resident_budget_bytes} B) without an offload")
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
                if th.checkpoint is None:
                    continue
                if th.resident is None and th.checkpoint_version == th.version:
                    th.lost = (f"exact recompute: checkpoint of context version {th.version} was dropped "
                               f"(offload budget {self.offload_budget_bytes} B)")
                self.events.append({"event": "drop_checkpoint", "key": th.key, "version": th.checkpoint_version})
                th.checkpoint = None
            finally:
                th.lock.release()


def run_stream(stream: TokenStream, on_token: Callable[[int], bool | None] | None = None) -> ResumeResult:
    """Drain a :class:`TokenStream`, calling ``on_token(tok)`` after each token; a truthy return stops it.

    Returns:
        The stream's result.
    """
    try:
        for tok in stream:
            if on_token is not None and on_token(tok):
                break
    finally:
        stream.close()
    return stream.result


__all__ = ["ThreadRegistry", "ThreadKey", "TokenStream", "thread_key", "ids_hash", "run_stream"]

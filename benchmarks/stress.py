"""Load test: many agent threads editing their contexts concurrently over one engine and one budgeted store.

``run_stress`` drives ``threads`` threads (OS threads or asyncio tasks), each through ``versions`` context
versions: version 0 is checkpointed into the store; every later version is a random middle edit of the
previous one, resumed from the stored checkpoint (:func:`~patchkv_agent.runtime.kvstore.resume_from_store`) and
checkpointed again, replacing the thread's previous entry. The store's byte budget holds only a few
threads' checkpoints, so entries are evicted and those resumes fall back to exact recomputation.

The check: every thread's results equal the same thread run alone (sequentially, unbudgeted store) with
the same resumes served from the store and the same ones falling back; i.e. concurrency and eviction change
which resumes hit the store, never what a resume returns, and no thread ever sees another's state.
The summary reports evictions, fallbacks by reason, peak RSS and wall time.

``patchkv-agent stress`` then runs the property check of diff + plan + recover
(:func:`~benchmarks.properties.run_properties`, ``--property-examples``, default 1,000 Hypothesis
examples on the same tiny engine) and adds its counts to the summary.

Knows the engine, the stores and the tiny model factory (:mod:`.tiny`); nothing about LangGraph or benchmarks.
"""

from __future__ import annotations

import asyncio
import json
import resource
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from patchkv_agent.engine import PatchKVEngine
from patchkv_agent.runtime.kvstore import CheckpointKey, DiskStore, KVStore, MemoryStore, resume_from_store
from .tiny import tiny_engine

LOGIT_TOL = 1e-4


def thread_versions(seed: int, thread: int, versions: int, length: int, vocab: int) -> list[list[int]]:
    """``versions`` context versions of one thread: random ids, then random middle edits (length changes)."""
    rng = np.random.default_rng([seed, thread])
    ids = rng.integers(3, vocab, size=length).tolist()
    out = [ids]
    for _ in range(versions - 1):
        ids = list(out[-1])
        i = int(rng.integers(4, len(ids) - 8))
        j = i + int(rng.integers(1, 9))
        ids[i:j] = rng.integers(3, vocab, size=int(rng.integers(1, 11))).tolist()
        out.append(ids)
    return out


def stress_workload(engine: PatchKVEngine, *, seed: int, threads: int, versions: int, length: int,
                    budget_entries: float) -> tuple[list[list[list[int]]], int, int]:
    """The load test's work and its store budget.

    Args:
        engine: the engine (its vocabulary; it checkpoints the first thread's version 0 once).
        seed, threads, versions, length: of :func:`thread_versions`.
        budget_entries: the budget in entries of that first checkpoint's size.

    Returns:
        ``(work, entry_bytes, budget_bytes)``: every thread's versions, the encoded blob bytes of one
        entry, and ``int(budget_entries * entry_bytes)``.
    """
    from patchkv_agent.runtime.kvstore.codec import encode_checkpoint

    work = [thread_versions(seed, t, versions, length, engine.spec.vocab_size) for t in range(threads)]
    probe = engine.checkpoint(work[0][0])
    entry = sum(b["nbytes"] for b in encode_checkpoint(
        probe, CheckpointKey.of(probe, deployment="stress", thread_id="probe", version=0))[0]["blobs"])
    return work, entry, int(budget_entries * entry)


def same_as_solo(row: dict[str, Any], solo: dict[str, Any]) -> bool:
    """A resume under load returned what the thread run alone did: the same tokens, both served from the
    store or both fallen back, logits within :data:`LOGIT_TOL`."""
    return (row["output_ids"] == solo["output_ids"] and (row["fallback"] is None) == (solo["fallback"] is None)
            and float((row["logits"] - solo["logits"]).abs().max()) <= LOGIT_TOL)


class ThreadEpisode:
    """One agent thread's episode of the load test, step by step (OS threads and asyncio tasks drive the
    same code; :mod:`.faults` replays threads alone with it).

    :meth:`start` checkpoints version 0 into ``store``; :meth:`step` resumes version ``v`` from the stored
    base with :func:`~patchkv_agent.runtime.kvstore.resume_from_store` and offloads the result in place of
    the thread's previous entry; :meth:`finish` deletes the last entry and returns one row per resume
    (``thread``, ``version``, ``fallback``, ``output_ids``, ``logits``, ``recompute_tokens``).
    :meth:`run` / :meth:`arun` do all three, waiting for a tool call between versions.

    Args:
        engine: the engine (its forwards run under ``lock``).
        store: where the thread's checkpoints go.
        lock: one forward at a time per model.
        thread: the thread's number (its id is ``thread-<n>``; seeds its tool waits).
        versions: the context versions (token ids), version 0 first.
        strategy, max_new_tokens: of every resume.
        evict_before: versions whose stored base is deleted before they resume (a solo replay of a
            thread whose entries were evicted under load).
    """

    def __init__(self, engine: PatchKVEngine, store: KVStore, lock: threading.Lock, thread: int,
                 versions: list[list[int]], *, strategy: str, max_new_tokens: int,
                 evict_before: set[int] | None = None):
        self.engine, self.store, self.lock, self.thread, self.versions = engine, store, lock, thread, versions
        self.kw = dict(strategy=strategy, max_new_tokens=max_new_tokens)
        self.evict_before = evict_before or set()  # versions whose base is deleted first (the solo replay)
        self.tid, self.key, self.rows = f"thread-{thread}", None, []
        self._rng = np.random.default_rng(thread)

    def _tool_wait(self, tool_s: float) -> float:
        return tool_s * (0.25 + 1.5 * float(self._rng.random()))  # tools take different times

    def _offload(self, ckpt, version: int) -> None:
        if self.key is not None:
            self.store.delete(self.key)  # a thread keeps only its latest version
        self.key = self.store.key_for(ckpt, thread_id=self.tid, version=version)
        self.store.put(self.key, ckpt)

    def start(self) -> None:
        with self.lock:
            ckpt = self.engine.checkpoint(self.versions[0])
        self._offload(ckpt, 0)

    def step(self, v: int) -> None:
        """Resume version ``v`` from the stored base (the agent is back from its tool), offload it."""
        if v in self.evict_before:
            self.store.delete(self.key)
        res = resume_from_store(self.engine, self.store, self.key, self.versions[v], forward_lock=self.lock,
                                **self.kw)
        with self.lock:
            ckpt = self.engine.checkpoint_from(res)
        self._offload(ckpt, v)
        self.rows.append({"thread": self.thread, "version": v, "fallback": res.stats["fallback"],
                          "output_ids": list(res.output_ids), "logits": res.logits.detach().clone(),
                          "recompute_tokens": res.stats["recompute_tokens"]})

    def finish(self) -> list[dict[str, Any]]:
        self.store.delete(self.key)
        return self.rows

    def run(self, tool_s: float = 0.0) -> list[dict[str, Any]]:
        self.start()
        for v in range(1, len(self.versions)):
            time.sleep(self._tool_wait(tool_s))
            self.step(v)
        return self.finish()

    async def arun(self, tool_s: float = 0.0) -> list[dict[str, Any]]:
        await asyncio.to_thread(self.start)
        for v in range(1, len(self.versions)):
            await asyncio.sleep(self._tool_wait(tool_s))  # the tool call: other threads offload meanwhile
            await asyncio.to_thread(self.step, v)
        return await asyncio.to_thread(self.finish)


def _reason_kind(fallback: str | None) -> str:
    if fallback is None:
        return "none"
    for kind in ("evicted", "never stored", "corrupt", "foreign", "another model", "unavailable", "exceed"):
        if kind in fallback:
            return kind
    return "other"


def run_stress(*, threads: int = 16, versions: int = 5, budget_entries: float = 4.0, tier: str = "memory",
               mode: str = "threads", workers: int | None = None, length: int = 96, max_new_tokens: int = 4,
               strategy: str = "patchkv", seed: int = 0, engine: PatchKVEngine | None = None,
               root: str | None = None, redis_url: str | None = None, tool_s: float = 0.02) -> dict[str, Any]:
    """Run the load test and compare every thread with its solo replay.

    Args:
        threads: concurrent agent threads.
        versions: context versions per thread (the first is checkpointed, the others resumed).
        budget_entries: store budget in checkpoints of the first thread's size (below ``threads``: evictions).
        tier: ``memory``, ``disk`` (under ``root``, a temporary directory by default) or ``redis`` (``redis_url``).
        mode: ``threads`` (a pool of OS threads) or ``asyncio`` (one task per agent thread).
        workers: OS threads of the pool (default: ``threads``).
        length: tokens of each thread's first version.
        max_new_tokens: greedy tokens per resume.
        strategy: resume strategy.
        seed: workload seed.
        engine: the engine (default: :func:`.tiny.tiny_engine` of ``seed``: a tiny random llama, 8-token blocks).
        root, redis_url: where the disk / Redis tier lives.
        tool_s: the tool call each thread waits for between versions (other threads offload meanwhile).

    Returns:
        The summary: counts, ``evictions``, ``fallbacks`` by reason, ``solo_match`` (all threads equal their
        solo replay), ``mismatches``, ``peak_rss_mib``, ``wall_s``, ``store`` (the store's summary).

    Raises:
        ValueError: an unknown tier or mode, or fewer than 2 versions.
    """
    if versions < 2 or threads < 1:
        raise ValueError("need threads >= 1 and versions >= 2")
    if mode not in ("threads", "asyncio"):
        raise ValueError(f"mode must be 'threads' or 'asyncio', got {mode!r}")
    engine = engine or tiny_engine(seed=seed)
    work, entry, budget = stress_workload(engine, seed=seed, threads=threads, versions=versions, length=length,
                                          budget_entries=budget_entries)
    tmp = None
    if tier == "memory":
        store: KVStore = MemoryStore(deployment="stress", budget_bytes=budget)
    elif tier == "disk":
        if root is None:
            tmp = tempfile.TemporaryDirectory(prefix="patchkv-stress-")
            root = tmp.name
        store = DiskStore(root, deployment="stress", budget_bytes=budget, fsync=False)
    elif tier == "redis":
        from patchkv_agent.runtime.kvstore import RedisStore

        store = RedisStore(redis_url or "redis://127.0.0.1:6379/0", deployment="stress",
                           prefix=f"stress-{time.time_ns()}", budget_bytes=budget)
    else:
        raise ValueError(f"tier must be memory, disk or redis, got {tier!r}")
    lock = threading.Lock()  # one forward at a time per model (the capture pass patches attention)
    kw = dict(strategy=strategy, max_new_tokens=max_new_tokens)

    t0 = time.perf_counter()
    episodes = [ThreadEpisode(engine, store, lock, t, work[t], **kw) for t in range(threads)]
    if mode == "threads":
        with ThreadPoolExecutor(max_workers=workers or threads) as pool:
            results = list(pool.map(lambda e: e.run(tool_s), episodes))
    else:
        async def main():
            return await asyncio.gather(*(e.arun(tool_s) for e in episodes))
        results = asyncio.run(main())
    wall = time.perf_counter() - t0
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    summary_store = store.summary()
    store.close()
    if tmp is not None:
        tmp.cleanup()

    mismatches = []
    solo_pool = ThreadPoolExecutor(max_workers=1)  # one thread at a time, off the main thread like the others
    for t, rows in enumerate(results):
        evicted = {r["version"] for r in rows if r["fallback"] is not None}
        alone = ThreadEpisode(engine, MemoryStore(deployment="stress"), lock, t, work[t], evict_before=evicted,
                              **kw)
        solo = solo_pool.submit(alone.run).result()
        for r, s in zip(rows, solo, strict=True):
            if not same_as_solo(r, s):
                mismatches.append({"thread": t, "version": r["version"], "fallback": r["fallback"]})
    solo_pool.shutdown()
    flat = [r for rows in results for r in rows]
    kinds = Counter(_reason_kind(r["fallback"]) for r in flat)
    return {
        "threads": threads, "versions": versions, "mode": mode, "tier": tier, "strategy": strategy,
        "resumes": len(flat), "entry_bytes": entry, "budget_bytes": budget,
        "evictions": summary_store["evictions"], "selective_resumes": kinds.pop("none", 0),
        "fallbacks": dict(kinds), "solo_match": not mismatches, "mismatches": mismatches,
        "recompute_tokens_mean": float(np.mean([r["recompute_tokens"] for r in flat])),
        "peak_rss_mib": round(peak_rss_mib, 1), "wall_s": round(wall, 3), "store": summary_store,
    }


def format_summary(s: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`run_stress`'s result."""
    lines = [
        f"stress: {s['threads']} threads x {s['versions']} versions ({s['mode']}, {s['tier']} tier, {s['strategy']})",
        f"  resumes {s['resumes']}: selective {s['selective_resumes']}, exact fallbacks {s['fallbacks'] or {}}",
        f"  budget {s['budget_bytes']} B (~{s['budget_bytes'] / max(1, s['entry_bytes']):.1f} checkpoints of "
        f"{s['entry_bytes']} B); evictions {s['evictions']}",
        f"  equal to each thread run alone: {'yes' if s['solo_match'] else 'NO: ' + json.dumps(s['mismatches'][:5])}",
        f"  peak RSS {s['peak_rss_mib']} MiB; wall {s['wall_s']} s; "
        f"mean recompute {s['recompute_tokens_mean']:.1f} tokens",
    ]
    if s.get("property") is not None:
        from .properties import format_properties

        lines.append(format_properties(s["property"]))
    return "\n".join(lines)

"""Fault-mode load test (``patchkv-agent stress --faults``): many threads, every tier, faults injected meanwhile.

:func:`run_fault_stress` drives ``threads`` agent threads x ``versions`` context versions (the workload of
:mod:`.stress`: version 0 checkpointed, each later version a random middle edit resumed from the stored
checkpoint with :func:`~patchkv_agent.runtime.kvstore.resume_from_store`, then checkpointed again) over each
tier (memory, disk, Redis when ``redis-server`` is installed; the test starts its own) with a byte budget
that holds only a few checkpoints, while an injector damages what is stored:

- ``meta_corrupt`` / ``payload_corrupt``: a flipped bit in a freshly acknowledged entry's metadata or
  payload (the disk file's header, metadata or blob bytes; the Redis metadata hash, an index record or a
  blob; the memory tier's metadata record or a tensor), flipped by its own thread after the put, while
  the others run (never bytes in use);
- ``writer_kill`` (disk): a separate writer process putting, replacing and deleting entries in a disk store
  of the same root, killed with SIGKILL at a random moment (mostly inside a put); then the store is
  reopened (recovery) and every entry the writer had acknowledged and not deleted must read back intact;
- ``disk_reopen``: a second store opened on the stressed directory while puts are in flight (its
  recovery must not disturb them);
- ``redis_pause`` (SIGSTOP for longer than the client timeout, then SIGCONT) and ``redis_restart``
  (SIGKILL, then a new server on the same port and append-only file, fsync always);
- budget pressure throughout (evictions).

The checks: every resume's result equals the same thread run alone (the selective result when it was
served from the store, the exact result when it fell back, which must carry a
:class:`~patchkv_agent.core.fallback.Fallback` reason); exceptions escaping to the caller (must be 0); entries
lost that were acknowledged and not evicted, deleted or damaged on purpose (must be 0), checked at every
resume and by a final sweep. The summary counts faults injected by kind, exact fallbacks by reason, peak
RSS and wall time, and is written as JSON.

Knows the engine, the stores and the stress workload; nothing about LangGraph.
"""

from __future__ import annotations

import contextlib
import os
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from patchkv_agent.core.fallback import FallbackKind
from patchkv_agent.engine import PatchKVEngine
from patchkv_agent.runtime.kvstore import (CheckpointKey, CheckpointMissing, CorruptCheckpoint, DiskStore, KVStore, MemoryStore,
                               StoreUnavailable, resume_from_store)
from .redis_server import RedisProcess, redis_server_path
from .stress import ThreadEpisode, same_as_solo, stress_workload
from .tiny import tiny_engine

REDIS_TIMEOUT_S = 0.5
REDIS_PAUSE_S = 1.2


# ------------------------------------------------------------------------------------------ the ledger


class Ledger:
    """What was acknowledged, deleted, evicted and damaged on purpose; what was lost (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.acked: set[CheckpointKey] = set()
        self.deleted: set[CheckpointKey] = set()
        self.evicted: set[CheckpointKey] = set()
        self.damaged: set[CheckpointKey] = set()
        self.lost: list[dict[str, Any]] = []
        self.escaped: list[str] = []

    def excused(self, key: CheckpointKey) -> bool:
        return key in self.deleted or key in self.evicted or key in self.damaged

    def check_missing(self, key: CheckpointKey, why: str, store: KVStore) -> None:
        """A read found ``key`` missing: lost unless it was never acknowledged or is excused."""
        with self.lock:
            self.evicted.update(store.stats.evicted_keys)
            if key in self.acked and not self.excused(key):
                self.lost.append({"key": key.describe(), "why": why[:300]})


# ------------------------------------------------------------------------------------------ episodes


class _FaultEpisode:
    """One thread's episode; every store call is guarded (a failure is a counted event, never a crash)."""

    def __init__(self, engine: PatchKVEngine, store: KVStore, thread: int, versions: list[list[int]],
                 ledger: Ledger, *, strategy: str, max_new_tokens: int, progress: "Counter[str]",
                 injector: "Injector | None" = None):
        self.engine, self.store, self.thread, self.versions, self.ledger = engine, store, thread, versions, ledger
        self.kw = dict(strategy=strategy, max_new_tokens=max_new_tokens)
        self.tid, self.key, self.rows = f"thread-{thread}", None, []
        self.lock = threading.Lock()  # held while the thread reads or writes its entry
        self.progress, self.injector = progress, injector
        self._rng = np.random.default_rng(thread)

    def _offload(self, ckpt, version: int) -> None:
        old, self.key = self.key, self.store.key_for(ckpt, thread_id=self.tid, version=version)
        if old is not None:
            with self.ledger.lock:
                self.ledger.deleted.add(old)
            with contextlib.suppress(StoreUnavailable):
                self.store.delete(old)
        try:
            r = self.store.put(self.key, ckpt)
        except StoreUnavailable:
            return  # not acknowledged: the next resume is exact and says why
        with self.ledger.lock:
            if r.stored:
                self.ledger.acked.add(self.key)
            self.ledger.evicted.update(r.evicted)
        if r.stored and self.injector is not None:
            self.injector.maybe(self.key)

    def _guard(self, what: str, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - counted: must never happen
            with self.ledger.lock:
                self.ledger.escaped.append(f"thread {self.thread} {what}: {type(e).__name__}: {str(e)[:300]}")
            return None

    def start(self) -> None:
        with self.lock:
            ckpt = self._guard("checkpoint", lambda: self.engine.checkpoint(self.versions[0]))
            if ckpt is not None:
                self._guard("offload", lambda: self._offload(ckpt, 0))

    def step(self, v: int) -> None:
        with self.lock:
            key = self.key
            res = self._guard("resume", lambda: resume_from_store(self.engine, self.store, key, self.versions[v],
                                                                   **self.kw))
            self.progress["resumes"] += 1
            if res is None:
                self.rows.append({"thread": self.thread, "version": v, "escaped": True})
                return
            fb = res.stats["fallback"]
            if fb is not None and getattr(fb, "kind", None) is FallbackKind.MISSING:
                self.ledger.check_missing(key, str(fb), self.store)
            self.rows.append({"thread": self.thread, "version": v, "fallback": fb, "escaped": False,
                              "output_ids": list(res.output_ids), "logits": res.logits.detach().clone()})
            ckpt = self._guard("checkpoint_from", lambda: self.engine.checkpoint_from(res))
            if ckpt is not None:
                self._guard("offload", lambda: self._offload(ckpt, v))

    def run(self, tool_s: float) -> list[dict[str, Any]]:
        self.start()
        for v in range(1, len(self.versions)):
            time.sleep(tool_s * (0.25 + 1.5 * float(self._rng.random())))
            self.step(v)
        return self.rows


# ------------------------------------------------------------------------------------------ damage


def _flip(buf: bytearray, lo: int, hi: int, rng: random.Random) -> None:
    i = rng.randrange(lo, hi)
    buf[i] ^= 1 << rng.randrange(8)


def corrupt(store: KVStore, key: CheckpointKey, kind: str, rng: random.Random) -> bool:
    """Flip one bit of ``key``'s stored metadata (``kind="meta"``) or payload (``"payload"``); False when
    the entry is not there to damage."""
    if isinstance(store, MemoryStore):
        entry = store._entries.get(key)  # noqa: SLF001 - the fault injector reaches into the held entry
        if entry is None:
            return False
        ckpt, meta, _ = entry
        if kind == "meta":
            spec = rng.choice(meta["blobs"])
            spec["nbytes"] ^= 1 << rng.randrange(8)
        else:
            tensors = list(ckpt.keys + ckpt.values)
            if ckpt.mixed is not None:
                tensors += [t for layer in ckpt.mixed.payloads for p in layer.values() for t in p.tensors().values()]
            t = rng.choice([t for t in tensors if t.numel()])
            flat = t.view(-1).view(torch.uint8)
            flat[rng.randrange(flat.numel())] ^= 1 << rng.randrange(8)
        return True
    if isinstance(store, DiskStore):
        p = store.path_of(key)
        try:
            off = store.data_offset(key)
            buf = bytearray(p.read_bytes())
        except (OSError, CorruptCheckpoint):
            return False
        if kind == "meta":
            _flip(buf, 0, off, rng)  # header or metadata
        else:
            _flip(buf, off, len(buf), rng)
        tmp = p.with_name(f".inject-{p.name}")
        tmp.write_bytes(bytes(buf))
        os.replace(tmp, p)  # as a bad sector would: in place, under the same name
        return True
    c = store.client  # Redis
    if kind == "meta":
        which = rng.choice(["meta", "idx"])
        if which == "meta":
            raw = c.hget(store.meta_key(key), "meta")
            if raw is None:
                return False
            buf = bytearray(raw)
            _flip(buf, 0, len(buf), rng)
            c.hset(store.meta_key(key), "meta", bytes(buf))
        else:
            raw = c.hget(f"{store.ns}:idx", key.digest)
            if raw is None:
                return False
            buf = bytearray(raw)
            _flip(buf, 0, len(buf), rng)
            c.hset(f"{store.ns}:idx", key.digest, bytes(buf))
        return True
    names = store.blob_keys(key)
    if not names:
        return False
    name = rng.choice(names)
    raw = c.get(name)
    if not raw:
        return False
    buf = bytearray(raw)
    _flip(buf, 0, len(buf), rng)
    c.set(name, bytes(buf), keepttl=True)
    return True


class Injector:
    """Flips a bit in a thread's freshly acknowledged entry with probability ``rate`` (called by the thread
    itself after its put, while it holds its own lock: never bytes in use); counts what it injected."""

    def __init__(self, store: KVStore, ledger: Ledger, faults: Counter, *, seed: int, rate: float):
        self.store, self.ledger, self.faults, self.rate = store, ledger, faults, rate
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def maybe(self, key: CheckpointKey | None) -> None:
        with self.lock:
            if key is None or self.rng.random() >= self.rate:
                return
            kind = self.rng.choice(["meta", "payload"])
            rng = random.Random(self.rng.random())
        with self.ledger.lock:
            self.ledger.damaged.add(key)  # before the bytes change: another reader may see it at once
        try:
            done = corrupt(self.store, key, kind, rng)
        except (OSError, StoreUnavailable, CheckpointMissing, *_redis_errors()):
            done = False
        except Exception as e:  # noqa: BLE001 - an injector bug must show, not end the injections
            self.errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            done = False
        if done:
            with self.lock:
                self.faults[f"{kind}_corrupt"] += 1


def _redis_errors() -> tuple:
    try:
        import redis

        return (redis.exceptions.RedisError,)
    except ImportError:
        return ()


class RedisChaos(threading.Thread):
    """Pauses and restarts the Redis server at fixed fractions of the run's resumes."""

    def __init__(self, server: RedisProcess, progress: Counter, total: int, faults: Counter):
        super().__init__(daemon=True, name="patchkv-redis-chaos")
        self.server, self.progress, self.total, self.faults = server, progress, total, faults
        self.plan = [(0.2, "pause"), (0.45, "restart"), (0.7, "pause")]
        self.stop = threading.Event()

    def run(self) -> None:
        for frac, what in self.plan:
            while self.progress["resumes"] < frac * self.total:
                if self.stop.wait(0.01):
                    return
            if what == "pause":
                self.server.pause(REDIS_PAUSE_S)
            else:
                self.server.kill()
                time.sleep(0.3)
                self.server.start()
            self.faults[f"redis_{what}"] += 1


# ------------------------------------------------------------------------------------------ writer kills


def _writer_main(root: str, seed: int) -> None:
    """The writer process: put, replace and delete synthetic checkpoints in ``root`` until killed."""
    from patchkv_agent.core.checkpoint import Checkpoint

    store = DiskStore(root, deployment="writer", fsync=True)
    rng = np.random.default_rng(seed)
    prev: dict[int, CheckpointKey] = {}
    out = sys.stdout
    for i in range(10**9):
        slot = i % 3
        g = torch.Generator().manual_seed(int(rng.integers(1 << 31)))
        kv = [torch.randn(2, 2048, 64, generator=g) for _ in range(4)]  # 4 x 1 MiB
        ids = rng.integers(0, 1000, 2048).astype(np.int64)
        ids[0] = i  # which write this is: the reader checks it against the key's version
        ckpt = Checkpoint(token_ids=ids, keys=kv[:2], values=kv[2:], fingerprint="writer:synthetic", scores=None,
                          mixed=None)
        key = store.key_for(ckpt, thread_id=f"w{slot}", version=i)
        for attempt in range(2):  # the second put replaces the entry just written
            out.write(f"BEGIN {key.to_json()}\n")
            out.flush()
            store.put(key, ckpt)
            out.write(f"ACK {key.to_json()}\n")
            out.flush()
        if slot in prev:
            out.write(f"DELBEGIN {prev[slot].to_json()}\n")
            out.flush()
            store.delete(prev[slot])
        prev[slot] = key


def run_writer_kills(root: str, kills: int, seed: int, faults: Counter) -> dict[str, Any]:
    """Start the writer process ``kills`` times, SIGKILL it at a random moment, reopen and check the store."""
    rng = random.Random(seed)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    res = {"kills": 0, "kills_mid_put": 0, "acked": 0, "checked": 0, "lost": [], "tmp_rolled_back": 0}
    acked: set[CheckpointKey] = set()
    gone: set[CheckpointKey] = set()
    for k in range(kills):
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.faults", "--writer", root, str(seed + k)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 120
        while not any(ln.startswith("ACK") for ln in list(lines)) and proc.poll() is None \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        seen = len(lines)  # then strike shortly after the next put begins (most kills land inside a put)
        while proc.poll() is None and time.monotonic() < deadline and not any(
                ln.startswith("BEGIN") for ln in list(lines)[seen:]):
            time.sleep(0.001)
        time.sleep(rng.uniform(0.0, 0.02))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        reader.join(5)
        res["kills"] += 1
        faults["writer_kill"] += 1
        last = next((ln for ln in reversed(lines) if ln.strip()), "")
        res["kills_mid_put"] += last.startswith("BEGIN")
        for ln in lines:
            tag, _, rest = ln.strip().partition(" ")
            if tag == "ACK":
                acked.add(CheckpointKey.from_json(rest))
            elif tag == "DELBEGIN":
                gone.add(CheckpointKey.from_json(rest))
        store = DiskStore(root, deployment="writer")  # the restarted process: recovery runs here
        res["tmp_rolled_back"] += store.recovered["tmp_removed"]
        for key in acked - gone:
            res["checked"] += 1
            try:
                got = store.get(key)
                assert int(got.token_ids[0]) == key.version
            except (CheckpointMissing, CorruptCheckpoint, StoreUnavailable, AssertionError) as e:
                res["lost"].append({"key": key.describe(), "why": str(e)[:300]})
        store.close()
    res["acked"] = len(acked)
    return res


# ------------------------------------------------------------------------------------------ the run


def _reason(fb) -> str:
    kind = getattr(fb, "kind", None)
    if kind is None:
        return "no_kind"
    if kind is FallbackKind.MISSING:
        text = str(fb)
        for word in ("evicted", "quarantined", "never stored", "was deleted", "expired", "exceed", "removed", "left"):
            if word in text:
                return f"missing:{word.replace(' ', '_')}"
        return "missing:other"
    return kind.value


def _run_tier(tier: str, engine: PatchKVEngine, work: list[list[list[int]]], *, budget: int, seed: int,
              strategy: str, max_new_tokens: int, tool_s: float, inject_rate: float, writer_kills: int,
              tmp: str, faults: Counter, log) -> dict[str, Any]:
    ledger, progress = Ledger(), Counter()
    server = None
    extra: dict[str, Any] = {}
    if tier == "memory":
        store: KVStore = MemoryStore(deployment="stress", budget_bytes=budget)
    elif tier == "disk":
        store = DiskStore(Path(tmp) / "disk", deployment="stress", budget_bytes=budget, fsync=False)
    else:
        from patchkv_agent.runtime.kvstore import RedisStore

        server = RedisProcess(str(Path(tmp) / "redis"))
        store = RedisStore(server.url, deployment="stress", prefix="faults", budget_bytes=budget,
                           timeout_s=REDIS_TIMEOUT_S)
    kw = dict(strategy=strategy, max_new_tokens=max_new_tokens)
    injector = Injector(store, ledger, faults, seed=seed, rate=inject_rate)
    episodes = [_FaultEpisode(engine, store, t, work[t], ledger, progress=progress, injector=injector, **kw)
                for t in range(len(work))]
    total = len(work) * (len(work[0]) - 1)
    chaos = RedisChaos(server, progress, total, faults) if server is not None else None
    side: list[threading.Thread] = []
    if tier == "disk":
        def reopen():
            while progress["resumes"] < total // 2:
                time.sleep(0.01)
            DiskStore(Path(tmp) / "disk", deployment="stress", fsync=False).close()
            faults["disk_reopen"] += 1

        def kills():
            extra["writer"] = run_writer_kills(str(Path(tmp) / "disk"), writer_kills, seed, faults)

        side = [threading.Thread(target=reopen, daemon=True), threading.Thread(target=kills, daemon=True)]
    t0 = time.perf_counter()
    for th in ([chaos] if chaos else []) + side:
        th.start()
    with ThreadPoolExecutor(max_workers=len(episodes)) as pool:
        results = list(pool.map(lambda e: e.run(tool_s), episodes))
    if chaos is not None:
        chaos.stop.set()
        chaos.join()
    for th in side:
        th.join()
    wall = time.perf_counter() - t0
    # final sweep: every thread's last acknowledged entry is there and intact, or excused
    swept = 0
    for e in episodes:
        if e.key is None or e.key not in ledger.acked:
            continue
        swept += 1
        try:
            store.get(e.key)
        except CheckpointMissing as err:
            ledger.check_missing(e.key, err.reason, store)
        except CorruptCheckpoint as err:
            if e.key not in ledger.damaged:
                ledger.lost.append({"key": e.key.describe(), "why": f"corrupt without injection: {err}"})
        except StoreUnavailable as err:
            ledger.lost.append({"key": e.key.describe(), "why": f"unreachable at the sweep: {err}"})
    summary_store = store.summary()
    store.close()
    if server is not None:
        server.stop()
    log(f"  {tier}: {len(results) and sum(len(r) for r in results)} resumes in {wall:.1f} s; comparing with solo runs")
    return {"results": results, "ledger": ledger, "wall_s": wall, "store": summary_store, "swept": swept,
            "injector_errors": injector.errors, **extra}


def run_fault_stress(*, threads: int = 64, versions: int = 5, tiers: tuple[str, ...] | None = None,
                     budget_entries: float = 8.0, length: int = 64, max_new_tokens: int = 2,
                     strategy: str = "patchkv", seed: int = 0, engine: PatchKVEngine | None = None,
                     tool_s: float = 0.01, inject_rate: float = 0.15, writer_kills: int = 4,
                     progress: bool = True) -> dict[str, Any]:
    """Run the fault-mode load test over each tier and check every result.

    Args:
        threads, versions: agent threads and context versions per thread (>= 2).
        tiers: tiers to run (default memory, disk, and redis when a ``redis-server`` is found: :func:`.redis_server_path`).
        budget_entries: each store's budget, in checkpoints of the first thread's size.
        length: tokens of each thread's first version.
        max_new_tokens: greedy tokens per resume.
        strategy: resume strategy.
        seed: workload and fault seed.
        engine: the engine (default :func:`~benchmarks.tiny.tiny_engine` of ``seed``).
        tool_s: the tool call each thread waits for between versions.
        inject_rate: probability that a freshly acknowledged entry gets one bit flipped.
        writer_kills: SIGKILLs of the disk writer process.
        progress: print one line per phase to stderr.

    Returns:
        The summary (JSON-safe): per tier and in total, ``faults_injected`` by kind, ``results``,
        ``equal_to_solo``, ``selective``, ``exact_fallbacks`` by reason, ``escaped_exceptions``,
        ``lost_acknowledged``, ``mismatches``, ``peak_rss_mib``, ``wall_s``, ``ok``.

    Raises:
        ValueError: bad counts or an unknown tier.
    """
    if versions < 2 or threads < 1:
        raise ValueError("need threads >= 1 and versions >= 2")
    if tiers is None:
        tiers = ("memory", "disk") + (("redis",) if redis_server_path() else ())
    for t in tiers:
        if t not in ("memory", "disk", "redis"):
            raise ValueError(f"unknown tier {t!r}; choose from memory, disk, redis")

    def log(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    t_all = time.perf_counter()
    engine = engine or tiny_engine(seed=seed)
    work, entry, budget = stress_workload(engine, seed=seed, threads=threads, versions=versions, length=length,
                                          budget_entries=budget_entries)
    kw = dict(strategy=strategy, max_new_tokens=max_new_tokens)
    per_tier: dict[str, Any] = {}
    total_faults: Counter = Counter()
    solo_cache: dict[tuple[int, frozenset], list[dict[str, Any]]] = {}
    solo_pool = ThreadPoolExecutor(max_workers=1)
    lock = threading.Lock()
    for i, tier in enumerate(tiers):
        faults: Counter = Counter()
        log(f"stress --faults: {threads} threads x {versions} versions, {tier} tier, budget ~{budget_entries:g} "
            "checkpoints")
        with tempfile.TemporaryDirectory(prefix=f"patchkv-faults-{tier}-") as tmp:
            out = _run_tier(tier, engine, work, budget=budget, seed=seed * 100 + i, tool_s=tool_s,
                            inject_rate=inject_rate, writer_kills=writer_kills, tmp=tmp, faults=faults,
                            log=log, **kw)
        ledger: Ledger = out["ledger"]
        mismatches, reasons, equal, selective, no_reason = [], Counter(), 0, 0, 0
        flat = [r for rows in out["results"] for r in rows]
        for t, rows in enumerate(out["results"]):
            done = [r for r in rows if not r["escaped"]]
            fell = frozenset(r["version"] for r in done if r["fallback"] is not None)
            if (t, fell) not in solo_cache:
                alone = ThreadEpisode(engine, MemoryStore(deployment="stress"), lock, t, work[t],
                                      evict_before=set(fell), **kw)
                solo_cache[(t, fell)] = solo_pool.submit(alone.run).result()
            solo = {s["version"]: s for s in solo_cache[(t, fell)]}
            for r in done:
                s = solo[r["version"]]
                fb = r["fallback"]
                if fb is None:
                    selective += 1
                else:
                    reasons[_reason(fb)] += 1
                    no_reason += getattr(fb, "kind", None) is None or not str(fb).startswith("exact recompute: ")
                if same_as_solo(r, s):
                    equal += 1
                else:
                    mismatches.append({"tier": tier, "thread": t, "version": r["version"],
                                       "fallback": None if fb is None else str(fb)[:300]})
        writer = out.get("writer")
        lost = ledger.lost + (writer["lost"] if writer else [])
        per_tier[tier] = {
            "resumes": len(flat), "results": len(flat) - sum(r["escaped"] for r in flat), "equal_to_solo": equal,
            "selective": selective, "exact_fallbacks": dict(sorted(reasons.items())),
            "fallbacks_without_reason": no_reason, "faults_injected": dict(sorted(faults.items())),
            "escaped_exceptions": len(ledger.escaped), "escaped": ledger.escaped[:10],
            "acknowledged": len(ledger.acked), "lost_acknowledged": len(lost), "lost": lost[:10],
            "final_sweep_checked": out["swept"], "injector_errors": out["injector_errors"][:5],
            "evictions": out["store"]["evictions"], "quarantined": out["store"]["quarantined"], "mismatches": mismatches[:20], "n_mismatches": len(mismatches),
            "wall_s": round(out["wall_s"], 2), "store": out["store"], **({"writer": writer} if writer else {}),
        }
        total_faults.update(faults)
        log(f"  {tier}: {equal}/{len(flat)} equal to solo runs, fallbacks {dict(reasons)}, faults {dict(faults)}, "
            f"escaped {len(ledger.escaped)}, lost {len(lost)}")
    solo_pool.shutdown()
    tot = lambda f: sum(v[f] for v in per_tier.values())  # noqa: E731
    reasons_all: Counter = Counter()
    for v in per_tier.values():
        reasons_all.update(v["exact_fallbacks"])
    s = {
        "mode": "faults", "threads": threads, "versions": versions, "tiers": list(tiers), "strategy": strategy,
        "entry_bytes": entry, "budget_bytes": budget, "budget_entries": budget_entries,
        "faults_injected": dict(sorted(total_faults.items())), "resumes": tot("resumes"), "results": tot("results"),
        "equal_to_solo": tot("equal_to_solo"), "selective": tot("selective"),
        "exact_fallbacks": dict(sorted(reasons_all.items())), "fallbacks_without_reason": tot("fallbacks_without_reason"),
        "escaped_exceptions": tot("escaped_exceptions"), "lost_acknowledged": tot("lost_acknowledged"),
        "mismatches": tot("n_mismatches"), "evictions": tot("evictions"), "quarantined": tot("quarantined"),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_rss_children_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        "wall_s": round(time.perf_counter() - t_all, 1), "per_tier": per_tier,
    }
    s["ok"] = (s["mismatches"] == 0 and s["escaped_exceptions"] == 0 and s["lost_acknowledged"] == 0
               and s["fallbacks_without_reason"] == 0 and s["equal_to_solo"] == s["resumes"])
    return s


def format_fault_summary(s: dict[str, Any]) -> str:
    """A short human-readable summary of :func:`run_fault_stress`'s result."""
    lines = [f"stress --faults: {s['threads']} threads x {s['versions']} versions over {', '.join(s['tiers'])} "
             f"(budget ~{s['budget_entries']:g} checkpoints of {s['entry_bytes']} B)",
             f"  faults injected: {s['faults_injected']}; budget evictions {s['evictions']}; entries quarantined "
             f"{s['quarantined']}",
             f"  resumes {s['resumes']}: equal to the thread run alone {s['equal_to_solo']} "
             f"(selective {s['selective']}, exact fallbacks {sum(s['exact_fallbacks'].values())})",
             f"  exact fallbacks by reason: {s['exact_fallbacks']}",
             f"  escaped exceptions {s['escaped_exceptions']}; lost acknowledged entries {s['lost_acknowledged']}; "
             f"mismatches {s['mismatches']}",
             f"  peak RSS {s['peak_rss_mib']} MiB (writer processes {s['peak_rss_children_mib']} MiB); "
             f"wall {s['wall_s']} s; {'OK' if s['ok'] else 'FAILED'}"]
    for tier, v in s["per_tier"].items():
        w = v.get("writer")
        lines.append(f"  {tier}: {v['equal_to_solo']}/{v['resumes']} equal, faults {v['faults_injected']}"
                     + (f", writer: {w['kills']} kills ({w['kills_mid_put']} mid-put), {w['checked']} acknowledged "
                        f"entries checked after recovery, {len(w['lost'])} lost" if w else ""))
    return "\n".join(lines)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--writer":
    _writer_main(sys.argv[2], int(sys.argv[3]))

"""ThreadRegistry: per-thread versions, resident/offloaded KV, background offload, budgets, isolation."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch

from patchkv_agent.runtime.threads import ThreadRegistry, ids_hash, run_stream, thread_key
from tiny_models import chat_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
A, B = thread_key("a"), thread_key("b")


ENGINE = chat_engine  # the `engine` fixture (conftest.py)


def ctx(seed: int, n: int = 300) -> list[int]:
    return np.random.default_rng(seed).integers(5, 100, n).tolist()


def edited(ids: list[int], at: int = 80, new: list[int] | None = None) -> list[int]:
    return ids[:at] + (new or [7, 8, 9, 10, 11, 12]) + ids[at + 4:]


def exact(engine, ids, n=6):
    return engine.resume(None, ids, strategy="exact", max_new_tokens=n)


def test_new_thread_is_exact_then_middle_edit_takes_patchkv(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(0)
    r0 = reg.generate(A, c0, max_new_tokens=4)
    ref = exact(engine, c0, 4)
    assert r0.stats["strategy"] == "exact" and r0.stats["fallback"] is None and r0.stats["version"] == 1
    assert r0.output_ids == ref.output_ids
    torch.testing.assert_close(r0.logits, ref.logits)
    r1 = reg.generate(A, edited(c0), max_new_tokens=4)
    st = r1.stats
    assert st["strategy"] == "patchkv" and st["version"] == 2 and st["base_version"] == 1
    assert st["prefix_tokens"] == 80 and st["restore_tokens"] > 0 and st["recompute_tokens"] < len(c0)
    assert st["base"] == "resident" and st["offload_wait_s"] == 0  # no offload: the resident KV, nothing written


def test_prefix_strategy_through_registry_equals_exact(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(1)
    reg.generate(A, c0, max_new_tokens=3)
    c1 = edited(c0, at=150)
    r = reg.generate(A, c1, strategy="prefix", max_new_tokens=5)
    ref = exact(engine, c1, 5)
    assert r.stats["prefix_tokens"] == 150
    torch.testing.assert_close(r.logits, ref.logits, atol=1e-4, rtol=1e-4)
    assert r.output_ids == ref.output_ids


def test_decoded_tokens_join_the_resident_version(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(2, 200)
    r0 = reg.generate(A, c0, max_new_tokens=6)
    nxt = c0 + r0.output_ids[:-1] + ctx(3, 40)
    r1 = reg.generate(A, nxt, strategy="prefix", max_new_tokens=4)
    assert r1.stats["prefix_tokens"] == len(c0) + len(r0.output_ids) - 1
    ref = exact(engine, nxt, 4)
    torch.testing.assert_close(r1.logits, ref.logits, atol=1e-4, rtol=1e-4)


def test_resident_thread_resumes_without_its_offload_and_a_released_one_reads_the_checkpoint(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(4)
    reg.generate(A, c0, max_new_tokens=2)
    fut = reg.offload_async(A)
    assert fut is not None and reg.offload_async(A) in (fut, None)
    r1 = reg.generate(A, edited(c0), max_new_tokens=3)  # the resident KV: no wait, nothing written
    assert r1.stats["base"] == "resident" and r1.stats["offload_wait_s"] == 0.0
    assert r1.stats["offload_wait_s"] == 0.0 and r1.stats["strategy"] == "patchkv"
    # the same resume from a fresh registry (no offload at all) is the same: offload timing changes nothing
    solo = ThreadRegistry(engine)
    solo.generate(A, c0, max_new_tokens=2)
    _same(solo.generate(A, edited(c0), max_new_tokens=3), r1)
    # a released offload drops the resident KV: the next resume reads the checkpoint
    reg2 = ThreadRegistry(engine)
    reg2.generate(A, c0, max_new_tokens=2)
    assert reg2.offload(A, release=True) > 0 and reg2.handle(A)["kv"] == "offloaded"
    r2 = reg2.generate(A, edited(c0), max_new_tokens=3)
    assert r2.stats["base"] == "background" and r2.stats["strategy"] == "patchkv" and r2.stats["fallback"] is None
    reg3 = ThreadRegistry(engine)
    reg3.generate(A, c0, max_new_tokens=2)
    reg3.offload(A, release=True)
    _same(reg3.generate(A, edited(c0), max_new_tokens=3), r2)
    reg.close()


def test_a_finished_offload_of_the_same_version_is_not_written_again(engine, monkeypatch):
    """Deterministic (the first offload is waited for): a repeat writes no second checkpoint; a repeat with
    ``release`` drops the resident KV, and the next resume reads the one checkpoint."""
    reg = ThreadRegistry(engine)
    c0 = ctx(4)
    reg.generate(A, c0, max_new_tokens=2)
    calls = []
    real = engine.checkpoint_from
    monkeypatch.setattr(engine, "checkpoint_from", lambda res: calls.append(1) or real(res))
    fut = reg.offload_async(A)
    assert fut.result() > 0 and len(calls) == 1
    assert reg.offload_async(A) is fut and reg.handle(A)["kv"] == "resident"
    assert reg.offload_async(A, release=True) is fut and len(calls) == 1
    assert reg.handle(A)["kv"] == "offloaded"
    r = reg.generate(A, edited(c0), max_new_tokens=3)
    assert r.stats["base"] == "background" and r.stats["fallback"] is None
    # after the resume the thread holds a new version: its offload is written (a second checkpoint)
    assert reg.offload(A) > 0 and len(calls) == 2
    reg.close()


def test_a_resume_does_not_wait_for_an_offload_in_flight(engine, monkeypatch):
    """Deterministic: the offload blocks inside checkpoint_from until released; the resume completes first."""
    reg = ThreadRegistry(engine)
    c0 = ctx(5)
    reg.generate(A, c0, max_new_tokens=2)
    entered, release = threading.Event(), threading.Event()
    real = engine.checkpoint_from

    def blocked(result):
        entered.set()
        assert release.wait(30), "the test never released the offload"
        return real(result)

    monkeypatch.setattr(engine, "checkpoint_from", blocked)
    fut = reg.offload_async(A)
    assert entered.wait(30) and not fut.done()
    done = []
    t = threading.Thread(target=lambda: done.append(reg.generate(A, edited(c0), max_new_tokens=3)))
    t.start()
    t.join(60)
    assert done and not fut.done(), "the resume waited for the blocked offload"
    r = done[0]
    assert r.stats["base"] == "resident" and r.stats["offload_wait_s"] == 0.0 and r.stats["fallback"] is None
    release.set()
    assert fut.result(30) is None  # the thread moved on: the stale checkpoint is discarded, not installed
    assert any(e["event"] == "offload_discarded" for e in reg.events) and reg.handle(A)["kv"] == "resident"
    monkeypatch.setattr(engine, "checkpoint_from", real)
    solo = ThreadRegistry(engine)
    solo.generate(A, c0, max_new_tokens=2)
    _same(solo.generate(A, edited(c0), max_new_tokens=3), r)
    reg.close()


def test_interleaved_threads_equal_each_thread_alone(engine):
    a = [ctx(10), None]
    a[1] = edited(a[0], at=60)
    b = [ctx(11), None]
    b[1] = edited(b[0], at=120, new=[20, 21])

    def alone(seq):
        reg = ThreadRegistry(engine)
        return [reg.generate(A, v, max_new_tokens=5) for v in seq]

    ra, rb = alone(a), alone(b)
    reg = ThreadRegistry(engine)
    ia0 = reg.generate(A, a[0], max_new_tokens=5)
    ib0 = reg.generate(B, b[0], max_new_tokens=5)
    reg.offload_async(B)
    ia1 = reg.generate(A, a[1], max_new_tokens=5)
    ib1 = reg.generate(B, b[1], max_new_tokens=5)
    for got, want in [(ia0, ra[0]), (ib0, rb[0]), (ia1, ra[1]), (ib1, rb[1])]:
        assert got.output_ids == want.output_ids
        torch.testing.assert_close(got.logits, want.logits)
    assert ia1.stats["thread_id"] == "a" and ib1.stats["thread_id"] == "b"


def test_concurrent_os_threads_equal_sequential(engine):
    seqs = {A: [ctx(20), None], B: [ctx(21), None]}
    for k, s in seqs.items():
        s[1] = edited(s[0], at=90)
    seq_reg = ThreadRegistry(engine)
    want = {k: [seq_reg.generate(k, v, max_new_tokens=4).output_ids for v in s] for k, s in seqs.items()}
    reg, got, errors = ThreadRegistry(engine), {}, []

    def run(k):
        try:
            got[k] = []
            for v in seqs[k]:
                got[k].append(reg.generate(k, v, max_new_tokens=4).output_ids)
                reg.offload_async(k)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(k,)) for k in seqs]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors and got == want


@pytest.mark.parametrize("policy", ["offload", "drop"])
def test_lru_eviction_beyond_resident_budget(engine, policy):
    reg = ThreadRegistry(engine, resident_budget_bytes=1, on_evict=policy)
    ca, cb = ctx(30), ctx(31)
    reg.generate(A, ca, max_new_tokens=2)
    reg.generate(B, cb, max_new_tokens=2)  # A is least recently used: evicted
    reg.wait(A)
    assert reg.handle(A)["kv"] == ("offloaded" if policy == "offload" else "none")
    assert reg.handle(B)["kv"] == "resident"
    assert reg.events[0]["event"] == f"evict_{policy}" and reg.events[0]["key"] == A
    r = reg.generate(A, edited(ca), max_new_tokens=2)
    if policy == "offload":
        assert r.stats["base"] == "evicted" and r.stats["strategy"] == "patchkv" and r.stats["fallback"] is None
    else:
        assert r.stats["strategy"] == "exact" and "evicted" in r.stats["fallback"]


def test_offload_budget_drops_checkpoints_and_says_so(engine):
    reg = ThreadRegistry(engine, offload_budget_bytes=1)
    reg.generate(A, ctx(40), max_new_tokens=2)
    reg.offload(A, release=True)
    reg.generate(B, ctx(41), max_new_tokens=2)
    reg.offload(B, release=True)  # over budget: A's checkpoint (least recently used) is dropped
    r = reg.generate(A, edited(ctx(40)), max_new_tokens=2)
    assert r.stats["strategy"] == "exact" and "offload budget" in r.stats["fallback"]


def test_expect_after_restart_falls_back_and_continues_versions(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(50)
    reg.generate(A, c0, max_new_tokens=2)
    reg.generate(A, c0 + [5, 6], max_new_tokens=2)
    handle = reg.handle(A)
    assert handle["version"] == 2 and handle["ids_hash"] == ids_hash(c0 + [5, 6])
    json.dumps(handle)  # JSON only, no tensors
    fresh = ThreadRegistry(engine)
    fresh.expect(A, handle)
    r = fresh.generate(A, edited(c0), max_new_tokens=2)
    assert r.stats["strategy"] == "exact" and "does not hold" in r.stats["fallback"] and r.stats["version"] == 3
    r2 = fresh.generate(A, edited(c0) + [9], max_new_tokens=2)
    assert r2.stats["fallback"] is None and r2.stats["version"] == 4
    reg.expect(A, handle)  # a registry that holds the version ignores it
    assert reg.handle(A)["kv"] == "resident"


def test_stream_matches_generate_and_early_close_commits(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(60, 150)
    s = reg.stream(A, c0, max_new_tokens=6)
    toks = list(s)
    assert toks == exact(engine, c0, 6).output_ids and s.stats["decode_s"] >= 0
    s2 = reg.stream(B, c0, max_new_tokens=50)
    res = run_stream(s2, on_token=lambda t: len(s2.result.output_ids) >= 3)
    assert res.output_ids == toks[:3] and res.stats["output_tokens"] == 3
    nxt = c0 + toks[:2] + [9, 9]
    assert reg.generate(B, nxt, strategy="prefix", max_new_tokens=1).stats["prefix_tokens"] == len(c0) + 2


def test_no_key_is_stateless_exact(engine):
    reg = ThreadRegistry(engine)
    r = reg.generate(None, ctx(70, 100), max_new_tokens=3)
    assert r.stats["strategy"] == "exact" and r.stats["thread_id"] is None and reg.keys() == []
    assert reg.offload_async(None) is None


def test_bad_options_raise(engine):
    with pytest.raises(ValueError, match="on_evict"):
        ThreadRegistry(engine, on_evict="later")
    with pytest.raises(ValueError):
        ThreadRegistry(engine).generate(A, [], max_new_tokens=1)


def test_fork_starts_a_thread_from_another_threads_kv(engine):
    reg = ThreadRegistry(engine)
    c0 = ctx(80, 200)
    reg.generate(A, c0, max_new_tokens=3)
    assert reg.fork(A, B) and not reg.fork(thread_key("nobody"), B)
    rb = reg.generate(B, edited(c0), max_new_tokens=3)
    ra = reg.generate(A, edited(c0), max_new_tokens=3)
    assert rb.stats["strategy"] == "patchkv" and rb.stats["version"] == 2 and rb.stats["thread_id"] == "b"
    assert rb.output_ids == ra.output_ids
    torch.testing.assert_close(rb.logits, ra.logits)


# ------------------------------------------------------------------ store tiers


def _episode(reg, key, versions, n=3):
    """Resume each version, then offload it and release the resident KV (the thread idles), so that the next
    resume reads the store."""
    out = []
    for v in versions:
        out.append(reg.generate(key, v, max_new_tokens=n))
        reg.offload(key, release=True)
    return out


def _same(got, want):
    assert got.output_ids == want.output_ids
    assert torch.equal(got.logits, want.logits)


def test_store_tier_is_transparent_and_keeps_one_entry_per_thread(engine):
    from patchkv_agent.runtime.kvstore import MemoryStore

    c = [ctx(90)]
    c += [edited(c[0], at=60), edited(edited(c[0], at=60), at=150, new=[30, 31])]
    want = _episode(ThreadRegistry(engine), A, c)
    store = MemoryStore(deployment="t")
    reg = ThreadRegistry(engine, store=store)
    got = _episode(reg, A, c)
    for g, w in zip(got, want):
        _same(g, w)
    for g in got[1:]:
        st = g.stats
        assert st["strategy"] == "patchkv" and st["fallback"] is None and st["store_tier"] == "memory"
        assert st["base"] == "background" and st["base_version"] == st["version"] - 1
    assert reg.handle(A)["kv"] == "offloaded" and reg.offloaded_bytes() == 0
    assert [(k.thread_id, k.version) for k in store.keys()] == [("a", 3)]  # superseded entries deleted
    assert reg.fork(A, B)  # the fork gets an entry of its own
    assert sorted((k.thread_id, k.version) for k in store.keys()) == [("a", 3), ("b", 3)]
    nxt = edited(c[2], at=200)
    rb, ra = reg.generate(B, nxt, max_new_tokens=3), reg.generate(A, nxt, max_new_tokens=3)
    _same(rb, ra)
    assert rb.stats["fallback"] is None and rb.stats["strategy"] == "patchkv"
    reg.forget("a")
    reg.forget("b")
    reg.close()
    assert store.keys() == []
    with pytest.raises(ValueError, match="budget on the store"):
        ThreadRegistry(engine, store=store, offload_budget_bytes=10)


def test_store_budget_evicts_and_the_next_resume_is_exact_with_the_reason(engine):
    from patchkv_agent.runtime.kvstore import MemoryStore

    ca, cb = ctx(91), ctx(92)
    probe = MemoryStore(deployment="t")
    _episode(ThreadRegistry(engine, store=probe), A, [ca])
    store = MemoryStore(deployment="t", budget_bytes=int(1.5 * probe.nbytes()))  # about one checkpoint
    reg = ThreadRegistry(engine, store=store)
    ref = ThreadRegistry(engine)  # the no-store run
    for r in (reg, ref):
        _episode(r, A, [ca])
        _episode(r, B, [cb])  # B's offload evicts A's entry (least recently used)
    assert store.stats.evictions == 1 and [k.thread_id for k in store.keys()] == ["b"]
    assert any(e["event"] == "store_evict" and e["evicted"] == [("a", "", 1)] for e in reg.events)
    assert reg.handle(A)["kv"] == "offloaded"  # where the KV went; the store decides whether it stays
    ra, rb = reg.generate(A, edited(ca), max_new_tokens=3), reg.generate(B, edited(cb), max_new_tokens=3)
    assert ra.stats["strategy"] == "exact" and ra.stats["base"] == "none" and ra.stats["version"] == 2
    assert "evicted" in ra.stats["fallback"] and "budget" in ra.stats["fallback"]
    want_a = exact(engine, edited(ca), 3)
    assert ra.output_ids == want_a.output_ids
    torch.testing.assert_close(ra.logits, want_a.logits, atol=1e-4, rtol=1e-4)
    assert rb.stats["fallback"] is None and rb.stats["strategy"] == "patchkv"
    _same(rb, ref.generate(B, edited(cb), max_new_tokens=3))  # a store hit equals the no-store run
    tiny = ThreadRegistry(engine, store=MemoryStore(deployment="t", budget_bytes=10))  # nothing fits
    _episode(tiny, A, [ca])
    r = tiny.generate(A, edited(ca), max_new_tokens=1)
    assert r.stats["strategy"] == "exact" and "not kept by the memory store" in r.stats["fallback"]
    for x in (reg, ref, tiny):
        x.close()


def test_disk_store_survives_a_restart_and_damage_falls_back(engine, tmp_path):
    from patchkv_agent.runtime.kvstore import DiskStore

    ca, cb = ctx(93), ctx(94)
    ref = ThreadRegistry(engine)
    _episode(ref, A, [ca])
    want = ref.generate(A, edited(ca), max_new_tokens=3)
    with DiskStore(tmp_path, deployment="t", fsync=False) as before:
        reg = ThreadRegistry(engine, store=before)
        _episode(reg, A, [ca])
        _episode(reg, B, [cb])
        handles = {k: reg.handle(k) for k in (A, B)}
        reg.close()
        key_b = next(k for k in before.keys() if k.thread_id == "b")
        data, off = before.path_of(key_b), before.data_offset(key_b)
        raw = bytearray(data.read_bytes())
        raw[off + (len(raw) - off) // 2] ^= 0xFF  # a flipped byte in B's stored K/V
        data.write_bytes(bytes(raw))
    assert handles[A]["kv"] == "offloaded" and json.dumps(list(handles.values()))
    after = DiskStore(tmp_path, deployment="t", fsync=False)  # the restarted process
    fresh = ThreadRegistry(engine, store=after)
    C = thread_key("c")
    for k, h in [*handles.items(), (C, {**handles[A], "thread_id": "c", "version": 5})]:
        fresh.expect(k, h)
    ra = fresh.generate(A, edited(ca), max_new_tokens=3)
    assert ra.stats["strategy"] == "patchkv" and ra.stats["fallback"] is None and ra.stats["base"] == "restart"
    assert ra.stats["store_tier"] == "disk" and ra.stats["version"] == 2
    _same(ra, want)
    rb = fresh.generate(B, edited(cb), max_new_tokens=3)
    assert rb.stats["strategy"] == "exact" and "corrupt" in rb.stats["fallback"]
    assert rb.output_ids == exact(engine, edited(cb), 3).output_ids
    rc = fresh.generate(C, ca, max_new_tokens=1)
    assert rc.stats["strategy"] == "exact" and "holds no checkpoint" in rc.stats["fallback"]
    assert rc.stats["version"] == 6
    fresh.close()
    after.close()


# ------------------------------------------------------------------ the agent-loop benchmark


def test_loop_bench_rows_and_summary(engine, tmp_path):
    from benchmarks.loop_bench import format_loop, plot_loop, run_loop_bench

    c0 = ctx(90)
    traces = [{"id": "e0", "versions": [{"token_ids": c0}, {"token_ids": edited(c0)},
                                        {"token_ids": edited(edited(c0), at=150)}]}]
    s = run_loop_bench(engine, traces, strategies=("patchkv", "prefix"), tool_latencies=(0.0, 0.02),
                       max_new_tokens=2, threads=2, threads_tool_s=0.0, progress=False)
    assert len(s["rows"]) == 2 * 2 * 2  # latencies x strategies x calls after the first
    for r in s["rows"]:
        # a resident thread never waits for its offload: the caller's wait is the resume (plus the lookup)
        assert r["base"] == "resident" and r["offload_wait_s"] == 0.0 and r["fallback"] is None
        assert r["e2e_ttft_s"] >= r["ttft_s"] + r["plan_s"] and r["ttft_s"] > 0 and r["plan_s"] > 0
        assert r["strategy"] == r["requested"]
    g = s["by"]["patchkv"]["0.0"]
    assert g["n"] == 2 and g["e2e_over_resume"] >= g["e2e_over_resume_call"] >= 1.0 and g["speedup_vs_prefix"] > 0
    assert g["resume_call_s_median"] > g["ttft_s_median"]
    assert s["by"]["prefix"]["0.02"]["speedup_vs_prefix"] == pytest.approx(1.0)
    c = s["concurrent"]["patchkv"]
    assert c["threads"] == 2 and c["calls"] == 6 and c["e2e_p95_s"] >= c["e2e_p50_s"] > 0
    assert "| patchkv | 0.02 | 2 |" in format_loop(s)
    plot_loop(s, tmp_path / "loop.png")
    assert (tmp_path / "loop.png").stat().st_size > 0
    # the prefix rows recompute everything after the prefix, the patchkv rows less
    pk = [r["recompute_tokens"] for r in s["rows"] if r["requested"] == "patchkv"]
    pf = [r["recompute_tokens"] for r in s["rows"] if r["requested"] == "prefix"]
    assert max(pk) < min(pf)
    with pytest.raises(ValueError, match="two versions"):
        run_loop_bench(engine, [{"id": "x", "versions": [{"token_ids": c0}]}], progress=False)


def test_an_open_stream_pins_its_thread_against_eviction(engine):
    """An eviction during an open stream would offload context-only KV and drop the stream's commit: the
    thread is skipped by eviction until its stream closes."""
    reg = ThreadRegistry(engine, resident_budget_bytes=1)
    ca, cb = ctx(100), ctx(101)
    with reg.stream(A, ca, max_new_tokens=4) as sa:
        next(sa)
        reg.generate(B, cb, max_new_tokens=2)  # over budget: A would be the victim, but its stream is open
        assert reg.handle(A)["kv"] == "resident" and not [e for e in reg.events if e["key"] == A]
        toks = [next(sa)] + list(sa)
    assert reg.table.get(A).streams == 0
    # the commit kept the decoded tokens: the next version that appends to them reuses them as a prefix
    nxt = ca + sa.result.output_ids[:2] + [9, 9]
    r = reg.generate(A, nxt, strategy="prefix", max_new_tokens=1)
    assert r.stats["prefix_tokens"] == len(ca) + 2 and toks
    reg.close()



def test_a_resume_is_validated_once_and_reuses_the_context_choice_diff(engine, monkeypatch):
    import patchkv_agent.resume as resume_mod
    import patchkv_agent.runtime.table as table_mod
    from patchkv_agent.engine import PatchKVEngine

    reg = ThreadRegistry(engine)
    c0 = ctx(0)
    reg.generate(A, c0, max_new_tokens=4)
    resident = reg.table.peek(reg.active(A)).resident
    c1 = edited(c0, at=80)  # an edit near the head: the context choice diffs to find the lane
    want = engine.resume(resident, c1, strategy="patchkv", max_new_tokens=4)  # its own diff: the oracle

    calls = {"validate": 0, "choice_diff": 0, "resume_diff": 0}
    real_validate, real_diff = PatchKVEngine.validate_ids, table_mod.diff_versions

    def counting_validate(self, *a, **k):
        calls["validate"] += 1
        return real_validate(self, *a, **k)

    def counted(name):
        def f(*a, **k):
            calls[name] += 1
            return real_diff(*a, **k)
        return f

    monkeypatch.setattr(PatchKVEngine, "validate_ids", counting_validate)
    monkeypatch.setattr(table_mod, "diff_versions", counted("choice_diff"))
    monkeypatch.setattr(resume_mod, "diff_versions", counted("resume_diff"))
    got = reg.generate(A, c1, max_new_tokens=4)
    assert calls == {"validate": 1, "choice_diff": 1, "resume_diff": 0}
    assert got.stats["base"] == "resident" and got.stats["prefix_tokens"] == 80
    assert got.stats["recompute_tokens"] == want.stats["recompute_tokens"] > 0
    assert got.output_ids == want.output_ids
    torch.testing.assert_close(got.logits, want.logits, atol=0, rtol=0)
    # a diff of another base is never used: the resume diffs again
    stale = engine.request(c1, "patchkv", 4, edit=resume_mod.diff_versions(c0[:200], c1))
    assert stale.edit_from(np.asarray(c0, dtype=np.int64)) is None
    calls["resume_diff"] = 0
    again = engine.resume_request(resident, stale)
    assert calls["resume_diff"] == 1
    torch.testing.assert_close(again.logits, want.logits, atol=0, rtol=0)


def test_resume_request_rejects_what_request_did_not_build(engine):
    from patchkv_agent.resume import ResumeRequest

    with pytest.raises(TypeError, match="engine.request"):
        engine.resume_request(None, ctx(1))
    # a request built by hand is validated by the engine that runs it
    exact_ = engine.strategy("exact")
    bad = ResumeRequest(ids=np.asarray([1, 2, engine.spec.vocab_size + 5]), strategy=exact_, max_new_tokens=1)
    with pytest.raises(ValueError, match="vocab"):
        engine.resume_request(None, bad)
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.resume_request(None, ResumeRequest(ids=np.asarray(ctx(1)), strategy=exact_, max_new_tokens=-1))
    res = engine.resume_request(None, ResumeRequest(ids=np.asarray(ctx(1)), strategy=exact_, max_new_tokens=3))
    want = engine.resume(None, ctx(1), strategy="exact", max_new_tokens=3)
    assert res.output_ids == want.output_ids
    torch.testing.assert_close(res.logits, want.logits, atol=0, rtol=0)
    with pytest.raises(ValueError, match="needs a checkpoint"):
        engine.resume_request(None, engine.request(ctx(1), "patchkv", 2))
    with pytest.raises(ValueError):
        engine.request(ctx(1), "no-such-strategy", 2)

"""The tool wait does the edit: the next call's context prepared exactly in background chunks.

Oracles: a full prefill of the same ids (K/V rows and first-token logits, fp32, 1e-4) and the order in
which the forward lock is handed out; the predictions against LangChain's own installed editors.
"""

from __future__ import annotations

import threading
import time
import zlib

import numpy as np
import pytest
import torch

from patchkv_agent.core.weights import ForwardLock
from patchkv_agent.eval.tiny import tiny_engine
from patchkv_agent.runtime.lifecycle import Phase
from patchkv_agent.runtime.state import Prediction
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key

TOL = 1e-4


def _rows_equal(res, ref) -> float:
    err = 0.0
    for a, b in zip(res.keys + res.values, ref.keys + ref.values):
        a = a[0] if a.dim() == 4 else a
        b = b[0] if b.dim() == 4 else b
        err = max(err, float((a[:, : b.shape[-2]] - b).abs().max()))
    return err


@pytest.mark.parametrize("family", ["llama", "qwen3", "glm", "gemma3"])
def test_prepare_equals_a_full_prefill_and_reuses_only_exact_rows(family, one_torch_thread):
    eng = tiny_engine(family)
    rng = np.random.default_rng(1)
    old = rng.integers(0, eng.spec.vocab_size, 260)
    new = np.concatenate([old[:90], rng.integers(0, eng.spec.vocab_size, 11), old[130:]])
    full = eng.resume(None, new, strategy="exact", max_new_tokens=0)
    base = eng.resume(None, old, strategy="exact", max_new_tokens=0)
    for chunk in (5, 64, 4096):
        p = eng.prepare(base, new, chunk_tokens=chunk)
        assert p.stats.prepare.reused_rows == 90 and p.exact_rows == len(new)
        assert _rows_equal(p, full) < TOL and float((p.logits - full.logits).abs().max()) < TOL
    # a base whose rows from 40 on are approximate gives only its 40 exact rows
    approx = eng.resume(eng.checkpoint(old), np.concatenate([old[:40], old[41:]]), strategy="direct",
                        max_new_tokens=0)
    assert approx.exact_rows is not None and approx.exact_rows <= 40
    p = eng.prepare(approx, new, chunk_tokens=32)
    assert p.stats.prepare.reused_rows == approx.exact_rows
    assert _rows_equal(p, full) < TOL
    # stopped between chunks: the rows done are exact, and fewer
    calls = iter([False, False, True])
    p = eng.prepare(base, new, chunk_tokens=16, should_stop=lambda: next(calls))
    assert p.stats.prepare.stopped and len(p.context_ids) == 90 + 32
    assert _rows_equal(p, eng.resume(None, new[:122], strategy="exact", max_new_tokens=0)) < TOL


def test_a_foreground_caller_waits_for_one_background_chunk_at_most():
    lock = ForwardLock()
    order: list[str] = []
    in_chunk, fg_done = threading.Event(), threading.Event()

    def background():
        for i in range(4):
            with lock.background():
                order.append(f"bg{i}")
                if i == 1:
                    in_chunk.set()
                    while not lock.foreground_waiting():  # the foreground caller is queued behind this chunk
                        time.sleep(0.001)
                    time.sleep(0.01)

    def foreground():
        in_chunk.wait()
        with lock:
            order.append("fg")
            time.sleep(0.01)
        fg_done.set()

    threads = [threading.Thread(target=background), threading.Thread(target=foreground)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert order == ["bg0", "bg1", "fg", "bg2", "bg3"]
    with lock:  # re-entrant for foreground holders
        with lock:
            pass
    assert not lock.foreground_waiting()


@pytest.fixture(scope="module")
def reg():
    r = ThreadRegistry(tiny_engine("llama"), prepare_chunk_tokens=24)
    yield r
    r.close()


def _first_call(reg, name: str, n: int = 300):
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # str hash() changes per process
    k = thread_key(name)
    first = rng.integers(0, reg.engine.spec.vocab_size, n)
    r = reg.generate(k, first, max_new_tokens=4)
    return k, np.concatenate([first, np.asarray(r.output_ids[:-1], dtype=np.int64)]), rng


def test_a_hit_appends_only_the_tool_results_and_equals_exact(reg, one_torch_thread):
    k, ctx, rng = _first_call(reg, "hit")
    predicted = np.concatenate([ctx[:80], ctx[140:]])  # a tool result cleared 80 tokens deep
    fut = reg.prepare_async(k, lambda: Prediction(predicted, info={"editor": "test"}))
    assert reg.prepare_async(k, lambda: None) is fut  # one preparation per version
    fut.result()
    assert reg.phase(k) is Phase.PREPARED
    new = np.concatenate([predicted, rng.integers(0, reg.engine.spec.vocab_size, 25)])
    res = reg.generate(k, new, max_new_tokens=3)
    st = res.stats
    assert st.base == "prepared" and st.prepared == "hit" and st.prepared_info == {"editor": "test"}
    assert st.recompute_tokens == 25 and st.approx_rows == 0 and st.prepared_wasted == 0
    shared = int(np.flatnonzero(ctx[: len(predicted)] != predicted)[0])  # 80, or more where tokens repeat
    assert st.prepared_tokens == len(predicted) - shared and st.prepared_hidden_share > 0.85
    assert st.prepared_predict_s >= 0 and st.prepared_compute_s > 0
    ref = reg.engine.resume(None, new, strategy="exact", max_new_tokens=3)
    assert float((res.logits - ref.logits).abs().max()) < TOL and res.output_ids == ref.output_ids
    assert _rows_equal(res, ref) < TOL


def test_a_miss_resumes_from_the_resident_context_and_says_why(reg, one_torch_thread):
    k, ctx, rng = _first_call(reg, "miss")
    reg.prepare_async(k, lambda: np.concatenate([ctx[:30], ctx[60:]])).result()  # predicted a clear at 30
    new = np.concatenate([ctx[:200], ctx[230:], rng.integers(0, reg.engine.spec.vocab_size, 9)])  # cleared at 200
    st = reg.generate(k, new, max_new_tokens=0).stats
    assert st.base == "resident" and st.prepared == "miss" and "at token 30" in st.prepared_reason
    assert st.prepared_wasted == st.prepared_tokens > 0 and st.prepared_hidden_share == 0.0


def test_a_partial_prediction_is_a_base_where_it_reaches_further(reg, one_torch_thread):
    k, ctx, rng = _first_call(reg, "partial")
    predicted = np.concatenate([ctx[:100], ctx[150:]])
    reg.prepare_async(k, lambda: predicted).result()
    new = np.concatenate([predicted[:200], rng.integers(0, reg.engine.spec.vocab_size, 5), predicted[200:]])
    res = reg.generate(k, new, max_new_tokens=0)
    assert res.stats.base == "prepared" and res.stats.prepared == "partial" and res.stats.fallback is None
    assert "at token 200" in res.stats.prepared_reason


def test_a_barely_started_preparation_gives_way_to_a_resident_base_that_recomputes_less(reg, one_torch_thread):
    from patchkv_agent.runtime.state import Preparation

    k, ctx, rng = _first_call(reg, "barely")
    predicted = np.concatenate([ctx[:100], ctx[150:]])
    th = reg._peek(reg.active(k))
    stopped = reg.engine.prepare(th.resident, predicted, chunk_tokens=8, should_stop=lambda: True)
    assert len(stopped.context_ids) == stopped.stats.prepare.reused_rows  # no chunk ran
    with th.lock:  # what a preparation stopped before its first chunk leaves behind
        th.preparation = Preparation(version=th.version, predict=None, chunk_tokens=8, stage="done",
                                     ids=predicted, result=stopped)
    new = np.concatenate([predicted, rng.integers(0, reg.engine.spec.vocab_size, 5)])
    theirs = reg.engine.planned_recompute(th.resident, new)
    mine = reg.engine.planned_recompute(stopped, new)
    assert theirs < mine  # the resident base restores what follows the edit; the stopped one cannot
    st = reg.generate(k, new, max_new_tokens=0).stats
    assert st.base == "resident" and st.prepared == "miss" and "recomputes fewer rows" in st.prepared_reason
    assert st.recompute_tokens == theirs


def test_an_unfinished_or_failed_prediction_never_delays_the_call(reg, one_torch_thread):
    k, ctx, rng = _first_call(reg, "slow")
    release = threading.Event()

    def slow():
        release.wait(10)
        return ctx[:100]

    reg.prepare_async(k, slow)
    time.sleep(0.05)
    assert reg.phase(k) is Phase.PREPARING
    new = np.concatenate([ctx, rng.integers(0, reg.engine.spec.vocab_size, 7)])
    t0 = time.perf_counter()
    st = reg.generate(k, new, max_new_tokens=0).stats
    waited = time.perf_counter() - t0
    release.set()
    assert st.prepared == "unfinished" and st.base == "resident" and "predicting" in st.prepared_reason
    assert waited < 5  # it did not wait for the 10 s predictor (a bound, not a speed claim)

    def boom():
        raise KeyError("no such editor")

    k2, ctx2, _ = _first_call(reg, "boom")
    reg.prepare_async(k2, boom).result()
    st = reg.generate(k2, np.concatenate([ctx2, ctx2[:5]]), max_new_tokens=0).stats
    assert st.prepared == "failed" and "KeyError" in st.prepared_reason and st.fallback is None
    k3, ctx3, _ = _first_call(reg, "junk")
    reg.prepare_async(k3, lambda: [-1, 2]).result()
    st = reg.generate(k3, np.concatenate([ctx3, ctx3[:5]]), max_new_tokens=0).stats
    assert st.prepared == "failed" and "not a valid context" in st.prepared_reason


def test_the_heal_is_left_to_the_preparation_and_budgets_count_prepared_kv(one_torch_thread):
    eng = tiny_engine("llama")
    reg = ThreadRegistry(eng, prepare_chunk_tokens=64)
    try:
        k, ctx, rng = _first_call(reg, "heal")
        new = np.concatenate([ctx[:50], ctx[51:]])
        res = reg.generate(k, new, max_new_tokens=2)  # a selective resume: approximate rows
        assert res.stats.approx_rows > 0
        ctx2 = np.concatenate([new, np.asarray(res.output_ids[:-1])])
        before = reg.resident_bytes()
        reg.prepare_async(k, lambda: ctx2).result()
        reg.offload_async(k).result()
        assert reg.resident_bytes() > before  # the prepared KV is held resident too
        assert not any(e["event"] == "heal" for e in reg.events)  # the preparation recomputed those rows
        nxt = np.concatenate([ctx2, rng.integers(0, eng.spec.vocab_size, 6)])
        res2 = reg.generate(k, nxt, max_new_tokens=0)
        assert res2.stats.prepared == "hit" and res2.stats.approx_rows == 0
        assert float((res2.logits - eng.resume(None, nxt, strategy="exact", max_new_tokens=0).logits).abs().max()) < TOL
    finally:
        reg.close()


def test_prepare_async_checks_its_arguments(reg):
    with pytest.raises(ValueError, match="chunk_tokens"):
        reg.prepare_async(thread_key("x"), lambda: None, chunk_tokens=0)
    assert reg.prepare_async(thread_key("never-seen"), lambda: None) is None
    with pytest.raises(ValueError, match="prepare_chunk_tokens"):
        ThreadRegistry(reg.engine, prepare_chunk_tokens=0)

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

from patchkv_agent.core.weights import ForwardLock
from benchmarks.tiny import tiny_engine
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


def test_a_partial_call_diffs_each_candidate_base_once_and_the_resume_reuses_the_chosen_diff(reg, one_torch_thread,
                                                                                            monkeypatch):
    import patchkv_agent.resume as resume_mod

    k, ctx, rng = _first_call(reg, "partial-once")
    predicted = np.concatenate([ctx[:100], ctx[150:]])
    reg.prepare_async(k, lambda: predicted).result()
    new = np.concatenate([predicted[:200], rng.integers(0, reg.engine.spec.vocab_size, 5), predicted[200:]])
    calls = []
    real = resume_mod.diff_versions
    monkeypatch.setattr(resume_mod, "diff_versions", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    res = reg.generate(k, new, max_new_tokens=0)
    assert res.stats.prepared == "partial" and calls == []  # the plan that chose the base gave the resume its diff
    ref = reg.engine.resume(None, new, strategy="exact", max_new_tokens=0)
    assert res.stats.fallback is None and float((res.logits - ref.logits).abs().max()) < 0.05


def test_a_barely_started_preparation_gives_way_to_a_resident_base_that_recomputes_less(reg, one_torch_thread):
    from patchkv_agent.runtime.state import Preparation

    k, ctx, rng = _first_call(reg, "barely")
    predicted = np.concatenate([ctx[:100], ctx[150:]])
    th = reg.table.peek(reg.active(k))
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
    default = ThreadRegistry(reg.engine)  # a CPU engine: chunks a call waits for are kept short
    assert reg.engine.device.type == "cpu" and default.prepare_chunk_tokens == 64
    default.close()


@pytest.fixture
def hung():
    """A predictor gate that is never opened during the test (opened in teardown, so no thread lingers)."""
    gate = threading.Event()
    yield gate
    gate.set()


def _exact(eng, ids, n):
    return eng.resume(None, ids, strategy="exact", max_new_tokens=n)


def _assert_exact(res, ref) -> None:
    assert res.output_ids == ref.output_ids
    assert float((res.logits - ref.logits).abs().max()) < TOL


def test_a_hung_prediction_holds_neither_the_worker_nor_other_threads(hung, one_torch_thread):
    """Thread A's predictor never returns; thread B's heal, offload and resumes go on through the one worker
    (the default deadline is never reached: nothing here waits for it) and are exact; A's next call
    proceeds and says its prediction was unfinished."""
    eng = tiny_engine("llama")
    reg = ThreadRegistry(eng, prepare_chunk_tokens=24)
    try:
        ka, ctx_a, rng_a = _first_call(reg, "hung-a")
        started = threading.Event()

        def never():
            started.set()
            hung.wait()
            return ctx_a[:100]

        fut_a = reg.prepare_async(ka, never)
        assert started.wait(30) and reg.phase(ka) is Phase.PREPARING
        kb, ctx_b, rng_b = _first_call(reg, "hung-b")
        edited = np.concatenate([ctx_b[:50], ctx_b[51:]])
        r1 = reg.generate(kb, edited, max_new_tokens=2)  # a selective resume: approximate rows to heal
        assert r1.stats.approx_rows > 0
        assert reg.offload_async(kb).result(timeout=30) is not None  # hang guard, not a speed claim
        assert any(e["event"] == "heal" and e["key"] == reg.active(kb) for e in reg.events)
        nxt = np.concatenate([edited, np.asarray(r1.output_ids[:-1]), rng_b.integers(0, eng.spec.vocab_size, 9)])
        r2 = reg.generate(kb, nxt, max_new_tokens=3)
        assert r2.stats.base == "resident" and r2.stats.base_approx_rows == 0 and r2.stats.approx_rows == 0
        _assert_exact(r2, _exact(eng, nxt, 3))
        ctx_b2 = np.concatenate([nxt, np.asarray(r2.output_ids[:-1])])
        assert reg.offload_async(kb, release=True).result(timeout=30) is not None  # the resident KV is freed
        assert reg.handle(kb)["kv"] == "offloaded"
        r3 = reg.generate(kb, ctx_b2, strategy="exact", max_new_tokens=2)
        _assert_exact(r3, _exact(eng, ctx_b2, 2))
        assert not fut_a.done()  # A's predictor is still hung
        new_a = np.concatenate([ctx_a, rng_a.integers(0, eng.spec.vocab_size, 7)])
        ra = reg.generate(ka, new_a, max_new_tokens=3)
        assert ra.stats.prepared == "unfinished" and "predicting" in ra.stats.prepared_reason
        assert ra.stats.base == "resident" and ra.stats.fallback is None
        _assert_exact(ra, _exact(eng, new_a, 3))
    finally:
        hung.set()
        reg.close()


def test_a_prediction_past_its_deadline_is_abandoned_and_recorded(hung, one_torch_thread):
    eng = tiny_engine("llama")
    reg = ThreadRegistry(eng, prepare_chunk_tokens=24, predict_timeout_s=0.2)
    try:
        k, ctx, rng = _first_call(reg, "deadline")
        fut = reg.prepare_async(k, lambda: hung.wait() and ctx)
        assert fut.result(timeout=30) is None  # hang guard: the deadline settles it
        assert reg.phase(k) is not Phase.PREPARING
        new = np.concatenate([ctx, rng.integers(0, eng.spec.vocab_size, 7)])
        res = reg.generate(k, new, max_new_tokens=3)
        st = res.stats
        assert st.prepared == "failed" and "timed out after 0.2 s" in st.prepared_reason and st.base == "resident"
        _assert_exact(res, _exact(eng, new, 3))
        # the worker moved on: the next version's preparation is computed and hit
        ctx2 = np.concatenate([new, np.asarray(res.output_ids[:-1])])
        reg.prepare_async(k, lambda: ctx2).result(timeout=30)
        nxt = np.concatenate([ctx2, rng.integers(0, eng.spec.vocab_size, 5)])
        res2 = reg.generate(k, nxt, max_new_tokens=2)
        assert res2.stats.prepared == "hit" and res2.stats.base == "prepared"
        _assert_exact(res2, _exact(eng, nxt, 2))
    finally:
        hung.set()
        reg.close()


class _Interrupt(KeyboardInterrupt):
    pass


class _Exit(SystemExit):
    pass


@pytest.mark.parametrize("error", [_Interrupt("stop now"), KeyboardInterrupt(), BaseException("odd"), _Exit(3)],
                         ids=["keyboard-interrupt-subclass", "keyboard-interrupt", "base-exception", "system-exit"])
def test_a_predictor_raising_a_base_exception_is_contained_and_recorded(reg, error, one_torch_thread):
    from concurrent.futures import wait

    k, ctx, rng = _first_call(reg, f"base-{type(error).__name__}-{error}")

    def boom():
        raise error

    fut = reg.prepare_async(k, boom)
    wait([fut], timeout=30)  # never .result(): a leaked KeyboardInterrupt would stop the test session
    assert fut.done() and fut.exception() is None and fut.result() is None
    new = np.concatenate([ctx, rng.integers(0, reg.engine.spec.vocab_size, 6)])
    res = reg.generate(k, new, max_new_tokens=3)
    st = res.stats
    assert st.prepared == "failed" and st.base == "resident" and st.fallback is None
    assert st.prepared_reason.startswith(f"the prediction raised {type(error).__name__}")
    if str(error):
        assert str(error) in st.prepared_reason
    _assert_exact(res, reg.engine.resume(None, new, strategy="exact", max_new_tokens=3))
    assert reg.offload_async(k).result(timeout=30) is not None  # the worker is alive


def test_predict_timeout_is_checked(reg):
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="predict_timeout_s"):
            ThreadRegistry(reg.engine, predict_timeout_s=bad)
    unbounded = ThreadRegistry(reg.engine, predict_timeout_s=None)
    assert unbounded.predict_timeout_s is None
    unbounded.close()


def test_a_predictions_own_model_call_is_exact_and_runs_in_background_chunks(reg, one_torch_thread):
    k, ctx, rng = _first_call(reg, "summarizer-exact")
    summary_ids = rng.integers(0, reg.engine.spec.vocab_size, 150)
    got = {}

    def predict():  # a summarizer writing its summary through the same registry, in a context of its own
        got["res"] = reg.generate(thread_key("summarizer-exact", "#summary"), summary_ids, max_new_tokens=4)
        return ctx[:50]

    reg.prepare_async(k, predict).result()
    res = got["res"]
    ref = reg.engine.resume(None, summary_ids, strategy="exact", max_new_tokens=4)
    assert float((res.logits - ref.logits).abs().max()) < TOL and res.output_ids == ref.output_ids
    assert _rows_equal(res, ref) < TOL
    assert res.stats.recompute_tokens == 1  # the chunks computed the rest before the resume ran


def test_a_real_call_stops_the_predictions_model_call_instead_of_paying_for_it(one_torch_thread, caplog):
    """The call that finds its preparation still predicting takes the model at the next chunk boundary of
    the prediction's own model call (a summary), and that call ends there: it raises PreparationStopped
    inside the predictor (so nothing is stored for a real call to be served), never computing further."""
    from patchkv_agent.runtime.background import PreparationStopped

    eng = tiny_engine("llama")
    reg = ThreadRegistry(eng, prepare_chunk_tokens=16)
    try:
        k, ctx, rng = _first_call(reg, "summarizer-stop")
        at_chunk, go = threading.Event(), threading.Event()
        chunks: list[int] = []
        orig = eng.prepare

        def gated(base, ids, *, chunk_tokens, should_stop):
            def check():
                chunks.append(len(chunks))
                if len(chunks) == 2:  # mid-way through the summary's prefill: hand over to the real call
                    at_chunk.set()
                    go.wait(10)
                return should_stop()
            return orig(base, ids, chunk_tokens=chunk_tokens, should_stop=check)

        eng.prepare = gated
        raised = {}

        def predict():
            try:
                reg.generate(thread_key("summarizer-stop", "#summary"), rng.integers(0, eng.spec.vocab_size, 200),
                             max_new_tokens=8)
            except PreparationStopped as e:
                raised["e"] = e
                raise
            return ctx[:50]

        fut = reg.prepare_async(k, predict)
        assert at_chunk.wait(10)
        new = np.concatenate([ctx, rng.integers(0, eng.spec.vocab_size, 7)])
        eng.prepare = orig  # the real call's own path (it does not prepare)
        res = reg.generate(k, new, max_new_tokens=2)
        go.set()
        fut.result(10)
        st = res.stats
        assert st.prepared == "unfinished" and "predicting" in st.prepared_reason and st.base == "resident"
        assert "e" in raised and len(chunks) == 2  # the check the real call came in ended it: one chunk ran
        ref = eng.resume(None, new, strategy="exact", max_new_tokens=2)
        assert res.output_ids == ref.output_ids
        assert not [e for e in reg.events if e.get("event") == "prepared" and e["key"] == k]  # nothing computed
        assert not [r for r in caplog.records if r.levelname == "WARNING"]  # the expected end, not a failure
    finally:
        eng.prepare = orig
        reg.close()


def test_a_predictions_decode_stops_at_the_next_step_once_abandoned(reg, one_torch_thread):
    from patchkv_agent.runtime.background import PreparationStopped, predicting

    stop = threading.Event()
    ids = np.random.default_rng(5).integers(0, reg.engine.spec.vocab_size, 40)
    key = thread_key("decode-stop")
    with predicting(stop):
        s = reg.stream(key, ids, max_new_tokens=10)
        drawn = [next(s), next(s)]
        stop.set()
        with pytest.raises(PreparationStopped):
            next(s)
        with pytest.raises(PreparationStopped):  # a new call of an abandoned prediction computes nothing
            reg.stream(key, ids, max_new_tokens=1)
    ref = reg.engine.resume(None, ids, strategy="exact", max_new_tokens=2)
    assert drawn == ref.output_ids  # what it drew before it stopped is exact's
    th = reg.table.peek(reg.active(key))
    assert th.streams == 0 and list(th.token_ids) == list(ids)  # the stopped stream was closed and committed

"""The preparation under stress: many threads preparing at once, each predictor calling the model itself (a
summary) while foreground calls, forgets and evictions of the same threads run. Oracles: every foreground
call's first-token logits against a full prefill of its ids (prefix strategy: exact), the lifecycle's
invariants on every record, and no error but the ones a prediction is meant to end with."""

from __future__ import annotations

import random
import threading
import zlib

import numpy as np
import pytest

from benchmarks.tiny import tiny_engine
from patchkv_agent.runtime.background import PreparationStopped
from patchkv_agent.runtime.lifecycle import invariant_violations
from patchkv_agent.runtime.state import Prediction
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("budget", [None, 60_000])  # 60 kB: about two threads' KV, so calls evict each other
def test_many_preparers_with_model_calls_forgets_and_evictions_stay_exact(budget):
    eng = tiny_engine("llama")
    kw = {"prepare_chunk_tokens": 16, "predict_timeout_s": 20.0}
    if budget is not None:
        kw["resident_budget_bytes"] = budget
    reg = ThreadRegistry(eng, **kw)
    vocab = eng.spec.vocab_size
    errors: list[BaseException] = []
    stopped = [0]
    lock = threading.Lock()

    def predictor(name: str, ids: np.ndarray):
        def predict():
            rng = np.random.default_rng(zlib.crc32(name.encode()) + len(ids))
            try:  # a summary written through the same registry, in a context of its own
                reg.generate(thread_key(name, "#summary"), rng.integers(0, vocab, 120), max_new_tokens=6)
            except PreparationStopped:
                with lock:
                    stopped[0] += 1
                raise
            return Prediction(np.concatenate([ids[:60], ids[90:]]))
        return predict

    def worker(w: int) -> None:
        rnd = random.Random(w)
        rng = np.random.default_rng(w)
        name = f"stress-{w}"
        k = thread_key(name)
        ids = rng.integers(0, vocab, 150)
        try:
            for step in range(8):
                op = rnd.choice(["call", "call", "prepare", "prepare", "forget"])
                if op == "forget":
                    reg.forget(name)
                    ids = rng.integers(0, vocab, 150)
                    continue
                if op == "prepare" and reg.table.peek(reg.active(k)) is not None:
                    reg.prepare_async(k, predictor(name, ids))
                    if rnd.random() < 0.5:
                        continue  # the next call comes while it predicts
                ids = np.concatenate([ids[:60], ids[90:], rng.integers(0, vocab, 20)]) if step else ids
                res = reg.generate(k, ids, strategy="prefix", max_new_tokens=2)
                ref = eng.resume(None, ids, strategy="exact", max_new_tokens=0)
                err = float((res.logits - ref.logits).abs().max())
                assert err < 1e-4, (name, step, res.stats.base, res.stats.prepared, err)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    try:
        [t.start() for t in threads]
        [t.join(300) for t in threads]
        assert not any(t.is_alive() for t in threads), "a worker hung"
        assert not errors, errors[:3]
        for k in reg.keys():
            th = reg.table.peek(k)
            if th is not None:
                reg.wait_prepared(k, timeout=60)
                with th.lock:
                    assert invariant_violations(th) == [], (k, invariant_violations(th))
                    assert th.streams == 0
    finally:
        reg.close()

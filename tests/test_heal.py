"""Healing: a selective resume's approximate rows recomputed exactly (engine.heal), oracle = a full prefill."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_recovery import assert_cache_equal, edited_pair, oracle
from patchkv_agent.strategies import get_strategy

TOL = 1e-4
ENGINE = dict(block_size=16)  # the `engine` fixture (conftest.py)


def _kv_equal(res, ref_cache, n_layers):
    for layer in range(n_layers):
        torch.testing.assert_close(res.keys[layer], ref_cache.layers[layer].keys, atol=TOL, rtol=0)
        torch.testing.assert_close(res.values[layer], ref_cache.layers[layer].values, atol=TOL, rtol=0)


def test_selective_resume_is_approximate_and_heal_makes_it_exact(engine):
    old, new = edited_pair(engine.model.config.vocab_size, seed=3, n=160)
    ckpt = engine.checkpoint(old)
    res = engine.resume(ckpt, new, strategy="patchkv", max_new_tokens=0)
    n_layers = engine.model.config.num_hidden_layers
    _, ref = oracle(engine.model, new)
    assert res.stats["restore_tokens"] > 0
    assert 0 < res.exact_rows < len(new)
    assert res.stats["approx_rows"] == len(new) - res.exact_rows
    # the rows before the first restored one are exact, the rows after it are not (stale view of the edit)
    for layer in range(n_layers):
        torch.testing.assert_close(res.keys[layer][..., : res.exact_rows, :],
                                   ref.layers[layer].keys[..., : res.exact_rows, :], atol=TOL, rtol=0)
    diff = max(float((res.values[layer] - ref.layers[layer].values).abs().max()) for layer in range(n_layers))
    assert diff > 10 * TOL
    healed = engine.heal(res)
    assert healed is not res and healed.exact_rows == len(new) and healed.approx_rows == 0
    assert healed.stats["healed_rows"] == len(new) - res.exact_rows and healed.stats["heal_s"] >= 0
    _kv_equal(healed, ref, n_layers)
    assert res.exact_rows < len(new)  # the input is left as it was
    assert engine.heal(healed) is healed  # nothing left to heal


def test_exact_strategies_are_exact_and_approximation_is_carried_to_the_next_version(engine):
    vocab = engine.model.config.vocab_size
    old, new = edited_pair(vocab, seed=4, n=150)
    ckpt = engine.checkpoint(old)
    for s in ("exact", "prefix"):
        r = engine.resume(ckpt, new, strategy=s, max_new_tokens=0)
        assert r.exact_rows == len(new) and r.approx_rows == 0 and engine.heal(r) is r
    approx = engine.resume(ckpt, new, strategy="direct", max_new_tokens=0)
    assert approx.exact_rows < len(new)
    # append-only next version: nothing restored, but the reused prefix carries the approximation
    nxt = new + np.random.default_rng(0).integers(0, vocab, 12).tolist()
    carried = engine.resume(engine.checkpoint_from(approx), nxt, strategy="patchkv", max_new_tokens=0)
    assert carried.stats["restore_tokens"] == 0 and carried.exact_rows == approx.exact_rows
    from_healed = engine.resume(engine.checkpoint_from(engine.heal(approx)), nxt, strategy="patchkv",
                                max_new_tokens=0)
    assert from_healed.exact_rows == len(nxt)
    ref_logits, ref = oracle(engine.model, nxt)
    torch.testing.assert_close(from_healed.logits, ref_logits, atol=TOL, rtol=0)
    _kv_equal(from_healed, ref, engine.model.config.num_hidden_layers)


def test_head_rewrite_rule_recomputes_the_whole_suffix_and_is_exact(engine):
    """A summary replacing most of the history: every suffix token recomputed, the result equals a prefill."""
    from patchkv_agent.core.plan import head_rewrite_share

    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(7)
    head, tail = rng.integers(0, vocab, 120).tolist(), rng.integers(0, vocab, 60).tolist()
    old = head[:4] + rng.integers(0, vocab, 100).tolist() + tail
    new = head[:4] + rng.integers(0, vocab, 10).tolist() + tail  # 100 tokens of history -> a 10-token summary
    ckpt = engine.checkpoint(old)
    res = engine.resume(ckpt, new, strategy="patchkv", max_new_tokens=0)
    edit = res.edit
    assert head_rewrite_share(edit, ckpt.scores) >= 0.35
    assert res.stats.get("head_rewrite") is True and res.stats["restore_tokens"] == 0 and res.approx_rows == 0
    ref_logits, ref = oracle(engine.model, new)
    torch.testing.assert_close(res.logits, ref_logits, atol=TOL, rtol=0)
    _kv_equal(res, ref, engine.model.config.num_hidden_layers)
    off = engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"rewrite_share": 1.0}), max_new_tokens=0)
    assert off.stats.head_rewrite is False and off.stats["restore_tokens"] > 0
    # a small edit in the middle is no rewrite: the plan restores as before
    small = old[:80] + [1, 2, 3] + old[84:]
    r = engine.resume(ckpt, small, strategy="patchkv", max_new_tokens=0)
    assert r.stats.head_rewrite is False and head_rewrite_share(r.edit, ckpt.scores) < 0.35
    with pytest.raises(ValueError, match="rewrite_share"):
        engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"rewrite_share": 1.5}))


def test_an_edit_near_the_head_is_a_head_rewrite_under_head_tokens_and_is_exact(engine):
    """A small edit 6 tokens in (right after a short system prompt): with ``head_tokens`` above its prefix every
    suffix token is recomputed, equal to a prefill; at or below it (and off, 0) the plan restores rows."""
    vocab = engine.model.config.vocab_size
    rng = np.random.default_rng(5)
    old = rng.integers(0, vocab, 180).tolist()
    new = old[:6] + rng.integers(0, vocab, 3).tolist() + old[9:]  # 3 tokens replaced after a 6-token prefix
    ckpt = engine.checkpoint(old)
    near = engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"head_tokens": 7}), max_new_tokens=0)
    assert near.edit.prefix_len == 6
    assert near.stats.head_rewrite is True and near.stats["restore_tokens"] == 0 and near.approx_rows == 0
    ref_logits, ref = oracle(engine.model, new)
    torch.testing.assert_close(near.logits, ref_logits, atol=TOL, rtol=0)
    _kv_equal(near, ref, engine.model.config.num_hidden_layers)
    for h in (6, 0):  # the edit starts at the window's end, or the rule is off: rows restored
        r = engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"head_tokens": h}), max_new_tokens=0)
        assert r.stats.head_rewrite is False and r.stats["restore_tokens"] > 0
    with pytest.raises(ValueError, match="head_tokens"):
        engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"head_tokens": -1}))


def test_a_late_offload_job_never_releases_a_newer_jobs_heal(engine):
    """v1's offload job runs only after v2 was resumed and v2's own job (with a heal stage) was queued. Its
    early return must not signal v2's heal as over: v3 must resume from v2's healed, exact KV (the flake of
    test_two_registries_and_direct_callers_share_one_engine: a stale job set the newer job's event)."""
    import threading

    from patchkv_agent.runtime.threads import ThreadRegistry, thread_key

    reg = ThreadRegistry(engine)
    key = thread_key("late-job")
    v1, v2 = edited_pair(engine.model.config.vocab_size, seed=11, n=160)
    v3 = v2[:100] + [7, 8, 9] + v2[103:]
    gate = threading.Event()
    reg.generate(key, v1, max_new_tokens=0)
    reg.residency.worker.submit(gate.wait, 30)  # the worker is busy: v1's job waits behind it
    reg.offload_async(key)
    r2 = reg.generate(key, v2, max_new_tokens=0)
    assert r2.stats["base"] == "resident" and r2.approx_rows > 0
    reg.offload_async(key)  # v2's job: heal, then checkpoint, queued behind v1's
    done = threading.Event()
    out = {}

    def resume_v3():
        out["r3"] = reg.generate(key, v3, max_new_tokens=0)
        done.set()

    t = threading.Thread(target=resume_v3)
    t.start()
    gate.set()  # v1's job runs now (stale: returns at once), then v2's heals
    t.join(60)
    assert done.is_set()
    r3 = out["r3"]
    assert r3.stats["base_approx_rows"] == 0 and r3.stats["base_healed_rows"] == r2.approx_rows
    reg.close()

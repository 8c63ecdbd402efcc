"""The model's runner: the user's model is left as it was given, engines over one model share
one runner (one forward lock, one weight watch), and K/V keep one layout through the engine's paths. Tiny
random llamas, fp32."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest
import torch

from patchkv_agent import FallbackKind, PatchKVEngine
from patchkv_agent.core.runner import ModelRunner
from benchmarks.tiny import tiny_model

TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ctx(seed: int, n: int = 120, vocab: int = 211) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, vocab, n)


def edited(old: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.concatenate([old[:50], rng.integers(3, 211, 7), old[60:]])


def _attributes(model) -> dict[str, set[str]]:
    """The instance attributes of the model, its config and every submodule, by name."""
    out = {"config": set(vars(model.config))}
    for name, mod in model.named_modules():
        out[name or "<model>"] = set(vars(mod))
    return out


def test_the_users_model_gets_no_new_attribute_from_any_path():
    model = tiny_model("llama")
    before = _attributes(model)
    impl = model.config._attn_implementation
    eng = PatchKVEngine(model, None, block_size=8, dirty_window=8, profile=None)
    old = ctx(1)
    new = edited(old, 2)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy="patchkv", max_new_tokens=3)
    eng.resume(res, np.concatenate([new, [5, 6]]), strategy="direct", max_new_tokens=2)
    eng.checkpoint_from(res)
    eng.heal(res)
    eng.prepare(res, np.concatenate([new[:80], [7, 8, 9]]), chunk_tokens=16)
    assert _attributes(model) == before
    assert model.config._attn_implementation == impl  # the capture's swap is undone


def test_engines_over_one_model_share_one_runner_and_serialize_their_forwards():
    model = tiny_model("llama")
    a = PatchKVEngine(model, None, block_size=8, dirty_window=8, profile=None)
    b = PatchKVEngine(model, None, block_size=16, dirty_window=16, profile=None)
    assert a.runner is b.runner is ModelRunner.of(model) and a.forward_lock is b.forward_lock
    assert PatchKVEngine(tiny_model("llama"), None, profile=None).runner is not a.runner
    olds = {e: ctx(10 + i) for i, e in enumerate((a, b))}
    solo = {e: e.resume(e.checkpoint(o), edited(o, 3), max_new_tokens=4) for e, o in olds.items()}

    active, peak, guard = [0], [0], threading.Lock()

    def enter(*_):
        with guard:
            active[0] += 1
            peak[0] = max(peak[0], active[0])

    def leave(*_):
        with guard:
            active[0] -= 1

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave)]
    got, errors = {}, []
    barrier = threading.Barrier(4)

    def work(e, k):
        try:
            barrier.wait()
            for _ in range(2):
                got[(e, k)] = e.resume(e.checkpoint(olds[e]), edited(olds[e], 3), max_new_tokens=4)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    try:
        threads = [threading.Thread(target=work, args=(e, k)) for e in (a, b) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        for h in hooks:
            h.remove()
    assert not errors, errors
    assert peak[0] == 1  # never two forwards through the model at once
    for (e, _), r in got.items():
        assert r.output_ids == solo[e].output_ids
        assert (r.logits - solo[e].logits).abs().max().item() <= TOL
        assert np.allclose(r.scores, solo[e].scores, atol=1e-5)  # each capture saw only its own forward

    # a caller holding one engine's lock holds the other engine's forwards back
    held, release, done = threading.Event(), threading.Event(), []

    def holder():
        with a.forward_lock:
            held.set()
            release.wait(30)

    t1 = threading.Thread(target=holder)
    t1.start()
    held.wait(10)
    t2 = threading.Thread(target=lambda: done.append(b.checkpoint(olds[b])))
    t2.start()
    t2.join(0.5)
    assert not done
    release.set()
    t1.join(10)
    t2.join(60)
    assert len(done) == 1


def test_an_in_place_weight_change_invalidates_the_checkpoints_of_every_engine_over_the_model():
    """One runner watches the weights for all its engines: each engine learns of a change, whichever looked first."""
    model = tiny_model("llama")
    a = PatchKVEngine(model, None, block_size=8, dirty_window=8, profile=None)
    b = PatchKVEngine(model, None, block_size=8, dirty_window=8, profile=None)
    old = ctx(20)
    new = edited(old, 21)
    ca, cb = a.checkpoint(old), b.checkpoint(old)
    fp = a.spec.fingerprint
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.25)  # in place
    ra = a.resume(ca, new, strategy="patchkv", max_new_tokens=3)
    assert ra.stats["fallback"] is not None and ra.stats["fallback"].kind is FallbackKind.WEIGHTS_CHANGED
    rb = b.resume(cb, new, strategy="patchkv", max_new_tokens=3)  # the shared watch already saw the change
    assert rb.stats["fallback"] is not None and rb.stats["fallback"].kind is FallbackKind.WEIGHTS_CHANGED
    assert a.spec.fingerprint == b.spec.fingerprint != fp
    with torch.no_grad():
        ref = model(torch.from_numpy(new)[None]).logits[0, -1]
    for r in (ra, rb):
        assert (r.logits - ref).abs().max().item() <= TOL and r.stats["strategy"] == "exact"
    again = a.resume(a.checkpoint(old), new, strategy="patchkv", max_new_tokens=1)
    assert again.stats["fallback"] is None


def test_the_runner_goes_with_its_last_engine_and_keeps_nothing_alive():
    model = tiny_model("llama")
    eng = PatchKVEngine(model, None, profile=None)
    eng.resume(None, ctx(30), strategy="exact", max_new_tokens=2)
    runner = weakref.ref(eng.runner)
    gone = weakref.ref(model)
    del eng, model
    gc.collect()
    assert runner() is None and gone() is None


def test_kv_keep_one_layout_through_the_paths():
    """``[1, H, N, D]`` per layer on the model's device everywhere between the paths; ``[H, N, D]`` on the CPU in
    a checkpoint (views of the resident rows for a resident one); the decode cache adopts the resume's tensors."""
    eng = PatchKVEngine(tiny_model("llama"), None, block_size=8, dirty_window=8, profile=None)
    spec = eng.spec
    old = ctx(40)
    new = edited(old, 41)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy="patchkv", max_new_tokens=1)
    prep = eng.prepare(res, new[:90], chunk_tokens=32)
    heal = eng.heal(eng.resume(ckpt, new, strategy="direct", max_new_tokens=1))
    for r in (res, prep, heal):
        assert all(k.shape == (1, spec.num_kv_heads, len(r.context_ids), spec.head_dim) for k in r.keys + r.values)
    assert all(k.shape == (spec.num_kv_heads, len(old), spec.head_dim) for k in ckpt.keys + ckpt.values)
    view = eng.as_checkpoint(res)
    assert all(v.data_ptr() == k.data_ptr() and v.shape == k.shape[1:] for v, k in zip(view.keys, res.keys))
    assert res.cache.layers[0].keys.untyped_storage().data_ptr() == res.keys[0].untyped_storage().data_ptr()


def test_a_runner_table_holds_its_runners_weakly():
    from patchkv_agent.core.runner import RunnerTable

    table = RunnerTable()
    model = torch.nn.Linear(2, 2)
    runner = ModelRunner.of(model, table)
    assert ModelRunner.of(model, table) is runner and len(table) == 1
    assert ModelRunner.of(model) is not runner  # the process's table is another one
    del runner
    gc.collect()
    assert len(table) == 0

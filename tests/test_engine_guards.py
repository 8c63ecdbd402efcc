"""Engine-level hardening: one forward lock and capture per engine shared by any number of
registries and direct callers; in-place weight changes noticed before each resume; one validator of ids
and ``max_new_tokens`` at the public boundary. Tiny random llamas, fp32."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from patchkv_agent import FallbackKind, PatchKVEngine
from patchkv_agent import engine as engine_mod
from patchkv_agent.cli import build_parser
from patchkv_agent.core.inputs import InvalidInput
from patchkv_agent.runtime.kvstore import MemoryStore, resume_from_store
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key
from benchmarks.tiny import tiny_engine, tiny_model

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def ctx(seed: int, n: int = 120, vocab: int = 211) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def versions(seed: int, k: int = 3) -> list[list[int]]:
    """k edited versions of one context (a middle span replaced each time)."""
    rng = np.random.default_rng(1000 + seed)
    out = [ctx(seed)]
    for _ in range(k - 1):
        prev = out[-1]
        at = int(rng.integers(20, len(prev) - 30))
        out.append(prev[:at] + rng.integers(3, 211, 6).tolist() + prev[at + 4:])
    return out


# ----------------------------------------------------------------------------- (a) one forward lock per engine


def _registry_run(reg: ThreadRegistry, key, vs: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for ids in vs:
        r = reg.generate(key, ids, max_new_tokens=3)
        out.append((r.output_ids, r.logits.clone()))
        reg.offload_async(key)  # background checkpoint_from (an attention-capture pass) while others run
    reg.wait(key)
    return out


def _direct_run(e: PatchKVEngine, vs: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for old, new in zip(vs, vs[1:]):
        r = e.resume(e.checkpoint(old), new, strategy="patchkv", max_new_tokens=3)
        out.append((r.output_ids, r.logits.clone()))
    return out


def test_two_registries_and_direct_callers_share_one_engine(engine):
    """Two registries on one engine plus direct checkpoint/resume callers, all at once, from 6 threads:
    every result equals the same work run alone (crashed on e3677db: 'this model is already inside another
    AttentionCapture' / 'attn and resid must be 1-D')."""
    jobs = {f"r1-{i}": versions(i) for i in range(2)} | {f"r2-{i}": versions(10 + i) for i in range(2)} | {
        f"d-{i}": versions(20 + i) for i in range(2)}
    solo = {}
    for name, vs in jobs.items():
        solo[name] = (_direct_run(engine, vs) if name.startswith("d") else
                      _registry_run(ThreadRegistry(engine), thread_key(name), vs))
    r1, r2 = ThreadRegistry(engine), ThreadRegistry(engine)
    assert r1.forward_lock is engine.forward_lock is r2.forward_lock
    got, errors = {}, []
    barrier = threading.Barrier(len(jobs))

    def work(name):
        try:
            barrier.wait()
            vs = jobs[name]
            if name.startswith("d"):
                got[name] = _direct_run(engine, vs)
            else:
                got[name] = _registry_run(r1 if name.startswith("r1") else r2, thread_key(name), vs)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((name, repr(e)))

    ts = [threading.Thread(target=work, args=(n,)) for n in jobs]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=600)
    assert not errors, errors
    for name in jobs:
        assert len(got[name]) == len(solo[name])
        for (ids_a, lg_a), (ids_b, lg_b) in zip(got[name], solo[name]):
            assert ids_a == ids_b, name
            assert (lg_a - lg_b).abs().max().item() <= TOL, name


def test_forward_lock_is_reentrant_and_held_by_resume(engine):
    old = ctx(3)
    ckpt = engine.checkpoint(old)
    with engine.forward_lock:  # a caller holding it can still call the engine (re-entrant)
        r = engine.resume(ckpt, old[:60] + [5, 6, 7] + old[64:], strategy="patchkv", max_new_tokens=2)
    assert r.stats["fallback"] is None
    held = threading.Event()
    release = threading.Event()
    done = []

    def holder():
        with engine.forward_lock:
            held.set()
            release.wait(30)

    def resumer():
        done.append(engine.resume(None, old, strategy="exact", max_new_tokens=1))

    t1 = threading.Thread(target=holder)
    t1.start()
    held.wait(10)
    t2 = threading.Thread(target=resumer)
    t2.start()
    t2.join(0.5)
    assert not done  # waits for the lock
    release.set()
    t1.join(10)
    t2.join(60)
    assert len(done) == 1


# ----------------------------------------------------------------------------- (b) weights identity


def _other_weights(seed: int = 7) -> dict:
    return tiny_model("llama", seed=seed).state_dict()


def test_checkpoint_before_load_state_dict_resumes_exactly_with_reason():
    e = tiny_engine()
    old = ctx(4)
    new = old[:60] + [9, 10, 11] + old[64:]
    ckpt = e.checkpoint(old)
    fp0 = e.spec.fingerprint
    assert e.resume(ckpt, new, strategy="prefix", max_new_tokens=1).stats["fallback"] is None
    e.model.load_state_dict(_other_weights())
    res = e.resume(ckpt, new, strategy="prefix", max_new_tokens=4)
    fb = res.stats["fallback"]
    assert fb is not None and fb.kind is FallbackKind.WEIGHTS_CHANGED and "weights changed" in fb
    assert res.stats["strategy"] == "exact" and e.spec.fingerprint != fp0
    with torch.no_grad():  # the oracle: a plain full forward of the new context under the new weights
        ref = e.model(torch.tensor([new])).logits[0, -1]
    assert (res.logits - ref).abs().max().item() <= TOL
    assert res.output_ids == e.resume(None, new, strategy="exact", max_new_tokens=4).output_ids
    # a checkpoint taken after the change resumes selectively again
    again = e.resume(e.checkpoint(old), new, strategy="patchkv", max_new_tokens=1)
    assert again.stats["fallback"] is None and again.stats["strategy"] == "patchkv"


def test_a_training_step_makes_old_checkpoints_exact():
    e = tiny_engine()
    old = ctx(5)
    new = old[:50] + [12, 13] + old[53:]
    ckpt = e.checkpoint(old)
    opt = torch.optim.SGD(e.model.parameters(), lr=1e-2)
    e.model.train()
    loss = e.model(torch.tensor([old]), labels=torch.tensor([old])).loss
    loss.backward()
    opt.step()
    e.model.eval()
    res = e.resume(ckpt, new, strategy="patchkv", max_new_tokens=2)
    assert res.stats["fallback"].kind is FallbackKind.WEIGHTS_CHANGED
    with torch.no_grad():
        ref = e.model(torch.tensor([new])).logits[0, -1]
    assert (res.logits - ref).abs().max().item() <= TOL


def test_replaced_parameters_are_noticed_too():
    """load_state_dict(assign=True) and setattr of a new Parameter replace tensors instead of writing them."""
    e = tiny_engine()
    old = ctx(13)
    ckpt = e.checkpoint(old)
    e.model.load_state_dict(_other_weights(3), assign=True)
    assert e.resume(ckpt, old, strategy="prefix", max_new_tokens=1).stats["fallback"].kind is \
        FallbackKind.WEIGHTS_CHANGED
    ckpt = e.checkpoint(old)
    w = e.model.model.layers[0].mlp.up_proj.weight
    e.model.model.layers[0].mlp.up_proj.weight = torch.nn.Parameter(w.detach() * 1.5)
    res = e.resume(ckpt, old, strategy="prefix", max_new_tokens=1)
    assert res.stats["fallback"].kind is FallbackKind.WEIGHTS_CHANGED
    with torch.no_grad():
        ref = e.model(torch.tensor([old])).logits[0, -1]
    assert (res.logits - ref).abs().max().item() <= TOL


def test_fingerprint_is_recomputed_only_when_parameters_moved(monkeypatch):
    e = tiny_engine()
    calls = []
    real = engine_mod.fingerprint
    monkeypatch.setattr(engine_mod, "fingerprint", lambda *a, **k: calls.append(1) or real(*a, **k))
    old = ctx(6)
    ckpt = e.checkpoint(old)
    for _ in range(3):
        e.resume(ckpt, old, strategy="prefix", max_new_tokens=2)
    assert calls == []  # forwards do not move parameter versions
    with torch.no_grad():
        next(e.model.parameters()).mul_(1.0)  # an in-place write, even one that changes nothing
    e.resume(ckpt, old, strategy="prefix", max_new_tokens=1)
    assert len(calls) == 1
    assert e.resume(ckpt, old, strategy="prefix", max_new_tokens=1).stats["fallback"] is None  # same bytes


def test_registry_resident_and_stored_kv_from_before_a_weight_change_are_exact():
    e = tiny_engine()
    vs = versions(30)
    store = MemoryStore()
    reg_mem, reg_store = ThreadRegistry(e), ThreadRegistry(e, store=store)
    a, b = thread_key("a"), thread_key("b")
    reg_mem.generate(a, vs[0], max_new_tokens=2)      # resident KV
    reg_store.generate(b, vs[0], max_new_tokens=2)
    reg_store.offload(b)                              # KV in the store
    ckpt = e.checkpoint(vs[0])
    key = store.key_for(ckpt, thread_id="c", version=1)
    store.put(key, ckpt)
    e.model.load_state_dict(_other_weights())
    ref = e.resume(None, vs[1], strategy="exact", max_new_tokens=3)
    for res in (reg_mem.generate(a, vs[1], max_new_tokens=3), reg_store.generate(b, vs[1], max_new_tokens=3),
                resume_from_store(e, store, key, vs[1], max_new_tokens=3)):
        fb = res.stats["fallback"]
        assert fb is not None and fb.kind is FallbackKind.WEIGHTS_CHANGED, fb
        assert res.stats["strategy"] == "exact"
        assert (res.logits - ref.logits).abs().max().item() <= TOL and res.output_ids == ref.output_ids


# ----------------------------------------------------------------------------- (c) one input validator


BAD_IDS = [
    ([1.7, 5.2], "float"),
    ([True, 5], "bool"),
    (["5", "6"], "str"),
    ([float("nan"), 4], "float"),
    ([2 ** 64, 4], "outside the vocabulary"),
    ([-1, 4], "outside the vocabulary"),
    ([[1, 2], [3]], "nested or ragged"),
    ([[1, 2, 3]], "nested or ragged"),
    ([], "empty"),
    ("5 6", "tokenize it first"),
    (None, "list of ints"),
    ({"role": "user"}, "list of ints"),
    (torch.tensor([1.0, 2.0]), "torch.float32"),
    (torch.tensor([True, False]), "torch.bool"),
    (torch.tensor([[1, 2]]), "1-D"),
    (np.array([1.5, 2.0]), "float64"),
    (np.array([True]), "bool"),
]


@pytest.mark.parametrize("ids, words", BAD_IDS, ids=[f"{i}-{w}" for i, (_, w) in enumerate(BAD_IDS)])
def test_bad_ids_are_rejected_at_every_entry(engine, ids, words):
    ckpt = engine.checkpoint(ctx(7))
    reg = ThreadRegistry(engine)
    for call in (lambda: engine.checkpoint(ids),
                 lambda: engine.resume(None, ids, strategy="exact"),
                 lambda: engine.resume(ckpt, ids, strategy="patchkv"),
                 lambda: reg.generate(thread_key("t"), ids),
                 lambda: resume_from_store(engine, MemoryStore(), MemoryStore().key_for(ckpt, thread_id="t", version=1),
                                           ids)):
        with pytest.raises(InvalidInput, match=words):
            call()
    assert reg.keys() == [] or reg.handle(thread_key("t")) is None  # nothing half-created


def test_bad_ids_are_both_value_and_type_errors(engine):
    with pytest.raises(ValueError):
        engine.resume(None, [1.5], strategy="exact")
    with pytest.raises(TypeError):
        engine.resume(None, ["5"], strategy="exact")


def test_good_id_containers_are_accepted_unchanged(engine):
    ids = ctx(8, n=40)
    ref = engine.resume(None, ids, strategy="exact", max_new_tokens=2)
    for form in (tuple(ids), np.asarray(ids, dtype=np.int32), np.asarray(ids, dtype=np.uint16),
                 torch.tensor(ids, dtype=torch.int32), [np.int64(t) for t in ids]):
        r = engine.resume(None, form, strategy="exact", max_new_tokens=2)
        assert r.output_ids == ref.output_ids and np.array_equal(r.context_ids, np.asarray(ids))


def test_encode_rejects_a_dict_and_validates_ids(engine):
    with pytest.raises(InvalidInput, match="wrap the message in a list"):
        engine.encode({"role": "user", "content": "hi"})
    with pytest.raises(InvalidInput, match="float"):
        engine.encode([1.7, 5.2])
    assert engine.encode(np.array([4, 5])) == [4, 5]


@pytest.mark.parametrize("bad", [-1, 2.5, "3", None, True, float("nan")])
def test_bad_max_new_tokens_fail_before_any_compute(engine, bad):
    ids = ctx(9, n=30)
    reg = ThreadRegistry(engine)
    for call in (lambda: engine.resume(None, ids, strategy="exact", max_new_tokens=bad),
                 lambda: reg.generate(thread_key("m"), ids, max_new_tokens=bad)):
        with pytest.raises(InvalidInput, match="max_new_tokens must be a non-negative int"):
            call()
    assert reg.handle(thread_key("m")) is None  # the registry did not advance the thread


def test_max_new_tokens_is_clipped_to_the_remaining_positions(engine):
    n_max = engine.spec.max_positions
    ids = ctx(10, n=n_max - 2)
    r = engine.resume(None, ids, strategy="exact", max_new_tokens=10)
    assert len(r.output_ids) <= 2
    ref = engine.resume(None, ids, strategy="exact", max_new_tokens=2)
    assert r.output_ids == ref.output_ids
    reg = ThreadRegistry(engine)
    assert len(reg.generate(thread_key("c"), ids, max_new_tokens=10).output_ids) <= 2
    full = ctx(11, n=n_max)
    assert engine.resume(None, full, strategy="exact", max_new_tokens=0).output_ids == []
    with pytest.raises(InvalidInput, match="already fill the model's"):
        engine.resume(None, full, strategy="exact", max_new_tokens=1)
    with pytest.raises(InvalidInput, match="maximum of"):
        engine.resume(None, ctx(12, n=n_max + 1), strategy="exact", max_new_tokens=0)


@pytest.mark.parametrize("bad", ["-1", "2.5", "three", ""])
def test_cli_rejects_bad_max_new_tokens(bad, capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["replay", "traces.jsonl", "--max-new-tokens", bad])
    assert ei.value.code == 2
    assert "--max-new-tokens must be a non-negative integer" in capsys.readouterr().err
    assert build_parser().parse_args(["replay", "t.jsonl", "--max-new-tokens", "3"]).max_new_tokens == 3

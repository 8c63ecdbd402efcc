"""The engine's typed surface: RecoverySettings (what strategies read), ResumeStats (typed parts, one JSON
form), CheckpointProvenance and Fallback (why a resume was exact), on a tiny llama."""

from __future__ import annotations

import dataclasses
import json
import pickle

import numpy as np
import pytest
import torch

from patchkv_agent import Fallback, FallbackKind, PatchKVEngine, RecoverySettings, ResumeStats
from patchkv_agent.results import EnginePart
from patchkv_agent.core.checkpoint import CorruptCheckpoint
from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, DEFAULT_DIRTY_WINDOW, LengthModel, plan_repair
from patchkv_agent.core.precision import PrecisionPolicy
from patchkv_agent.runtime.kvstore import CheckpointMissing, ForeignCheckpoint, MemoryStore, StoreUnavailable
from patchkv_agent.runtime.kvstore import load_for_resume, resume_from_store
from patchkv_agent.strategies import PatchKVStrategy, get_strategy
from benchmarks.tiny import tiny_engine, tiny_model
from kv_helpers import plan_settings
from test_recovery import edited_pair

TOL = 1e-4

# the stats keys of an engine resume before ResumeStats existed (e3677db), in order
OLD_KEYS = ("strategy", "prompt_tokens", "prefix_tokens", "new_tokens", "suffix_tokens", "recompute_tokens",
            "recompute_ratio", "restore_tokens", "payload_bytes", "ttft_s", "plan_s", "restore_s", "recompute_s",
            "offload_s", "stats_s", "quantize_s", "fallback")


@pytest.fixture(scope="module")
def pair(engine):
    return edited_pair(engine.spec.vocab_size, n=120, low=3)


# ----------------------------------------------------------------------------- RecoverySettings


def test_settings_defaults_validation_and_replace():
    s = RecoverySettings()
    assert (s.block_size, s.kappa, s.restore_precision, s.capture_window, s.mixed_precision) == (
        DEFAULT_BLOCK_SIZE, 0.0, "fp16", 32, True)
    assert s.length_model == LengthModel.fixed(DEFAULT_DIRTY_WINDOW)
    with pytest.raises(TypeError):
        RecoverySettings(16)  # keyword-only
    with pytest.raises(Exception):
        s.block_size = 4  # frozen
    for bad in ({"block_size": 0}, {"block_size": 2.5}, {"kappa": 1.5}, {"kappa": float("nan")},
                {"restore_precision": "int4"}, {"capture_window": 0}, {"mixed_precision": "yes"},
                {"length_model": 32}):
        with pytest.raises(ValueError):
            s.replace(**bad)
    with pytest.raises(TypeError):
        s.replace(no_such_field=1)
    assert s.replace(kappa=0.1).kappa == 0.1 and s.kappa == 0.0


def test_engine_builds_settings_once_explicit_args_win(engine):
    s = engine.settings
    assert (s.block_size, s.length_model) == (8, LengthModel.fixed(8))
    assert engine.settings_sources["block_size"] == "argument" and engine.settings_sources["kappa"] == "default"
    assert not hasattr(engine, "kappa") and not hasattr(engine, "block_size")  # one way in: the settings
    base = RecoverySettings(block_size=16, kappa=0.25, precision_policy=PrecisionPolicy(tau_L=0.5))
    e2 = PatchKVEngine(engine.model, None, settings=base, kappa=0.5, profile=None)
    assert (e2.settings.block_size, e2.settings.kappa, e2.settings.precision_policy.tau_L) == (16, 0.5, 0.5)
    with pytest.raises(ValueError):
        PatchKVEngine(engine.model, None, block_size=0, profile=None)


def test_one_schema_names_every_setting_an_entry_point_takes(engine):
    # every settings field is a keyword of the engine, checked by the schema; a typo names the valid ones
    every = {"capture_window": 4, "mixed_precision": False, "restore_precision": "mixed", "recent_window": 16,
             "tail_threshold": 0.5, "head_tokens": 3, "reader_min_blocks": 2}
    e = PatchKVEngine(engine.model, None, profile=None, **every)
    assert {k: getattr(e.settings, k) for k in every} == every
    assert all(e.settings_sources[k] == "argument" for k in every)
    with pytest.raises(TypeError, match=r"no setting \['kapa'\].*kappa.*tail_threshold.*dirty_window"):
        PatchKVEngine(engine.model, None, profile=None, kapa=0.1)
    with pytest.raises(TypeError, match="from_pretrained has no setting"):  # before any model is loaded
        PatchKVEngine.from_pretrained("/nonexistent/model", kapa=0.1)
    with pytest.raises(ValueError, match="dirty_window"):
        PatchKVEngine(engine.model, None, profile=None, dirty_window=-1)
    # the alias converts; the field it stands for wins when both are given
    assert RecoverySettings.overrides({"dirty_window": 7}) == {"length_model": LengthModel.fixed(7)}
    both = RecoverySettings.overrides({"dirty_window": 7, "length_model": LengthModel.fixed(9), "kappa": None})
    assert both == {"length_model": LengthModel.fixed(9)}
    # a strategy takes the planner's settings, not the checkpoint pass's, with the same names and checks
    assert set(PatchKVStrategy.option_names()) == {"precision", "dirty_window",
                                                   *RecoverySettings.field_names(strategy=True)}
    assert not {"capture_window", "mixed_precision", "precision_policy"} & set(PatchKVStrategy.option_names())
    with pytest.raises(TypeError, match=r"PatchKVStrategy has no setting \['capture_window'\]"):
        PatchKVStrategy(capture_window=4)
    with pytest.raises(ValueError, match=r"takes no option \['capture_window'\]"):
        get_strategy("patchkv", {"capture_window": 4})
    assert PatchKVStrategy(head_tokens=5).resolve(RecoverySettings()).head_tokens == 5


def test_engine_settings_are_replaced_whole_and_repr_says_where_each_came_from(tmp_path):
    from patchkv_agent.profiles import Profile

    model = tiny_model("llama")
    fp = PatchKVEngine(model, None, profile=None).spec.fingerprint
    prof = Profile.from_dict({"schema": 1, "model": "tiny", "fingerprint": fp, "kappa": 0.25, "block_size": 16,
                              "length_model": LengthModel.fixed(40).to_dict()})
    e = PatchKVEngine(model, None, profile=prof, block_size=8)
    assert (e.settings.kappa, e.settings.block_size, e.settings.length_model) == (0.25, 8, LengthModel.fixed(40))
    src = e.settings_sources
    assert src["kappa"] == src["length_model"] == "profile (given)" and src["block_size"] == "argument"
    assert src["capture_window"] == "default"
    before = e.settings
    e.settings = e.settings.replace(capture_window=4)
    assert before.capture_window != 4 and e.settings.capture_window == 4
    assert e.settings_sources["capture_window"] == "assigned" and e.settings_sources["kappa"] == "profile (given)"
    r = repr(e)
    assert "kappa=0.25 [profile (given)]" in r and "block_size=8 [argument]" in r and "capture_window=4 [assigned]" in r
    with pytest.raises(TypeError, match="RecoverySettings"):
        e.settings = {"kappa": 0.1}
    with pytest.raises(ValueError):
        e.settings = e.settings.replace(kappa=2.0)
    with pytest.raises(ValueError, match="Profile.from_dict"):
        PatchKVEngine(model, None, profile={"kappa": 0.1})
    with pytest.raises(AttributeError):
        e.kappa = 0.1  # no engine setters: a typo'd attribute must not silently do nothing
    (tmp_path / "p.json").write_text(json.dumps({**prof.data, "kappa": 0.5}))
    assert PatchKVEngine(model, None, profile_dirs=[tmp_path]).settings.kappa == 0.5  # the caller's folder


def test_strategies_read_settings_not_the_engine(engine, pair):
    old, new = pair
    ckpt = engine.checkpoint(old)
    edit = diff_versions(ckpt.token_ids, np.asarray(new))
    s = RecoverySettings(block_size=4, length_model=LengthModel.fixed(12), kappa=0.05)
    got = get_strategy("patchkv").plan(s, ckpt, edit)
    # the settings' reader defaults
    ref = plan_repair(edit, ckpt.scores, plan_settings(length_model=LengthModel.fixed(12), kappa=0.05, block_size=4,
                                                       readers="lexical", reader_budget=s.reader_budget))
    assert np.array_equal(got.recompute_positions, ref.recompute_positions)
    off = get_strategy("patchkv", {"readers": "none"}).plan(s, ckpt, edit)
    no_readers = plan_repair(edit, ckpt.scores, plan_settings(length_model=LengthModel.fixed(12), kappa=0.05,
                                                              block_size=4))
    assert off.n_readers == 0 and np.array_equal(off.recompute_positions, no_readers.recompute_positions)
    assert np.array_equal(got.restore_old_positions, ref.restore_old_positions)
    # options are overrides of the settings
    strat = PatchKVStrategy(dirty_window=20, block_size=16, precision="fp16")
    r = strat.resolve(s)
    assert (r.length_model, r.block_size, r.kappa, r.restore_precision) == (LengthModel.fixed(20), 16, 0.05, "fp16")
    got = strat.plan(s, ckpt, edit)
    ref = plan_repair(edit, ckpt.scores, plan_settings(length_model=LengthModel.fixed(20), kappa=0.05, block_size=16,
                                                       readers=r.readers, reader_budget=r.reader_budget))
    assert np.array_equal(got.recompute_positions, ref.recompute_positions)
    with pytest.raises(ValueError, match="precision"):
        PatchKVStrategy(precision="int4")
    with pytest.raises(ValueError):
        PatchKVStrategy(kappa=-0.1)
    # an engine resume with options equals one on an engine whose settings are those options (fp16
    # restores: the mixed runs of the two checkpoints are tagged per block of their own size)
    e2 = PatchKVEngine(engine.model, None, block_size=16, dirty_window=20, profile=None)
    a = engine.resume(ckpt, new, strategy=get_strategy("patchkv", {"dirty_window": 20, "block_size": 16, "precision": "fp16"}), max_new_tokens=3)
    b = e2.resume(e2.checkpoint(old), new, strategy=get_strategy("patchkv", {"precision": "fp16"}), max_new_tokens=3)
    assert a.stats["recompute_tokens"] == b.stats["recompute_tokens"] and a.output_ids == b.output_ids
    assert torch.allclose(a.logits, b.logits, atol=TOL)


# ----------------------------------------------------------------------------- ResumeStats


def test_resume_stats_are_typed_and_read_as_the_result_rows_dict(engine, pair):
    old, new = pair
    named = OLD_KEYS + ("approx_rows", "nonfinite_values", "head_rewrite", "small_restore", "heal_s", "healed_rows",
                        "restore_kernel")
    assert EnginePart.field_names() == named
    keys = named[:len(OLD_KEYS)] + ("fallback_kind",) + named[len(OLD_KEYS):]  # the JSON form's keys, in order
    res = engine.resume(engine.checkpoint(old), new, strategy="patchkv", max_new_tokens=2)
    assert isinstance(res.stats, ResumeStats) and isinstance(res.stats.engine, EnginePart)
    assert res.stats.runtime is None and res.stats.call is None and dict(res.stats.extras) == {}
    assert tuple(res.stats) == keys and res.stats.restore_kernel in ("native", "torch", "triton")
    exact = engine.resume(None, new, strategy="exact", max_new_tokens=0)
    assert tuple(exact.stats) == keys and exact.stats.approx_rows == 0
    assert res.stats["approx_rows"] == res.stats.approx_rows == len(new) - res.exact_rows > 0
    assert exact.stats.offload_s is None and exact.stats.fallback is None and "extras" not in exact.stats
    assert exact.stats.base is None and "base" not in exact.stats  # no runtime part: its fields read as None
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.stats.engine.ttft_s = 0.0
    json.dumps(res.stats.to_json())  # a trace row's fields are JSON values
    back = ResumeStats.from_json(json.loads(json.dumps(res.stats.to_json())))
    assert back == res.stats and back.recompute_tokens == res.stats.recompute_tokens
    with pytest.raises(KeyError, match="ttft_s"):
        ResumeStats.from_json({k: v for k, v in res.stats.to_json().items() if k != "ttft_s"})
    healed = engine.heal(res)
    assert healed.stats.healed_rows == res.stats.approx_rows and res.stats.heal_s is None  # the copy, not res


def test_cacheblend_stats_keep_their_extras(engine, pair):
    old, new = pair
    e = tiny_engine(model=engine.model, mixed_precision=False)
    res = e.resume(e.checkpoint(old), new, strategy="cacheblend", max_new_tokens=1)
    assert tuple(res.stats)[:len(OLD_KEYS)] == OLD_KEYS
    extras = {"cacheblend_full_layers", "cacheblend_full_tokens", "cacheblend_selected",
              "cacheblend_selected_positions"}
    assert set(res.stats.extras) == extras and tuple(res.stats)[-4:] == tuple(res.stats.extras)  # strategy-owned, last
    assert res.stats.restore_kernel is None
    back = ResumeStats.from_json(res.stats.to_json())  # arrays come back as lists
    assert back.extras["cacheblend_selected_positions"] == res.stats.extras["cacheblend_selected_positions"].tolist()


# ----------------------------------------------------------------------------- Fallback


def test_fallback_is_its_text():
    f = Fallback(FallbackKind.MISSING, "evicted by the LRU")
    assert f == "exact recompute: checkpoint missing: evicted by the LRU" and str(f) == f
    assert type(str(f)) is str and f.kind is FallbackKind.MISSING and f.detail == "evicted by the LRU"
    assert json.loads(json.dumps({"fallback": f})) == {"fallback": str(f)}
    g = pickle.loads(pickle.dumps(f))
    assert g == f and g.kind is FallbackKind.MISSING
    assert Fallback("corrupt_checkpoint", "x").kind is FallbackKind.CORRUPT_CHECKPOINT
    with pytest.raises(ValueError):
        Fallback("no-such-kind", "x")
    for kind in FallbackKind:
        assert Fallback(kind, "d").startswith("exact recompute: ") and Fallback(kind, "d").endswith("d")


def test_engine_fallback_kinds(engine, pair):
    old, new = pair
    dyn = tiny_engine("dynamic")
    res = dyn.resume(dyn.checkpoint(old), new, strategy="direct", max_new_tokens=1)
    fb = res.stats["fallback"]
    assert fb.kind is FallbackKind.UNSUPPORTED_ROPE and fb == f"exact recompute: {dyn.spec.rope_unsupported_reason}"

    ckpt = engine.checkpoint(old)
    for tag in ckpt.mixed.tag_rows:
        ckpt.mixed.payloads[0][tag].k_data.view(torch.uint8).view(-1)[0] ^= 0x5A
    res = engine.resume(ckpt, new, strategy="patchkv", max_new_tokens=1)
    fb = res.stats["fallback"]
    assert fb.kind is FallbackKind.CORRUPT_RUN and fb.startswith("exact recompute: checksum mismatch")
    exact = engine.resume(None, new, strategy="exact", max_new_tokens=1)
    assert (res.logits - exact.logits).abs().max().item() <= TOL and res.output_ids == exact.output_ids


@pytest.mark.parametrize("exc, kind, label", [
    (CheckpointMissing(None, "gone"), FallbackKind.MISSING, "checkpoint missing: "),
    (ForeignCheckpoint("entry of thread u"), FallbackKind.FOREIGN, "foreign checkpoint: "),
    (CorruptCheckpoint("bad bytes"), FallbackKind.CORRUPT_CHECKPOINT, "corrupt checkpoint: "),
    (StoreUnavailable("connection refused"), FallbackKind.STORE_UNAVAILABLE, "store unavailable: "),
])
def test_store_fallback_kinds(engine, pair, exc, kind, label, monkeypatch):
    old, new = pair
    store = MemoryStore()
    ckpt = engine.checkpoint(old)
    key = store.key_for(ckpt, thread_id="t", version=1)
    store.put(key, ckpt)

    def fail(_key, **_kw):
        raise exc

    monkeypatch.setattr(store, "get", fail)
    _, reason = load_for_resume(engine, store, key)
    assert reason.kind is kind and reason.startswith("exact recompute: " + label)
    res = resume_from_store(engine, store, key, new, max_new_tokens=2)
    assert res.stats["fallback"].kind is kind and res.stats["strategy"] == "exact"


def test_store_foreign_model_kind(engine, pair):
    import dataclasses

    old, new = pair
    store = MemoryStore()
    ckpt = engine.checkpoint(old)
    key = dataclasses.replace(store.key_for(ckpt, thread_id="t", version=1), fingerprint="other:" + "0" * 24)
    _, reason = load_for_resume(engine, store, key)
    assert reason.kind is FallbackKind.FOREIGN_MODEL and "another model" in reason


# ------------------------------------------------------------- statistics from the resume's own forward


def test_exact_resume_takes_the_checkpoint_passes_statistics(engine, pair):
    """Oracle: the checkpoint-creation pass over the same ids (the same last query rows, the same keys)."""
    _, new = pair
    res = engine.resume(None, new, strategy="exact", max_new_tokens=2)
    ckpt = engine.checkpoint(new)
    assert res.scores is not None and res.scores.shape == (len(new),)
    np.testing.assert_allclose(res.scores, ckpt.scores, rtol=1e-5, atol=1e-7)


def test_checkpoint_from_reuses_the_resume_statistics_without_a_forward(engine, pair):
    import threading

    old, new = pair
    res = engine.resume(engine.checkpoint(old), new, strategy="patchkv", max_new_tokens=2)
    assert res.scores is not None and res.scores.sum() == pytest.approx(1.0, abs=1e-5)
    got = []
    holder_has_lock, done = threading.Event(), threading.Event()

    def hold():  # another caller's forward holds the model the whole time
        with engine.forward_lock:
            holder_has_lock.set()
            done.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    assert holder_has_lock.wait(10)
    worker = threading.Thread(target=lambda: got.append(engine.checkpoint_from(res)))
    worker.start()
    worker.join(30)
    done.set()
    t.join()
    assert got, "checkpoint_from waited for the forward lock although it needs no forward"
    ck = got[0]
    assert ck.provenance.stats_s == 0.0 and ck.provenance.quantize_s >= 0 and ck.provenance.copy_s >= 0
    np.testing.assert_array_equal(ck.scores, res.scores)
    # a result without statistics still gets them (the tail pass, under the lock)
    import dataclasses

    bare = dataclasses.replace(res, scores=None)
    ck2 = engine.checkpoint_from(bare)
    assert ck2.scores is not None and ck2.provenance.stats_s > 0
    # the zero-copy resident view carries the statistics, padded for tokens decoded after the resume
    longer = dataclasses.replace(res, context_ids=np.concatenate([res.context_ids, [5, 6]]))
    view = engine.as_checkpoint(longer)
    assert view.scores.shape == (len(new) + 2,) and view.scores[-2:].tolist() == [0.0, 0.0]


def test_strategy_options_are_named_and_checked_in_one_place(engine, pair):
    old, new = pair
    ckpt = engine.checkpoint(old)
    with pytest.raises(TypeError):
        engine.resume(ckpt, new, strategy="patchkv", kappa=0.1)  # no **options swallowing a typo'd keyword
    with pytest.raises(ValueError, match=r"takes no option \['kapa'\].*kappa"):
        get_strategy("patchkv", {"kapa": 0.1})
    with pytest.raises(ValueError, match="takes no option"):
        get_strategy("exact", {"kappa": 0.1})
    with pytest.raises(ValueError, match="kappa"):
        get_strategy("patchkv", {"kappa": 1.5})
    with pytest.raises(ValueError, match="build the instance"):
        get_strategy(PatchKVStrategy(), {"kappa": 0.1})
    a = engine.resume(ckpt, new, strategy=PatchKVStrategy(dirty_window=1000), max_new_tokens=0)
    b = engine.resume(ckpt, new, strategy=engine.strategy("patchkv", {"dirty_window": 1000}), max_new_tokens=0)
    assert a.stats.restore_tokens == b.stats.restore_tokens == 0 and torch.equal(a.logits, b.logits)


def test_the_exact_strategies_a_layer_gets_without_naming_them():
    from patchkv_agent.resume import ResumeRequest
    from patchkv_agent.strategies import exact_reuse, full_prefill, get_strategy

    full, reuse = full_prefill(), exact_reuse()
    assert full.exact and not full.uses_checkpoint
    assert reuse.exact and reuse.uses_checkpoint
    req = ResumeRequest(ids=np.arange(4, dtype=np.int64), strategy=get_strategy("patchkv"), max_new_tokens=2)
    assert req.as_full_prefill().strategy.exact and not req.as_full_prefill().strategy.uses_checkpoint
    assert req.as_exact_reuse().strategy.exact and req.as_exact_reuse().max_new_tokens == 2

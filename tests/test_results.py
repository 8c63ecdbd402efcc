"""Typed results: a resume's stats are frozen parts (engine, runtime, call) with one JSON form, and a
checkpoint's provenance is typed and read back strictly (stored entries are untrusted)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from patchkv_agent.core.checkpoint import CorruptCheckpoint
from patchkv_agent.core.fallback import Fallback, FallbackKind
from patchkv_agent.core.recovery import RecoveryOutput, RecoveryStats
from patchkv_agent.core.provenance import CheckpointProvenance, Source
from benchmarks.tiny import tiny_engine
from patchkv_agent.results import (BaseKind, CallPart, EnginePart, PreparedOutcome, ResumeStats, RuntimePart,
                                   SamplingInfo)
from patchkv_agent.runtime.keys import thread_key
from patchkv_agent.runtime.kvstore import MemoryStore, decode_checkpoint, encode_checkpoint
from patchkv_agent.runtime.kvstore.codec import CheckpointKey, meta_checksum
from patchkv_agent.runtime.state import TakenPreparation
from patchkv_agent.runtime.threads import ThreadRegistry

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine_part(**over) -> EnginePart:
    base = dict(strategy="patchkv", prompt_tokens=100, prefix_tokens=40, new_tokens=17, suffix_tokens=43,
                recompute_tokens=30, recompute_ratio=0.5, restore_tokens=30, payload_bytes=1024, ttft_s=0.01,
                plan_s=0.001, restore_s=0.002, recompute_s=0.008, offload_s=0.2, stats_s=0.0, quantize_s=0.1,
                fallback=None)
    return EnginePart(**{**base, **over})


def _pair(vocab: int, n: int = 120, seed: int = 0):
    rng = np.random.default_rng(seed)
    old = rng.integers(3, vocab, size=n)
    new = np.concatenate([old[:40], rng.integers(3, vocab, size=17), old[50:]])
    return old, new


@pytest.fixture(scope="module")
def eng():
    return tiny_engine()


# ----------------------------------------------------------------------------- the parts, without a model


def test_every_part_round_trips_through_the_one_json_form():
    fb = Fallback(FallbackKind.MISSING, "evicted by the budget")
    st = ResumeStats(_engine_part(fallback=fb, restore_kernel="native",
                                  extras={"cacheblend_selected_positions": np.arange(3)}))
    st = st.with_runtime(thread_id="t", checkpoint_ns="", version=2, base_version=1, base=BaseKind.RESTART,
                         prepared=PreparedOutcome.MISS, prepared_info={"editors": ["clear"]})
    st = st.with_call(decode_s=0.5, output_tokens=4, thread_key=("t", ""),
                      sampling=SamplingInfo(temperature=0.0, top_p=1.0, seed=None), tool_s=1.5)
    js = st.to_json()
    text = json.dumps(js)  # JSON values only: enums are their strings, the fallback its text
    assert js["base"] == "restart" and type(js["base"]) is str and js["prepared"] == "miss"
    assert js["fallback"] == str(fb) and js["fallback_kind"] == "missing" and js["thread_key"] == ["t", ""]
    assert js["sampling"] == {"temperature": 0.0, "top_p": 1.0, "seed": None}
    assert list(js)[-1] == "cacheblend_selected_positions"  # the strategy's extras come last
    back = ResumeStats.from_json(json.loads(text))
    assert back.to_json() == js
    assert back.fallback.kind is FallbackKind.MISSING and back.fallback.detail == "evicted by the budget"
    assert back.base is BaseKind.RESTART and back.runtime.prepared_info == {"editors": ["clear"]}
    assert back.call.sampling == SamplingInfo(temperature=0.0, top_p=1.0) and back.call.thread_key == ("t", "")
    # an engine-only result has no runtime or call keys; their fields read as None
    only = ResumeStats(_engine_part())
    assert "base" not in only.to_json() and "decode_s" not in only and only.base is None and only.tool_s is None
    assert ResumeStats.from_json(only.to_json()).runtime is None


def test_a_layer_adds_its_own_part_and_edits_no_other():
    st = ResumeStats(_engine_part())
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.engine.ttft_s = 1.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.runtime = RuntimePart()
    with pytest.raises(TypeError, match="base"):
        st.with_call(base="resident")  # a runtime field through the call part
    with pytest.raises(TypeError, match="tool_s"):
        st.with_runtime(tool_s=1.0)
    with pytest.raises(TypeError):
        st.engine.extras["x"] = 1  # strategy extras are read-only
    with pytest.raises(ValueError, match="ttft_s"):
        _engine_part(extras={"ttft_s": 0})  # a strategy cannot shadow a result field
    with pytest.raises(ValueError, match="base"):
        _engine_part(extras={"base": "x"})
    with pytest.raises(ValueError):
        RuntimePart(base="offloaded")  # not a BaseKind
    with pytest.raises(ValueError):
        RuntimePart(prepared="maybe")
    with pytest.raises(ValueError, match="fallback_kind"):
        ResumeStats.from_json({**st.to_json(), "fallback": "exact recompute: why", "fallback_kind": None})
    a = st.with_call(tool_s=1.0)
    assert st.call is None and a.call == CallPart(tool_s=1.0)  # a new object: the old one is unchanged
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.ttft_s = 0.0  # the flat reads are derived from the parts, never written
    with pytest.raises(AttributeError, match="tttf_s"):
        st.tttf_s  # a typo is an error, not a None
    assert type(st).ttft_s.fget(st) == st.engine.ttft_s and "ttft_s" in dir(st)


def test_a_taken_preparation_carries_a_typed_report():
    report = RuntimePart(prepared=PreparedOutcome.PARTIAL, prepared_reason="stopped", prepared_tokens=8)
    taken = TakenPreparation(report=report, shared_resident=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        taken.shared_resident = 0
    got = taken.runtime_fields(n_ids=20, recompute_tokens=5, from_prepared=True)
    assert set(got) == set(RuntimePart.preparation_fields()) and got["prepared"] is PreparedOutcome.PARTIAL
    assert got["prepared_hidden_share"] == 0.5 and taken.report.prepared_hidden_share is None  # composed, not edited
    assert TakenPreparation().runtime_fields(20, 5, False) == {}
    with pytest.raises(TypeError, match="thread_id"):
        TakenPreparation(report=RuntimePart(prepared=PreparedOutcome.HIT, thread_id="t"))  # not the preparation's

def test_a_recovery_measurement_is_frozen_and_composed():
    inner = RecoveryStats(restore_s=1.0, recompute_s=2.0, recompute_tokens=5, extras={"cacheblend_selected": 3})
    with pytest.raises(dataclasses.FrozenInstanceError):
        inner.restore_s = 0.0
    with pytest.raises(TypeError):
        inner.extras["tail_probe"] = "off"  # an executor's extras are read-only
    outer = inner.adding(restore_s=0.5, recompute_s=0.25, tail_probe="off: no layer-wise forward")
    assert (outer.restore_s, outer.recompute_s, outer.recompute_tokens) == (1.5, 2.25, 5)
    assert dict(outer.extras) == {"cacheblend_selected": 3, "tail_probe": "off: no layer-wise forward"}
    assert inner.restore_s == 1.0 and dict(inner.extras) == {"cacheblend_selected": 3}  # the inner one unchanged
    out = RecoveryOutput(logits=None, keys=[], values=[], stats=inner)
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.stats = outer


def test_base_kind_names_every_base_the_registry_reports():
    assert {b.value for b in BaseKind} == {"resident", "prepared", "background", "evicted", "restart", "none"}
    assert {p.value for p in PreparedOutcome} == {"hit", "partial", "miss", "unfinished", "failed"}
    assert {s.value for s in Source} == {"prefill", "resume", "resident"}


# ----------------------------------------------------------------------------- a real resume, tiny model


def test_registry_resumes_carry_each_layers_part(eng):
    old, new = _pair(eng.spec.vocab_size)
    reg = ThreadRegistry(eng)
    key = thread_key("t")
    first = reg.generate(key, old, max_new_tokens=0)
    assert first.stats.base is BaseKind.NONE and first.stats.version == 1 and first.stats.base_version is None
    reg.offload_async(key, release=True).result()  # the next resume reads the background checkpoint
    ckpt = reg.table.peek(key).checkpoint
    assert ckpt.provenance.source is Source.RESUME and ckpt.provenance.exact_rows == len(ckpt) == len(old)
    res = reg.generate(key, new, strategy="patchkv", max_new_tokens=3)
    st = res.stats
    e, r, c = st.engine, st.runtime, st.call
    assert e.strategy == "patchkv" and e.prompt_tokens == len(new) and e.prefix_tokens == 40
    assert e.new_tokens == 17 and e.restore_tokens > 0 and e.fallback is None and e.restore_kernel is not None
    assert e.prefix_tokens + e.recompute_tokens + e.restore_tokens == len(new)
    assert e.offload_s == ckpt.provenance.offload_s and e.quantize_s == ckpt.provenance.quantize_s
    assert e.approx_rows == len(new) - res.exact_rows > 0
    assert (r.thread_id, r.checkpoint_ns, r.version, r.base_version) == ("t", "", 2, 1)
    assert r.base is BaseKind.BACKGROUND and r.requested_strategy == "patchkv" and r.prepared is None
    assert c.output_tokens == len(res.output_ids) == 3 and c.decode_s >= 0 and c.tool_mode is None
    assert st["base"] == "background" and st.ttft_s == e.ttft_s  # the flat reads
    js = json.loads(json.dumps(st.to_json()))
    assert ResumeStats.from_json(js) == st and js["base"] == "background" and js["restore_tokens"] == e.restore_tokens
    # the next call continues the resident version
    more = reg.generate(key, np.concatenate([new, [5, 6, 7]]), max_new_tokens=0).stats
    assert more.base is BaseKind.RESIDENT and more.base_version == 2 and more.base_approx_rows is not None
    reg.close()


def test_store_resume_and_registry_fill_one_runtime_part(eng):
    old, new = _pair(eng.spec.vocab_size, seed=1)
    reg = ThreadRegistry(eng, store=MemoryStore(deployment="t"))
    key = thread_key("s")
    reg.generate(key, old, max_new_tokens=0)
    reg.offload_async(key, release=True).result()
    st = reg.generate(key, new, max_new_tokens=0).stats
    assert st.base is BaseKind.BACKGROUND and st.store_tier == "memory" and st.store_key and st.store_get_s >= 0
    assert st.runtime.version == 2 and st.requested_strategy == "patchkv" and st.fallback is None
    reg.close()


def test_heal_and_prepare_fill_typed_engine_fields(eng):
    old, new = _pair(eng.spec.vocab_size, seed=2)
    res = eng.resume(eng.checkpoint(old), new, strategy="patchkv", max_new_tokens=0)
    healed = eng.heal(res)
    assert healed.stats.healed_rows == res.stats.approx_rows > 0 and healed.stats.heal_s > 0
    assert res.stats.heal_s is None and healed.stats.engine.ttft_s == res.stats.engine.ttft_s
    prep = eng.prepare(healed, np.concatenate([new, [9, 9, 9]]), chunk_tokens=2)
    work = prep.stats.prepare
    assert prep.stats.strategy == "prepared" and work.reused_rows == len(new) and work.computed_rows == 3
    assert work.chunks == 2 and not work.stopped and "prepare" in prep.stats.to_json()


# ----------------------------------------------------------------------------- checkpoint provenance


def test_provenance_says_how_each_checkpoint_was_made(eng):
    old, new = _pair(eng.spec.vocab_size, seed=3)
    ck = eng.checkpoint(old)
    p = ck.provenance
    assert p.source is Source.PREFILL and p.offload_s > 0 and p.prefill_s > 0 and p.quantize_s >= 0
    assert p.exact_rows is None and p.kept_full_tokens == 0 and p.pack_s >= 0
    res = eng.resume(ck, new, max_new_tokens=0)
    assert res.stats.offload_s == p.offload_s and res.stats.stats_s == p.stats_s
    ck2 = eng.checkpoint_from(res)
    assert ck2.provenance.source is Source.RESUME and ck2.provenance.exact_rows == res.exact_rows
    view = eng.as_checkpoint(res)
    assert view.provenance.source is Source.RESIDENT and view.provenance.exact_rows == res.exact_rows
    assert CheckpointProvenance.from_json(json.loads(json.dumps(p.to_json()))) == p


# the stats dict an engine wrote before provenance was typed (a stored entry of an older version)
OLD_STATS = {"quantize_s": 0.12, "value_residual_s": 0.05, "key_residual_s": 0.0, "tags_s": 0.001, "pack_s": 0.06,
             "kept_full_tokens": 0, "copy_s": 0.01, "offload_s": 0.3, "stats_s": 0.0, "source": "resume",
             "exact_rows": 87}


def test_an_old_stats_dict_reads_as_provenance():
    p = CheckpointProvenance.from_json(OLD_STATS)
    assert p.source is Source.RESUME and p.exact_rows == 87 and p.offload_s == 0.3 and p.prefill_s is None
    assert CheckpointProvenance.from_json({}) == CheckpointProvenance()


HOSTILE = [
    ({**OLD_STATS, "exec": "import os"}, "unknown fields"),
    ({"offload_s": "0.3"}, "offload_s"),
    ({"offload_s": [0.3]}, "offload_s"),
    ({"offload_s": {"a": 1}}, "offload_s"),
    ({"offload_s": True}, "offload_s"),
    ({"offload_s": -1.0}, "offload_s"),
    ({"offload_s": math.nan}, "offload_s"),
    ({"offload_s": math.inf}, "offload_s"),
    ({"exact_rows": 1.5}, "exact_rows"),
    ({"exact_rows": -3}, "exact_rows"),
    ({"exact_rows": False}, "exact_rows"),
    ({"kept_full_tokens": "many"}, "kept_full_tokens"),
    ({"source": "evil"}, "source"),
    ({"source": 7}, "source"),
    ([("offload_s", 0.1)], "object"),
    ("offload_s", "object"),
]


@pytest.mark.parametrize("stats,why", HOSTILE, ids=[str(i) for i in range(len(HOSTILE))])
def test_hostile_provenance_is_refused(stats, why):
    with pytest.raises(ValueError, match=why):
        CheckpointProvenance.from_json(stats)


@pytest.mark.parametrize("stats", [h[0] for h in HOSTILE[:4]] + [{"source": "evil"}, {"exact_rows": -3}])
def test_a_stored_entry_with_hostile_stats_is_corrupt(stats):
    from kv_helpers import make_ckpt

    ck = make_ckpt(5)
    key = CheckpointKey.of(ck, deployment="d", thread_id="t", version=1)
    meta, blobs = encode_checkpoint(ck, key)
    blobs = {k: v.tobytes() for k, v in blobs.items()}
    assert decode_checkpoint(meta, blobs, key).provenance == ck.provenance  # the genuine entry reads back
    bad = {k: v for k, v in meta.items() if k != "meta_xxh3"}
    bad["stats"] = stats
    bad["meta_xxh3"] = meta_checksum(bad)  # resealed: only the type checks stand in the way
    with pytest.raises(CorruptCheckpoint, match="stats"):
        decode_checkpoint(bad, blobs, key)
    old = {k: v for k, v in meta.items() if k != "meta_xxh3"}
    old["stats"] = OLD_STATS  # an entry written before provenance was typed
    old["meta_xxh3"] = meta_checksum(old)
    assert decode_checkpoint(old, blobs, key).provenance.exact_rows == 87


def test_the_middleware_adds_its_fields_through_the_call_part():
    from langchain_core.messages import AIMessage

    from patchkv_agent.langgraph.middleware import annotate

    st = ResumeStats(_engine_part(offload_s=2.0)).with_runtime(base=BaseKind.BACKGROUND, offload_wait_s=0.5)
    st = st.with_call(tool_mode="json", output_tokens=3)
    msg = AIMessage(content="x", response_metadata={"patchkv": st.to_json(), "model_name": "m"})
    annotate(msg, 1.25)
    got = ResumeStats.from_json(msg.response_metadata["patchkv"])
    assert got.call == CallPart(tool_mode="json", output_tokens=3, tool_s=1.25, offload_hidden_share=0.75)
    assert got.engine.to_dict() == st.engine.to_dict() and got.runtime == st.runtime
    odd = {"strategy": "mine"}  # not stats a PatchKVChatModel wrote: left alone, never raised
    msg = AIMessage(content="x", response_metadata={"patchkv": odd})
    annotate(msg, 1.0)
    assert msg.response_metadata["patchkv"] is odd and odd == {"strategy": "mine"}

"""Exactness anchors of the recovery engine on tiny fp32 models (docs/DESIGN.md section 5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchkv_agent import PatchKVEngine
from benchmarks.tiny import FAMILIES, ROPE_VARIANTS, tiny_engine, tiny_model
from patchkv_agent.strategies import get_strategy
from tiny_models import family_engine

TOL = 1e-4


def edited_pair(vocab: int, seed: int = 0, n: int = 150, low: int = 0):
    """old = P + M_old + S, new = P + M_new + S with |M_new| != |M_old| (a real RoPE shift); token ids in
    ``[low, vocab)`` (``low=3``: no special ids of the tiny models)."""
    rng = np.random.default_rng(seed)
    old = rng.integers(low, vocab, size=n).tolist()
    new = old[:40] + rng.integers(low, vocab, size=17).tolist() + old[50:]
    return old, new


def multi_edit_pair(vocab: int, seed: int = 1, n: int = 160):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, vocab, size=n).tolist()
    new = old[:20] + rng.integers(0, vocab, 3).tolist() + old[30:90] + rng.integers(0, vocab, 12).tolist() + old[95:]
    return old, new


def oracle(model, ids):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    return out.logits[0, -1].float(), cache


def assert_cache_equal(cache, ref_cache, n_layers):
    for layer in range(n_layers):
        a, b = cache.layers[layer], ref_cache.layers[layer]
        assert a.keys.shape == b.keys.shape
        assert (a.keys - b.keys).abs().max().item() <= TOL, f"layer {layer} keys"
        assert (a.values - b.values).abs().max().item() <= TOL, f"layer {layer} values"


def engine_of(family: str):
    """The tiny engine of ``family`` (shared by the tests of this module, which do not change it)."""
    return family_engine(family)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("strategy", ["exact", "prefix"])
@pytest.mark.parametrize("pair", [edited_pair, multi_edit_pair])
def test_exact_strategies_equal_full_prefill(family, strategy, pair):
    eng = engine_of(family)
    old, new = pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy=strategy, max_new_tokens=1)
    ref_logits, ref_cache = oracle(eng.model, new)
    assert (res.logits - ref_logits).abs().max().item() <= TOL
    assert_cache_equal(res.cache, ref_cache, eng.spec.num_layers)
    assert res.stats["fallback"] is None


@pytest.mark.parametrize("family", FAMILIES)
def test_patchkv_with_full_window_equals_exact(family):
    eng = engine_of(family)
    old, new = multi_edit_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy=get_strategy("patchkv", {"dirty_window": 10**6}), max_new_tokens=1)
    ref_logits, ref_cache = oracle(eng.model, new)
    assert (res.logits - ref_logits).abs().max().item() <= TOL
    assert_cache_equal(res.cache, ref_cache, eng.spec.num_layers)
    assert res.stats["recompute_tokens"] == len(new) - res.stats["prefix_tokens"]


@pytest.mark.parametrize("family", FAMILIES + ROPE_VARIANTS)
def test_direct_rope_correction_is_exact_at_layer0(family):
    eng = engine_of(family)
    assert eng.spec.rope_supported, eng.spec.rope_unsupported_reason
    old, new = multi_edit_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    res = eng.resume(ckpt, new, strategy="direct", max_new_tokens=1)
    edit = res.edit
    assert any(s.delta != 0 for s in edit.segments), "test needs shifted segments"
    fresh = eng.checkpoint(new)  # layer-0 K/V depend on the token and position only
    newp = np.array(edit.suffix_new_positions[:-1])  # the last token is recomputed, not restored
    oldp = np.array(edit.suffix_old_positions[:-1])
    k_rest = res.keys[0][0][:, newp]
    assert (k_rest - fresh.keys[0][:, newp]).abs().max().item() <= TOL
    # without the correction they would differ: the test can fail
    assert (ckpt.keys[0][:, oldp] - fresh.keys[0][:, newp]).abs().max().item() > 10 * TOL
    # values never rotate: restored bit for bit from the checkpoint
    for layer in range(eng.spec.num_layers):
        assert torch.equal(res.values[layer][0][:, newp], ckpt.values[layer][:, oldp])
    assert res.stats["recompute_tokens"] == edit.new_token_count + 1


def test_direct_differs_from_exact_beyond_layer0():
    """Deeper layers of restored rows carry stale history: direct is not exact (drift is real)."""
    eng = engine_of("llama")
    old, new = edited_pair(eng.spec.vocab_size)
    res = eng.resume(eng.checkpoint(old), new, strategy="direct", max_new_tokens=1)
    fresh = eng.checkpoint(new)
    newp = res.edit.suffix_new_positions[:-1].copy()  # a writable index (torch warns on read-only arrays)
    assert (res.values[1][0][:, newp] - fresh.values[1][:, newp]).abs().max().item() > 1e-3


def test_unsupported_rope_falls_back_to_exact_and_says_so():
    eng = tiny_engine("dynamic")
    assert not eng.spec.rope_supported
    old, new = edited_pair(eng.spec.vocab_size)
    res = eng.resume(eng.checkpoint(old), new, strategy="direct", max_new_tokens=1)
    assert res.stats["fallback"] and "dynamic" in res.stats["fallback"]
    ref_logits, ref_cache = oracle(eng.model, new)
    assert (res.logits - ref_logits).abs().max().item() <= TOL
    assert_cache_equal(res.cache, ref_cache, eng.spec.num_layers)


def test_patchkv_recomputes_window_and_last_block_only():
    eng = engine_of("llama")
    old, new = edited_pair(eng.spec.vocab_size)
    # random ids: the lexical reader signal is off here, so the plan is the window + last block alone
    res = eng.resume(eng.checkpoint(old), new, strategy=get_strategy("patchkv", {"readers": "none"}), max_new_tokens=1)
    s = res.stats
    assert s["prefix_tokens"] == 40 and s["new_tokens"] == 17
    # X (17) + window of 8 (one block of 8) + the last block of the suffix (block-aligned from the segment start)
    assert s["recompute_tokens"] == 17 + 8 + (100 % 8 or 8)
    assert 0 < s["recompute_ratio"] < 1
    full = s["restore_tokens"] * eng.checkpoint(old).bytes_per_token
    assert 0 < s["payload_bytes"] < full  # mixed-precision runs are smaller than full-precision rows
    d = eng.resume(eng.checkpoint(old), new, strategy="direct", max_new_tokens=1).stats
    assert d["payload_bytes"] == d["restore_tokens"] * eng.checkpoint(old).bytes_per_token


def test_mixed_precision_restore_is_close_and_smaller():
    eng = engine_of("llama")
    old, new = multi_edit_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    assert ckpt.mixed is not None and ckpt.mixed.nbytes < ckpt.nbytes
    fp = eng.resume(ckpt, new, strategy="direct", max_new_tokens=1)
    mx = eng.resume(ckpt, new, strategy=get_strategy("direct", {"precision": "mixed"}), max_new_tokens=1)
    newp = np.array(fp.edit.suffix_new_positions[:-1])
    for layer in range(eng.spec.num_layers):
        for a, b in ((fp.keys, mx.keys), (fp.values, mx.values)):
            x, y = a[layer][0][:, newp], b[layer][0][:, newp]
            rel = ((x - y).norm() / x.norm()).item()
            assert 0 <= rel < 0.1, rel
    assert mx.stats["payload_bytes"] < fp.stats["payload_bytes"]


def test_corrupted_run_falls_back_to_exact_and_says_why():
    eng = engine_of("llama")
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(old)
    for tag in ckpt.mixed.tag_rows:  # corrupt every payload of layer 0: one of them is restored
        ckpt.mixed.payloads[0][tag].k_data.view(torch.uint8).view(-1)[0] ^= 0x5A
    res = eng.resume(ckpt, new, strategy="patchkv", max_new_tokens=1)
    assert res.stats["fallback"] and "checksum" in res.stats["fallback"]
    ref_logits, ref_cache = oracle(eng.model, new)
    assert (res.logits - ref_logits).abs().max().item() <= TOL
    assert_cache_equal(res.cache, ref_cache, eng.spec.num_layers)


def test_continuation_from_cache_matches_generate():
    eng = engine_of("qwen2")
    old, new = edited_pair(eng.spec.vocab_size)
    res = eng.resume(eng.checkpoint(old), new, strategy="prefix", max_new_tokens=6)
    ids = torch.tensor([new])
    cur = ids
    ref = []
    with torch.no_grad():
        for _ in range(6):
            tok = int(eng.model(input_ids=cur).logits[0, -1].argmax())
            ref.append(tok)
            cur = torch.cat([cur, torch.tensor([[tok]])], dim=1)
    assert res.output_ids == ref
    # the returned cache continues decoding
    with torch.no_grad():
        nxt = eng.model(input_ids=torch.tensor([[res.output_ids[-1]]]),
                        position_ids=torch.tensor([[len(new) + 5]]), cache=res.cache).logits[0, -1]
        full = eng.model(input_ids=cur).logits[0, -1]
    assert (nxt - full).abs().max().item() <= TOL


def test_resumed_state_becomes_next_checkpoint():
    eng = engine_of("llama")
    v0, v1 = edited_pair(eng.spec.vocab_size)
    v2 = v1[:70] + [3, 4, 5] + v1[80:]
    r1 = eng.resume(eng.checkpoint(v0), v1, strategy="prefix", max_new_tokens=1)
    c1 = eng.checkpoint_from(r1)
    assert c1.scores is not None and abs(float(c1.scores.sum()) - 1) < 1e-4
    r2 = eng.resume(c1, v2, strategy="prefix", max_new_tokens=1)
    ref_logits, _ = oracle(eng.model, v2)
    assert (r2.logits - ref_logits).abs().max().item() <= TOL
    assert r2.stats["prefix_tokens"] == 70


@pytest.mark.parametrize("bad,match", [
    ([], "empty"),
    ([1, 2, 10**6], "outside the vocabulary"),
    ([-1, 2], "outside the vocabulary"),
    (list(range(5)) * 200, "maximum"),
    ([[1, 2]], "flat"),
])
def test_bad_input_is_refused_before_compute(bad, match):
    eng = engine_of("llama")
    with pytest.raises(ValueError, match=match):
        eng.checkpoint(bad)
    ckpt = eng.checkpoint([1, 2, 3, 4])
    with pytest.raises(ValueError, match=match):
        eng.resume(ckpt, bad)


def test_checkpoint_from_another_model_is_refused():
    a, b = engine_of("llama"), tiny_engine(seed=1, block_size=None, dirty_window=None)
    ckpt = b.checkpoint([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="another model"):
        a.resume(ckpt, [1, 2, 3, 9, 5])


def test_unknown_strategy_and_missing_checkpoint():
    eng = engine_of("llama")
    with pytest.raises(ValueError, match="choose one of"):
        eng.resume(eng.checkpoint([1, 2, 3]), [1, 2, 4], strategy="magic")
    with pytest.raises(ValueError, match="needs a checkpoint"):
        eng.resume(None, [1, 2, 4], strategy="patchkv")
    res = eng.resume(None, [1, 2, 4], strategy="exact", max_new_tokens=2)
    assert len(res.output_ids) == 2


def test_tensor_input_and_identical_versions():
    eng = engine_of("gemma3")
    old, _ = edited_pair(eng.spec.vocab_size)
    ckpt = eng.checkpoint(torch.tensor(old))
    res = eng.resume(ckpt, torch.tensor(old), strategy="patchkv", max_new_tokens=1)
    assert res.stats["recompute_tokens"] == 1  # only the last token, for the logits
    ref_logits, _ = oracle(eng.model, old)
    assert (res.logits - ref_logits).abs().max().item() <= TOL


def test_resume_from_resident_result_without_offload():
    eng = engine_of("qwen3")
    v0, v1 = edited_pair(eng.spec.vocab_size)
    v2 = v1[:60] + [7, 8] + v1[64:]
    r1 = eng.resume(eng.checkpoint(v0), v1, strategy="prefix", max_new_tokens=1)
    r2 = eng.resume(r1, v2, strategy=get_strategy("patchkv", {"dirty_window": 10**6}), max_new_tokens=1)
    ref_logits, _ = oracle(eng.model, v2)
    assert (r2.logits - ref_logits).abs().max().item() <= TOL
    assert r2.stats["prefix_tokens"] == 60 and r2.stats["offload_s"] == 0.0


def test_engine_loads_its_profile_automatically_and_arguments_win(tmp_path, monkeypatch):
    import json

    model = tiny_model("llama")
    fp = PatchKVEngine(model, None, profile=None).spec.fingerprint
    prof = {"schema": 1, "model": "tiny", "fingerprint": fp, "kappa": 0.02, "block_size": 16,
            "precision_policy": {"tau_L": 0.5, "tau_H": 4.0}}
    from patchkv_agent.core.plan import LengthModel

    prof["length_model"] = LengthModel.fixed(40).to_dict()
    (tmp_path / "tiny.json").write_text(json.dumps(prof))
    monkeypatch.setenv("PATCHKV_PROFILE_DIR", str(tmp_path))
    eng = PatchKVEngine(model, None)
    s = eng.settings
    assert (s.block_size, s.kappa) == (16, 0.02) and eng.profile_path.endswith("tiny.json")
    assert s.length_model == LengthModel.fixed(40)
    assert (s.precision_policy.tau_L, s.precision_policy.tau_H) == (0.5, 4.0)
    eng2 = PatchKVEngine(model, None, block_size=8, kappa=0.0)
    assert (eng2.settings.block_size, eng2.settings.kappa) == (8, 0.0)
    assert PatchKVEngine(model, None, profile=None).profile_path is None

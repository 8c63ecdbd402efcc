"""Host-side resume path: carried word ids, the fast id validation, the native value residual,
and the host benchmark / GPU check script in their small modes. No test here times anything or needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.inputs import InvalidInput, as_token_ids
from patchkv_agent.core.lexicon import WordIndex
from kv_helpers import plan_settings

PIECES = ["Ġfoo", "bar", ".", "Ġ", "1", "Ċ", "ab", "Ġx", "Sof", "ia", "Ġ(", ")", "Ġthe", "ĠS", "of", "-", "Z"]


def _index() -> WordIndex:
    return WordIndex(lambda i: PIECES[i])


def _edited(rng, old: np.ndarray, n_edits: int) -> np.ndarray:
    new, cut = [], 0
    starts = np.sort(rng.choice(np.arange(1, max(2, len(old) - 1)), size=min(n_edits, len(old) - 2), replace=False))
    for s in starts:
        if s < cut:
            continue
        new.append(old[cut:s])
        new.append(rng.integers(0, len(PIECES), int(rng.integers(0, 6))))
        cut = s + int(rng.integers(0, 4))
    new.append(old[cut:])
    return np.concatenate(new).astype(np.int64)


def _random_edit(rng, wi: WordIndex, min_len: int, max_len: int):
    """A random old version, an edited new one (1-5 edits) and their diff with carried words; None if empty."""
    old = rng.integers(0, len(PIECES), int(rng.integers(min_len, max_len))).astype(np.int64)
    new = _edited(rng, old, int(rng.integers(1, 6)))
    if len(new) == 0:
        return None
    return old, new, diff_versions(old, new, words=wi, old_words=wi(old), min_match=int(rng.integers(1, 9)))


@pytest.mark.parametrize("seed", range(40))
def test_carried_words_equal_a_whole_mapping(seed):
    rng = np.random.default_rng(seed)
    wi = _index()
    got = _random_edit(rng, wi, 3, 300)
    if got is None:
        return
    old, new, edit = got
    got = edit.new_words()
    assert got is not None and np.array_equal(got, wi(new))
    if edit.spans:
        o, n = edit.words()
        assert np.array_equal(o, wi(old)) and np.array_equal(n, wi(new))


def test_carry_reads_only_the_edited_words():
    rng = np.random.default_rng(1)
    seen: list[int] = []
    wi = WordIndex(lambda i: (seen.append(i), PIECES[i])[1])
    old = rng.integers(0, len(PIECES), 20000).astype(np.int64)
    old_words = wi(old)
    new = np.concatenate([old[:10000], [0, 1, 2], old[10005:]])
    edit = diff_versions(old, new, words=wi, old_words=old_words)
    calls: list[int] = []
    orig = wi.__class__.__call__
    wi.__class__.__call__ = lambda self, ids: (calls.append(len(ids)), orig(self, ids))[1]
    try:
        got = edit.new_words()
    finally:
        wi.__class__.__call__ = orig
    assert sum(calls) < 100  # only the window around the edit is mapped
    assert np.array_equal(got, wi(new))


@pytest.mark.parametrize("seed", range(12))
def test_sampled_anchors_give_the_full_density_diff(seed, monkeypatch):
    """Long middles look for anchors among a content-defined sample of k-grams; the edit is the same."""
    import patchkv_agent.core.diff as diff

    rng = np.random.default_rng(seed)
    old = rng.integers(0, 500 if seed % 3 == 0 else 49152, 20000).astype(np.int64)
    new = old
    for _ in range(int(rng.integers(2, 17))):
        s = int(rng.integers(0, len(new) - 50))
        new = np.concatenate([new[:s], rng.integers(0, 49152, int(rng.integers(0, 40))), new[s + int(rng.integers(0, 30)):]])
    got = diff.diff_versions(old, new)
    monkeypatch.setattr(diff, "_SAMPLE_FROM", 1 << 40)
    want = diff.diff_versions(old, new)
    assert (got.prefix_len, got.spans, got.segments) == (want.prefix_len, want.spans, want.segments)


def test_member_positions_are_isin_with_ranks():
    from patchkv_agent.core.readers import _member_positions

    rng = np.random.default_rng(0)
    x = rng.integers(-5, 2**62, 50000)
    x[::7] = x[::7] & 0xFFFF  # low-bit collisions with the set
    s = np.sort(np.unique(np.concatenate([rng.choice(x, 40), rng.integers(0, 2**62, 10), [3, 70000]])))
    pos, rank = _member_positions(x, s)
    assert np.array_equal(pos, np.flatnonzero(np.isin(x, s)))
    assert np.array_equal(s[rank], x[pos])
    assert _member_positions(x, s[:0])[0].size == 0


class _Tok:
    """A stand-in tokenizer: pieces only (the engine's word index reads convert_ids_to_tokens)."""

    eos_token_id = None

    def convert_ids_to_tokens(self, i):
        return PIECES[int(i) % len(PIECES)]


def test_engine_carries_words_through_checkpoints_and_resumes():
    from benchmarks.tiny import tiny_engine

    eng = tiny_engine()
    eng.words = WordIndex.from_tokenizer(_Tok())
    rng = np.random.default_rng(3)
    v0 = rng.integers(0, 64, 120).astype(np.int64)
    ck = eng.checkpoint(v0)
    assert np.array_equal(ck.words, eng.words(v0))
    v1 = np.concatenate([v0[:40], [5, 6, 7], v0[44:]])
    res = eng.resume(ck, v1, strategy="patchkv", max_new_tokens=2)
    assert np.array_equal(res.words, eng.words(v1))
    # a runtime appends decoded tokens to context_ids: the offload extends the words over them
    grown = np.concatenate([v1, np.asarray(res.output_ids[:1], dtype=np.int64)])
    ck2 = eng.checkpoint_from(res)
    assert np.array_equal(ck2.words, eng.words(v1))
    assert np.array_equal(eng._words_for(grown, res.words), eng.words(grown))
    v2 = np.concatenate([v1[:90], v1[95:]])
    res2 = eng.resume(ck2, v2, strategy="patchkv", max_new_tokens=0)
    assert np.array_equal(res2.words, eng.words(v2))
    assert np.array_equal(eng.as_checkpoint(res2).words, eng.words(v2))


def _values(seed: int, layers: int = 4, n: int = 300, d: int = 64) -> list:
    import torch

    g = torch.Generator().manual_seed(seed)
    scale = torch.rand(1, 1, d, generator=g) * 3 + 0.05
    return [torch.randn(2, n, d, generator=g) * scale for _ in range(layers)]


@pytest.mark.parametrize("d,group", [(64, 32), (80, 32), (96, 64), (8, 32)])
def test_native_value_residual_matches_the_reference(d, group):
    import torch

    from patchkv_agent.kernels import native, value_residual_4bit, value_residual_layers
    from patchkv_agent.kernels.dispatch import backend

    if not native.available():
        pytest.skip(f"native kernels {native.status()}")
    vals = _values(d, d=d)
    vals[1][:, 5] = 0.0  # an all-zero token in one layer
    ref_e, ref_r = __import__("patchkv_agent.kernels.residual", fromlist=["x"]).value_residual_sq(torch.stack(vals), group)
    err, nrm = native.value_residual_sq_native(vals, group)
    # element errors are the reference's fp32 operations; only the summation order differs (double here)
    torch.testing.assert_close(err, ref_e, rtol=2e-6, atol=0.0)
    torch.testing.assert_close(nrm, ref_r, rtol=2e-6, atol=0.0)
    with backend("native"):
        got = value_residual_layers(vals, group)
    with backend("torch"):
        want = value_residual_layers(vals, group)
    torch.testing.assert_close(want, value_residual_4bit(torch.stack(vals), group), rtol=0, atol=0)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-12)


def test_native_value_residual_gives_the_same_tags():
    """The offload's precision tags are the same with the native residual as with the torch reference."""
    import torch

    from patchkv_agent.core.checkpoint import build_mixed
    from patchkv_agent.core.precision import PrecisionPolicy
    from patchkv_agent.kernels import native
    from patchkv_agent.kernels.dispatch import backend

    if not native.available():
        pytest.skip(f"native kernels {native.status()}")
    vals = _values(7, layers=6, n=640)
    keys = _values(8, layers=6, n=640)
    scores = np.random.default_rng(0).random(640).astype(np.float32)
    out = {}
    for name in ("native", "torch"):
        with backend(name):
            out[name] = build_mixed(keys, vals, scores, block_size=32, policy=PrecisionPolicy()).tags
    assert np.array_equal(out["native"], out["torch"])


def test_native_value_residual_rejects_bad_layers():
    import torch

    from patchkv_agent.kernels import native

    if not native.available():
        pytest.skip(f"native kernels {native.status()}")
    with pytest.raises(ValueError, match="contiguous float32"):
        native.value_residual_sq_native([torch.zeros(2, 4, 8), torch.zeros(2, 5, 8)], 32)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.value_residual_sq_native([torch.zeros(2, 4, 8).transpose(0, 1)], 32)
    with pytest.raises(ValueError):
        native.value_residual_sq_native([], 32)


def test_gpu_check_script_runs_in_its_small_mode(tmp_path):
    """scripts/gpu_check.sh at CI sizes: Triton kernels under the interpreter against their references (every
    format), and bench-host; both write JSON under one folder. No GPU is needed or used."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, GPU_CHECK_SMALL="1", GPU_CHECK_OUT=str(tmp_path / "out"), PYTHON=sys.executable,
               CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(["bash", str(root / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    kern = json.loads((tmp_path / "out" / "kernels.json").read_text())
    assert kern["ok"] and set(kern["formats"]) == {"FP16", "K8V8", "K8V4", "K4V4"}
    host = json.loads((tmp_path / "out" / "host_tiny" / "host.json").read_text())
    assert [r["edits"] for r in host["rows"]] == [1, 2]
    assert all(r["host_ms"] > 0 and r["kv_bytes"] > 0 for r in host["rows"])
    from patchkv_agent.kernels import native  # the engine loaded the library: the plans scanned natively

    assert {r["reader_scan"] for r in host["rows"]} == {"native" if native.available() else "numpy"}
    assert (tmp_path / "out" / "host_tiny" / "host.png").stat().st_size > 0
    prep = json.loads((tmp_path / "out" / "prepare_contention.json").read_text())
    assert prep["tokens"] == 600 and prep["chunks"] >= 1 and prep["b_resume_during_preparation_s"]["median"] > 0


def test_bench_host_rejects_bad_arguments(capsys):
    from patchkv_agent.cli import main

    for argv in (["bench-host", "--lengths", "2048,x"], ["bench-host", "--edits", "0"], ["bench-host", "--repeats", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
    assert "--edits" in capsys.readouterr().err


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_to_dynamic_cache_adopts_the_kv_and_decodes_like_update(family):
    """The resume's cache is assembled without copying the context's K/V (full and sliding layers): the same
    layer state as ``DynamicCache.update`` builds, and decoding from it gives the same logits."""
    import torch
    from transformers.cache_utils import DynamicCache

    from patchkv_agent.core.runner import ModelRunner
    from benchmarks.tiny import tiny_model

    model = tiny_model(family)
    runner = ModelRunner(model)
    cfg = model.config
    n, shape = 40, (1, cfg.num_key_value_heads, 40, cfg.head_dim)
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(shape, generator=g) for _ in range(cfg.num_hidden_layers)]  # full-length rows per layer
    values = [torch.randn(shape, generator=g) for _ in range(cfg.num_hidden_layers)]
    before = [k.clone() for k in keys]
    runner.dynamic_cache([k.clone() for k in keys], [v.clone() for v in values])  # the first call records the layers
    adopted = runner.dynamic_cache(keys, values)  # built from the record
    assert runner._cache_layers is not None and "_patchkv_cache_layers" not in vars(model)
    ref = DynamicCache(config=model.config)
    assert [(type(a), getattr(a, "sliding_window", None)) for a in adopted.layers] == \
        [(type(b), getattr(b, "sliding_window", None)) for b in ref.layers]
    for i, (k, v) in enumerate(zip(keys, values)):
        ref.update(k, v, i)
    for a, b, k in zip(adopted.layers, ref.layers, keys):
        assert type(a) is type(b)
        torch.testing.assert_close(a.keys, b.keys, rtol=0, atol=0)
        torch.testing.assert_close(a.values, b.values, rtol=0, atol=0)
        assert a.get_seq_length() == b.get_seq_length()
        assert a.keys.data_ptr() >= k.data_ptr()  # a view of the given rows, not a copy
        assert a.keys.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
    tok, pos = 5, n
    for _ in range(30):  # past gemma3's 24-token window
        la, lb = runner.decode_step(adopted, tok, pos), runner.decode_step(ref, tok, pos)
        torch.testing.assert_close(la, lb, rtol=0, atol=0)
        tok, pos = int(la.argmax()), pos + 1
    for k, k0 in zip(keys, before):  # decoding never wrote into the adopted rows
        torch.testing.assert_close(k, k0, rtol=0, atol=0)


def _lexical_reference(edit, blocks, max_df=0.1, min_df=3):
    """lexical_reader_scores spelled out with Python sets (the oracle of the vectorized version)."""
    old, new = edit.words() if edit.words() is not None else (edit.old_ids, edit.new_ids)
    old_side = {int(t) for s in edit.spans for t in old[s.old_start:s.old_end]}
    new_side = {int(t) for s in edit.spans for t in new[s.new_start:s.new_end]}
    changed = {t for t in old_side ^ new_side if t >= 0}
    n_ctx = -(-len(new) // blocks.block_size)
    blocks_of: dict[int, set[int]] = {}
    for i, t in enumerate(new.tolist()):
        if t in changed and (i == 0 or new[i - 1] != t):
            blocks_of.setdefault(t, set()).add(i // blocks.block_size)
    weight = {}
    for t in changed:
        df = len(blocks_of.get(t, ()))
        if df <= max(min_df, max_df * n_ctx):
            weight[t] = float(np.log((1 + n_ctx) / (1 + df)))
    out = np.zeros(blocks.n_blocks)
    total = sum(weight.values())
    if total <= 0:
        return out
    for b in range(blocks.n_blocks):
        sel = blocks.token_block == b
        held = {int(t) for t in new[blocks.new_positions[sel]]} & set(weight)
        out[b] = sum(weight[t] for t in held) / total
    return out


@pytest.mark.parametrize("scan", ["native", "numpy"])
@pytest.mark.parametrize("seed", range(30))
def test_vectorized_reader_scores_and_block_attention_match_their_oracles(seed, scan, monkeypatch):
    from patchkv_agent.core.blocks import block_attention, suffix_blocks
    from patchkv_agent.core.readers import lexical_reader_scores
    from patchkv_agent.kernels import native

    if scan == "native" and not native.available():
        pytest.skip(f"native reader scan {native.status()}")
    if scan == "numpy":
        monkeypatch.setattr(native, "available", lambda: False)

    rng = np.random.default_rng(seed)
    vocab = int(rng.integers(4, 300))
    old = rng.integers(0, vocab, int(rng.integers(20, 1500))).astype(np.int64)
    new = _edited(rng, old, int(rng.integers(1, 6))) % vocab
    if len(new) < 2:
        return
    edit = diff_versions(old, new)
    blocks = suffix_blocks(edit, block_size=int(rng.choice([4, 16, 32])))
    np.testing.assert_allclose(lexical_reader_scores(edit, blocks), _lexical_reference(edit, blocks), atol=1e-12)
    scores = rng.random(len(old))
    scores[rng.integers(0, len(old), 3)] = np.nan
    ref = np.full(blocks.n_blocks, -np.inf)
    for b in range(blocks.n_blocks):
        sel = blocks.old_positions[blocks.token_block == b]
        ref[b] = np.nan_to_num(scores[sel], nan=0.0).max()
    np.testing.assert_array_equal(block_attention(blocks, scores), ref)


@pytest.mark.parametrize("seed", range(5))
def test_unquantizable_tokens_marks_nonfinite_and_out_of_range_values(seed):
    """The offload's fp16-range screen against a per-element numpy oracle: a token is marked when any
    layer's K or V, in any head or channel, is NaN, +-inf or beyond FP16_SAFE in magnitude (the bound itself
    is kept)."""
    from patchkv_agent.core.checkpoint import unquantizable_tokens
    from patchkv_agent.core.precision import FP16_SAFE

    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(2, 50, 8, generator=g) for _ in range(3)]
    values = [torch.randn(2, 50, 8, generator=g) for _ in range(3)]
    r = np.random.default_rng(seed)
    for v in (float("nan"), float("inf"), -float("inf"), FP16_SAFE * 1.01, -FP16_SAFE * 2, FP16_SAFE, -FP16_SAFE):
        t = (keys + values)[int(r.integers(0, 6))]
        t[int(r.integers(0, 2)), int(r.integers(0, 50)), int(r.integers(0, 8))] = v
    want = np.zeros(50, dtype=bool)
    for t in keys + values:
        a = t.numpy()
        want |= (~np.isfinite(a) | (np.abs(a) > FP16_SAFE)).any(axis=(0, 2))
    assert want.any()
    assert unquantizable_tokens(keys, values).tolist() == want.tolist()


# ---------------------------------------------------------------------------------------------------------------------
# The block-level planner against a per-token reference (the rules as DESIGN states them, token by token)
# ---------------------------------------------------------------------------------------------------------------------


def _plan_reference(edit, scores, *, d, kappa, block_size, readers, recent_window, min_restore_share,
                    reader_min_share=0.1, reader_min_blocks=3, reader_attention_blocks=2, reader_budget=0.25):
    """plan_repair spelled out per suffix token with the Edit's own per-token arrays (no block-level shortcuts)."""
    import math

    from patchkv_agent.core.blocks import suffix_blocks
    from patchkv_agent.core.readers import lexical_reader_scores

    prefix_len = min(edit.prefix_len, edit.new_len - 1)
    blocks = suffix_blocks(edit, block_size=block_size, keep_from=prefix_len)
    keep = edit.suffix_new_positions >= prefix_len
    new_pos, old_pos = edit.suffix_new_positions[keep], edit.suffix_old_positions[keep]
    dist = edit.suffix_distance[keep]
    seg_len = {s.new_start: s.length for s in edit.segments}
    span_d = {s.new_end: min(d, seg_len.get(s.new_end, 0)) for s in edit.spans}
    base = new_pos - dist
    dirty = dist < np.array([span_d[int(b)] for b in base], dtype=np.int64)
    tok_block = np.array([int(np.searchsorted(blocks.starts, p, side="right")) - 1 for p in new_pos], dtype=np.int64)
    sc = None if scores is None else np.nan_to_num(np.asarray(scores, dtype=np.float64), nan=0.0)
    high = np.zeros_like(dirty)
    if sc is not None and kappa > 0:
        outside = np.flatnonzero(~dirty)
        vals = sc[old_pos[outside]]
        k = min(len(vals), int(math.ceil(kappa * len(vals) - 1e-9)))
        order = sorted(range(len(vals)), key=lambda i: (-vals[i], i))[:k]  # top k, ties to the earlier token
        high[outside[order]] = True
    repair = np.zeros(blocks.n_blocks, dtype=bool)
    repair[tok_block[dirty | high]] = True
    if blocks.n_blocks and new_pos[-1] == edit.new_len - 1:
        repair[-1] = True
    if readers == "lexical" and reader_budget > 0 and blocks.n_blocks:
        lex = lexical_reader_scores(edit, blocks)
        cand = [b for b in range(blocks.n_blocks) if lex[b] >= reader_min_share and lex[b] > 0 and not repair[b]]
        x = sum(s.new_len for s in edit.spans)
        cost = x + sum(int(blocks.ends[b] - blocks.starts[b]) for b in range(blocks.n_blocks) if repair[b])
        k = min(len(cand), max(reader_min_blocks, int(math.ceil(reader_budget * cost / block_size - 1e-9))))
        picked = sorted(cand, key=lambda b: (-lex[b], b))[:k]
        repair[picked] = True
        if picked and sc is not None and reader_attention_blocks:
            bmax = {b: max(sc[old_pos[tok_block == b]]) for b in range(blocks.n_blocks) if not repair[b]}
            repair[sorted(bmax, key=lambda b: (-bmax[b], b))[:reader_attention_blocks]] = True
    if recent_window and blocks.n_blocks:
        restored_tokens = [i for i in range(len(new_pos)) if not repair[tok_block[i]]]
        repair[sorted({int(tok_block[i]) for i in restored_tokens[-recent_window:]})] = True
    if min_restore_share and blocks.n_blocks:
        if sum(1 for i in range(len(new_pos)) if not repair[tok_block[i]]) < min_restore_share * len(new_pos):
            repair[:] = True
    rec_tok = repair[tok_block].copy()
    if len(new_pos) and new_pos[-1] == edit.new_len - 1:
        rec_tok[-1] = True
    recompute = np.sort(np.concatenate([edit.new_positions, new_pos[rec_tok],
                                        np.arange(prefix_len, edit.prefix_len, dtype=np.int64)]))
    return recompute, new_pos[~rec_tok], old_pos[~rec_tok], np.flatnonzero(repair)


@pytest.mark.parametrize("seed", range(60))
def test_block_level_plan_equals_the_per_token_rules(seed):
    from patchkv_agent.core.plan import LengthModel, plan_repair

    rng = np.random.default_rng(seed)
    got = _random_edit(rng, _index(), 2, 500)
    if got is None:
        return
    old, _, edit = got
    scores = None if seed % 5 == 0 else rng.random(len(old)).astype(np.float32)
    if scores is not None and seed % 3 == 0:
        scores[rng.integers(0, len(old), 3)] = np.nan  # NaN reads as 0
    kw = dict(d=int(rng.choice([0, 3, 16, 64])), kappa=float(rng.choice([0.0, 0.0, 0.1, 0.5])),
              block_size=int(rng.choice([1, 4, 16])), readers=str(rng.choice(["none", "lexical"])),
              recent_window=int(rng.choice([0, 5, 40])), min_restore_share=float(rng.choice([0.0, 0.5])))
    if seed % 2:  # the reader constants a profile may set (the even seeds keep the built-in ones)
        kw.update(reader_min_share=float(rng.choice([0.0, 0.05, 0.3])), reader_min_blocks=int(rng.choice([0, 1, 6])),
                  reader_attention_blocks=int(rng.choice([0, 1, 4])), reader_budget=float(rng.choice([0.0, 0.1, 1.0])))
    rules = {k: kw[k] for k in ("reader_min_share", "reader_min_blocks", "reader_attention_blocks", "reader_budget")
             if k in kw}
    plan = plan_repair(edit, scores, plan_settings(
        length_model=LengthModel.fixed(kw["d"]), kappa=kw["kappa"], block_size=kw["block_size"], readers=kw["readers"],
        rewrite_share=1.0, recent_window=kw["recent_window"], min_restore_share=kw["min_restore_share"], **rules))
    rec, rnew, rold, rep = _plan_reference(edit, scores, **kw)
    assert np.array_equal(plan.recompute_positions, rec)
    assert np.array_equal(plan.restore_new_positions, rnew) and np.array_equal(plan.restore_old_positions, rold)
    assert np.array_equal(plan.repair_blocks, rep)
    assert plan.prefix_len + plan.n_restore + plan.n_recompute == edit.new_len


def test_length_model_python_and_numpy_paths_agree_and_stay_in_range(monkeypatch):
    """Few spans are predicted in Python, many in numpy: the same windows, never negative, never past the
    segment, even for weights whose exponent overflows (calibrated profiles are checked, but not bounded)."""
    import patchkv_agent.core.length_model as lm

    rng = np.random.default_rng(0)
    for _ in range(400):
        w = tuple(rng.normal(0, 3.0, 7))
        d_min = int(rng.integers(0, 40))
        m = lm.LengthModel(weights=w, d_min=d_min, d_max=None if rng.random() < 0.5 else d_min + int(rng.integers(0, 400)))
        k = int(rng.integers(1, 6))
        p, e, s = rng.integers(0, 100000, k), rng.integers(0, 5000, k), rng.integers(0, 30000, k)
        few = m.predict(p, e, s)
        monkeypatch.setattr(lm, "_FEW_SPANS", -1)
        many = m.predict(p, e, s)
        monkeypatch.setattr(lm, "_FEW_SPANS", 16)
        assert few.dtype == many.dtype == np.int64
        assert np.array_equal(few, many)
        assert np.all(few >= 0) and np.all(few <= s)


@pytest.mark.parametrize("seed", range(30))
def test_small_ranges_anchor_in_python_like_the_hashed_path(seed, monkeypatch):
    """Middles up to _SMALL_RANGE tokens find their anchors (and skip the fallback) in Python: the same edit as the
    hashed numpy path."""
    import patchkv_agent.core.diff as diff

    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([2, 5, 50, 5000]))
    old = rng.integers(0, vocab, int(rng.integers(1, 400))).astype(np.int64)
    if seed % 4 == 0:
        old = np.tile(old[:7], 100)[: len(old)]  # repeats: no unique anchors, the fallback decides
    new = old
    for _ in range(int(rng.integers(1, 5))):
        s = int(rng.integers(0, len(new) + 1))
        new = np.concatenate([new[:s], rng.integers(0, vocab, int(rng.integers(0, 30))), new[s + int(rng.integers(0, 30)):]])
    mm = int(rng.integers(1, 12))
    got = diff.diff_versions(old, new, min_match=mm)
    monkeypatch.setattr(diff, "_SMALL_RANGE", -1)
    want = diff.diff_versions(old, new, min_match=mm)
    assert (got.prefix_len, got.spans, got.segments) == (want.prefix_len, want.spans, want.segments)


def test_carry_runs_equals_carry_and_rejects_runs_outside():
    rng = np.random.default_rng(3)
    wi = _index()
    old = rng.integers(0, len(PIECES), 3000).astype(np.int64)
    new = _edited(rng, old, 5)
    edit = diff_versions(old, new)
    runs = [(0, 0, edit.prefix_len)] + [(s.new_start, s.old_start, s.length) for s in edit.segments]
    changed = [(s.new_start, s.new_end) for s in edit.spans]
    got = wi.carry_runs(new, wi(old), runs, changed)
    assert np.array_equal(got, wi.carry(new, wi(old), edit.new_to_old, changed))
    assert np.array_equal(got, wi(new))
    with pytest.raises(ValueError, match="outside"):
        wi.carry_runs(new, wi(old), [(len(new) - 2, 0, 5)], changed)
    with pytest.raises(ValueError, match="outside"):
        wi.carry_runs(new, wi(old)[:10], [(0, 0, 20)], changed)


def test_strategy_resolve_is_memoized_per_settings_object():
    from patchkv_agent.core.settings import RecoverySettings
    from patchkv_agent.strategies.builtin import PatchKVStrategy

    st = PatchKVStrategy(kappa=0.2)
    a = RecoverySettings()
    ra = st.resolve(a)
    assert ra.kappa == 0.2 and st.resolve(a) is ra
    b = a.replace(block_size=64)
    rb = st.resolve(b)
    assert rb.kappa == 0.2 and rb.block_size == 64 and st.resolve(a) == ra


@pytest.mark.parametrize("seed", range(30))
def test_few_segment_blocks_equal_the_vectorized_cut(seed, monkeypatch):
    """A few suffix segments are cut segment by segment (fewer numpy calls); the blocks equal the vectorized cut's."""
    import patchkv_agent.core.blocks as P

    rng = np.random.default_rng(seed)
    got = _random_edit(rng, _index(), 2, 400)
    if got is None:
        return
    edit = got[2]
    bs = int(rng.choice([1, 3, 8, 32]))
    keep_from = int(rng.integers(0, max(1, edit.prefix_len + 1)))
    fast = P.suffix_blocks(edit, block_size=bs, keep_from=keep_from)
    monkeypatch.setattr(P, "_FEW_SEGMENTS", 0)
    slow = P.suffix_blocks(edit, block_size=bs, keep_from=keep_from)
    for f in ("starts", "ends", "segment", "old_starts", "base"):
        a, b = getattr(fast, f), getattr(slow, f)
        assert np.array_equal(a, b) and a.dtype == np.int64 and not a.flags.writeable, f


def test_recovery_buffers_follow_a_model_moved_in_place_and_a_replaced_first_parameter():
    """The model's first parameter is remembered by its runner (a resume skips ``next(model.parameters())``); its
    dtype is read live, and a first parameter that is replaced (and dropped) is looked up again."""
    import gc

    from patchkv_agent.core.plan import plan_full
    from patchkv_agent.core.recovery import RecoveryBuffers
    from patchkv_agent.core.runner import ModelRunner
    from benchmarks.tiny import tiny_engine

    eng = tiny_engine(seed=0, layers=1, heads=2, kv_heads=2, head_dim=16, profile=None)
    model, spec, runner = eng.model, eng.spec, eng.runner
    ids = np.arange(10, dtype=np.int64) % 50
    plan = plan_full(diff_versions(ids, ids))
    assert RecoveryBuffers(runner, spec, torch.from_numpy(ids), plan).keys[0].dtype == torch.float32
    first = runner.parameter()
    model.to(torch.float64)  # in place: the same Parameter objects, new data
    assert runner.parameter() is first and runner.dtype == torch.float64
    assert RecoveryBuffers(runner, spec, torch.from_numpy(ids), plan).keys[0].dtype == torch.float64
    emb = model.get_input_embeddings()
    assert emb.weight is first
    emb.weight = torch.nn.Parameter(first.detach().to(torch.float32))  # replaced: the old one is dropped
    del first
    gc.collect()
    assert runner.parameter() is emb.weight
    assert RecoveryBuffers(runner, spec, torch.from_numpy(ids), plan).keys[0].dtype == torch.float32
    lin = torch.nn.Linear(3, 3)  # a model holding its first parameter itself: its runner goes with the last holder
    lin_runner = ModelRunner.of(lin)
    assert lin_runner.parameter() is lin.weight and ModelRunner.of(lin) is lin_runner
    gone = __import__("weakref").ref(lin)
    del lin, lin_runner
    gc.collect()
    assert gone() is None


def test_the_planner_never_builds_the_native_library_and_plans_the_same_without_it(monkeypatch):
    """The resume path's plan uses the native reader scan only once the library is loaded (the engine loads it
    when constructed); before that, the numpy twin gives the same plan, and nothing compiles or loads."""
    from patchkv_agent.core.length_model import LengthModel
    from patchkv_agent.core.plan import plan_repair
    from benchmarks.tiny import tiny_engine
    from patchkv_agent.kernels import native

    rng = np.random.default_rng(7)
    got = _random_edit(rng, _index(), 300, 900)
    assert got is not None
    old, _, edit = got
    kw = dict(length_model=LengthModel.fixed(8), readers="lexical", block_size=8)
    scores = rng.random(len(old))
    with_lib = plan_repair(edit, scores, plan_settings(**kw))

    def refuse():
        raise AssertionError("the planner tried to build or load the native library")

    import patchkv_agent.core.readers as P

    calls = []
    twin = P._reader_scan_numpy
    monkeypatch.setattr(P, "_reader_scan_numpy", lambda *a: calls.append(1) or twin(*a))
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_library", refuse)
    without = plan_repair(edit, scores, plan_settings(**kw))
    assert calls  # the scan ran, through the twin
    for f in ("recompute_positions", "restore_new_positions", "restore_old_positions", "repair_blocks"):
        assert np.array_equal(getattr(with_lib, f), getattr(without, f)), f
    assert with_lib.n_readers == without.n_readers
    monkeypatch.undo()
    if native.available():  # an engine's construction is what loads it
        monkeypatch.setattr(native, "_lib", None)
        monkeypatch.setattr(native, "_tried", False)
        tiny_engine(seed=0, layers=1, heads=2, kv_heads=2, head_dim=16, profile=None)
        assert native.ready()

"""Host-side resume path (issue 21): carried word ids, the fast id validation, the native value residual,
and the host benchmark / GPU check script in their small modes. No test here times anything or needs a GPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.inputs import InvalidInput, as_token_ids
from patchkv_agent.core.lexicon import WordIndex

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


@pytest.mark.parametrize("seed", range(40))
def test_carried_words_equal_a_whole_mapping(seed):
    rng = np.random.default_rng(seed)
    wi = _index()
    old = rng.integers(0, len(PIECES), int(rng.integers(3, 300))).astype(np.int64)
    new = _edited(rng, old, int(rng.integers(1, 6)))
    if len(new) == 0:
        return
    edit = diff_versions(old, new, words=wi, old_words=wi(old), min_match=int(rng.integers(1, 9)))
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


def test_member_is_isin():
    from patchkv_agent.core.plan import _member

    rng = np.random.default_rng(0)
    x = rng.integers(-5, 2**62, 50000)
    x[::7] = x[::7] & 0xFFFF  # low-bit collisions with the set
    s = np.sort(np.unique(np.concatenate([rng.choice(x, 40), rng.integers(0, 2**62, 10), [3, 70000]])))
    assert np.array_equal(_member(x, s), np.isin(x, s))
    assert not _member(x, s[:0]).any()


class _Tok:
    """A stand-in tokenizer: pieces only (the engine's word index reads convert_ids_to_tokens)."""

    eos_token_id = None

    def convert_ids_to_tokens(self, i):
        return PIECES[int(i) % len(PIECES)]


def test_engine_carries_words_through_checkpoints_and_resumes():
    from patchkv_agent.eval.tiny import tiny_engine

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
    ref_e, ref_r = __import__("patchkv_agent.kernels.quant", fromlist=["x"]).value_residual_sq(torch.stack(vals), group)
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
    assert (tmp_path / "out" / "host_tiny" / "host.png").stat().st_size > 0


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

    from patchkv_agent.core.recovery import decode_step, to_dynamic_cache
    from patchkv_agent.eval.tiny import tiny_model

    model = tiny_model(family)
    cfg = model.config
    n, shape = 40, (1, cfg.num_key_value_heads, 40, cfg.head_dim)
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(shape, generator=g) for _ in range(cfg.num_hidden_layers)]  # full-length rows per layer
    values = [torch.randn(shape, generator=g) for _ in range(cfg.num_hidden_layers)]
    before = [k.clone() for k in keys]
    adopted = to_dynamic_cache(model, keys, values)
    ref = DynamicCache(config=model.config)
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
        la, lb = decode_step(model, adopted, tok, pos), decode_step(model, ref, tok, pos)
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


@pytest.mark.parametrize("seed", range(30))
def test_vectorized_reader_scores_and_block_attention_match_their_oracles(seed):
    from patchkv_agent.core.plan import block_attention, lexical_reader_scores, suffix_blocks

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

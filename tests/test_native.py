"""The native CPU kernels (kernels/native.c: restore and quantize) against the torch references,
bit for bit, and the dispatcher's choice and fallbacks around them; the planner's native reader scan
against its numpy twin."""

import dataclasses

import numpy as np
import pytest
import torch

from patchkv_agent.kernels import ScatterCall, backend, dequantize_scatter, dequantize_scatter_many, native
from patchkv_agent.kernels import dispatch
from patchkv_agent.kernels import formats as KF, reference as KR, rope as KRP

from kv_helpers import assert_same_payload

pytestmark = pytest.mark.skipif(not native.available(), reason=f"native restore {native.status()}")


def _inv_freq(rot):
    return 1.0 / (1e4 ** (torch.arange(0, rot, 2).float() / rot)) if rot else None


def _case(h, d, r, tag, pdt, seed=0, n_src=150, bs=32, vg=32):
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(h, n_src, d, generator=g) * torch.exp(torch.randn(d, generator=g))).to(pdt)
    v = torch.randn(h, n_src, d, generator=g).to(pdt)
    rows = torch.randperm(n_src, generator=g)[:r].sort().values
    return KR.reference_quantize_gather(k, v, rows, tag, bs, vg), g


def _scatter(name, p, n_dst, dst_rows, delta, inv, inter, src_rows=None, fill=7.0):
    dk = torch.full((p.num_kv_heads, n_dst, p.head_dim), fill)
    dv = torch.full((p.num_kv_heads, n_dst, p.head_dim), -fill)
    with backend(name):
        path = dequantize_scatter(p, dk, dv, dst_rows, delta, inv, interleaved=inter, src_rows=src_rows)
    return dk, dv, path


# (heads, head_dim, rows, tag, payload dtype, rotary dim, interleaved, block, value group)
CASES = [
    (1, 64, 32, KF.K8V4, torch.float32, 64, False, 32, 32),
    (3, 80, 37, KF.K8V4, torch.float16, 80, False, 32, 32),  # groups 32 + 32 + 16, ends mid-block
    (16, 128, 45, KF.K8V8, torch.bfloat16, 64, False, 32, 32),  # partial half-layout RoPE
    (2, 256, 70, KF.K8V4, torch.float32, 256, True, 16, 16),
    (4, 64, 0, KF.K8V4, torch.float32, 64, False, 32, 32),  # empty run
    (3, 48, 25, KF.K8V4, torch.float32, 48, False, 32, 32),  # value groups 32 + 16
    (2, 112, 14, KF.K8V8, torch.float16, 112, True, 5, 64),  # odd block, groups 64 + 48
    (3, 64, 40, KF.FP16, torch.float16, 64, True, 32, 32),
    (3, 80, 17, KF.FP16, torch.bfloat16, 40, True, 32, 32),
    (5, 64, 33, KF.FP16, torch.float32, 64, False, 32, 32),
    (3, 64, 30, KF.K8V8, torch.float32, 0, False, 32, 32),  # no RoPE
]


@pytest.mark.parametrize("h,d,r,tag,pdt,rot,inter,bs,vg", CASES)
@pytest.mark.parametrize("shifts", ["mixed", "zero"])
def test_native_equals_reference_bitwise(h, d, r, tag, pdt, rot, inter, bs, vg, shifts):
    p, g = _case(h, d, r, tag, pdt, bs=bs, vg=vg)
    n_dst = 200
    dst_rows = torch.randperm(n_dst, generator=g)[:r]  # scattered, any order
    delta = torch.zeros(r, dtype=torch.int64) if shifts == "zero" else torch.randint(-300, 4000, (r,), generator=g)
    tk, tv, tp = _scatter("torch", p, n_dst, dst_rows, delta, _inv_freq(rot), inter)
    nk, nv, np_ = _scatter("native", p, n_dst, dst_rows, delta, _inv_freq(rot), inter)
    assert (tp, np_) == ("torch", "native")
    assert torch.equal(nk, tk) and torch.equal(nv, tv)
    untouched = torch.ones(n_dst, dtype=torch.bool)
    untouched[dst_rows] = False
    assert torch.all(nk[:, untouched] == 7.0) and torch.all(nv[:, untouched] == -7.0)


@pytest.mark.parametrize("tag", KF.FORMATS)
def test_native_selected_rows_match_decode_then_select(tag):
    """``src_rows``: only some rows of a run restored, in any order, to strided destinations."""
    h, d = 3, 64
    p, g = _case(h, d, 120, tag, torch.float16)
    sel = torch.randperm(120, generator=g)[:53]
    dst_rows = torch.randperm(90, generator=g)[:53]
    delta = torch.randint(-50, 900, (53,), generator=g)
    inv = _inv_freq(d)
    ref_k, ref_v = KR.reference_dequantize(p)
    ref_k = KRP.rope_delta_reference(ref_k[:, sel], delta, inv)
    outs = {}
    for name in ("torch", "native"):
        dk = torch.zeros(1, h, 90, d)[0]  # a view of a [1, H, N, D] cache, as the engine passes
        dv = torch.zeros(1, h, 90, d)[0]
        with backend(name):
            dequantize_scatter(p, dk, dv, dst_rows, delta, inv, src_rows=sel)
        outs[name] = dk, dv
        torch.testing.assert_close(dk[:, dst_rows], ref_k, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dv[:, dst_rows], ref_v[:, sel], rtol=0, atol=0)
    assert torch.equal(outs["native"][0], outs["torch"][0]) and torch.equal(outs["native"][1], outs["torch"][1])


def test_native_many_calls_one_pass_equals_one_by_one():
    """Several layers and tags in one ``dequantize_scatter_many`` equal the calls made singly."""
    h, d, n_dst = 2, 64, 300
    calls_a, calls_b = [], []
    for i, tag in enumerate([KF.K8V4, KF.K8V8, KF.FP16, KF.K8V4]):
        p, g = _case(h, d, 60 + 10 * i, tag, torch.float16, seed=i)
        rows = torch.arange(p.n_rows) * 2 + i % 2 + 1
        delta = torch.full((p.n_rows,), 13 * i - 5)
        for calls in (calls_a, calls_b):
            calls.append(ScatterCall(p, torch.zeros(h, n_dst, d), torch.zeros(h, n_dst, d), rows, delta, _inv_freq(d)))
    with backend("native"):
        assert dequantize_scatter_many(calls_a) == "native"
    with backend("torch"):
        for c in calls_b:
            dequantize_scatter_many([c])
    for a, b in zip(calls_a, calls_b):
        assert torch.equal(a.dst_k, b.dst_k) and torch.equal(a.dst_v, b.dst_v)


def _sources(h, n, d, dtype, kind, seed=0):
    """Strided ``[H, N, D]`` views (rows cut from a wider buffer) of keys and values of one ``kind``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, h, n + 7, d, generator=g) * torch.exp(torch.randn(d, generator=g))
    if kind == "large":
        x = x * 3000
    elif kind == "tiny":  # fp16 subnormal scales and zeros
        x = x * 1e-6
    elif kind == "constant":  # min == max groups and blocks
        x[:, :, ::3] = 1.5
    return x[0][:, 3:3 + n].to(dtype), x[1][:, 2:2 + n].to(dtype)


@pytest.mark.parametrize("tag", KF.FORMATS)
@pytest.mark.parametrize("d,h,dtype,bs,vg,kind", [
    (64, 3, torch.float32, 32, 32, "gauss"),
    (80, 2, torch.float16, 32, 32, "large"),  # value groups 32 + 32 + 16
    (128, 1, torch.bfloat16, 16, 64, "tiny"),
    (48, 4, torch.float32, 5, 32, "constant"),  # odd block; groups 32 + 16
    (256, 16, torch.float16, 32, 16, "gauss"),
    (112, 3, torch.float32, 32, 64, "large"),  # groups 64 + 48
])
def test_native_quantize_equals_reference_bitwise(tag, d, h, dtype, bs, vg, kind):
    n = 90
    k, v = _sources(h, n, d, dtype, kind)
    g = torch.Generator().manual_seed(d)
    for r in (0, 1, 37, n):  # empty, one row, ends mid-block, all rows
        rows = torch.randperm(n, generator=g)[:r]
        with backend("torch"):
            ref = dispatch.quantize_gather(k, v, rows, tag, bs, vg)
        with backend("native"):
            got = dispatch.quantize_gather(k, v, rows, tag, bs, vg)
        assert_same_payload(ref, got)


def test_auto_quantize_uses_native_and_checks_arguments():
    k, v = _sources(2, 40, 64, torch.float32, "gauss")
    rows = torch.arange(10, 30)
    with backend("torch"):
        ref = dispatch.quantize_gather(k, v, rows, KF.K8V4)
    assert_same_payload(ref, dispatch.quantize_gather(k, v, rows, KF.K8V4))
    with backend("native"), pytest.raises(ValueError, match="outside"):
        dispatch.quantize_gather(k, v, torch.tensor([0, 40]), KF.K8V8)
    with backend("native"), pytest.raises(RuntimeError, match="one dtype"):
        dispatch.quantize_gather(k, v.half(), rows, KF.K8V8)


def test_software_half_conversion_build_is_exact(tmp_path):
    """The fallback fp16 conversions (compilers without _Float16) give the same bits, both ways."""
    lib = native.load(native.build(tmp_path, ["-DPKV_NO_FLOAT16"], native_arch=False))
    p, g = _case(3, 80, 64, KF.K8V4, torch.float16)
    raw, _ = _case(3, 80, 64, KF.FP16, torch.float16)
    # every fp16 class: subnormals, zeros of both signs, normals, large values
    special = torch.tensor([0.0, -0.0, 6e-8, -3e-6, 1e-5, 0.5, -2.0, 6e4], dtype=torch.float16)
    raw = dataclasses.replace(raw, k_data=special.repeat(3 * 64 * 10).view(3, 64, 80))
    monkey = native._lib
    try:
        native._lib = lib
        for run in (p, raw):
            rows, delta = torch.arange(64) + 3, torch.full((64,), 21)
            tk, tv, _ = _scatter("torch", run, 70, rows, delta, _inv_freq(80), False)
            nk, nv, _ = _scatter("native", run, 70, rows, delta, _inv_freq(80), False)
            assert torch.equal(nk, tk) and torch.equal(nv, tv)
        for kind in ("gauss", "large", "tiny", "constant"):  # scales and zeros rounded to fp16 in C
            k, v = _sources(3, 50, 80, torch.float16, kind)
            rows = torch.arange(3, 47)
            for tag in (KF.K8V8, KF.K8V4):
                with backend("torch"):
                    ref = dispatch.quantize_gather(k, v, rows, tag, 16)
                with backend("native"):
                    assert_same_payload(ref, dispatch.quantize_gather(k, v, rows, tag, 16))
    finally:
        native._lib = monkey


def test_auto_uses_native_on_cpu_and_torch_where_it_cannot():
    p, _ = _case(2, 64, 20, KF.K8V4, torch.float32)
    rows, delta = torch.arange(20), torch.full((20,), 3)
    assert _scatter("auto", p, 30, rows, delta, _inv_freq(64), False)[2] == "native"
    half = torch.zeros(2, 30, 64, dtype=torch.float16)  # fp16 destinations: the reference takes them
    assert dequantize_scatter(p, half, half.clone(), rows, delta, _inv_freq(64)) == "torch"
    with backend("native"), pytest.raises(RuntimeError, match="fp32 destinations"):
        dequantize_scatter(p, half, half.clone(), rows, delta, _inv_freq(64))


def test_disabled_native_falls_back_to_torch(monkeypatch):
    monkeypatch.setenv("PATCHKV_NATIVE", "0")
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_lib", None)
    assert not native.available() and "PATCHKV_NATIVE=0" in native.status()
    p, _ = _case(2, 64, 20, KF.K8V8, torch.float32)
    assert _scatter("auto", p, 30, torch.arange(20), torch.full((20,), 3), _inv_freq(64), False)[2] == "torch"
    with backend("native"), pytest.raises(RuntimeError, match="PATCHKV_NATIVE=0"):
        _scatter("native", p, 30, torch.arange(20), torch.full((20,), 3), _inv_freq(64), False)


def test_missing_compiler_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "no-such-cc")
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build(tmp_path)


def test_native_rejects_bad_rows():
    before = dispatch.get_backend()
    p, _ = _case(2, 64, 20, KF.K8V8, torch.float32)
    with backend("native"), pytest.raises(ValueError, match="outside"):
        _scatter("native", p, 10, torch.arange(20), torch.zeros(20, dtype=torch.int64), None, False)
    with backend("native"), pytest.raises(ValueError, match="src_rows"):
        _scatter("native", p, 30, torch.arange(3), torch.zeros(3, dtype=torch.int64), None, False,
                 src_rows=torch.tensor([0, 5, 20]))
    assert dispatch.get_backend() == before  # the context managers restored the backend


def test_transport_bench_on_a_tiny_model():
    """The transport benchmark restores what it stored: values exact for FP16 and within each
    format's bound otherwise, keys equal to the stored keys rotated by the shift (oracle:
    ``rope_delta_reference``); the native and torch paths are both timed."""
    from benchmarks.tiny import tiny_engine
    from benchmarks.transport_bench import transport_bench

    eng = tiny_engine(dirty_window=None)
    ids = torch.randint(3, eng.spec.vocab_size, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    out = transport_bench(eng, repeats=1, ids=ids)
    f = out["formats"]
    assert out["restore_kernel"] == ("torch" if dispatch.get_backend() == "torch" else "native")
    assert out["n_tokens"] == 100
    assert f["FP16"]["value_rel_err"] == 0.0 and f["FP16"]["key_rel_err"] < 1e-6
    assert 0 < f["INT8"]["value_rel_err"] < 0.006 and 0 < f["INT4"]["value_rel_err"] < 0.09
    assert 0 < f["INT8"]["key_rel_err"] < 0.006 and 0 < f["INT4"]["key_rel_err"] < 0.006
    assert f["INT4"]["payload_mib"] < f["INT8"]["payload_mib"] < f["FP16"]["payload_mib"]
    assert all(v["restore_ms"] > 0 and v["restore_ms_torch"] > 0 and v["store_ms_torch"] > 0 for v in f.values())


def _scan_case(rng):
    """Word ids with runs (multi-token words), -1 (no word), ids that share their low 16 bits, and changed words
    that are absent from the context; suffix blocks as disjoint increasing runs."""
    n = int(rng.integers(0, 3000))
    pool = np.concatenate([rng.integers(0, 40, 30), rng.integers(0, 40, 10) + (1 << 16) * rng.integers(1, 5, 10),
                           [-1, -1, (1 << 62) + 7]]).astype(np.int64)
    words = np.repeat(rng.choice(pool, n), rng.integers(1, 4, n))[:n].astype(np.int64)
    changed = np.unique(np.concatenate([rng.choice(pool, int(rng.integers(0, 12))), rng.integers(100, 200, 2)]))
    changed = changed[changed >= 0].astype(np.int64)
    cuts = np.unique(rng.integers(0, max(n, 1), int(rng.integers(0, 200)))) if n else np.zeros(0, np.int64)
    starts, ends = [], []
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
        if rng.random() < 0.7:  # some gaps between blocks (the edited spans)
            starts.append(a)
            ends.append(b)
    return words, changed, np.asarray(starts, np.int64), np.asarray(ends, np.int64)


@pytest.mark.parametrize("seed", range(40))
def test_reader_scan_native_equals_the_numpy_twin(seed):
    from patchkv_agent.core.blocks import SuffixBlocks
    from patchkv_agent.core.readers import _reader_scan_numpy

    rng = np.random.default_rng(seed)
    words, changed, starts, ends = _scan_case(rng)
    size = int(rng.choice([1, 3, 32, 64]))
    z = np.zeros_like(starts)
    blocks = SuffixBlocks(block_size=size, starts=starts, ends=ends, segment=z, old_starts=starts, base=z)
    want = _reader_scan_numpy(words, changed, size, blocks)
    got = native.reader_scan_native(words, changed, size, starts, ends)
    for name, a, b in zip(("df", "pair_blk", "pair_tok"), got, want):
        assert a.dtype == np.int64 and np.array_equal(a, b), name


def test_reader_scan_native_refuses_bad_arguments():
    w = np.arange(10, dtype=np.int64)
    st, en = np.array([2, 5], np.int64), np.array([4, 8], np.int64)
    ch = np.array([1, 3], np.int64)
    assert native.reader_scan_native(w, ch, 4, st, en)[0].tolist() == [1, 1]
    cases = [
        (dict(changed=np.array([3, 1], np.int64)), "strictly increasing"),
        (dict(changed=np.array([3, 3], np.int64)), "strictly increasing"),
        (dict(starts=np.array([2, 3], np.int64)), "increasing non-empty runs"),  # overlapping blocks
        (dict(ends=np.array([4, 11], np.int64)), "increasing non-empty runs"),  # past the context
        (dict(ends=np.array([2, 8], np.int64)), "increasing non-empty runs"),  # an empty block
        (dict(starts=np.array([-1, 5], np.int64)), "increasing non-empty runs"),
        (dict(ctx_block=0), "block size"),
        (dict(words=w.astype(np.int32)), "1-D int64"),
        (dict(ends=np.array([4], np.int64)), "differ in length"),
    ]
    for change, match in cases:
        args = dict(words=w, changed=ch, ctx_block=4, starts=st, ends=en)
        args.update(change)
        with pytest.raises(ValueError, match=match):
            native.reader_scan_native(**args)

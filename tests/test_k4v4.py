"""The K4V4 transport format (4-bit keys per channel over the block, 4-bit values) end to end:
the torch reference against independently computed codes and its error bound, the native and
Triton (interpreted) kernels against the reference bit for bit, the precision rule that assigns it,
checkpoint serialization of the new tag, and an engine restore against the reference dequantization
rotated by ``rope_delta_reference``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules are imported below

import dataclasses  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

from kv_helpers import assert_same_checkpoint, assert_same_payload, make_ckpt  # noqa: E402
from patchkv_agent.core.checkpoint import key_residual, quantize_mixed  # noqa: E402
from patchkv_agent.core.precision import (  # noqa: E402
    DEFAULT_G4K,
    DEFAULT_TAU_LL,
    K4V4_TAU_LL,
    PrecisionPolicy,
    Run,
    Tag,
    assign_tags,
    block_risk,
    cluster_runs,
)
from patchkv_agent.kernels import backend, dispatch, native  # noqa: E402
from patchkv_agent.kernels import formats as KF, quantizer as KQ, reference as KR, residual as KRS, torch_restore as KT  # noqa: E402
from patchkv_agent.kernels.rope import rope_delta_reference  # noqa: E402
from patchkv_agent.runtime.kvstore import CheckpointKey, CorruptCheckpoint, decode_checkpoint, encode_checkpoint  # noqa: E402
from patchkv_agent.runtime.kvstore.codec import meta_checksum  # noqa: E402
from benchmarks.tiny import tiny_engine  # noqa: E402
from test_recovery import edited_pair  # noqa: E402
from patchkv_agent.strategies import get_strategy  # noqa: E402

NATIVE = pytest.mark.skipif(not native.available(), reason=f"native kernels {native.status()}")


def _kv(h, n, d, dtype=torch.float32, seed=0, kind="gauss"):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(h, n, d, generator=g) * torch.exp(torch.randn(d, generator=g) * 0.5) + torch.randn(d, generator=g)
    v = torch.randn(h, n, d, generator=g)
    if kind == "large":
        k, v = k * 3000, v * 3000
    elif kind == "tiny":  # fp16 subnormal scales and zeros
        k, v = k * 1e-6, v * 1e-6
    elif kind == "constant":  # min == max over blocks and groups
        k[:, ::3], v[:, :, ::3] = 1.5, -0.25
    return k.to(dtype), v.to(dtype)


def _rows(n, r, seed=0):
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:r]


def _inv_freq(rot):
    return 1.0 / (1e4 ** (torch.arange(0, rot, 2).float() / rot)) if rot else None


# ----------------------------------------------------------------------------- the reference


def test_format_order_and_tags():
    assert KF.FORMATS == ("K4V4", "K8V4", "K8V8", "FP16")
    assert tuple(t.name for t in sorted(Tag)) == KF.FORMATS
    assert max(Tag.K4V4, Tag.K8V4) == Tag.K8V4 and min(Tag.K4V4, Tag.FP16) == Tag.K4V4
    # stored codes of the older tags never change (checkpoints written before K4V4 still read)
    assert (int(Tag.K8V4), int(Tag.K8V8), int(Tag.FP16), int(Tag.K4V4)) == (0, 1, 2, -1)
    assert KF.normalize_tag(Tag.K4V4) == "K4V4"


@pytest.mark.parametrize("d,bs,vg", [(64, 32, 32), (80, 32, 32), (48, 5, 32), (128, 16, 64)])
def test_reference_codes_and_packing(d, bs, vg):
    """Keys: the 8-bit quantizer's groups with qmax 15, channel 2j in the low nibble; values and
    value scales: those of K8V4, byte for byte."""
    k, v = _kv(3, 70, d)
    rows = _rows(70, 45)
    p = KR.reference_quantize_gather(k, v, rows, KF.K4V4, bs, vg)
    kr = k[:, rows]
    nb = -(-45 // bs)
    mn = torch.stack([kr[:, b * bs:(b + 1) * bs].amin(1) for b in range(nb)], 1)
    mx = torch.stack([kr[:, b * bs:(b + 1) * bs].amax(1) for b in range(nb)], 1)
    s, z = KQ.scale_zero(mn, mx, 15)
    blk = torch.arange(45) // bs
    q = KQ.codes(kr, s[:, blk], z[:, blk], 15)
    assert int(q.max()) <= 15
    assert p.k_data.shape == (3, 45, d // 2) and p.k_data.dtype == torch.uint8
    assert torch.equal(p.k_data & 15, q[..., 0::2]) and torch.equal(p.k_data >> 4, q[..., 1::2])
    assert torch.equal(p.k_scale, s) and torch.equal(p.k_zero, z)
    p84 = KR.reference_quantize_gather(k, v, rows, KF.K8V4, bs, vg)
    for f in ("v_data", "v_scale", "v_zero"):
        assert torch.equal(getattr(p, f), getattr(p84, f)), f
    k_hat, v_hat = KR.reference_dequantize(p)
    assert torch.equal(k_hat, q.float() * s[:, blk].float() + z[:, blk].float())
    assert torch.equal(v_hat, KR.reference_dequantize(p84)[1])


def test_nbytes_is_1_25_per_pair():
    k, v = _kv(3, 64, 128, torch.float16)
    p = KR.reference_quantize_gather(k, v, torch.arange(64), KF.K4V4)
    fp16 = KR.reference_quantize_gather(k, v, torch.arange(64), KF.FP16)
    assert p.nbytes == 3 * 64 * 64 * 2 + 3 * 2 * 128 * 4 + 3 * 64 * 4 * 4  # codes + key meta + value meta
    assert p.nbytes / fp16.nbytes == 1.25 / 4


@pytest.mark.parametrize("path", ["torch", "native", "triton"])
@pytest.mark.parametrize("d", [64, 80])
def test_round_trip_within_bound(path, d):
    if path == "native" and not native.available():
        pytest.skip(f"native kernels {native.status()}")
    k, v = _kv(2, 45, d)
    rows = torch.arange(45)
    with backend(path):
        p = dispatch.quantize_gather(k, v, rows, KF.K4V4)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dispatch.dequantize_scatter(p, dk, dv, rows, torch.zeros(45, dtype=torch.int64), None)
    sk = p.k_scale[:, torch.arange(45) // p.block_size].float()
    sv = p.v_scale[..., torch.arange(d) // p.v_group].float()
    for x, x_hat, s in ((k, dk, sk), (v, dv, sv)):
        assert torch.all((x - x_hat).abs() <= s / 2 * (1 + 1e-5) + 1e-6 * x.abs())
    rel_k = ((dk - k).norm() / k.norm()).item()
    assert 0.01 < rel_k < 0.09, rel_k  # 16 levels over each channel's block range


def test_hard_groups_and_odd_head_dim():
    k = torch.tensor([[[1000.0, -3.0, 1e-6, 0.0], [1000.001, -3.0, -1e-6, 5.0], [999.99, -3.0, 0.0, -5.0]]])
    v = torch.tensor([[[1e4, 1e4 + 1, -2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-7.0, 1e-8, 3.0, 3.0]]])
    p = KR.reference_quantize_gather(k, v, torch.arange(3), KF.K4V4, v_group=2)
    k_hat, _ = KR.reference_dequantize(p)
    s = p.k_scale[:, torch.zeros(3, dtype=torch.long)].float()
    assert torch.all((k - k_hat).abs() <= s / 2 * (1 + 1e-5) + 1e-6 * k.abs())
    with pytest.raises(ValueError, match="K4V4 .*even head_dim"):
        dispatch.quantize_gather(torch.zeros(1, 4, 63), torch.zeros(1, 4, 63), torch.arange(2), KF.K4V4)


def test_key_residual_matches_the_format():
    k = torch.randn(3, 2, 50, 64, generator=torch.Generator().manual_seed(1))  # [L, H, N, D]
    ek = KRS.key_residual_4bit(k, 16)
    err = ref = 0
    for layer in range(3):
        p = KR.reference_quantize_gather(k[layer], k[layer], torch.arange(50), KF.K4V4, 16)
        k_hat, _ = KR.reference_dequantize(p)
        err = err + (k_hat - k[layer]).square().sum((0, 2))
        ref = ref + k[layer].square().sum((0, 2))
    torch.testing.assert_close(ek, (err / ref).sqrt())
    np.testing.assert_allclose(key_residual(list(k), 16), ek.numpy().astype(np.float64), rtol=1e-6)
    assert torch.equal(KRS.key_residual_4bit(torch.zeros(2, 4, 32)), torch.zeros(4))
    with pytest.raises(ValueError, match="block_size"):
        KRS.key_residual_sq(k, 0)


@pytest.mark.parametrize("layout", ["contiguous", "fragmented"])
def test_torch_pieces_equal_the_oracle(monkeypatch, layout):
    monkeypatch.setattr(KT, "_PIECE_ELEMS", 2 * 64 * 48)  # 48-row pieces
    monkeypatch.setattr(KT, "_MIN_DIRECT_ROWS", 24)
    monkeypatch.setattr(KT, "_MIN_COPY_ROWS", 8)
    h, d, r = 2, 64, 150
    k, v = _kv(h, r + 10, d, torch.float16)
    p = KR.reference_quantize_gather(k, v, _rows(r + 10, r), KF.K4V4, 16)
    if layout == "contiguous":
        dst, delta = torch.arange(r) + 3, torch.full((r,), 29)
    else:
        dst = torch.sort(_rows(2 * r, r, seed=3)).values
        delta = torch.randint(-20, 900, (r,), generator=torch.Generator().manual_seed(4))
    n_dst = int(dst.max()) + 2
    outs = []
    for fn in (KR.reference_dequantize_scatter, KT.torch_dequantize_scatter):
        dk, dv = torch.full((h, n_dst, d), 7.0), torch.full((h, n_dst, d), -7.0)
        fn(p, dk, dv, dst, delta, _inv_freq(d))
        outs.append((dk, dv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------- native


@NATIVE
@pytest.mark.parametrize("h,d,r,pdt,rot,inter,bs,vg", [
    (1, 64, 32, torch.float32, 64, False, 32, 32),
    (3, 80, 37, torch.float16, 80, False, 32, 32),  # ends mid-block, groups 32 + 32 + 16
    (2, 256, 70, torch.float32, 256, True, 16, 16),
    (4, 64, 0, torch.float32, 64, False, 32, 32),  # empty run
    (3, 112, 25, torch.bfloat16, 56, True, 5, 64),  # odd block, partial interleaved RoPE
    (3, 64, 30, torch.float32, 0, False, 32, 32),  # no RoPE
])
@pytest.mark.parametrize("shifts", ["mixed", "zero"])
def test_native_restore_equals_reference_bitwise(h, d, r, pdt, rot, inter, bs, vg, shifts):
    g = torch.Generator().manual_seed(r)
    k, v = _kv(h, 150, d, pdt)
    p = KR.reference_quantize_gather(k, v, torch.randperm(150, generator=g)[:r], KF.K4V4, bs, vg)
    dst = torch.randperm(200, generator=g)[:r]
    delta = torch.zeros(r, dtype=torch.int64) if shifts == "zero" else torch.randint(-300, 4000, (r,), generator=g)
    want_k, want_v = torch.full((h, 200, d), 7.0), torch.full((h, 200, d), -7.0)
    KR.reference_dequantize_scatter(p, want_k, want_v, dst, delta, _inv_freq(rot), interleaved=inter)
    got_k, got_v = torch.full((h, 200, d), 7.0), torch.full((h, 200, d), -7.0)
    with backend("native"):
        assert dispatch.dequantize_scatter(p, got_k, got_v, dst, delta, _inv_freq(rot), interleaved=inter) == "native"
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@NATIVE
def test_native_selected_rows_and_software_half_build(tmp_path):
    k, v = _kv(3, 120, 64, torch.float16)
    p = KR.reference_quantize_gather(k, v, torch.arange(120), KF.K4V4)
    g = torch.Generator().manual_seed(5)
    sel, dst = torch.randperm(120, generator=g)[:53], torch.randperm(90, generator=g)[:53]
    delta = torch.randint(-50, 900, (53,), generator=g)
    ref_k, ref_v = KR.reference_dequantize(p)
    ref_k = rope_delta_reference(ref_k[:, sel], delta, _inv_freq(64))
    dk, dv = torch.zeros(3, 90, 64), torch.zeros(3, 90, 64)
    with backend("native"):
        dispatch.dequantize_scatter(p, dk, dv, dst, delta, _inv_freq(64), src_rows=sel)
    torch.testing.assert_close(dk[:, dst], ref_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(dv[:, dst], ref_v[:, sel])
    lib = native.load(native.build(tmp_path, ["-DPKV_NO_FLOAT16"], native_arch=False))
    saved = native._lib
    try:
        native._lib = lib
        for kind in ("gauss", "tiny", "large"):
            k2, v2 = _kv(3, 50, 80, torch.float16, kind=kind)
            with backend("torch"):
                ref = dispatch.quantize_gather(k2, v2, torch.arange(3, 47), KF.K4V4, 16)
            with backend("native"):
                assert_same_payload(ref, dispatch.quantize_gather(k2, v2, torch.arange(3, 47), KF.K4V4, 16))
            rows, delta = torch.arange(44) + 2, torch.full((44,), 21)
            want_k, want_v = torch.zeros(3, 50, 80), torch.zeros(3, 50, 80)
            KR.reference_dequantize_scatter(ref, want_k, want_v, rows, delta, _inv_freq(80))
            got_k, got_v = torch.zeros(3, 50, 80), torch.zeros(3, 50, 80)
            with backend("native"):
                dispatch.dequantize_scatter(ref, got_k, got_v, rows, delta, _inv_freq(80))
            assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    finally:
        native._lib = saved


# ----------------------------------------------------------------------------- Triton (interpreted)


@pytest.mark.parametrize("h,n,d,r,dtype,bs,vg", [
    (1, 40, 64, 32, torch.float32, 32, 32),
    (3, 50, 80, 37, torch.float16, 32, 32),  # groups 32 + 32 + 16, ends mid-block
    (2, 12, 64, 7, torch.bfloat16, 5, 64),  # non-power-of-two block
])
def test_triton_quantize_equals_reference(h, n, d, r, dtype, bs, vg):
    from patchkv_agent.kernels.triton_quantize_gather import quantize_gather_triton

    k, v = _kv(h, n, d, dtype)
    rows = _rows(n, r)
    assert_same_payload(KR.reference_quantize_gather(k, v, rows, KF.K4V4, bs, vg), quantize_gather_triton(k, v, rows, KF.K4V4, bs, vg))


@pytest.mark.parametrize("d,r,rot,inter,ddt", [
    (64, 37, 64, False, torch.float32),
    (80, 21, 40, True, torch.float32),  # GLM-like partial interleaved
    (48, 9, 48, False, torch.float16),
])
def test_triton_restore_equals_reference(d, r, rot, inter, ddt):
    from patchkv_agent.kernels.triton_dequantize_scatter import dequantize_scatter_triton

    h = 2
    k, v = _kv(h, 48, d)
    p = KR.reference_quantize_gather(k, v, _rows(48, r), KF.K4V4, 16)
    dst = _rows(70, r, seed=1)
    delta = torch.randint(-300, 4000, (r,), generator=torch.Generator().manual_seed(2))
    outs = []
    for fn in (KR.reference_dequantize_scatter, dequantize_scatter_triton):
        dk, dv = torch.full((h, 70, d), 7.0, dtype=ddt), torch.full((h, 70, d), -7.0, dtype=ddt)
        fn(p, dk, dv, dst, delta, _inv_freq(rot), interleaved=inter)
        outs.append((dk, dv))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# ----------------------------------------------------------------------------- the precision rule


def test_policy_fields_defaults_and_validation():
    p = PrecisionPolicy()
    assert (p.tau_LL, p.g4k) == (min(DEFAULT_TAU_LL, p.tau_L), DEFAULT_G4K) == (0.0, DEFAULT_G4K)  # K4V4 off
    assert PrecisionPolicy(tau_L=0.01, tau_H=4.0).tau_LL == 0.0
    assert PrecisionPolicy(tau_LL=K4V4_TAU_LL).tau_LL == 0.05  # on: the measured payload setting
    assert PrecisionPolicy(tau_LL=0.0).tau_LL == 0.0
    assert dataclasses.asdict(PrecisionPolicy(tau_LL=0.2))["tau_LL"] == 0.2
    for bad, msg in ((dict(tau_LL=2.0), "tau_LL <= tau_L"), (dict(tau_LL=-0.1), "tau_LL <= tau_L"),
                     (dict(g4k=0.0), "g4k must be > 0")):
        with pytest.raises(ValueError, match=msg):
            PrecisionPolicy(**bad)


def test_assign_tags_k4v4_exact():
    # blocks of 4 tokens, attention of mean 1; value residual 0.1 (G4 passes) except block 4
    attn = np.array([0.5] * 4 + [1.0] * 4 + [0.5] * 4 + [10.0, 0, 0, 0] + [0.5] * 4)
    resid = np.array([0.1] * 16 + [0.1, 0.2, 0.1, 0.1])
    kres = np.array([0.05] * 8 + [0.05, 0.05, 0.09, 0.05] + [0.05] * 8)
    pol = PrecisionPolicy(alpha=0.5, tau_L=0.2, tau_H=1.0, g4=0.15, tau_LL=0.1, g4k=0.08)
    np.testing.assert_allclose(block_risk(attn, resid, 4, 0.5), [0.05, 0.1, 0.05, 0.625, 0.08125])
    tags = assign_tags(attn, resid, 4, pol, kres)
    # 0: r 0.05 < tau_LL, G4 and G4K pass -> K4V4; 1: r == tau_LL -> K8V4; 2: G4K fails (0.09) -> K8V4;
    # 3: r 0.625 in [tau_L, tau_H) -> K8V8; 4: r < tau_LL but G4 fails (0.2) -> K8V8 whatever the keys
    assert [Tag(t) for t in tags] == [Tag.K4V4, Tag.K8V4, Tag.K8V4, Tag.K8V8, Tag.K8V8]
    assert tags.dtype == np.int8
    assert [Tag(t) for t in assign_tags(attn, resid, 4, pol)] == [Tag.K8V4, Tag.K8V4, Tag.K8V4, Tag.K8V8, Tag.K8V8]
    assert Tag.K4V4 not in assign_tags(attn, resid, 4, dataclasses.replace(pol, tau_LL=0.0), kres)
    assert cluster_runs(tags) == [Run(Tag.K4V4, 0, 1), Run(Tag.K8V4, 1, 2), Run(Tag.K8V8, 3, 2)]
    for bad in (kres[:-1], -kres, np.where(kres > 0.08, np.nan, kres)):
        with pytest.raises(ValueError, match="key_resid"):
            assign_tags(attn, resid, 4, pol, bad)


def test_old_profiles_still_load():
    from patchkv_agent.profiles import SHIPPED_PROFILE_DIR, Profile

    with open(SHIPPED_PROFILE_DIR / "smollm2-135m.json") as f:
        shipped = json.load(f)
    pol = Profile.from_dict(shipped).settings().precision_policy
    assert "tau_LL" not in shipped["precision_policy"]
    assert (pol.tau_L, pol.tau_LL, pol.g4k) == (0.25, min(DEFAULT_TAU_LL, 0.25), DEFAULT_G4K)
    prof = dict(shipped, precision_policy={**shipped["precision_policy"], "tau_LL": 0.05, "g4k": 0.2})
    pol = Profile.from_dict(prof).settings().precision_policy
    assert (pol.tau_LL, pol.g4k) == (0.05, 0.2)
    with pytest.raises(ValueError, match="tau_LL"):
        Profile.from_dict(dict(shipped, precision_policy={**shipped["precision_policy"], "tau_LL": 0.5}))


# ----------------------------------------------------------------------------- checkpoints


def _forced(ckpt, pattern=(Tag.K4V4, Tag.K8V4, Tag.K4V4, Tag.K8V8, Tag.FP16), block_size=8):
    n = len(ckpt)
    nb = -(-n // block_size)
    tags = np.array([pattern[i % len(pattern)] for i in range(nb)], dtype=np.int8)
    return dataclasses.replace(ckpt, mixed=quantize_mixed(list(ckpt.keys), list(ckpt.values), tags,
                                                          block_size=block_size))


def test_codec_roundtrip_and_refusals_with_k4v4():
    c = _forced(make_ckpt(7))
    assert "K4V4" in c.mixed.tag_rows
    key = CheckpointKey.of(c, deployment="d", thread_id="t", version=1)
    meta, blobs = encode_checkpoint(c, key)
    raw = {k: bytes(v) for k, v in blobs.items()}
    back = decode_checkpoint(json.loads(json.dumps(meta)), raw, key)
    assert_same_checkpoint(back, c)
    assert back.mixed.runs[0] == Run(Tag.K4V4, 0, 1)

    def resealed(m):
        m = json.loads(json.dumps(m))
        m["meta_xxh3"] = meta_checksum(m)
        return m

    bad = json.loads(json.dumps(meta))
    bad["mixed"]["runs"][0][0] = -2  # no such tag code
    with pytest.raises(CorruptCheckpoint, match="runs are malformed"):
        decode_checkpoint(resealed(bad), raw, key)
    bad = json.loads(json.dumps(meta))
    bad["mixed"]["tags"][bad["mixed"]["tags"].index("K4V4")] = "K2V2"
    with pytest.raises(CorruptCheckpoint, match="tags or block size are malformed"):
        decode_checkpoint(resealed(bad), raw, key)
    tags = np.frombuffer(raw["mixed.tags"], dtype=np.int8).copy()
    tags[0] = 5  # a consistent blob (checksum resealed) holding an unknown code
    bad, raw2 = json.loads(json.dumps(meta)), dict(raw, **{"mixed.tags": tags.tobytes()})
    next(b for b in bad["blobs"] if b["name"] == "mixed.tags")["xxh3"] = xxhash.xxh3_64_hexdigest(tags.tobytes())
    with pytest.raises(CorruptCheckpoint, match="unknown tag codes"):
        decode_checkpoint(resealed(bad), raw2, key)


def test_engine_restores_k4v4_blocks_as_the_reference():
    """A mixed checkpoint with K4V4 (and every other) blocks, restored by a ``direct`` resume: each
    restored row equals the reference dequantization of its payload rotated by ``rope_delta_reference``."""
    eng = tiny_engine()
    old, new = edited_pair(eng.spec.vocab_size)
    ckpt = _forced(eng.checkpoint(old))
    res = eng.resume(ckpt, new, strategy=get_strategy("direct", {"precision": "mixed"}), max_new_tokens=1)
    assert res.stats["fallback"] is None
    old_pos = np.asarray(res.edit.suffix_old_positions[:-1])  # the last token is recomputed
    new_pos = np.asarray(res.edit.suffix_new_positions[:-1])
    seen = set()
    for layer in range(eng.spec.num_layers):
        rope = eng.spec.rope_for_layer(layer)
        for tag, rows in ckpt.mixed.tag_rows.items():
            k_hat, v_hat = KR.reference_dequantize(ckpt.mixed.payloads[layer][tag])
            where = {int(r): i for i, r in enumerate(rows)}
            pick = [(where[o], n) for o, n in zip(old_pos, new_pos) if int(o) in where]
            if not pick:
                continue
            seen.add(tag)
            idx, dst = torch.tensor([a for a, _ in pick]), torch.tensor([b for _, b in pick])
            delta = dst - torch.tensor([int(rows[a]) for a, _ in pick])
            want_k = rope_delta_reference(k_hat[:, idx], delta, rope.inv_freq, interleaved=rope.interleaved)
            got_k, got_v = res.keys[layer][0][:, dst], res.values[layer][0][:, dst]
            torch.testing.assert_close(got_k, want_k, rtol=1e-6, atol=1e-6)
            assert torch.equal(got_v, v_hat[:, idx]), (layer, tag)
    assert seen == {"K4V4", "K8V4", "K8V8", "FP16"}
    fp = eng.resume(ckpt, new, strategy=get_strategy("direct", {"precision": "fp16"}), max_new_tokens=1)
    assert res.stats["payload_bytes"] < fp.stats["payload_bytes"]


def test_build_mixed_assigns_k4v4_from_key_residuals():
    """``build_mixed`` (the engine's offload) tags low-risk blocks K4V4 when their keys pass G4K and
    never when tau_LL is 0; payloads then decode as their tag's reference."""
    from patchkv_agent.core.checkpoint import build_mixed

    g = torch.Generator().manual_seed(3)
    keys = [torch.randn(2, 64, 32, generator=g) for _ in range(2)]
    values = [torch.randn(2, 64, 32, generator=g) for _ in range(2)]
    scores = np.ones(64)
    ek = key_residual(keys, 8)
    ek_max = ek.reshape(8, 8).max(1)
    pol = PrecisionPolicy(tau_L=1.0, tau_H=8.0, g4=0.2, tau_LL=1.0, g4k=float(np.median(ek_max)))
    m = build_mixed(keys, values, scores, block_size=8, policy=pol)
    want = np.where(ek_max <= pol.g4k, Tag.K4V4, Tag.K8V4)  # uniform attention: r = e < tau_LL everywhere
    assert np.array_equal(m.tags, want.astype(np.int8)) and 0 < (m.tags == Tag.K4V4).sum() < 8
    rows = m.tag_rows["K4V4"]
    k_hat, v_hat = KR.reference_dequantize(m.payloads[1]["K4V4"])
    ref = KR.reference_quantize_gather(keys[1], values[1], torch.from_numpy(rows), KF.K4V4, 8)
    assert torch.equal(k_hat, KR.reference_dequantize(ref)[0]) and torch.equal(v_hat, KR.reference_dequantize(ref)[1])
    off = build_mixed(keys, values, scores, block_size=8, policy=dataclasses.replace(pol, tau_LL=0.0))
    assert Tag.K4V4 not in off.tags and "K4V4" not in off.tag_rows

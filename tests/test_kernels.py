"""KV transport kernels: Triton (interpreted on CPU) against the torch references, round-trip
bounds, and the RoPE correction against Hugging Face's own ``apply_rotary_pos_emb``."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel modules are imported below

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import GlmConfig, LlamaConfig  # noqa: E402
from transformers.models.glm import modeling_glm  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from patchkv_agent.kernels import dispatch  # noqa: E402
from patchkv_agent.kernels import formats as KF, quantizer as KQ, reference as KR, residual as KRS, rope as KRP, torch_restore as KT  # noqa: E402
from patchkv_agent.kernels.triton_dequantize_scatter import _dequantize_scatter_kernel, dequantize_scatter_triton  # noqa: E402
from patchkv_agent.kernels.triton_quantize_gather import _quantize_gather_kernel, quantize_gather_triton  # noqa: E402
from patchkv_agent.core.precision import Tag  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Triton vs reference on the destination, relative, by destination dtype. Under the interpreter
# both run the same fp32 operations in the same order: bit-exact for fp32/fp16. The interpreter
# truncates fp32 -> bf16 (Triton 3.9) where torch rounds to nearest: one bf16 ulp.
KERNEL_TOL = {torch.float32: 0.0, torch.float16: 0.0, torch.bfloat16: 2.0**-7}

# Round trip (relative Frobenius error, Gaussian rows) per format: (keys, values). FP16 is exact;
# the elementwise bound |x - x_hat| <= scale / 2 is checked separately.
ROUND_TRIP_REL = {KF.FP16: (0.0, 0.0), KF.K8V8: (0.006, 0.006), KF.K8V4: (0.006, 0.09)}


def _kv(h, n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn(d, generator=g) * 0.5)  # channel-wise key scales
    k = torch.randn(h, n, d, generator=g) * scale + torch.randn(d, generator=g)
    v = torch.randn(h, n, d, generator=g)
    return k.to(dtype), v.to(dtype)


def _rows(n_src, r, seed=0):
    return torch.randperm(n_src, generator=torch.Generator().manual_seed(seed))[:r]


def _elementwise_scales(p: KF.RunPayload) -> tuple[torch.Tensor, torch.Tensor]:
    blk = torch.arange(p.n_rows) // p.block_size
    gid = torch.arange(p.head_dim) // p.v_group
    return p.k_scale[:, blk].float(), p.v_scale[..., gid].float()


def test_interpreter_is_active():
    from triton.runtime.interpreter import InterpretedFunction

    assert INTERPRETED, "these tests expect TRITON_INTERPRET=1 (set above unless overridden)"
    assert isinstance(_quantize_gather_kernel, InterpretedFunction)
    assert isinstance(_dequantize_scatter_kernel, InterpretedFunction)


def test_tag_names_match_precision_policy():
    assert tuple(t.name for t in sorted(Tag)) == KF.FORMATS


# (heads, source rows, head_dim, run rows, tag, dtype, block_size, v_group)
GATHER_CASES = [
    (1, 40, 64, 32, KF.K8V4, torch.float32, 32, 32),  # one full block
    (3, 50, 80, 37, KF.K8V4, torch.float16, 32, 32),  # head_dim 80: groups 32+32+16; ends mid-block
    (2, 30, 128, 0, KF.K8V8, torch.float32, 32, 32),  # empty run
    (16, 20, 64, 5, KF.K8V8, torch.bfloat16, 32, 32),  # many heads, one partial block
    (4, 70, 256, 45, KF.K8V4, torch.float32, 32, 32),
    (2, 33, 80, 33, KF.K8V8, torch.float32, 16, 16),  # other block and group sizes
    (5, 12, 64, 7, KF.K8V4, torch.float32, 5, 64),  # non-power-of-two block
    (3, 25, 80, 19, KF.FP16, torch.float16, 32, 32),
]


@pytest.mark.parametrize("h,n,d,r,tag,dtype,bs,vg", GATHER_CASES)
def test_quantize_gather_triton_matches_reference(h, n, d, r, tag, dtype, bs, vg):
    k, v = _kv(h, n, d, dtype)
    rows = _rows(n, r)
    got = quantize_gather_triton(k, v, rows, tag, bs, vg)
    want = KR.reference_quantize_gather(k, v, rows, tag, bs, vg)
    assert got.tensors().keys() == want.tensors().keys()
    for name, t in want.tensors().items():
        assert got.tensors()[name].dtype == t.dtype and torch.equal(got.tensors()[name], t), name
    assert got.nbytes == want.nbytes and got.n_rows == r


def test_quantize_gather_reads_strided_sources():
    k, v = _kv(24, 3, 64)  # stored [N, H, D], viewed as [H, N, D]
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    rows = _rows(24, 21)
    got = quantize_gather_triton(k, v, rows, KF.K8V4)
    want = KR.reference_quantize_gather(k.contiguous(), v.contiguous(), rows, KF.K8V4)
    for name, t in want.tensors().items():
        assert torch.equal(got.tensors()[name], t), name


# (tag, head_dim, rows, rotary_dim, interleaved, payload dtype, destination dtype, zero delta)
SCATTER_CASES = [
    (KF.K8V4, 64, 37, 64, False, torch.float32, torch.float32, False),
    (KF.K8V4, 80, 21, 40, True, torch.float16, torch.float32, False),  # GLM-like partial interleaved
    (KF.K8V8, 128, 33, 128, False, torch.float16, torch.float16, False),
    (KF.K8V8, 256, 9, 64, False, torch.float32, torch.bfloat16, False),  # partial half layout
    (KF.FP16, 64, 40, 64, True, torch.float16, torch.float32, False),
    (KF.FP16, 80, 17, 80, False, torch.bfloat16, torch.bfloat16, False),
    (KF.K8V4, 64, 30, 64, False, torch.float32, torch.float32, True),  # all-zero delta: no rotation
    (KF.K8V8, 64, 12, 0, False, torch.float32, torch.float16, False),  # no RoPE
    (KF.K8V4, 64, 0, 64, False, torch.float32, torch.float32, False),  # empty run
    (KF.K8V4, 48, 25, 48, False, torch.float32, torch.float32, False),  # value groups 32 + 16
    (KF.K8V8, 112, 14, 112, True, torch.float16, torch.float32, False),  # value groups 32 x 3 + 16
]


@pytest.mark.parametrize("tag,d,r,rot,inter,pdt,ddt,zero", SCATTER_CASES)
def test_dequantize_scatter_triton_matches_reference(tag, d, r, rot, inter, pdt, ddt, zero):
    h, n_src, n_dst = 3, 48, 70
    k, v = _kv(h, n_src, d, pdt)
    p = KR.reference_quantize_gather(k, v, _rows(n_src, r), tag, 16)
    dst_rows = _rows(n_dst, r, seed=1)  # scattered, not block aligned
    delta = torch.zeros(r, dtype=torch.int64) if zero else torch.randint(-300, 4000, (r,))
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rot, 2).float() / rot)) if rot else None
    outs = []
    for fn in (KR.reference_dequantize_scatter, dequantize_scatter_triton, KT.torch_dequantize_scatter):
        dk, dv = torch.full((h, n_dst, d), 7.0, dtype=ddt), torch.full((h, n_dst, d), -7.0, dtype=ddt)
        fn(p, dk, dv, dst_rows, delta, inv_freq, interleaved=inter)
        outs.append((dk, dv))
    (rk, rv), (tk, tv), (ck, cv) = outs
    tol = KERNEL_TOL[ddt]
    for want, got in ((rk, tk), (rv, tv)):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(ck, rk) and torch.equal(cv, rv)  # the torch path: the oracle's bits
    untouched = torch.ones(n_dst, dtype=torch.bool)
    untouched[dst_rows] = False
    assert torch.all(tk[:, untouched] == 7.0) and torch.all(tv[:, untouched] == -7.0)


def _fragmented_rows(layout, r, seed=0):
    """Destination rows and shifts of a run: one aligned stretch, or stretches of mixed lengths."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        return torch.arange(r) + 5, torch.full((r,), 37)
    if layout == "shift_changes":  # consecutive destination rows, three shifts (per-row angles)
        i = torch.arange(r)
        return i + 2, torch.where(i < r // 3, 1000, torch.where(i < r // 2, -3, 7))
    lengths = {"long_and_short": [70, 12, 15, 20, 3, 44, 1, 2, 1, 61, 30, 5, 40],  # direct, copied, index_copy_
               "scattered": [1, 2, 1, 3, 1]}[layout]
    rows, shifts, pos = [], [], 0
    while len(rows) < r:
        for n in lengths:
            pos += int(torch.randint(1, 4, (1,), generator=g))
            rows += range(pos, pos + n)
            shifts += [int(torch.randint(-20, 500, (1,), generator=g))] * n
            pos += n
    return torch.tensor(rows[:r]), torch.tensor(shifts[:r])


@pytest.mark.parametrize("layout", ["contiguous", "shift_changes", "long_and_short", "scattered"])
@pytest.mark.parametrize("tag,pdt,ddt,inter", [
    (KF.K8V4, torch.float32, torch.float32, False),
    (KF.K8V8, torch.float16, torch.float32, True),
    (KF.FP16, torch.float16, torch.float32, False),
    (KF.K8V4, torch.float16, torch.bfloat16, False),
])
def test_dequantize_scatter_pieces(monkeypatch, layout, tag, pdt, ddt, inter):
    """The CPU path cuts a run into pieces (direct, copied per stretch, index_copy_'d); with small
    pieces every kind occurs, and the result must equal both the Triton kernel and the oracle."""
    monkeypatch.setattr(KT, "_PIECE_ELEMS", 2 * 64 * 48)  # 48-row pieces
    monkeypatch.setattr(KT, "_MIN_DIRECT_ROWS", 24)
    monkeypatch.setattr(KT, "_MIN_COPY_ROWS", 8)
    h, d, r, bs = 2, 64, 230, 16
    k, v = _kv(h, r + 20, d, pdt)
    p = KR.reference_quantize_gather(k, v, _rows(r + 20, r), tag, bs)
    dst_rows, delta = _fragmented_rows(layout, r)
    n_dst = int(dst_rows.max()) + 3
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))
    plan = KT._plan(dst_rows.numpy(), delta.numpy(), 48, bs)
    kinds = {"direct" if len(st) == 1 else "index_copy" if len(st) * 8 > r1 - r0 else "copy"
             for r0, r1, st, _ in plan}
    assert kinds == {"contiguous": {"direct"}, "shift_changes": {"direct"}, "scattered": {"index_copy"},
                     "long_and_short": {"direct", "copy", "index_copy"}}[layout], kinds
    assert any(not one_shift for *_, one_shift in plan) == (layout != "contiguous")
    outs = []
    for fn in (KT.torch_dequantize_scatter, dequantize_scatter_triton, KR.reference_dequantize_scatter):
        dk, dv = torch.full((h, n_dst, d), 7.0, dtype=ddt), torch.full((h, n_dst, d), -7.0, dtype=ddt)
        fn(p, dk, dv, dst_rows, delta, inv_freq, interleaved=inter)
        outs.append((dk, dv))
    tol = KERNEL_TOL[ddt]
    for dk, dv in outs[1:]:
        torch.testing.assert_close(dk.float(), outs[0][0].float(), rtol=tol, atol=tol)
        torch.testing.assert_close(dv.float(), outs[0][1].float(), rtol=tol, atol=tol)
    assert torch.equal(outs[0][0], outs[2][0]) and torch.equal(outs[0][1], outs[2][1])  # the oracle: same bits
    untouched = torch.ones(n_dst, dtype=torch.bool)
    untouched[dst_rows] = False
    assert torch.all(outs[0][0][:, untouched] == 7.0) and torch.all(outs[0][1][:, untouched] == -7.0)


def test_unpack4_inverts_pack4():
    q = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(KQ.unpack4(KQ.pack4(q)), q)
    assert torch.equal(KQ.unpack4(KQ.pack4(q[:, 1:4])), q[:, 1:4])  # strided input
    assert KQ.unpack4(torch.zeros(2, 0, 32, dtype=torch.uint8)).shape == (2, 0, 64)


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("tag", [KF.K8V8, KF.K8V4])
@pytest.mark.parametrize("d", [64, 80])
def test_round_trip_within_documented_bound(tag, d, use_triton):
    k, v = _kv(2, 45, d)
    rows = torch.arange(45)
    with dispatch.backend("triton" if use_triton else "torch"):
        p = dispatch.quantize_gather(k, v, rows, tag)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        dispatch.dequantize_scatter(p, dk, dv, rows, torch.zeros(45, dtype=torch.int64), None)
    sk, sv = _elementwise_scales(p)
    for x, x_hat, s in ((k, dk, sk), (v, dv, sv)):
        assert torch.all((x - x_hat).abs() <= s / 2 * (1 + 1e-5) + 1e-6 * x.abs())
    rel_k, rel_v = ((dk - k).norm() / k.norm()).item(), ((dv - v).norm() / v.norm()).item()
    assert rel_k <= ROUND_TRIP_REL[tag][0] and rel_v <= ROUND_TRIP_REL[tag][1], (rel_k, rel_v)


def test_bound_holds_on_hard_groups():
    """Constant channels, large offsets, tiny ranges, mixed signs: clamping never bites."""
    k = torch.tensor([[[1000.0, -3.0, 1e-6, 0.0], [1000.001, -3.0, -1e-6, 5.0], [999.99, -3.0, 0.0, -5.0]]])
    v = torch.tensor([[[1e4, 1e4 + 1, -2.0, 2.0], [0.0, 0.0, 0.0, 0.0], [-7.0, 1e-8, 3.0, 3.0]]])
    for tag in (KF.K8V8, KF.K8V4):
        p = KR.reference_quantize_gather(k, v, torch.arange(3), tag, v_group=2)
        k_hat, v_hat = KR.reference_dequantize(p)
        sk, sv = _elementwise_scales(p)
        assert torch.all((k - k_hat).abs() <= sk / 2 * (1 + 1e-5) + 1e-6 * k.abs())
        assert torch.all((v - v_hat).abs() <= sv / 2 * (1 + 1e-5) + 1e-6 * v.abs())
        got = quantize_gather_triton(k, v, torch.arange(3), tag, v_group=2)
        assert all(torch.equal(got.tensors()[n], t) for n, t in p.tensors().items())


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp16_tag_round_trip_is_bit_exact(dtype, use_triton):
    k, v = _kv(2, 30, 64, dtype)
    rows = _rows(30, 23)
    dst_rows = _rows(40, 23, seed=2)
    with dispatch.backend("triton" if use_triton else "torch"):
        p = dispatch.quantize_gather(k, v, rows, Tag.FP16)
        for ddt in {dtype, torch.float32}:  # same dtype, and widened to fp32
            dk, dv = torch.zeros(2, 40, 64, dtype=ddt), torch.zeros(2, 40, 64, dtype=ddt)
            dispatch.dequantize_scatter(p, dk, dv, dst_rows, torch.zeros(23, dtype=torch.int64), torch.ones(32))
            assert torch.equal(dk[:, dst_rows], k[:, rows].to(ddt))
            assert torch.equal(dv[:, dst_rows], v[:, rows].to(ddt))
    assert p.k_data.dtype == dtype and p.nbytes == 2 * 2 * 23 * 64 * k.element_size()


def _hf_rope_case(family):
    if family == "llama":  # half layout, full rotary
        cfg = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64, rope_theta=1e5)
        return modeling_llama.LlamaRotaryEmbedding(cfg), modeling_llama.apply_rotary_pos_emb, 64, False
    cfg = GlmConfig(hidden_size=160, num_attention_heads=2, num_key_value_heads=2, head_dim=80, partial_rotary_factor=0.5)
    return modeling_glm.GlmRotaryEmbedding(cfg), modeling_glm.apply_rotary_pos_emb, 80, True  # interleaved


@pytest.mark.parametrize("use_triton", [False, True])
@pytest.mark.parametrize("tag", [KF.FP16, KF.K8V8])
@pytest.mark.parametrize("family", ["llama", "glm"])
def test_rope_correction_matches_hf(family, tag, use_triton):
    """Rotate at p_old with HF, restore with the delta rotation, compare with HF at p_new."""
    emb, apply_rope, d, interleaved = _hf_rope_case(family)
    h, n = 2, 40
    k0, v = _kv(1, h * n, d, seed=3)
    k0 = k0.view(1, h, n, d)
    p_old = torch.arange(n) + 11
    delta = torch.where(torch.arange(n) < 25, 173, -9)  # two edited spans, two shifts
    p_new = p_old + delta

    def hf(pos):
        cos, sin = emb(k0, pos[None])
        return apply_rope(k0, k0, cos, sin)[1][0]

    k_old, k_new = hf(p_old), hf(p_new)
    with dispatch.backend("triton" if use_triton else "torch"):
        p = dispatch.quantize_gather(k_old, v.view(h, n, d), torch.arange(n), tag)
        dk, dv = torch.zeros(h, n + 200, d), torch.zeros(h, n + 200, d)
        dispatch.dequantize_scatter(p, dk, dv, p_new, delta, emb.inv_freq, interleaved=interleaved)
    # fp32 HF angles at position ~200 carry ~1e-5 error; quantized keys add at most one scale
    atol = 5e-5 if tag == KF.FP16 else p.k_scale.float().max().item()
    torch.testing.assert_close(dk[:, p_new], k_new, atol=atol, rtol=1e-5)
    assert torch.equal(dv[:, p_new], KR.reference_dequantize(p)[1])  # values never rotate


def test_per_channel_key_scaling_beats_per_token():
    """The documented choice: keys with outlier channels quantize better per channel (KIVI)."""
    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(128, generator=g) * 0.5)
    scale[[5, 17, 70, 81]] *= 20
    k = torch.randn(2, 256, 128, generator=g) * scale + torch.randn(128, generator=g) * 0.5
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, 128, 2).float() / 128))
    k = KRP.rope_delta_reference(k, torch.arange(256), inv_freq)  # cached keys are post-RoPE
    q, s, z = KQ.quantize_keys(k, 32)
    blk = torch.arange(256) // 32
    per_channel = (q.float() * s[:, blk].float() + z[:, blk].float() - k).norm() / k.norm()
    q, s, z = KQ.quantize_values(k, 8, 128)  # per token over all channels
    per_token = (q.float() * s.float() + z.float() - k).norm() / k.norm()
    assert per_channel * 2.5 < per_token, (per_channel, per_token)


def test_value_residual():
    v = torch.randn(3, 2, 50, 80, generator=torch.Generator().manual_seed(0))  # [L, H, N, D]
    e = KRS.value_residual_4bit(v)
    assert e.shape == (50,) and 0.05 < e.median() < 0.11
    per_layer = [KRS.value_residual_sq(v[i]) for i in range(3)]
    err, ref = sum(x[0] for x in per_layer), sum(x[1] for x in per_layer)
    torch.testing.assert_close((err / ref).sqrt(), e)
    _, v_hat = KR.reference_dequantize(KR.reference_quantize_gather(v[0], v[0], torch.arange(50), KF.K8V4))
    manual = (v_hat - v[0]).square().sum((0, 2)) / v[0].square().sum((0, 2))
    torch.testing.assert_close(KRS.value_residual_4bit(v[0]), manual.sqrt())
    assert torch.equal(KRS.value_residual_4bit(torch.zeros(2, 4, 32)), torch.zeros(4))


def test_nbytes_is_exact():
    k, v = _kv(3, 70, 80, torch.float16)
    rows = torch.arange(70)  # 3 blocks of 32 (last partial), 3 value groups
    meta = 3 * 3 * 80 * 2 * 2 + 3 * 70 * 3 * 2 * 2  # key (scale, zero) + value (scale, zero), fp16
    assert KR.reference_quantize_gather(k, v, rows, KF.K8V8).nbytes == 2 * 3 * 70 * 80 + meta
    assert KR.reference_quantize_gather(k, v, rows, KF.K8V4).nbytes == 3 * 70 * 80 + 3 * 70 * 40 + meta
    assert KR.reference_quantize_gather(k, v, rows, KF.FP16).nbytes == 2 * 3 * 70 * 80 * 2
    assert KR.reference_quantize_gather(k, v, rows[:0], KF.K8V4).nbytes == 0


def test_errors_name_the_problem(monkeypatch):
    k, v = _kv(2, 10, 64)
    with pytest.raises(ValueError, match="unknown precision tag"):
        dispatch.quantize_gather(k, v, torch.arange(3), "K2V2")
    with pytest.raises(ValueError, match="even head_dim"):
        dispatch.quantize_gather(k[..., :63], v[..., :63], torch.arange(3), KF.K8V4)
    with pytest.raises(ValueError, match="outside"):
        dispatch.quantize_gather(k, v, torch.tensor([0, 10]), KF.K8V8)
    p = dispatch.quantize_gather(k, v, torch.arange(3), KF.K8V8)
    no_shift = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="dst_k must be"):
        dispatch.dequantize_scatter(p, torch.zeros(3, 5, 64), torch.zeros(3, 5, 64), torch.arange(3), no_shift, None)
    with pytest.raises(ValueError, match="dst_rows span"):
        dispatch.dequantize_scatter(p, torch.zeros(2, 5, 64), torch.zeros(2, 5, 64), torch.tensor([0, 1, 5]), no_shift, None)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with dispatch.backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.quantize_gather(k, v, torch.arange(3), KF.K8V8)


def test_backend_selection(monkeypatch):
    assert dispatch.get_backend() in dispatch.BACKENDS
    monkeypatch.setenv("PATCHKV_KERNELS", "torch")
    assert dispatch.get_backend() == "torch"
    with dispatch.backend("triton"):
        assert dispatch.get_backend() == "triton"
    assert dispatch.get_backend() == "torch"
    monkeypatch.setenv("PATCHKV_KERNELS", "cuda")
    with pytest.raises(ValueError, match="PATCHKV_KERNELS"):
        dispatch.get_backend()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
class TestCuda:
    """Compiled kernels (run with TRITON_INTERPRET=0) on CUDA against the CPU references.

    fp32 division may round differently on the GPU, so a code may differ by one step: decoded
    values agree within one scale, FP16 runs exactly.
    """

    @pytest.mark.parametrize("tag", KF.FORMATS)
    def test_round_trip_against_cpu_reference(self, tag):
        k, v = _kv(4, 100, 128, torch.float16)
        rows, dst_rows = _rows(100, 77), _rows(120, 77, seed=1)
        delta = torch.randint(-50, 5000, (77,))
        inv_freq = 1.0 / (1e4 ** (torch.arange(0, 128, 2).float() / 128))
        p = dispatch.quantize_gather(k.cuda(), v.cuda(), rows.cuda(), tag).to("cpu")
        dk = torch.zeros(4, 120, 128, dtype=torch.float16, device="cuda")
        dv = torch.zeros_like(dk)
        dispatch.dequantize_scatter(p, dk, dv, dst_rows, delta, inv_freq.cuda())
        want = KR.reference_quantize_gather(k, v, rows, tag)
        rk, rv = torch.zeros(4, 120, 128, dtype=torch.float16), torch.zeros(4, 120, 128, dtype=torch.float16)
        KR.reference_dequantize_scatter(want, rk, rv, dst_rows, delta, inv_freq)
        if tag == KF.FP16:
            tol_k = tol_v = 2e-3
        else:
            tol_k, tol_v = want.k_scale.float().max().item() + 2e-3, want.v_scale.float().max().item() + 2e-3
        torch.testing.assert_close(dk.cpu().float(), rk.float(), atol=tol_k, rtol=1e-3)
        torch.testing.assert_close(dv.cpu().float(), rv.float(), atol=tol_v, rtol=1e-3)

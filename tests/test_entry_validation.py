"""A store entry is hostile even when its checksums are consistent, and K/V beyond the fp16 range never
break a checkpoint.

- An entry whose header fields disagree with its blob table (a group size or block size of 0, a row count
  larger than the blobs, a truncated scale blob, K4V4 data labelled as another format, row indices out of
  range, K/V of another shape than the model's) is refused by the codec before any tensor op (no SIGFPE in
  the native kernel, no read past its buffers, no ValueError / IndexError out of ``resume_from_store``),
  quarantined, and the resume is exact with the reason in ``stats["fallback"]``;
- the native library checks its arguments (a job with a block size of 0 or rows past its buffers returns
  an error code), and the native and torch paths refuse the same payloads with the same ``ValueError``;
- a model whose activations exceed the fp16 range still checkpoints, and non-finite values in a forward
  are reported.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from patchkv_agent.core.checkpoint import quantize_mixed
from patchkv_agent.core.fallback import FallbackKind
from patchkv_agent.core.precision import Tag
from benchmarks.entry_fuzz import editable, reseal
from benchmarks.tiny import tiny_engine
from patchkv_agent.kernels import backend, dequantize_scatter, native
from patchkv_agent.kernels import reference as KR
from patchkv_agent.runtime.kvstore import CorruptCheckpoint, DiskStore, decode_checkpoint, resume_from_store

HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None
TAGS = np.array([Tag.K4V4, Tag.K8V4, Tag.K8V8, Tag.FP16, Tag.K4V4, Tag.K8V8], dtype=np.int8)


@pytest.fixture(scope="module")
def base(engine):
    """A checkpoint of 48 tokens whose mixed runs hold every format (K4V4 included), and an edited context."""
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 200, 48).tolist()
    ckpt = engine.checkpoint(ids)
    mixed = quantize_mixed(ckpt.keys, ckpt.values, TAGS, block_size=8)
    ckpt = dataclasses.replace(ckpt, mixed=mixed)
    new = ids[:20] + [5, 6, 7] + ids[22:]
    exact = engine.resume(None, new, strategy="exact", max_new_tokens=2)
    return ckpt, new, exact


def _stored(tmp_path, ckpt):
    store = DiskStore(tmp_path / "store", deployment="dep")
    key = store.key_for(ckpt, thread_id="t", version=1)
    store.put(key, ckpt)
    return store, key


def _plant(store, key, meta, blobs):
    store._write(key, meta, blobs, None)  # the tier's own publish: what a hostile writer can do


def _truncate(meta, blobs, name, dim, size):
    spec = next(s for s in meta["blobs"] if s["name"] == name)
    arr = blobs[name]
    if spec["kind"] == "torch":
        t = torch.from_numpy(arr.copy()).view(getattr(torch, spec["dtype"])).reshape(spec["shape"])
        idx = [slice(None)] * t.dim()
        idx[dim] = slice(0, size)
        t = t[tuple(idx)].contiguous()
        blobs[name] = t.reshape(-1).view(torch.uint8).numpy().copy()
        spec["shape"] = list(t.shape)
    else:
        a = arr.view(np.dtype(spec["dtype"])).reshape(spec["shape"])
        idx = [slice(None)] * a.ndim
        idx[dim] = slice(0, size)
        a = np.ascontiguousarray(a[tuple(idx)])
        blobs[name] = a.reshape(-1).view(np.uint8)
        spec["shape"] = list(a.shape)


def _set_rows(meta, blobs, tag, index, value):
    rows = blobs[f"mixed.rows.{tag}"].view(np.int64).copy()
    rows[index] = value
    blobs[f"mixed.rows.{tag}"] = rows.view(np.uint8)


def _header(field, value, tag="K8V4", layer=0):
    def edit(meta, blobs):
        meta["mixed"]["headers"][layer][tag][field] = value
    return edit


HOSTILE = {
    "v_group_0": _header("v_group", 0),
    "v_group_0_k4v4": _header("v_group", 0, "K4V4"),
    "block_size_0": _header("block_size", 0, "K8V8", 1),
    "v_group_not_power_of_two": _header("v_group", 12),
    "n_rows_beyond_blobs": _header("n_rows", 4000),
    "n_rows_below_blobs": _header("n_rows", 3),
    "head_dim_beyond_blobs": _header("head_dim", 64, "K4V4"),
    "heads_beyond_blobs": _header("num_kv_heads", 9, "FP16"),
    "mixed_block_size_0": lambda m, b: m["mixed"].__setitem__("block_size", 0),
    "truncated_k_scale": lambda m, b: _truncate(m, b, "p.0.K8V8.k_scale", 1, 0),
    "truncated_v_scale": lambda m, b: _truncate(m, b, "p.1.K4V4.v_scale", 2, 0),
    "truncated_v_data": lambda m, b: _truncate(m, b, "p.0.K8V4.v_data", 1, 3),
    "row_index_past_the_end": lambda m, b: _set_rows(m, b, "K8V8", -1, 10_000),
    "row_index_negative": lambda m, b: _set_rows(m, b, "K8V4", 0, -3),
    "rows_not_the_tag_rows": lambda m, b: _set_rows(m, b, "K8V8", 0, 9),
    "kv_of_another_shape": lambda m, b: [_truncate(m, b, f"{kv}.{i}", 2, 8) for i in range(2) for kv in "kv"],
}


def _swap_tags(meta, blobs, a, b):
    """Exchange the labels of two formats' runs (each run's data then carries the other's label)."""
    m = meta["mixed"]
    tmp = "__swap__"
    for old, new in ((a, tmp), (b, a), (tmp, b)):
        m["tags"] = [new if t == old else t for t in m["tags"]]
        for layer in m["headers"]:
            hdr = layer.pop(old)
            hdr["tag"] = new
            layer[new] = hdr
        for layer in m["checksums"]:
            layer[new] = layer.pop(old)
        for name in list(blobs):
            parts = name.split(".")
            if name == f"mixed.rows.{old}" or (parts[0] == "p" and parts[2] == old):
                blobs[name.replace(f".{old}", f".{new}")] = blobs.pop(name)
        for spec in meta["blobs"]:
            parts = spec["name"].split(".")
            if spec["name"] == f"mixed.rows.{old}" or (parts[0] == "p" and parts[2] == old):
                spec["name"] = spec["name"].replace(f".{old}", f".{new}")
    ca, cb = int(Tag[a]), int(Tag[b])
    m["runs"] = [[cb if r[0] == ca else ca if r[0] == cb else r[0], r[1], r[2]] for r in m["runs"]]
    tags = blobs["mixed.tags"].view(np.int8).copy()
    tags = np.where(tags == ca, cb, np.where(tags == cb, ca, tags)).astype(np.int8)
    blobs["mixed.tags"] = tags.view(np.uint8)


HOSTILE["k4v4_labelled_k8v4"] = lambda m, b: _swap_tags(m, b, "K4V4", "K8V4")
HOSTILE["k8v8_labelled_k4v4"] = lambda m, b: _swap_tags(m, b, "K8V8", "K4V4")


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_entry_with_consistent_checksums_is_quarantined_and_resumes_exactly(engine, base, tmp_path, case):
    ckpt, new, exact = base
    store, key = _stored(tmp_path, ckpt)
    meta, blobs = editable(ckpt, key)
    HOSTILE[case](meta, blobs)
    reseal(meta, blobs)
    _plant(store, key, meta, blobs)
    with pytest.raises(CorruptCheckpoint):  # the codec alone refuses it, before any tensor is built
        decode_checkpoint(meta, {k: v.tobytes() for k, v in blobs.items()}, key)
    for b in (["torch", "native"] if HAVE_CC else ["torch"]):
        with backend(b):
            res = resume_from_store(engine, store, key, new, max_new_tokens=2)
        fb = res.stats["fallback"]
        assert fb is not None and fb.kind in (FallbackKind.CORRUPT_CHECKPOINT, FallbackKind.MISSING), fb
        assert torch.equal(res.logits, exact.logits) and res.output_ids == exact.output_ids
    assert store.stats.quarantined == 1
    assert "quarantined" in str(res.stats["fallback"])  # the second resume names why the entry is gone


def test_the_untampered_entry_still_resumes_from_every_format(engine, base, tmp_path):
    ckpt, new, exact = base
    store, key = _stored(tmp_path, ckpt)
    meta, blobs = editable(ckpt, key)
    reseal(meta, blobs)  # resealing an intact entry changes nothing
    _plant(store, key, meta, blobs)
    res = resume_from_store(engine, store, key, new, max_new_tokens=2)
    assert res.stats["fallback"] is None and res.stats["restore_tokens"] > 0
    assert store.stats.quarantined == 0


# ------------------------------------------------------------------ kernels: the same refusal on both paths


def _payload(tag="K8V4", r=20, d=16):
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, r, d, generator=g), torch.randn(2, r, d, generator=g)
    return KR.reference_quantize_gather(k, v, torch.arange(r), tag, 8, 32)


BAD_PAYLOADS = {
    "v_group_0": lambda p: dataclasses.replace(p, v_group=0),
    "block_size_0": lambda p: dataclasses.replace(p, block_size=0),
    "n_rows_beyond_data": lambda p: dataclasses.replace(p, n_rows=p.n_rows + 5),
    "short_k_scale": lambda p: dataclasses.replace(p, k_scale=p.k_scale[:, :1].contiguous()),
    "short_v_zero": lambda p: dataclasses.replace(p, v_zero=p.v_zero[:, :3].contiguous()),
    "k4v4_data_as_k8v4": lambda p: dataclasses.replace(_payload("K4V4"), tag="K8V4"),
    "k8v4_data_as_k4v4": lambda p: dataclasses.replace(p, tag="K4V4"),
    "missing_scales": lambda p: dataclasses.replace(p, k_scale=None),
}


@pytest.mark.parametrize("case", sorted(BAD_PAYLOADS))
def test_native_and_torch_refuse_an_inconsistent_payload_alike(case):
    p = BAD_PAYLOADS[case](_payload())
    paths = ["torch", "native"] if HAVE_CC and native.available() else ["torch"]
    for b in paths:
        dk, dv = torch.zeros(2, 30, 16), torch.zeros(2, 30, 16)
        r = p.n_rows
        with backend(b), pytest.raises(ValueError, match="payload"):
            dequantize_scatter(p, dk, dv, torch.arange(r), torch.full((r,), 2), None)
        assert not dk.any() and not dv.any()  # nothing written


_NATIVE_PROBE = r"""
import ctypes, sys, torch
from patchkv_agent.kernels import native
from patchkv_agent.kernels import reference as KR
lib = native._library()
g = torch.Generator().manual_seed(1)
k, v = torch.randn(2, 20, 16, generator=g), torch.randn(2, 20, 16, generator=g)
p = KR.reference_quantize_gather(k, v, torch.arange(20), "K8V8", 8, 32)
dk, dv = torch.zeros(2, 30, 16), torch.zeros(2, 30, 16)
rows = torch.arange(20)
case = sys.argv[1]
j = native._Job(tag=1, H=2, D=16, block_size=8, v_group=16, R=20, M=20)
for name in ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero"):
    setattr(j, name, getattr(p, name).data_ptr())
j.dst_rows = rows.data_ptr()
j.dst_k, j.dst_v = dk.data_ptr(), dv.data_ptr()
j.dk_sh, j.dk_sr, j.dv_sh, j.dv_sr = 30 * 16, 16, 30 * 16, 16
native._set_sizes(j, p, dst_rows=30, angles=0, dst_k=dk, dst_v=dv)
if case == "block_size_0":
    j.block_size = 0
elif case == "rows_past_the_payload":
    j.R = 4
elif case == "dst_row_past_the_end":
    rows[3] = 10_000
elif case == "head_dim_1025":
    j.D = 1025
starts = (ctypes.c_int64 * 2)()
rc = lib.pkv_restore(ctypes.byref(j), 1, 1, starts)
print("rc", rc, "written", bool(dk.any()))
"""


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the native library is not built")
@pytest.mark.parametrize("case", ["block_size_0", "rows_past_the_payload", "dst_row_past_the_end", "head_dim_1025"])
def test_the_native_library_checks_its_own_arguments(case):
    # in a subprocess: unchecked, these would kill the process (SIGFPE) or write past the destination
    proc = subprocess.run([sys.executable, "-c", _NATIVE_PROBE, case], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(__file__)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rc = int(proc.stdout.split()[1])
    assert rc < -1 and native.error_text(rc), proc.stdout  # an error code naming the argument, nothing run
    assert "written False" in proc.stdout


@pytest.mark.parametrize("shape", ["layers", "heads", "head_dim", "dtype"])
def test_a_consistent_entry_that_does_not_fit_the_model_is_quarantined(engine, base, tmp_path, shape):
    # every field agrees with every other and with the blob table, and it carries this model's fingerprint:
    # only the model's own shape can refuse it (before, the recovery raised IndexError / RuntimeError)
    ckpt, new, exact = base
    layers, h, d = len(ckpt.keys), ckpt.keys[0].shape[0], ckpt.keys[0].shape[2]
    layers, h, d = {"layers": (layers + 1, h, d), "heads": (layers, h + 1, d), "head_dim": (layers, h, d // 2),
                    "dtype": (layers, h, d)}[shape]
    g = torch.Generator().manual_seed(3)
    dtype = torch.float16 if shape == "dtype" else torch.float32
    keys = [torch.randn(h, len(ckpt), d, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(h, len(ckpt), d, generator=g).to(dtype) for _ in range(layers)]
    other = dataclasses.replace(ckpt, keys=keys, values=values,
                                mixed=quantize_mixed(keys, values, TAGS, block_size=8))
    store, key = _stored(tmp_path, other)
    res = resume_from_store(engine, store, key, new, max_new_tokens=2)
    fb = res.stats["fallback"]
    if shape == "dtype":  # K/V of another float dtype fit (restores cast on write): not refused
        assert fb is None
        return
    assert fb is not None and fb.kind is FallbackKind.CORRUPT_CHECKPOINT and "does not fit" in str(fb), fb
    assert torch.equal(res.logits, exact.logits) and res.output_ids == exact.output_ids
    assert store.stats.quarantined == 1


# ------------------------------------------------------------------ item 5: K/V beyond the fp16 range


def _loud_engine(factor):
    e = tiny_engine(seed=0)
    with torch.no_grad():  # layer 1's values (and so its attention output) far beyond fp16, or overflowing fp32
        e.model.model.layers[1].self_attn.v_proj.weight.mul_(factor)
    return e


@pytest.mark.parametrize("factor", [1e5, 1e38])
def test_checkpoint_never_raises_for_kv_beyond_fp16_and_keeps_those_blocks_full(factor):
    e = _loud_engine(factor)
    rng = np.random.default_rng(7)
    ids = rng.integers(3, 200, 48).tolist()
    ckpt = e.checkpoint(ids)  # activations past fp16 checkpoint (no ValueError "resid must be finite and non-negative")
    v = ckpt.values[1]
    unsafe = (~torch.isfinite(v) | (v.abs() > 6e4)).any(2).any(0).numpy()
    assert unsafe.any()
    blocks = np.unique(np.flatnonzero(unsafe) // 8)
    assert (ckpt.mixed.tags[blocks] == Tag.FP16).all()  # held at the source precision (fp32), never quantized
    assert ckpt.provenance.kept_full_tokens == int(np.isin(np.arange(48) // 8, blocks).sum())
    for layer in ckpt.mixed.payloads:  # every quantized payload is finite: nothing overflowed into a scale
        for tag, p in layer.items():
            if tag != "FP16":
                assert all(bool(torch.isfinite(t.float()).all()) for t in p.tensors().values()), tag
    new = ids[:20] + [5, 6, 7] + ids[22:]
    res = e.resume(ckpt, new, max_new_tokens=2)
    exact = e.resume(None, new, strategy="exact", max_new_tokens=2)
    nonfinite = int((~torch.isfinite(exact.logits)).sum()) + sum(
        int((~torch.isfinite(x)).sum()) for x in exact.keys + exact.values)
    assert exact.stats["nonfinite_values"] == nonfinite  # every value of the exact forward is its own
    assert (nonfinite > 0) == (factor > 1e30)
    assert res.stats["nonfinite_values"] >= 0 and (res.stats["nonfinite_values"] > 0) == (factor > 1e30)
    if factor < 1e30:  # finite K/V beyond fp16: restored from the fp32 rows, no overflowed scale turns them NaN
        assert res.stats["fallback"] is None and res.stats["restore_tokens"] > 0
        assert bool(torch.isfinite(res.logits).all())

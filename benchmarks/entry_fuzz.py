"""A structure-aware fuzzer of stored checkpoint entries: hostile headers under consistent checksums.

A store entry is a metadata dict and named blobs (:mod:`patchkv_agent.runtime.kvstore.codec`). A writer with
access to a shared tier can store any entry whose checksums it computed itself, so checksums prove
nothing about intent. This module builds such entries: it starts from a genuine entry holding every
format (K4V4 included), applies random structural edits (header fields, blob shapes and dtypes, row
indices, block tags, runs, format labels, missing or extra blobs) and :func:`reseal` s the result (every
blob's length and xxh3, every run payload checksum, the metadata checksum), so only the codec's structural
checks stand between the entry and the kernels.

:func:`check_entry` is the oracle of one example: the codec refuses the entry with
:class:`~patchkv_agent.core.checkpoint.CorruptCheckpoint`, or it accepts it and then every (layer, format)
run restores on the torch and native paths without an exception and with bit-identical results; and the
native library, handed the raw hostile header with honest buffer sizes (no Python check in between),
returns 0 or an error code. Anything else (another exception, a difference, a crash, a sanitizer report)
is a failure. :func:`run_fuzz` drives it with Hypothesis; :func:`run_fuzz_asan` runs the same in a
subprocess whose native library is built with AddressSanitizer (``tests/test_entry_fuzz.py`` in CI,
``patchkv-agent stress --fuzz`` for longer runs).

Needs the test extra (``pip install 'patchkv-agent[test]'``) for Hypothesis; knows the codec, the
kernels and the native library; nothing about engines or models.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import numpy as np
import xxhash

from patchkv_agent.runtime.kvstore.codec import CheckpointKey, encode_checkpoint, meta_checksum

_PAYLOAD_FIELDS = ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero")


def editable(ckpt, key: CheckpointKey) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """The entry of ``ckpt`` under ``key`` as a deep-copied metadata dict and private uint8 blob arrays.

    Returns:
        ``(meta, blobs)`` to edit in place, then :func:`reseal`.
    """
    meta, blobs = encode_checkpoint(ckpt, key)
    return json.loads(json.dumps(meta)), {k: np.array(v, dtype=np.uint8, copy=True) for k, v in blobs.items()}


def _payload_sum(hdr: dict, blobs: dict[str, np.ndarray], layer: int, tag: str) -> int:
    """What ``core.checkpoint.payload_checksum`` gives for the payload these header and blobs decode to."""
    h = xxhash.xxh3_64()
    h.update(f"{hdr.get('tag')}:{hdr.get('n_rows')}:{hdr.get('num_kv_heads')}:{hdr.get('head_dim')}:"
             f"{hdr.get('block_size')}:{hdr.get('v_group')}".encode())
    for f in _PAYLOAD_FIELDS:
        raw = blobs.get(f"p.{layer}.{tag}.{f}")
        if raw is not None:
            h.update(f.encode())
            h.update(raw.tobytes())
    return h.intdigest()


def reseal(meta: dict[str, Any], blobs: dict[str, np.ndarray]) -> None:
    """Make an edited entry's checksums consistent again (in place), as a hostile writer would.

    Every blob-table row gets its blob's xxh3 (its ``nbytes`` stays what its shape and dtype make, so a
    blob whose bytes disagree with its row is still refused as a wrong length), every run payload its
    checksum, and the metadata its own checksum.
    """
    for spec in meta.get("blobs", []):
        raw = blobs.get(spec.get("name")) if isinstance(spec, dict) else None
        if raw is not None:
            spec["xxh3"] = xxhash.xxh3_64_hexdigest(raw.tobytes())
            if isinstance(spec.get("nbytes"), int):
                spec["nbytes"] = int(raw.nbytes)
    m = meta.get("mixed")
    if isinstance(m, dict) and isinstance(m.get("headers"), list) and isinstance(m.get("checksums"), list):
        for i, (layer, sums) in enumerate(zip(m["headers"], m["checksums"])):
            if isinstance(layer, dict) and isinstance(sums, dict):
                for tag, hdr in layer.items():
                    if tag in sums and isinstance(hdr, dict):
                        sums[tag] = _payload_sum(hdr, blobs, i, tag)
    meta["meta_xxh3"] = meta_checksum(meta)


def deep_copy(meta: dict[str, Any], blobs: dict[str, np.ndarray]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Independent copies of an editable entry."""
    return copy.deepcopy(meta), {k: v.copy() for k, v in blobs.items()}


# ------------------------------------------------------------------ genuine entries to start from

BASE_TAGS = (-1, 0, 1, 2, -1, 1)  # every format, K4V4 included (precision.Tag codes, one per block)


def base_entries(seed: int = 0) -> list[tuple[Any, dict[str, Any], dict[str, np.ndarray], CheckpointKey]]:
    """Two genuine entries (fp32 and fp16 K/V; blocks of 4 and 8 tokens, the last one partial) whose mixed
    runs hold every format: ``(checkpoint, meta, blobs, key)`` each."""
    import torch

    from patchkv_agent.core.checkpoint import Checkpoint, quantize_mixed

    out = []
    for i, (bs, dtype) in enumerate(((4, torch.float32), (8, torch.float16))):
        g = torch.Generator().manual_seed(seed * 10 + i)
        nb = len(BASE_TAGS)
        n = nb * bs - 1
        keys = [torch.randn(2, n, 8, generator=g).to(dtype) for _ in range(2)]
        values = [torch.randn(2, n, 8, generator=g).to(dtype) for _ in range(2)]
        mixed = quantize_mixed(keys, values, np.array(BASE_TAGS, dtype=np.int8), block_size=bs)
        ids = np.random.default_rng(seed + i).integers(0, 200, n).astype(np.int64)
        ckpt = Checkpoint(token_ids=ids, keys=keys, values=values, fingerprint="llama:fuzz",
                          scores=np.full(n, 1.0 / n, dtype=np.float32), mixed=mixed)
        key = CheckpointKey.of(ckpt, deployment="fuzz", thread_id=f"t{i}", version=1)
        meta, blobs = editable(ckpt, key)
        out.append((ckpt, meta, blobs, key))
    return out


# ------------------------------------------------------------------ structural edits

_HEADER_FIELDS = ("n_rows", "num_kv_heads", "head_dim", "block_size", "v_group")
_EDGES = (0, 1, 2, 3, 4, 7, 8, 9, 16, 31, 32, 33, 64, 1023, 1024, 1025, 2**31 - 1, 2**31, 2**32, 2**40, 2**62)
_SAME_SIZE = {"float16": ("bfloat16", "int16"), "bfloat16": ("float16", "int16"), "int16": ("float16",),
              "uint8": ("int8", "bool"), "int8": ("uint8",), "bool": ("uint8",), "float32": ("int32",),
              "int32": ("float32",), "int64": ("float64",), "float64": ("int64",)}
_ITEM = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
         "uint8": 1, "bool": 1}


def _spec(meta, name):
    return next((s for s in meta["blobs"] if s["name"] == name), None)


def _rename_everywhere(meta, blobs, old, new):
    m = meta["mixed"]
    m["tags"] = [new if t == old else t for t in m["tags"]]
    for seq in (m["headers"], m["checksums"]):
        for layer in seq:
            if old in layer:
                layer[new] = layer.pop(old)
                if isinstance(layer[new], dict) and "tag" in layer[new]:
                    layer[new]["tag"] = new
    for name in list(blobs):
        parts = name.split(".")
        if name == f"mixed.rows.{old}" or (parts[0] == "p" and len(parts) == 4 and parts[2] == old):
            nn = f"mixed.rows.{new}" if parts[0] == "mixed" else f"p.{parts[1]}.{new}.{parts[3]}"
            blobs[nn] = blobs.pop(name)
            _spec(meta, name)["name"] = nn


def _swap_labels(meta, blobs, a, b):
    """Each of two formats' runs carries the other's label (data, scales and rows unchanged)."""
    from patchkv_agent.core.precision import Tag

    for old, new in ((a, "__x__"), (b, a), ("__x__", b)):
        _rename_everywhere(meta, blobs, old, new)
    ca, cb = int(Tag[a]), int(Tag[b])
    m = meta["mixed"]
    m["runs"] = [[cb if r[0] == ca else ca if r[0] == cb else r[0], r[1], r[2]] for r in m["runs"]]
    t = blobs["mixed.tags"].view(np.int8)
    blobs["mixed.tags"] = np.where(t == ca, cb, np.where(t == cb, ca, t)).astype(np.int8).view(np.uint8)


def apply_edit(meta: dict[str, Any], blobs: dict[str, np.ndarray], edit: tuple) -> None:
    """Apply one structural edit (see :func:`edits`) in place; an edit that does not apply is a no-op."""
    kind, *a = edit
    m = meta.get("mixed")
    names = sorted(blobs)
    if kind == "header" and m:
        layer = m["headers"][a[0] % len(m["headers"])]
        tag = sorted(layer)[a[1] % len(layer)] if layer else None
        if tag:
            layer[tag][_HEADER_FIELDS[a[2] % len(_HEADER_FIELDS)]] = a[3]
    elif kind == "block_size" and m:
        m["block_size"] = a[0]
    elif kind == "n_layers":
        meta["n_layers"] = a[0]
    elif kind in ("truncate", "permute", "dtype", "kind", "drop"):
        name = names[a[0] % len(names)]
        spec = _spec(meta, name)
        shape = spec["shape"]
        if kind == "truncate" and shape:
            d = a[1] % len(shape)
            new = min(shape[d] - 1, a[2] % (shape[d] + 1)) if shape[d] else 0
            arr = blobs[name].view(np.uint8).reshape(*shape, _ITEM[spec["dtype"]]) if np.prod(shape) else None
            if arr is not None and new >= 0:
                idx = [slice(None)] * arr.ndim
                idx[d] = slice(0, new)
                blobs[name] = np.ascontiguousarray(arr[tuple(idx)]).reshape(-1)
                shape[d] = new
                spec["nbytes"] = int(blobs[name].nbytes)
        elif kind == "permute" and len(shape) >= 2:
            i, j = a[1] % len(shape), a[2] % len(shape)
            shape[i], shape[j] = shape[j], shape[i]  # same bytes read as another shape
        elif kind == "dtype":
            alts = _SAME_SIZE.get(spec["dtype"], ())
            if alts:
                spec["dtype"] = alts[a[1] % len(alts)]
        elif kind == "kind":
            spec["kind"] = "numpy" if spec["kind"] == "torch" else "torch"
        elif kind == "drop" and name.startswith(("p.", "mixed.rows", "scores")):
            del blobs[name]
            meta["blobs"].remove(spec)
    elif kind == "rows" and m and m["tags"]:
        tag = m["tags"][a[0] % len(m["tags"])]
        r = blobs[f"mixed.rows.{tag}"].view(np.int64).copy()
        if r.size:
            r[a[1] % r.size] = a[2]
            blobs[f"mixed.rows.{tag}"] = r.view(np.uint8)
    elif kind == "block_tag" and m:
        t = blobs["mixed.tags"].view(np.int8).copy()
        if t.size:
            t[a[0] % t.size] = a[1]
            blobs["mixed.tags"] = t.view(np.uint8)
    elif kind == "run" and m and m["runs"]:
        m["runs"][a[0] % len(m["runs"])][a[1] % 3] = a[2]
    elif kind == "swap" and m and len(m["tags"]) >= 2:
        tags = m["tags"]
        x, y = tags[a[0] % len(tags)], tags[a[1] % len(tags)]
        if x != y:
            _swap_labels(meta, blobs, x, y)
    elif kind == "relabel" and m and m["tags"]:
        from patchkv_agent.core.precision import Tag

        old = m["tags"][a[0] % len(m["tags"])]
        new = Tag(a[1]).name
        if new not in m["tags"]:
            _rename_everywhere(meta, blobs, old, new)
    elif kind == "add_scale" and m:
        layer = a[0] % len(m["headers"])
        if "FP16" in m["headers"][layer]:
            src = next((s for s in meta["blobs"] if s["name"].endswith(".k_scale")), None)
            if src is not None:
                name = f"p.{layer}.FP16.{('k_scale', 'v_zero')[a[1] % 2]}"
                if name not in blobs:
                    blobs[name] = blobs[src["name"]].copy()
                    meta["blobs"].append({**src, "name": name, "shape": list(src["shape"])})


def edits():
    """The Hypothesis strategy of one structural edit (a tuple for :func:`apply_edit`)."""
    from hypothesis import strategies as st

    small = st.integers(0, 63)
    value = st.one_of(st.sampled_from(_EDGES), st.integers(0, 80), st.integers(-3, -1))
    return st.one_of(
        st.tuples(st.just("header"), small, small, small, value),
        st.tuples(st.just("block_size"), value),
        st.tuples(st.just("n_layers"), st.integers(0, 4)),
        st.tuples(st.sampled_from(["truncate", "permute", "dtype", "kind", "drop"]), small, small, small),
        st.tuples(st.just("rows"), small, small, st.one_of(st.integers(-3, 60), st.sampled_from([2**31, 2**62]))),
        st.tuples(st.just("block_tag"), small, st.sampled_from([-128, -2, -1, 0, 1, 2, 3, 127])),
        st.tuples(st.just("run"), small, small, st.one_of(st.integers(-1, 12), st.sampled_from([-128, 2**31]))),
        st.tuples(st.just("swap"), small, small),
        st.tuples(st.just("relabel"), small, st.sampled_from([-1, 0, 1, 2])),
        st.tuples(st.just("add_scale"), small, small),
    )


# ------------------------------------------------------------------ the oracle of one example


def _bits(t):
    import torch

    return t.contiguous().view(torch.int32)


def _restore_both(ckpt) -> None:
    """Restore every (layer, format) run of an accepted entry on every CPU path; they must agree bit for bit."""
    import torch

    from patchkv_agent.kernels import backend, dequantize_scatter, native
    from patchkv_agent.kernels.reference import reference_dequantize_scatter

    m, n = ckpt.mixed, len(ckpt)
    paths = ["torch", "native"] if native.available() else ["torch"]
    for layer in range(len(m.payloads)):
        for tag, rows in m.tag_rows.items():
            p = m.verify(layer, tag)
            h, d = p.num_kv_heads, p.head_dim
            inv = 1.0 / (10000.0 ** (torch.arange(0, d - d % 2, 2, dtype=torch.float32) / max(d, 1))) if d >= 2 else None
            for sel in (None, torch.arange(0, p.n_rows, 2)):
                m_rows = p.n_rows if sel is None else sel.numel()
                dst = torch.from_numpy(np.asarray(rows, dtype=np.int64)[: p.n_rows] + 3)
                dst = dst if sel is None else dst[sel]
                delta = torch.full((m_rows,), 3)
                outs = []
                for b in paths:
                    dk, dv = torch.zeros(h, n + 3, d), torch.zeros(h, n + 3, d)
                    with backend(b):
                        dequantize_scatter(p, dk, dv, dst, delta, inv, src_rows=sel)
                    outs.append((dk, dv))
                if sel is None:  # the oracle of both
                    dk, dv = torch.zeros(h, n + 3, d), torch.zeros(h, n + 3, d)
                    reference_dequantize_scatter(p, dk, dv, dst, delta, inv)
                    outs.append((dk, dv))
                for dk, dv in outs[1:]:
                    if not (torch.equal(_bits(dk), _bits(outs[0][0])) and torch.equal(_bits(dv), _bits(outs[0][1]))):
                        raise AssertionError(f"restore paths disagree on the {tag} run of layer {layer}")


def _raw_native(meta, blobs) -> int:
    """Hand every hostile run header to ``pkv_restore`` as it stands, with honest buffer bounds and no Python
    check in between; returns the number of jobs it refused (a crash or a sanitizer report is the failure)."""
    import ctypes

    import torch

    from patchkv_agent.kernels import native

    lib = native._library()
    m = meta.get("mixed")
    if lib is None or not isinstance(m, dict) or not isinstance(m.get("headers"), list):
        return 0
    codes = {"FP16": 0, "K8V8": 1, "K8V4": 2, "K4V4": 3}
    n_tok = blobs["token_ids"].nbytes // 8 if "token_ids" in blobs else 0
    refused = 0
    for i, layer in enumerate(m["headers"]):
        if not isinstance(layer, dict):
            continue
        for tag, hdr in layer.items():
            if not isinstance(hdr, dict) or tag not in codes:
                continue
            vals = [hdr.get(f) for f in _HEADER_FIELDS]
            if not all(isinstance(v, int) and -2**31 <= v < 2**31 for v in vals[1:]) or not isinstance(vals[0], int):
                continue
            r, h, d, bs, g = vals
            raw = {f: blobs.get(f"p.{i}.{tag}.{f}") for f in _PAYLOAD_FIELDS}
            if raw["k_data"] is None or raw["v_data"] is None:
                continue
            kspec = _spec(meta, f"p.{i}.{tag}.k_data")
            src_dtype = {"float32": 0, "float16": 1, "bfloat16": 2}.get(kspec["dtype"], 0)
            src_item = (4, 2, 2)[src_dtype] if tag == "FP16" else 1  # what the kernel reads per element
            rows_raw = blobs.get(f"mixed.rows.{tag}")
            dst_rows = np.ascontiguousarray(rows_raw.view(np.int64)) if rows_raw is not None and rows_raw.nbytes % 8 == 0 \
                else np.zeros(0, np.int64)
            n_dst = n_tok + 4
            ok_dst = 0 < h <= 64 and 0 < d <= 2048 and h * n_dst * d <= 1 << 22
            dk = torch.zeros(h, n_dst, d) if ok_dst else torch.zeros(1)
            dv = torch.zeros_like(dk)
            j = native._Job(tag=codes[tag], src_dtype=src_dtype, H=h, D=d, block_size=bs,
                            v_group=g, R=max(min(r, 2**62), -1), M=len(dst_rows))
            keep = [np.ascontiguousarray(x) if x is not None else None for x in raw.values()]
            for f, x in zip(_PAYLOAD_FIELDS, keep):
                setattr(j, f, x.ctypes.data if x is not None and x.size else None)
                item = src_item if f.endswith("data") else 2
                setattr(j, f"n_{f}", 0 if x is None else x.nbytes // item)
            j.dst_rows = dst_rows.ctypes.data if dst_rows.size else None
            j.dst_k, j.dst_v = dk.data_ptr(), dv.data_ptr()
            j.n_dst = n_dst if ok_dst else 0
            j.n_dst_k, j.n_dst_v = dk.numel(), dv.numel()  # honest: what the destinations hold
            j.dk_sh = j.dv_sh = n_dst * d if ok_dst else 0
            j.dk_sr = j.dv_sr = d if ok_dst else 0
            starts = (ctypes.c_int64 * 2)()
            rc = lib.pkv_restore(ctypes.byref(j), 1, 1, starts)
            if rc < -1:
                if native.error_text(rc) is None:
                    raise AssertionError(f"pkv_restore returned an unknown code {rc}")
                refused += 1
            del keep
    return refused


def check_entry(meta: dict[str, Any], blobs: dict[str, np.ndarray], key: CheckpointKey) -> str:
    """The oracle of one fuzzed entry (see the module docstring).

    Returns:
        ``"refused"`` (the codec raised CorruptCheckpoint) or ``"accepted"`` (decoded; every run restored
        alike on every path).

    Raises:
        AssertionError: the paths disagree, or the native library returned an unknown code.
        Exception: anything else the codec or a kernel let escape (the finding the fuzzer looks for).
    """
    from patchkv_agent.core.checkpoint import CorruptCheckpoint
    from patchkv_agent.runtime.kvstore.codec import decode_checkpoint

    _raw_native(meta, blobs)
    try:
        ckpt = decode_checkpoint(meta, {k: v.tobytes() for k, v in blobs.items()}, key)
    except CorruptCheckpoint:
        return "refused"
    if ckpt.mixed is not None:
        _restore_both(ckpt)
    return "accepted"


# ------------------------------------------------------------------ native argument cases


def native_argument_cases() -> dict[str, str]:
    """Calls of the native wrappers and entry points with hostile sizes and strides (arguments that would
    write or read out of bounds if unchecked), each answered by its outcome, plus controls that must be accepted.

    Cases: ``block_size`` at and beyond 2^31 (ctypes would wrap 2^32 + 1 to 1: a heap overflow in
    ``pkv_quantize``); a quantize source with inner stride 0 (read past it); a restore into an fp16
    destination (fp32 rows written past it); and the same three jobs handed to ``native.c`` directly, past
    every Python check, with the buffers' true sizes: the library must return an error code and touch
    nothing. Under AddressSanitizer (:func:`run_fuzz_asan` runs these in its child) an out-of-bounds access
    is a sanitizer report, not a silent success.

    Returns:
        ``{case: outcome}``, outcome ``"accepted"``, ``"refused: <why>"`` (a ValueError of the wrapper or the
        library's error text) or ``"wrote: ..."`` (a refused raw job that changed its outputs); empty when the
        library is unavailable.
    """
    import ctypes

    import torch

    from patchkv_agent.kernels import native
    from patchkv_agent.kernels.reference import reference_quantize_gather

    lib = native._library()
    if lib is None:
        return {}
    out: dict[str, str] = {}
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(2, 20, 16, generator=g), torch.randn(2, 20, 16, generator=g)
    rows = torch.arange(20)

    def wrapper(name, fn):
        try:
            fn()
            out[name] = "accepted"
        except ValueError as e:
            out[name] = "refused: " + str(e)[:200]

    def control_quantize():
        got, want = native.quantize_native(k, v, rows, "K8V8", 8, 32), reference_quantize_gather(k, v, rows, "K8V8", 8, 32)
        if not all(torch.equal(a, b) for a, b in zip(got.tensors().values(), want.tensors().values())):
            raise AssertionError("native quantize differs from the reference")

    wrapper("control: quantize", control_quantize)
    for bs in (2**31, 2**32, 2**32 + 1):
        wrapper(f"quantize block_size {bs}", lambda bs=bs: native.quantize_native(k, v, rows, "K8V8", bs, 32))
    k0 = torch.randn(2, 20, 1, generator=g).expand(2, 20, 16)  # inner stride 0: 40 floats behind 640 elements
    wrapper("quantize inner stride 0", lambda: native.quantize_native(k0, k0, rows, "K8V8", 8, 32))
    p = reference_quantize_gather(k, v, rows, "K8V8", 8, 32)
    zero = torch.zeros(20, dtype=torch.int64)
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        d_k, d_v = torch.zeros(2, 30, 16, dtype=dt), torch.zeros(2, 30, 16, dtype=dt)
        call = native.ScatterCall(p, d_k, d_v, torch.arange(20), zero, None)
        name = "control: scatter fp32 destination" if dt == torch.float32 else f"scatter {str(dt)[6:]} destination"
        wrapper(name, lambda call=call: native.scatter_native([call]))

    def raw(name, fn, outputs):
        before = [t.clone() for t in outputs]
        rc = fn()
        if rc == 0:
            out[name] = "accepted"
        elif any(not torch.equal(a, b) for a, b in zip(before, outputs)):
            out[name] = f"wrote: refused with {rc} after changing its outputs"
        else:
            out[name] = f"refused: {native.error_text(rc) or rc}"

    def qjob(block_size, src, nb_alloc):
        """A K8V8 quantize job over ``src`` with outputs allocated for ``nb_alloc`` key blocks."""
        o = dict(k_data=torch.zeros(2, 20, 16, dtype=torch.uint8), v_data=torch.zeros(2, 20, 16, dtype=torch.uint8),
                 k_scale=torch.zeros(2, nb_alloc, 16, dtype=torch.float16),
                 k_zero=torch.zeros(2, nb_alloc, 16, dtype=torch.float16),
                 v_scale=torch.zeros(2, 20, 1, dtype=torch.float16), v_zero=torch.zeros(2, 20, 1, dtype=torch.float16))
        j = native._QJob(tag=1, src_dtype=0, H=2, D=16, block_size=block_size, v_group=16, R=20, k=src.data_ptr(),
                         v=src.data_ptr(), k_sh=src.stride(0), k_sn=src.stride(1), v_sh=src.stride(0),
                         v_sn=src.stride(1), rows=rows.data_ptr(), N=20)
        for f, t in o.items():
            setattr(j, f, t.data_ptr())
            setattr(j, f"n_{f}", t.numel())
        j.n_k = j.n_v = native.extent(src)
        starts = (ctypes.c_int64 * 2)()
        return (lambda: lib.pkv_quantize(ctypes.byref(j), 1, 1, starts)), list(o.values()), (j, o, starts)

    fn, outs, keep = qjob(8, k, 3)
    raw("control: raw quantize", fn, outs)
    fn, outs, keep = qjob(1, k, 1)  # 2^32 + 1 as ctypes wraps it, outputs sized for one block
    raw("raw quantize block_size 2^32+1 wrapped to 1", fn, outs)
    fn, outs, keep = qjob(8, k0, 3)
    raw("raw quantize inner stride 0", fn, outs)

    def rjob(dst):
        j = native._Job(tag=1, src_dtype=0, H=2, D=16, block_size=8, v_group=16, R=20, M=20)
        for f in ("k_data", "v_data", "k_scale", "k_zero", "v_scale", "v_zero"):
            setattr(j, f, getattr(p, f).data_ptr())
        dst_rows = torch.arange(20)
        j.dst_rows, j.dst_k, j.dst_v = dst_rows.data_ptr(), dst[0].data_ptr(), dst[1].data_ptr()
        j.dk_sh, j.dk_sr, j.dv_sh, j.dv_sr = 30 * 16, 16, 30 * 16, 16  # fp32 rows of 16, as the caller claims
        native._set_sizes(j, p, dst_rows=30, angles=0, dst_k=dst[0], dst_v=dst[1])
        starts = (ctypes.c_int64 * 2)()
        return (lambda: lib.pkv_restore(ctypes.byref(j), 1, 1, starts)), list(dst), (j, dst_rows, starts)

    fn, outs, keep = rjob((torch.zeros(2, 30, 16), torch.zeros(2, 30, 16)))
    raw("control: raw restore", fn, outs)
    fn, outs, keep = rjob((torch.zeros(2, 30, 16, dtype=torch.float16), torch.zeros(2, 30, 16, dtype=torch.float16)))
    raw("raw restore into fp16 destination", fn, outs)
    del keep
    return out


# ------------------------------------------------------------------ drivers

ASAN_FLAGS = ("-fsanitize=address", "-fno-omit-frame-pointer", "-g")


def run_fuzz(examples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Run ``examples`` Hypothesis examples of :func:`check_entry` in this process.

    Args:
        examples: examples to run (>= 1).
        seed: seeds the base entries and Hypothesis (the same seed runs the same examples).

    Returns:
        ``{"examples", "refused", "accepted", "failures", "first_failure", "native"}``; ``failures`` is 0 or 1
        (the first failing example stops the run; ``first_failure`` describes it).

    Raises:
        ValueError: ``examples < 1``.
        ImportError: Hypothesis is not installed (``pip install 'patchkv-agent[test]'``).
    """
    if examples < 1:
        raise ValueError(f"examples must be >= 1, got {examples}")
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    from patchkv_agent.kernels import native

    bases = base_entries(seed)
    counts = {"refused": 0, "accepted": 0}

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=(Phase.generate,),
              suppress_health_check=list(HealthCheck))
    @given(base=st.integers(0, len(bases) - 1), ops=st.lists(edits(), min_size=0, max_size=3))
    def one(base, ops):
        _, meta, blobs, key = bases[base]
        meta, blobs = deep_copy(meta, blobs)
        for op in ops:
            apply_edit(meta, blobs, op)
        reseal(meta, blobs)
        try:
            counts[check_entry(meta, blobs, key)] += 1
        except Exception as e:  # noqa: BLE001 - the finding: name the edits that produced it
            raise AssertionError(f"{type(e).__name__}: {str(e)[:300]} after edits {ops}") from e

    summary = {"examples": 0, "refused": 0, "accepted": 0, "failures": 0, "first_failure": None,
               "native": native.status()}
    try:
        one()
    except AssertionError as e:
        summary.update(failures=1, first_failure=str(e)[:2000])
    summary.update(counts, examples=counts["refused"] + counts["accepted"] + summary["failures"])
    return summary


def asan_runtime() -> tuple[str | None, str]:
    """``(path of libasan, "")`` when the C compiler can build and preload AddressSanitizer, else ``(None, why)``."""
    import os
    import shutil
    import subprocess
    import tempfile

    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return None, f"no C compiler {cc!r} on PATH"
    try:
        lib = subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{cc} -print-file-name failed: {e}"
    if not os.path.isabs(lib) or not os.path.exists(lib):
        return None, f"{cc} ships no libasan.so (install libasan, e.g. Debian: apt-get install libasan8)"
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("int f(int x) { return x + 1; }\n")
        proc = subprocess.run([cc, *ASAN_FLAGS, "-shared", "-fPIC", src, "-o", os.path.join(d, "t.so")],
                              capture_output=True, text=True, timeout=60)
        if proc.returncode:
            return None, f"{cc} cannot build with -fsanitize=address: {proc.stderr.strip()[-300:]}"
    return lib, ""


def run_fuzz_asan(examples: int = 2000, seed: int = 0, timeout: float = 600.0) -> dict[str, Any]:
    """:func:`run_fuzz` in a subprocess whose native library is built with AddressSanitizer (libasan preloaded).

    Returns:
        The child's summary plus ``"asan": True``, ``"returncode"``, ``"crashed"`` (killed by a signal, or no
        summary), ``"sanitizer_reports"`` (AddressSanitizer reports in its stderr) and ``"stderr_tail"``; the
        child runs :func:`native_argument_cases` first (``"native_cases"``).

    Raises:
        RuntimeError: AddressSanitizer is not available (the message says why).
    """
    import json as _json
    import os
    import subprocess
    import sys
    import tempfile

    lib, why = asan_runtime()
    if lib is None:
        raise RuntimeError(f"AddressSanitizer unavailable: {why}")
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "summary.json")
        env = {**os.environ, "LD_PRELOAD": lib, "PATCHKV_CACHE_DIR": os.path.join(d, "cache"),
               "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:abort_on_error=0:exitcode=86:"
                               "allocator_may_return_null=1:verify_asan_link_order=0",
               "PATCHKV_NATIVE": "1", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "benchmarks.entry_fuzz", "--examples", str(examples), "--seed", str(seed),
               "--asan-child", "--json", out]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            rc, err = proc.returncode, proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, err = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        summary: dict[str, Any] = {}
        if os.path.exists(out):
            with open(out) as f:
                summary = _json.load(f)
    reports = err.count("ERROR: AddressSanitizer")
    summary.update(asan=True, returncode=rc, crashed=rc is None or rc < 0 or not summary, sanitizer_reports=reports,
                   stderr_tail=err[-3000:])
    summary.setdefault("failures", 0)
    summary.setdefault("examples", 0)
    return summary


def _asan_child_library() -> None:
    """In the ASan child: build ``native.c`` with AddressSanitizer and make it the library the kernels use."""
    from patchkv_agent.kernels import native

    lib = native.load(native.build(extra_flags=ASAN_FLAGS, native_arch=False))
    native._lib, native._why, native._tried = lib, None, True


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json as _json

    ap = argparse.ArgumentParser(prog="python -m benchmarks.entry_fuzz",
                                 description="fuzz stored checkpoint entries (see the module docstring)")
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--asan-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--native-cases", action="store_true",
                    help="run only the native argument cases (native_argument_cases) and print their outcomes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.examples < 1:
        ap.error("--examples must be >= 1")
    if args.asan_child:
        _asan_child_library()
    cases = native_argument_cases()
    if args.native_cases:
        s = {"native_cases": cases, "failures": 0}
    else:
        s = run_fuzz(args.examples, args.seed)
        s["native_cases"] = cases
    if args.asan_child:
        s["native"] = "native (AddressSanitizer build)"
    if args.json:
        with open(args.json, "w") as f:
            _json.dump(s, f, indent=2)
    print(_json.dumps(s, indent=2))
    return 0 if s["failures"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())

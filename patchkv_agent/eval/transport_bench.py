"""Transport benchmark: payload size, store (quantize_gather) and restore (dequantize_scatter + RoPE)
time of a real checkpoint at FP16, INT8 (K8V8), INT4 (K8V4) and the mixed policy, plus the
first-token KL that mixed precision adds to ``direct`` on edited contexts.

Knows the engine, kernels and precision policy; writes JSON. Timings are medians over repeats
measured side by side in one run (restores round-robin across the formats, after one warm-up
restore each), for the default kernel path (the native restore on a CPU with a C compiler) and
for the torch reference; nothing here is asserted by tests.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from ..kernels import ScatterCall, backend, dequantize_scatter_many, quantize_gather, scatter_backend, value_residual_4bit
from ..kernels.rope import rope_delta_reference
from ..core.precision import PrecisionPolicy, Tag, assign_tags, cluster_runs


def _context(engine, n_tokens: int, seed: int = 0) -> list[int]:
    from .workloads import load_qa

    rng = np.random.default_rng(seed)
    data = load_qa("2wikimqa")
    text, ids = "", []
    while len(ids) < n_tokens:
        ex = data[int(rng.integers(len(data)))]
        text += "\n\n" + ex["context"]
        ids = engine.encode(text)
    return ids[:n_tokens]


def _time(fn, repeats: int) -> float:
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def transport_bench(engine, *, n_tokens: int = 8192, repeats: int = 5, shift: int = 17,
                    ids: list[int] | None = None) -> dict[str, Any]:
    """Measure the four formats on one real checkpoint of ``n_tokens``.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine`.
        n_tokens: checkpoint length.
        repeats: timing repeats (median reported).
        shift: position delta applied on restore (exercises the RoPE correction).
        ids: the checkpoint's token ids (default: ``n_tokens`` of 2WikiMQA passages, which needs
            the engine's tokenizer).

    Returns:
        ``{"n_tokens", "formats": {name: {payload_mib, store_ms, restore_ms, ...}}, "ratios": ...}``.
    """
    ids = _context(engine, n_tokens) if ids is None else list(ids)
    t0 = time.perf_counter()
    ckpt = engine.checkpoint(ids)
    prefill_s = time.perf_counter() - t0
    keys = [k.half() for k in ckpt.keys]  # the FP16 baseline stores half precision, as on an accelerator
    values = [v.half() for v in ckpt.values]
    spec, bs = engine.spec, engine.block_size
    n = len(ids)
    resid = value_residual_4bit(torch.stack([v.float() for v in values])).numpy()
    mixed_tags = assign_tags(ckpt.scores if ckpt.scores is not None else np.ones(n), resid, bs,
                             engine.precision_policy)
    n_blocks = len(mixed_tags)
    scores = ckpt.scores if ckpt.scores is not None else np.ones(n)
    grid = []
    elem_bytes = {int(Tag.FP16): 4.0, int(Tag.K8V8): 2.25, int(Tag.K8V4): 1.75}  # K+V bytes per element pair
    for tau_h in (2.0, 4.0, 8.0, 16.0):
        for tau_l in (0.25, 0.5, 1.0, 2.0):
            if tau_l >= tau_h:
                continue
            pol = PrecisionPolicy(alpha=engine.precision_policy.alpha, tau_L=tau_l, tau_H=tau_h,
                                  g4=engine.precision_policy.g4)
            t = assign_tags(scores, resid, bs, pol)
            grid.append({"tau_L": tau_l, "tau_H": tau_h,
                         "blocks": {g.name: int((t == int(g)).sum()) for g in Tag},
                         "payload_vs_fp16_est": float(np.mean([elem_bytes[int(x)] for x in t]) / 4.0)})
    layouts = {
        "FP16": np.full(n_blocks, int(Tag.FP16), np.int8),
        "INT8": np.full(n_blocks, int(Tag.K8V8), np.int8),
        "INT4": np.full(n_blocks, int(Tag.K8V4), np.int8),
        "mixed": mixed_tags,
    }
    dst_k = [torch.empty(spec.num_kv_heads, n + shift, spec.head_dim) for _ in range(spec.num_layers)]
    dst_v = [torch.empty_like(d) for d in dst_k]
    out: dict[str, Any] = {"n_tokens": n, "repeats": repeats, "prefill_s": prefill_s, "formats": {},
                           "policy": vars(engine.precision_policy) if hasattr(engine.precision_policy, "__dict__")
                           else str(engine.precision_policy), "policy_grid": grid}
    restores, stored = {}, {}
    for name, tags in tqdm(layouts.items(), desc="store"):
        block_of_row = np.arange(n) // bs
        tag_rows = {Tag(t).name: torch.from_numpy(np.flatnonzero(tags[block_of_row] == t))
                    for t in np.unique(tags).tolist()}

        def store(tag_rows=tag_rows):  # as store.build_mixed: one payload per (layer, tag)
            return [{t: quantize_gather(keys[li], values[li], rows, t, bs) for t, rows in tag_rows.items()}
                    for li in range(spec.num_layers)]

        payloads = store()
        store_s = _time(store, repeats)
        with backend("torch"):
            store_torch_s = _time(store, repeats)

        calls = [ScatterCall(payloads[li][t], dst_k[li], dst_v[li], rows + shift, torch.full((len(rows),), shift),
                             spec.rope_for_layer(li).inv_freq, spec.rope_for_layer(li).interleaved)
                 for li in range(spec.num_layers) for t, rows in tag_rows.items()]
        restores[name] = calls  # as the engine restores: every (layer, tag) run in one call
        stored[name] = (payloads, (store_s, store_torch_s), tags)
    # Restores are timed round-robin (one repeat of every format, then the next), so load changes on
    # a shared CPU hit all formats alike and the ratios stay meaningful; per kernel path: the
    # default one ("native" on CPU with a compiler) and the torch reference.
    default = scatter_backend(restores["FP16"][0])
    paths = [default] if default == "torch" else [default, "torch"]
    restore_ts = {(path, name): [] for path in paths for name in restores}
    for path in paths:
        with backend("torch" if path == "torch" else "auto"):
            for calls in restores.values():
                dequantize_scatter_many(calls)  # warm-up: first touch of the destination pages, angle tables
            for _ in range(repeats):
                for name, calls in restores.items():
                    t = time.perf_counter()
                    dequantize_scatter_many(calls)
                    restore_ts[path, name].append(time.perf_counter() - t)
    out["restore_kernel"] = default
    for name, calls in restores.items():
        payloads, store_s, tags = stored[name]
        dequantize_scatter_many(calls)
        # error of values (keys are rotated, compare values which are placed unrotated)
        got_v = torch.cat([dst_v[li][:, shift:] for li in range(spec.num_layers)])
        ref_v = torch.cat([values[li].float() for li in range(spec.num_layers)])
        got_k = torch.cat([dst_k[li][:, shift:] for li in range(spec.num_layers)])
        ref_k = torch.cat([rope_delta_reference(keys[li].float(), torch.full((n,), shift), spec.rope_for_layer(li).inv_freq,
                                                interleaved=spec.rope_for_layer(li).interleaved)
                           for li in range(spec.num_layers)])
        out["formats"][name] = {
            "payload_mib": sum(p.nbytes for layer in payloads for p in layer.values()) / 2**20,
            "store_ms": store_s[0] * 1e3,
            "store_ms_torch": store_s[1] * 1e3,
            "restore_ms": statistics.median(restore_ts[default, name]) * 1e3,
            "restore_ms_all": [t * 1e3 for t in restore_ts[default, name]],
            "restore_ms_torch": statistics.median(restore_ts["torch", name]) * 1e3,
            "runs": len(cluster_runs(tags)),
            "blocks": {t.name: int((tags == int(t)).sum()) for t in Tag},
            "value_rel_err": float((got_v - ref_v).norm() / ref_v.norm()),
            "key_rel_err": float((got_k - ref_k).norm() / ref_k.norm()),  # vs the stored keys rotated by shift
        }
    f = out["formats"]
    out["ratios"] = {
        "mixed_payload_vs_fp16": f["mixed"]["payload_mib"] / f["FP16"]["payload_mib"],
        "mixed_restore_vs_fp16": f["mixed"]["restore_ms"] / f["FP16"]["restore_ms"],
        "mixed_restore_vs_fp16_torch": f["mixed"]["restore_ms_torch"] / f["FP16"]["restore_ms_torch"],
        "mixed_restore_vs_fp16_torch_reference": f["mixed"]["restore_ms"] / f["FP16"]["restore_ms_torch"],
    }
    return out


def mixed_kl_bench(engine, *, n_contexts: int = 4, target_tokens: int = 1500) -> dict[str, Any]:
    """First-token KL vs exact of direct@FP16 and direct@mixed on edited SmolLM2 contexts.

    Returns:
        per-context KLs and their means, and the relative increase of the mean.
    """
    from .metrics import first_token_kl
    from .traces import plain_messages, version_ids
    from .workloads import build_traces

    count = lambda msgs: len(engine.encode(plain_messages(msgs)))  # noqa: E731
    traces = build_traces("hotpotqa-e", "replace_tool_result", n=n_contexts, split="eval",
                          target_tokens=target_tokens, count_tokens=count)
    rows = []
    for tr in tqdm(traces, desc="kl"):
        old, new = (version_ids(engine, v) for v in tr["versions"][:2])
        ckpt = engine.checkpoint(old)
        ref = engine.resume(None, new, strategy="exact", max_new_tokens=0)
        fp = engine.resume(ckpt, new, strategy="direct", precision="fp16", max_new_tokens=0)
        mx = engine.resume(ckpt, new, strategy="direct", precision="mixed", max_new_tokens=0)
        pk = engine.resume(ckpt, new, strategy="patchkv", max_new_tokens=0)
        rows.append({"id": tr["id"], "kl_direct_fp16": first_token_kl(ref.logits, fp.logits),
                     "kl_direct_mixed": first_token_kl(ref.logits, mx.logits),
                     "kl_patchkv_mixed": first_token_kl(ref.logits, pk.logits),
                     "payload_fp16": fp.stats["payload_bytes"], "payload_mixed": mx.stats["payload_bytes"]})
    m_fp = statistics.fmean(r["kl_direct_fp16"] for r in rows)
    m_mx = statistics.fmean(r["kl_direct_mixed"] for r in rows)
    return {"contexts": rows, "mean_kl_direct_fp16": m_fp, "mean_kl_direct_mixed": m_mx,
            "mixed_adds_to_direct_kl": (m_mx - m_fp) / m_fp if m_fp > 0 else None}


def engine_restore_bench(engine, *, n_contexts: int = 4, repeats: int = 3, target_tokens: int = 3000) -> dict[str, Any]:
    """``restore_s`` of real resumes (``direct`` at FP16, ``patchkv`` at mixed precision) per kernel
    path: the default one and the torch reference, alternated, median over contexts x repeats.

    Returns:
        ``{"contexts", "tokens", "restore_ms": {strategy: {path: ms}}, "kernel": {strategy: path},
        "identical_logits"}``; the last says whether both paths gave bit-identical first-token logits.
    """
    from .traces import plain_messages, version_ids
    from .workloads import build_traces

    count = lambda msgs: len(engine.encode(plain_messages(msgs)))  # noqa: E731
    traces = build_traces("hotpotqa-e", "replace_tool_result", n=n_contexts, split="eval",
                          target_tokens=target_tokens, count_tokens=count)
    runs = {"direct": dict(strategy="direct", precision="fp16"), "patchkv": dict(strategy="patchkv")}
    times = {(s, p): [] for s in runs for p in ("auto", "torch")}
    kernel, identical, tokens = {}, True, []
    for tr in tqdm(traces, desc="engine restore"):
        old, new = (version_ids(engine, v) for v in tr["versions"][:2])
        tokens.append(len(new))
        ckpt = engine.checkpoint(old)
        for _ in range(repeats):
            for name, kw in runs.items():
                logits = {}
                for path in ("auto", "torch"):
                    with backend(path):
                        res = engine.resume(ckpt, new, max_new_tokens=0, **kw)
                    times[name, path].append(res.stats["restore_s"])
                    logits[path] = res.logits
                    if path == "auto":
                        kernel[name] = res.stats.get("restore_kernel")
                identical &= bool(torch.equal(logits["auto"], logits["torch"]))
    return {"contexts": len(traces), "tokens": tokens,
            "restore_ms": {s: {("default" if p == "auto" else p): statistics.median(times[s, p]) * 1e3
                               for p in ("auto", "torch")} for s in runs},
            "kernel": kernel, "identical_logits": identical}


def main(args) -> int:
    from ..engine import PatchKVEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    from ..profiles import resolve_profile_arg

    eng = PatchKVEngine.from_pretrained(args.model, profile=resolve_profile_arg(args.profile), block_size=args.block_size)
    result = {"model": args.model, "profile": eng.profile_path, "block_size": eng.block_size,
              "precision_policy": dataclasses.asdict(eng.precision_policy), "transport": transport_bench(eng, n_tokens=args.tokens, repeats=args.repeats)}
    if args.kl_contexts:
        result["kl"] = mixed_kl_bench(eng, n_contexts=args.kl_contexts)
    if args.engine_contexts:
        result["engine_restore"] = engine_restore_bench(eng, n_contexts=args.engine_contexts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for name, f in result["transport"]["formats"].items():
        print(f"{name:>6}: {f['payload_mib']:8.2f} MiB  store {f['store_ms']:6.1f} ms (torch {f['store_ms_torch']:.1f})"
              f"  restore {f['restore_ms']:6.1f} ms ({result['transport']['restore_kernel']}; torch"
              f" {f['restore_ms_torch']:.1f})  blocks {f['blocks']}")
    print("ratios", result["transport"]["ratios"])
    if "kl" in result:
        k = result["kl"]
        print(f"direct KL fp16 {k['mean_kl_direct_fp16']:.4f}  mixed {k['mean_kl_direct_mixed']:.4f}  "
              f"(+{100 * (k['mixed_adds_to_direct_kl'] or 0):.1f}%)")
    if "engine_restore" in result:
        e = result["engine_restore"]
        for s, ms in e["restore_ms"].items():
            print(f"resume restore_s {s}: {ms['default']:.1f} ms ({e['kernel'][s]}) vs torch {ms['torch']:.1f} ms")
        print(f"identical logits across kernel paths: {e['identical_logits']}")
    print(f"wrote {args.out}")
    return 0


def add_cli(sub) -> None:
    p = sub.add_parser("bench-transport", help="payload/store/restore of FP16, INT8, INT4 and mixed checkpoints")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kl-contexts", type=int, default=4)
    p.add_argument("--engine-contexts", type=int, default=2,
                   help="edited ~3k-token contexts for resume restore_s per kernel path (0: skip)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default="runs/transport.json")
    p.add_argument("--profile", default="auto",
                   help="calibration profile: 'auto' (by model fingerprint), 'none' (built-in defaults) or a JSON path")
    p.add_argument("--block-size", type=int, default=None, help="default: the profile's, else 32")
    p.set_defaults(func=main)

"""Transport benchmark: payload size, store (quantize_gather) and restore (dequantize_scatter + RoPE)
time of a real checkpoint at FP16, INT8 (K8V8), INT4 (K8V4), INT4K (K4V4) and the mixed policy, plus
the first-token KL that mixed precision adds to ``direct`` on edited contexts.

Policy grids: ``policy_grid`` (tau_L x tau_H) and ``k4_grid`` (the K4V4 thresholds tau_LL x g4k at
the engine's tau_L, tau_H) give tag counts and the payload estimate on the transport checkpoint;
with ``--k4-grid`` the KL bench also measures direct@mixed per ``k4_grid`` policy and ``k4_choice``
names the policy with the smallest payload among those within the payload and KL targets.

Knows the engine, kernels and precision policy; writes JSON. Timings are medians over repeats
measured side by side in one run (restores round-robin across the formats, after one warm-up
restore each), for the default kernel path (the native restore on a CPU with a C compiler) and
for the torch reference; nothing here is asserted by tests.

``bench-transport --capture-cost`` measures instead what the attention statistics cost the checkpoint
pass (:func:`capture_cost`: the same prefill with and without
:class:`~patchkv_agent.core.capture.AttentionCapture`, alternated; target < 5 %).
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

from patchkv_agent.kernels import ScatterCall, backend, dequantize_scatter_many, quantize_gather, scatter_backend, value_residual_4bit
from patchkv_agent.kernels.rope import rope_delta_reference
from patchkv_agent.core.checkpoint import key_residual, quantize_mixed
from patchkv_agent.core.precision import PrecisionPolicy, Tag, assign_tags, cluster_runs

# K+V bytes per element pair of each tag (metadata included, head_dim a multiple of 32; fp16 source)
ELEM_BYTES = {int(Tag.FP16): 4.0, int(Tag.K8V8): 2.25, int(Tag.K8V4): 1.75, int(Tag.K4V4): 1.25}
K4_TAU_LL = (0.0, 0.01, 0.02, 0.03, 0.05, 0.1, 0.3, 1.0)  # K4V4 grid (capped at the policy's tau_L)
K4_G4K = (0.04, 0.045, 0.05, 0.06, 1.0)  # 1.0: no key test (SmolLM2 key residuals: median 0.039, max 0.074)


def k4_policies(base: PrecisionPolicy) -> dict[str, PrecisionPolicy]:
    """The ``k4_grid`` policies: ``base`` with each (tau_LL, g4k) of the grid (tau_LL capped at tau_L).

    Args:
        base: the policy whose alpha, tau_L, tau_H and g4 are kept.

    Returns:
        ``{"tau_LL=..,g4k=..": policy}`` in grid order, duplicates (after capping) dropped.
    """
    out = {}
    for tau_ll in K4_TAU_LL:
        t = min(tau_ll, base.tau_L)
        for g4k in K4_G4K if t > 0 else K4_G4K[:1]:
            out.setdefault(f"tau_LL={t:g},g4k={g4k:g}", dataclasses.replace(base, tau_LL=t, g4k=g4k))
    return out


def payload_estimate(tags: np.ndarray) -> float:
    """Payload of blocks tagged ``tags`` relative to FP16 storage (bytes per element pair / 4)."""
    return float(np.mean([ELEM_BYTES[int(x)] for x in tags]) / 4.0) if len(tags) else 1.0


def select_k4(rows: list[dict], max_payload: float = 0.40, max_kl_increase: float = 0.037) -> dict | None:
    """The grid row with the smallest ``payload_vs_fp16_est`` whose payload is ``<= max_payload`` and
    whose measured ``kl_increase`` (direct@mixed over direct@FP16) is ``<= max_kl_increase``.

    Args:
        rows: ``k4_grid`` rows carrying ``kl_increase`` (rows without it are skipped).
        max_payload, max_kl_increase: the targets.

    Returns:
        The chosen row, or None when no row meets both targets.
    """
    ok = [r for r in rows if r.get("kl_increase") is not None and r["payload_vs_fp16_est"] <= max_payload
          and r["kl_increase"] <= max_kl_increase]
    return min(ok, key=lambda r: (r["payload_vs_fp16_est"], r["kl_increase"])) if ok else None


def _context(engine, n_tokens: int, seed: int = 0) -> list[int]:
    from patchkv_agent.eval.workloads import load_qa

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
    spec, bs = engine.spec, engine.settings.block_size
    n = len(ids)
    resid = value_residual_4bit(torch.stack([v.float() for v in values])).numpy()
    key_resid = key_residual(keys, bs)
    pol0 = engine.settings.precision_policy
    scores = ckpt.scores if ckpt.scores is not None else np.ones(n)
    mixed_tags = assign_tags(scores, resid, bs, pol0, key_resid)
    n_blocks = len(mixed_tags)
    grid = []
    for tau_h in (2.0, 4.0, 8.0, 16.0):
        for tau_l in (0.25, 0.5, 1.0, 2.0):
            if tau_l >= tau_h:
                continue
            pol = PrecisionPolicy(alpha=pol0.alpha, tau_L=tau_l, tau_H=tau_h, g4=pol0.g4,
                                  tau_LL=min(pol0.tau_LL, tau_l), g4k=pol0.g4k)
            t = assign_tags(scores, resid, bs, pol, key_resid)
            grid.append({"tau_L": tau_l, "tau_H": tau_h, "tau_LL": pol.tau_LL, "g4k": pol.g4k,
                         "blocks": {g.name: int((t == int(g)).sum()) for g in Tag},
                         "payload_vs_fp16_est": payload_estimate(t)})
    k4_grid = []
    for name, pol in k4_policies(pol0).items():
        t = assign_tags(scores, resid, bs, pol, key_resid)
        k4_grid.append({"policy": name, "tau_LL": pol.tau_LL, "g4k": pol.g4k,
                        "blocks": {g.name: int((t == int(g)).sum()) for g in Tag},
                        "payload_vs_fp16_est": payload_estimate(t)})
    layouts = {
        "FP16": np.full(n_blocks, int(Tag.FP16), np.int8),
        "INT8": np.full(n_blocks, int(Tag.K8V8), np.int8),
        "INT4": np.full(n_blocks, int(Tag.K8V4), np.int8),
        "INT4K": np.full(n_blocks, int(Tag.K4V4), np.int8),
        "mixed": mixed_tags,
    }
    dst_k = [torch.empty(spec.num_kv_heads, n + shift, spec.head_dim) for _ in range(spec.num_layers)]
    dst_v = [torch.empty_like(d) for d in dst_k]
    out: dict[str, Any] = {"n_tokens": n, "repeats": repeats, "prefill_s": prefill_s, "formats": {},
                           "policy": vars(engine.settings.precision_policy) if hasattr(engine.settings.precision_policy, "__dict__")
                           else str(engine.settings.precision_policy), "policy_grid": grid, "k4_grid": k4_grid,
                           "key_resid": {"median": float(np.median(key_resid)), "p90": float(np.quantile(key_resid, 0.9)),
                                         "max": float(key_resid.max())} if n else None}
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
        "k4v4_payload_vs_fp16": f["INT4K"]["payload_mib"] / f["FP16"]["payload_mib"],
        "mixed_restore_vs_fp16": f["mixed"]["restore_ms"] / f["FP16"]["restore_ms"],
        "mixed_restore_vs_fp16_torch": f["mixed"]["restore_ms_torch"] / f["FP16"]["restore_ms_torch"],
        "mixed_restore_vs_fp16_torch_reference": f["mixed"]["restore_ms"] / f["FP16"]["restore_ms_torch"],
    }
    return out


def mixed_kl_bench(engine, *, n_contexts: int = 4, target_tokens: int = 1500,
                   policies: dict[str, PrecisionPolicy] | None = None) -> dict[str, Any]:
    """First-token KL vs exact of direct@FP16 and direct@mixed on edited SmolLM2 contexts.

    Args:
        engine: the engine (its policy writes the checkpoints' mixed runs).
        n_contexts: edited contexts (hotpotqa-e, replace_tool_result).
        target_tokens: their length.
        policies: more policies to measure direct@mixed under: each re-tags the context's
            checkpoint (its attention scores, value and key residuals) and restores from
            :func:`~patchkv_agent.core.checkpoint.quantize_mixed` runs (policies tagging a context
            alike share one resume).

    Returns:
        per-context KLs and their means, the relative increase of the mean, and with ``policies``
        ``"policies": {name: {mean_kl_direct_mixed, adds_to_direct_kl, payload_vs_fp16_est, blocks}}``
        (payload and blocks summed over the contexts).
    """
    from patchkv_agent.eval.metrics import first_token_kl
    from patchkv_agent.eval.traces import plain_messages, version_ids
    from patchkv_agent.eval.workloads import build_traces

    count = lambda msgs: len(engine.encode(plain_messages(msgs)))  # noqa: E731
    traces = build_traces("hotpotqa-e", "replace_tool_result", n=n_contexts, split="eval",
                          target_tokens=target_tokens, count_tokens=count)
    rows = []
    for tr in tqdm(traces, desc="kl"):
        old, new = (version_ids(engine, v) for v in tr["versions"][:2])
        ckpt = engine.checkpoint(old)
        ref = engine.resume(None, new, strategy="exact", max_new_tokens=0)
        fp = engine.resume(ckpt, new, strategy=engine.strategy("direct", {"precision": "fp16"}), max_new_tokens=0)
        mx = engine.resume(ckpt, new,
                                      strategy=engine.strategy("direct", {"precision": "mixed"}), max_new_tokens=0)
        pk = engine.resume(ckpt, new, strategy="patchkv", max_new_tokens=0)
        row = {"id": tr["id"], "kl_direct_fp16": first_token_kl(ref.logits, fp.logits),
               "kl_direct_mixed": first_token_kl(ref.logits, mx.logits),
               "kl_patchkv_mixed": first_token_kl(ref.logits, pk.logits),
               "payload_fp16": fp.stats["payload_bytes"], "payload_mixed": mx.stats["payload_bytes"],
               "blocks_mixed": {t.name: int((ckpt.mixed.tags == int(t)).sum()) for t in Tag}}
        if policies:
            bs = engine.settings.block_size
            resid = value_residual_4bit(torch.stack([v.float() for v in ckpt.values])).numpy()
            k_resid = key_residual(list(ckpt.keys), bs)
            attn = np.ones(len(old)) if ckpt.scores is None else np.asarray(ckpt.scores, dtype=np.float64)
            seen: dict[bytes, float] = {}
            row["policies"] = {}
            for name, pol in policies.items():
                tags = assign_tags(attn, resid, bs, pol, k_resid)
                sig = tags.tobytes()
                if sig not in seen:
                    mixed = quantize_mixed(list(ckpt.keys), list(ckpt.values), tags, block_size=bs)
                    r = engine.resume(dataclasses.replace(ckpt, mixed=mixed), new,
                                      strategy=engine.strategy("direct", {"precision": "mixed"}), max_new_tokens=0)
                    seen[sig] = first_token_kl(ref.logits, r.logits)
                row["policies"][name] = {"kl_direct_mixed": seen[sig], "n_blocks": len(tags),
                                         "blocks": {t.name: int((tags == int(t)).sum()) for t in Tag}}
        rows.append(row)
    m_fp = statistics.fmean(r["kl_direct_fp16"] for r in rows)
    m_mx = statistics.fmean(r["kl_direct_mixed"] for r in rows)
    out = {"contexts": rows, "mean_kl_direct_fp16": m_fp, "mean_kl_direct_mixed": m_mx,
           "mixed_adds_to_direct_kl": (m_mx - m_fp) / m_fp if m_fp > 0 else None}
    if policies:
        out["policies"] = {}
        for name in policies:
            per = [r["policies"][name] for r in rows]
            m = statistics.fmean(p["kl_direct_mixed"] for p in per)
            blocks = {t.name: sum(p["blocks"][t.name] for p in per) for t in Tag}
            tags = np.concatenate([np.full(c, int(Tag[t]), np.int8) for t, c in blocks.items()])
            out["policies"][name] = {"mean_kl_direct_mixed": m, "adds_to_direct_kl": (m - m_fp) / m_fp if m_fp > 0 else None,
                                     "payload_vs_fp16_est": payload_estimate(tags), "blocks": blocks}
    return out


def engine_restore_bench(engine, *, n_contexts: int = 4, repeats: int = 3, target_tokens: int = 3000) -> dict[str, Any]:
    """``restore_s`` of real resumes (``direct`` at FP16, ``patchkv`` at mixed precision) per kernel
    path: the default one and the torch reference, alternated, median over contexts x repeats.

    Returns:
        ``{"contexts", "tokens", "restore_ms": {strategy: {path: ms}}, "kernel": {strategy: path},
        "identical_logits"}``; the last says whether both paths gave bit-identical first-token logits.
    """
    from patchkv_agent.eval.traces import plain_messages, version_ids
    from patchkv_agent.eval.workloads import build_traces

    count = lambda msgs: len(engine.encode(plain_messages(msgs)))  # noqa: E731
    traces = build_traces("hotpotqa-e", "replace_tool_result", n=n_contexts, split="eval",
                          target_tokens=target_tokens, count_tokens=count)
    runs = {"direct": engine.strategy("direct", {"precision": "fp16"}), "patchkv": engine.strategy("patchkv")}
    times = {(s, p): [] for s in runs for p in ("auto", "torch")}
    kernel, identical, tokens = {}, True, []
    for tr in tqdm(traces, desc="engine restore"):
        old, new = (version_ids(engine, v) for v in tr["versions"][:2])
        tokens.append(len(new))
        ckpt = engine.checkpoint(old)
        for _ in range(repeats):
            for name, strat in runs.items():
                logits = {}
                for path in ("auto", "torch"):
                    with backend(path):
                        res = engine.resume(ckpt, new, strategy=strat, max_new_tokens=0)
                    times[name, path].append(res.stats["restore_s"])
                    logits[path] = res.logits
                    if path == "auto":
                        kernel[name] = res.stats.get("restore_kernel")
                identical &= bool(torch.equal(logits["auto"], logits["torch"]))
    return {"contexts": len(traces), "tokens": tokens,
            "restore_ms": {s: {("default" if p == "auto" else p): statistics.median(times[s, p]) * 1e3
                               for p in ("auto", "torch")} for s in runs},
            "kernel": kernel, "identical_logits": identical}


def capture_cost(engine, *, n_tokens: int = 3000, repeats: int = 5, ids: list[int] | None = None) -> dict[str, Any]:
    """Cost of the attention statistics (``capture``) in the checkpoint pass, against a plain prefill.

    Times the same prefill forward (:func:`~patchkv_agent.core.recovery.execute` over the whole context, as
    ``engine.checkpoint`` runs it) with and without :class:`~patchkv_agent.core.capture.AttentionCapture`
    (the engine's capture window), alternating the two so that load swings hit both alike, after one
    warm-up forward.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine`.
        n_tokens: context length.
        repeats: timed pairs (medians reported).
        ids: the context's token ids (default: ``n_tokens`` of 2WikiMQA passages, which needs the
            engine's tokenizer).

    Returns:
        ``{"tokens", "repeats", "threads", "plain_s", "capture_s", "extra", "all_s"}``; ``extra`` is the
        relative extra time of the capture pass.
    """
    from patchkv_agent.core.capture import AttentionCapture
    from patchkv_agent.core.recovery import FullRecompute, execute

    ids_t = torch.tensor(_context(engine, n_tokens) if ids is None else list(ids), dtype=torch.long)
    plan = FullRecompute(new_len=len(ids_t))
    cap = AttentionCapture(engine.model, window=engine.settings.capture_window)
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    with torch.inference_mode():
        execute(engine.runner, engine.spec, ids_t, plan)  # warm-up
        for _ in range(repeats):
            for mode in ("plain", "capture"):
                cap.reset()
                t = time.perf_counter()
                if mode == "plain":
                    execute(engine.runner, engine.spec, ids_t, plan)
                else:
                    with cap:
                        execute(engine.runner, engine.spec, ids_t, plan)
                    cap.scores()
                times[mode].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"tokens": len(ids_t), "repeats": repeats, "threads": torch.get_num_threads(), "plain_s": med["plain"],
            "capture_s": med["capture"], "extra": med["capture"] / med["plain"] - 1.0, "all_s": times}


def _capture_main(eng, args) -> int:
    out = {"model": args.model, **capture_cost(eng, n_tokens=args.tokens, repeats=args.repeats)}
    print(f"{out['tokens']} tokens: plain prefill {out['plain_s']:.3f} s, with capture {out['capture_s']:.3f} s "
          f"({out['extra'] * 100:+.1f} %; median of {args.repeats}, alternating)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


def main(args) -> int:
    from patchkv_agent.engine import PatchKVEngine

    capture = getattr(args, "capture_cost", False)
    if args.tokens is None:
        args.tokens = 3000 if capture else 8192
    if args.out is None:
        args.out = "runs/capture_cost.json" if capture else "runs/transport.json"

    if args.threads:
        torch.set_num_threads(args.threads)
    from patchkv_agent.profiles import resolve_profile_arg

    eng = PatchKVEngine.from_pretrained(args.model, profile=resolve_profile_arg(args.profile), block_size=args.block_size)
    if getattr(args, "tau_ll", None) is not None:  # K4V4 on (e.g. 0.05, K4V4_TAU_LL) or off (0)
        pol = eng.settings.precision_policy
        eng.settings = eng.settings.replace(precision_policy=dataclasses.replace(pol, tau_LL=min(args.tau_ll, pol.tau_L)))
    if capture:
        return _capture_main(eng, args)
    result = {"model": args.model, "profile": eng.profile_path, "block_size": eng.settings.block_size,
              "precision_policy": dataclasses.asdict(eng.settings.precision_policy), "transport": transport_bench(eng, n_tokens=args.tokens, repeats=args.repeats)}
    if args.kl_contexts:
        grid = k4_policies(eng.settings.precision_policy) if args.k4_grid else None
        result["kl"] = mixed_kl_bench(eng, n_contexts=args.kl_contexts, policies=grid)
        if grid:
            for row in result["transport"]["k4_grid"]:
                kl = result["kl"]["policies"][row["policy"]]
                row["kl_increase"] = kl["adds_to_direct_kl"]
                row["mean_kl_direct_mixed"] = kl["mean_kl_direct_mixed"]
                row["kl_contexts_payload_vs_fp16_est"] = kl["payload_vs_fp16_est"]
            result["k4_choice"] = select_k4(result["transport"]["k4_grid"], args.max_payload, args.max_kl_increase)
    if args.engine_contexts:
        result["engine_restore"] = engine_restore_bench(eng, n_contexts=args.engine_contexts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    for name, f in result["transport"]["formats"].items():
        print(f"{name:>6}: {f['payload_mib']:8.2f} MiB  store {f['store_ms']:6.1f} ms (torch {f['store_ms_torch']:.1f})"
              f"  restore {f['restore_ms']:6.1f} ms ({result['transport']['restore_kernel']}; torch"
              f" {f['restore_ms_torch']:.1f})  blocks {f['blocks']}")
    print("ratios", result["transport"]["ratios"])
    for row in result["transport"]["k4_grid"] if args.k4_grid and args.kl_contexts else ():
        print(f"k4 grid {row['policy']:>22}: payload {100 * row['payload_vs_fp16_est']:5.1f} % (kl contexts "
              f"{100 * row['kl_contexts_payload_vs_fp16_est']:5.1f} %)  KL {row['mean_kl_direct_mixed']:.4f} "
              f"({100 * (row['kl_increase'] or 0):+.1f} %)  blocks {row['blocks']}")
    if "k4_choice" in result:
        print("k4 choice:", result["k4_choice"] and result["k4_choice"]["policy"])
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
    p = sub.add_parser("bench-transport", help="payload/store/restore of FP16, INT8, INT4, INT4K and mixed checkpoints")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--tokens", type=int, default=None,
                   help="checkpoint length (default 8192; with --capture-cost 3000)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kl-contexts", type=int, default=4)
    p.add_argument("--engine-contexts", type=int, default=2,
                   help="edited ~3k-token contexts for resume restore_s per kernel path (0: skip)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", default=None,
                   help="result JSON (default runs/transport.json; with --capture-cost runs/capture_cost.json)")
    p.add_argument("--capture-cost", action="store_true",
                   help="only time the checkpoint pass with and without its attention statistics (capture_cost)")
    p.add_argument("--profile", default="auto",
                   help="calibration profile: 'auto' (by model fingerprint), 'none' (built-in defaults) or a JSON path")
    p.add_argument("--block-size", type=int, default=None, help="default: the profile's, else 32")
    p.add_argument("--tau-ll", type=float, default=None,
                   help="K4V4 risk threshold of the policy (default: the policy's own, 0 = K4V4 off; 0.05 is the "
                        "measured payload setting, core.precision.K4V4_TAU_LL)")
    p.add_argument("--k4-grid", action="store_true",
                   help="also measure direct@mixed KL per K4V4 policy (tau_LL x g4k) and pick one (k4_choice)")
    p.add_argument("--max-payload", type=float, default=0.40, help="k4_choice: payload target (fraction of FP16)")
    p.add_argument("--max-kl-increase", type=float, default=0.037,
                   help="k4_choice: target on direct@mixed's KL increase over direct@FP16")
    p.set_defaults(func=main)

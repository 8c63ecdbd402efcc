"""Resume time per strategy of one edited context, per context length, on one model (scripts/gpu_check.sh).

    python scripts/gpu_resume_bench.py --model random:llama-1b@bf16 --lengths 8192,32768 --out DIR/resume.json
    python scripts/gpu_resume_bench.py --model tiny --lengths 256 --repeats 1 --out x.json     # CI size, CPU

For each length N: a context of N tokens (an agent conversation rendered through the tokenizer's chat template
and cut to N ids; random ids without a tokenizer), checkpointed with :meth:`PatchKVEngine.checkpoint`; the
next version replaces ``--edit-tokens`` ids at ``--depth`` of the context by others and appends ``--append``
ids (a tool result rewritten, the next turn added). Each strategy then resumes that version from the
checkpoint (``max_new_tokens=0``: up to the first token) ``--warmup`` times untimed and ``--repeats`` times
timed, the device synchronised around each call. Per (length, strategy): the medians of the wall time of
the call, of the engine's ``ttft_s`` (restore + forward to the first token) and of its host-side ``plan_s``
(diff + plan, CPU only), restore / recompute split, rows recomputed and restored, bytes read from the
checkpoint, fallbacks, and ``vs_prefix`` (prefix's median wall time over this one's).

``random:<shape>`` models have random weights: every number here is a *timing* (the plans follow the
attention statistics of random weights, so recompute counts are indicative only). The JSON is rewritten after
every strategy, so a run cut short keeps what it finished; ``--budget-s`` stops starting new work in time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/ beside the package

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# the measured tail rule at its two bounds (random weights make its choice meaningless, not its cost): a threshold of
# 0+ keeps every probed block (the fixed window plus the probe's layers), an unreachable one keeps none
STRATEGIES = ("exact,prefix,patchkv,patchkv:tail_threshold=1e-9:min_restore_share=0,"
              "patchkv:tail_threshold=1e9:min_restore_share=0,cacheblend,direct")
LABEL = "random weights, timing only"


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _engine(args):
    import torch

    from patchkv_agent.engine import PatchKVEngine
    from patchkv_agent.profiles import resolve_profile_arg

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.model == "tiny":
        from benchmarks.tiny import tiny_engine

        eng = tiny_engine("llama", max_positions=max(args.lengths) + args.edit_tokens + args.append + 64, device=device,
                          config={"vocab_size": 4096, "pad_token_id": None}, scale=1.0)
        eng.source = "tiny"
        return eng, "none (tiny: 8-token blocks and window)"
    profile = args.profile
    if profile == "shape":  # the SmolLM2 shape takes SmolLM2's shipped profile (its block size, kappa, length model)
        shipped = ROOT / "patchkv_agent" / "profiles" / "shipped" / "smollm2-135m.json"
        profile = str(shipped) if "smollm2" in args.model and shipped.is_file() else "none"
    eng = PatchKVEngine.from_pretrained(args.model, device=device, dtype=getattr(torch, args.dtype),
                                        profile=resolve_profile_arg(profile))
    return eng, profile


def _versions(eng, n: int, args, rng) -> tuple[np.ndarray, np.ndarray, str]:
    """The checkpointed context (n ids) and the edited next version."""
    vocab = int(eng.spec.vocab_size)
    tok = eng.tokenizer
    if tok is not None and getattr(tok, "chat_template", None):
        from benchmarks.host_bench import _conversation

        msgs = _conversation(tok, n + 256, args.seed)
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
        while len(ids) < n:  # (the estimate fell short: repeat the conversation)
            ids = np.concatenate([ids, ids])
        old = ids[:n]
        other = np.asarray(tok(" ".join(str(x) for x in rng.integers(0, 10**6, args.edit_tokens)),
                               add_special_tokens=False)["input_ids"], dtype=np.int64)[: args.edit_tokens]
        tail = np.asarray(tok(text[-4000:], add_special_tokens=False)["input_ids"], dtype=np.int64)[-args.append:]
        source = "chat-template conversation (host_bench._conversation), cut to N ids"
    else:
        old = rng.integers(0, vocab, n).astype(np.int64)
        other = rng.integers(0, vocab, args.edit_tokens).astype(np.int64)
        tail = rng.integers(0, vocab, args.append).astype(np.int64)
        source = "random ids (no tokenizer)"
    cut = int(n * args.depth)
    new = np.concatenate([old[:cut], other, old[cut + len(other):], tail]).astype(np.int64)
    return old, new, source


def _med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:smollm2-135m@bf16",
                    help="random:SHAPE[@DTYPE], any --model of patchkv-agent, or 'tiny' (CI)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder of random: models (default: .gpu_assets/"
                                                      "tokenizer-smollm2, see patchkv_agent.loading)")
    ap.add_argument("--lengths", type=_ints, default=[8192, 32768])
    ap.add_argument("--strategies", default=STRATEGIES)
    ap.add_argument("--edit-tokens", type=int, default=200)
    ap.add_argument("--depth", type=float, default=0.5, help="where the edit starts (share of the context)")
    ap.add_argument("--append", type=int, default=64, help="ids appended after the edit (the next turn)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default=None, help="default: cuda when available")
    ap.add_argument("--dtype", default="bfloat16", help="for models without a dtype of their own (not random:X@DTYPE)")
    ap.add_argument("--profile", default="shape", help="'shape' (SmolLM2's shipped profile for smollm2 shapes, "
                                                       "else none), 'auto', 'none' or a profile path")
    ap.add_argument("--budget-s", type=float, default=None, help="start no new (length, strategy) after this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.tokenizer:
        os.environ["PATCHKV_RANDOM_TOKENIZER"] = args.tokenizer
    t_start = time.perf_counter()
    import torch
    import transformers

    from patchkv_agent.kernels import dispatch
    from patchkv_agent.loading import is_random

    eng, profile = _engine(args)
    load_s = time.perf_counter() - t_start
    device = eng.device
    from patchkv_agent.strategies import register_spec

    strategies = [register_spec(s.strip()) for s in args.strategies.split(",") if s.strip()]
    random_weights = is_random(eng.source) or args.model == "tiny"
    try:
        import triton

        triton_version = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_version = f"unavailable ({type(e).__name__})"
    out = {"label": LABEL if random_weights else "trained weights", "model": args.model,
           "random_weights": random_weights, "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."),
           "device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "torch": torch.__version__, "transformers": transformers.__version__, "triton": triton_version,
           "python": platform.python_version(), "kernel_backend": dispatch.get_backend(),
           "layers": eng.spec.num_layers, "kv_heads": eng.spec.num_kv_heads, "head_dim": eng.spec.head_dim,
           "profile": profile, "block_size": eng.settings.block_size, "kappa": eng.settings.kappa,
           "tokenizer": type(eng.tokenizer).__name__ if eng.tokenizer is not None else None,
           "edit_tokens": args.edit_tokens, "depth": args.depth, "append": args.append, "repeats": args.repeats,
           "warmup": args.warmup, "load_s": load_s, "checkpoints": [], "rows": [], "errors": [], "skipped": []}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save():
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")

    save()
    print(f"{args.model} ({LABEL if random_weights else 'trained'}) on {device}, loaded in {load_s:.1f}s; profile "
          f"{profile}, block {eng.settings.block_size}", file=sys.stderr)
    rng = np.random.default_rng(args.seed)
    for n in args.lengths:
        if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
            out["skipped"].append({"tokens": n, "why": "budget"})
            continue
        try:
            old, new, source = _versions(eng, n, args, rng)
            _sync(device)
            t = time.perf_counter()
            ckpt = eng.checkpoint(old)
            _sync(device)
            out["checkpoints"].append({"tokens": n, "checkpoint_ms": (time.perf_counter() - t) * 1e3,
                                       "source": source,
                                       **{k[:-2] + "_ms": (v * 1e3 if isinstance(v, float) else v) for k, v in ckpt.provenance.to_json().items()
                                          if k.endswith("_s")}})
        except Exception as e:  # noqa: BLE001 - this length fails, the next one may not
            out["errors"].append({"tokens": n, "stage": "checkpoint", "error": f"{type(e).__name__}: {e}"[:500]})
            save()
            continue
        by: dict[str, dict] = {}
        for s in strategies:
            if args.budget_s is not None and time.perf_counter() - t_start > args.budget_s:
                out["skipped"].append({"tokens": n, "strategy": s, "why": "budget"})
                continue
            runs = []
            try:
                for i in range(args.warmup + args.repeats):
                    _sync(device)
                    t = time.perf_counter()
                    res = eng.resume(ckpt, new, s, max_new_tokens=0)
                    _sync(device)
                    wall = time.perf_counter() - t
                    if i >= args.warmup:
                        st = res.stats
                        runs.append({"wall": wall, "ttft": st.ttft_s, "plan": st.plan_s, "restore": st.restore_s,
                                     "recompute": st.recompute_s, "recompute_tokens": st.recompute_tokens,
                                     "restore_tokens": st.restore_tokens, "payload_bytes": st.payload_bytes,
                                     "fallback": None if st.fallback is None else str(st.fallback),
                                     "kernel": st.extras.get("restore_kernel")})
                    del res
            except Exception as e:  # noqa: BLE001
                out["errors"].append({"tokens": n, "strategy": s, "error": f"{type(e).__name__}: {e}"[:500]})
                save()
                continue
            row = {"tokens": int(len(new)), "context_tokens": n, "strategy": s, "n": len(runs),
                   "wall_ms": _med(r["wall"] for r in runs) * 1e3, "wall_min_ms": min(r["wall"] for r in runs) * 1e3,
                   "wall_max_ms": max(r["wall"] for r in runs) * 1e3,
                   "ttft_ms": _med(r["ttft"] for r in runs) * 1e3,
                   "host_plan_ms": _med(r["plan"] for r in runs) * 1e3,
                   "restore_ms": (_med(r["restore"] for r in runs) or 0.0) * 1e3,
                   "recompute_ms": (_med(r["recompute"] for r in runs) or 0.0) * 1e3,
                   "recompute_tokens": runs[-1]["recompute_tokens"], "restore_tokens": runs[-1]["restore_tokens"],
                   "payload_bytes": runs[-1]["payload_bytes"], "restore_kernel": runs[-1]["kernel"],
                   "fallbacks": sorted({r["fallback"] for r in runs if r["fallback"]})}
            by[s] = row
            if "prefix" in by:
                for r in by.values():
                    r["vs_prefix"] = by["prefix"]["wall_ms"] / r["wall_ms"]
                    r["ttft_vs_prefix"] = by["prefix"]["ttft_ms"] / r["ttft_ms"]
            out["rows"].append(row)
            if device.type == "cuda":
                out.setdefault("peak_gib", {})[str(n)] = torch.cuda.max_memory_allocated(device) / 2**30
            save()
            print(f"{n:>6} {s:>10}: wall {row['wall_ms']:8.2f} ms  ttft {row['ttft_ms']:8.2f} ms  plan "
                  f"{row['host_plan_ms']:6.2f} ms  recompute {row['recompute_tokens']:>6}  restore "
                  f"{row['restore_tokens']:>6}", file=sys.stderr)
        del ckpt
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out["wall_s"] = time.perf_counter() - t_start
    save()
    print(f"resume bench: {len(out['rows'])} rows, {len(out['errors'])} errors -> {path}", file=sys.stderr)
    return 1 if out["errors"] or not out["rows"] else 0


if __name__ == "__main__":
    sys.exit(main())

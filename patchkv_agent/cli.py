"""The `patchkv-agent` command line: demo, replay, bench, bench-transport, stress, traces, calibrate.

Knows the engine, replay and workload builder through their public functions; prints tables and
writes JSON Lines, nothing more.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from tqdm import tqdm


def _table(rows: list[dict[str, Any]]) -> str:
    """A per-strategy summary table (medians over rows) as aligned text."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["strategy"], []).append(r)
    prefix_ttft = statistics.median(r["ttft_s"] for r in by["prefix"]) if "prefix" in by else None
    head = ["strategy", "ttft_ms", "vs_prefix", "recompute", "ratio", "payload_MiB", "kl", "top1", "tf", "exact_cont", "f1"]
    lines = [head]
    for s, rs in by.items():
        ttft = statistics.median(r["ttft_s"] for r in rs)

        def mean(f):
            vals = [float(r[f]) for r in rs if r.get(f) is not None]
            return statistics.fmean(vals) if vals else None

        def fmt(v, spec):
            return "-" if v is None else format(v, spec)

        lines.append([
            s, f"{ttft * 1e3:.1f}", fmt(prefix_ttft / ttft if prefix_ttft else None, ".2f") + "x",
            f"{statistics.fmean(r['recompute_tokens'] for r in rs):.0f}", f"{mean('recompute_ratio'):.3f}",
            f"{mean('payload_bytes') / 2**20:.2f}", fmt(mean("first_token_kl"), ".4f"), fmt(mean("top1_agree"), ".2f"),
            fmt(mean("tf_agree"), ".2f"), fmt(mean("exact_continuation"), ".2f"), fmt(mean("f1"), ".2f"),
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in lines)


def _engine(args):
    import torch

    from .engine import PatchKVEngine

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    from .profiles import resolve_profile_arg

    eng = PatchKVEngine.from_pretrained(args.model, block_size=args.block_size, dirty_window=args.dirty_window,
                                        profile=resolve_profile_arg(getattr(args, "profile", "auto")))
    print(f"loaded {args.model} in {time.perf_counter() - t:.1f}s (profile: {eng.profile_path or 'none'}; "
          f"block {eng.block_size}, kappa {eng.kappa})", file=sys.stderr)
    return eng


def _count_tokens(eng):
    from .eval.replay import plain_messages

    return lambda msgs: len(eng.encode(plain_messages(msgs)))


def _token_counter_for(model: str):
    """Chat-template token counter of a model's tokenizer (for `traces build --model`)."""
    from transformers import AutoTokenizer

    from .core.models import EMBEDDED_MODELS, ensure_embedded
    from .eval.replay import plain_messages

    if model in EMBEDDED_MODELS or model.endswith(".gguf"):
        path = ensure_embedded(model) if model in EMBEDDED_MODELS else __import__("pathlib").Path(model).resolve()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(model)

    def count(msgs):
        text = tok.apply_chat_template(plain_messages(msgs), tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


def cmd_replay(args) -> int:
    from .eval.replay import read_jsonl, replay_episode, write_jsonl

    if (args.traces is None) == (args.from_checkpointer is None):
        raise SystemExit("replay: pass a traces file (JSON Lines) or --from-checkpointer sqlite:PATH, not both")
    if args.from_checkpointer is not None:
        from .eval.replay import traces_from_checkpointer

        traces = traces_from_checkpointer(args.from_checkpointer, args.thread or None)
        if not traces:
            raise SystemExit(f"replay: no thread in {args.from_checkpointer} has two or more model contexts")
        print(f"{len(traces)} threads from {args.from_checkpointer}: "
              + ", ".join(f"{t['id']} ({len(t['versions'])} versions)" for t in traces))
    else:
        traces = read_jsonl(args.traces)
    traces = traces[: args.limit or None]
    eng = _engine(args)
    strategies = args.strategies.split(",")
    rows: list[dict] = []
    for tr in tqdm(traces, desc="replay", unit="episode"):
        rows.extend(replay_episode(eng, tr, strategies, max_new_tokens=args.max_new_tokens, model_name=args.model))
    write_jsonl(rows, args.out)
    print(_table(rows))
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


def cmd_demo(args) -> int:
    from .eval.replay import replay_episode, write_jsonl
    from .eval.workloads import build_traces

    eng = _engine(args)
    traces = build_traces(args.workload, args.edit, n=1, split="eval", target_tokens=args.target_tokens,
                          seed=args.seed, count_tokens=_count_tokens(eng))
    tr = traces[0]
    strategies = args.strategies.split(",")
    print(f"episode {tr['id']} ({tr['edit']}), strategies {strategies}; warming up ...", file=sys.stderr)
    list(replay_episode(eng, tr, ["exact"], max_new_tokens=2))  # warm-up: first calls pay allocator costs
    rows = list(tqdm(replay_episode(eng, tr, strategies, max_new_tokens=args.max_new_tokens, model_name=args.model),
                     total=len(strategies) * (len(tr["versions"]) - 1), desc="resume", unit="strategy"))
    r0 = next(r for r in rows if r["strategy"] != "exact") if len(rows) > 1 else rows[0]
    print(f"\n{tr['id']}: {r0['prompt_tokens']} tokens, prefix {r0['prefix_tokens']}, new {r0['new_tokens']}, "
          f"suffix {r0['suffix_tokens']}; answers {tr.get('answers')}")
    print(_table(rows))
    for r in rows:
        print(f"  {r['strategy']:>8}: {r['output_text']!r}")
    if args.out:
        write_jsonl(rows, args.out)
    return 0


def _shard(spec: str) -> tuple[int, int]:
    """``"I/K"`` -> ``(I, K)`` with ``0 <= I < K``; raises SystemExit naming the fix otherwise."""
    try:
        i, k = (int(x) for x in spec.split("/"))
    except ValueError:
        raise SystemExit(f"--shard must look like I/K (e.g. 0/2), got {spec!r}") from None
    if not 0 <= i < k:
        raise SystemExit(f"--shard {spec}: need 0 <= I < K")
    return i, k


def cmd_bench(args) -> int:
    from .eval.bench import markdown_table, read_results, run_bench, write_summary

    if args.summarize:
        summary = write_summary([r for f in args.summarize for r in read_results(f)], args.out_dir)
    else:
        from .eval.workloads import build_traces

        eng = _engine(args)
        count = _count_tokens(eng)
        traces = []
        for wl in args.workloads.split(","):
            traces += build_traces(wl, args.edit, n=args.n, split="eval", target_tokens=args.target_tokens,
                                   seed=args.seed, count_tokens=count)
        i, k = _shard(args.shard)
        traces = [t for j, t in enumerate(traces) if j % k == i]
        summary = run_bench(eng, traces, args.strategies.split(","), args.out_dir,
                            max_new_tokens=args.max_new_tokens, model_name=args.model, resume=args.resume)
        for e in summary["errors"]:
            print(f"skipped {e['id']}: {e['error']}", file=sys.stderr)
    print(markdown_table(summary))
    print("wrote " + ", ".join(summary["files"]), file=sys.stderr)
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="HF id, local dir, .gguf path or 'smollm2-135m'")
    p.add_argument("--block-size", type=int, default=None, help="default: the model's calibration profile, else 32")
    p.add_argument("--dirty-window", type=int, default=None,
                   help="fixed dirty window; default: the profile's length model, else 32 tokens")
    p.add_argument("--profile", default="auto",
                   help="calibration profile: 'auto' (calibration/profiles/ by model fingerprint), 'none' (the "
                        "built-in defaults), or a profile JSON path")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--strategies", default="exact,prefix,direct,patchkv")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="patchkv-agent", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="replay one edited episode on the embedded model and print the table")
    _common(p)
    p.add_argument("--workload", default="hotpotqa-e")
    p.add_argument("--edit", default="replace_tool_result")
    p.add_argument("--target-tokens", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the result rows (JSON Lines)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("replay", help="replay traces (TRACES.md) or a LangGraph SQLite checkpointer's threads; "
                                      "write results.jsonl")
    p.add_argument("traces", nargs="?", default=None, help="traces (JSON Lines)")
    p.add_argument("--from-checkpointer", default=None, metavar="sqlite:PATH",
                   help="read the message history at each checkpoint of the threads a LangGraph SqliteSaver stored")
    p.add_argument("--thread", action="append", default=[], metavar="ID",
                   help="with --from-checkpointer: only this thread (repeatable; default: all)")
    _common(p)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--out", default="results.jsonl")
    p.set_defaults(func=cmd_replay)

    from .eval.bench import DEFAULT_STRATEGIES, DEFAULT_WORKLOADS

    p = sub.add_parser("bench", help="replay the workloads' eval episodes under every strategy; summary + plots")
    _common(p)
    p.set_defaults(strategies=",".join(DEFAULT_STRATEGIES))
    p.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    p.add_argument("--edit", default="all", help="edit kind, or 'all' (kinds in rotation)")
    p.add_argument("--n", type=int, default=30, help="episodes per workload")
    p.add_argument("--target-tokens", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--resume", action="store_true", help="keep results.jsonl and skip episodes already in it")
    p.add_argument("--shard", default="0/1", metavar="I/K",
                   help="run only episodes I, I+K, I+2K, ... (0-based) of the list; run K processes with their own "
                        "--out-dir, then merge with --summarize DIR0/results.jsonl DIR1/results.jsonl ...")
    p.add_argument("--summarize", metavar="RESULTS", nargs="+", default=None,
                   help="only summarize these results.jsonl files (merged) into --out-dir (no model is loaded)")
    p.set_defaults(func=cmd_bench)

    from .eval import transport_bench
    from .eval.stress import add_stress_cli
    from .eval.workloads import add_traces_cli

    from .calibration.cli import add_calibrate_cli

    transport_bench.add_cli(sub)
    add_stress_cli(sub)
    add_calibrate_cli(sub)
    add_traces_cli(sub, token_counter_factory=_token_counter_for)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

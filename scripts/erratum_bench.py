"""The erratum repair on a benchmark's edited calls: a note that states what changed, instead of recomputing the
stale readers (benchmarks/erratum.py), beside direct reuse and the note alone.

Builds the episodes as ``patchkv-agent bench`` does (same workloads / n / seed / context options), replays every
edited call with the arms and writes result rows to ``OUT_DIR/results.jsonl``; pass ``--reference`` the
results.jsonl of the bench run whose noise floor the rows are scored against (its exact rows are checked
against this run's); ``OUT_DIR/summary.md`` scores every arm against that run's floor (``--summarize`` rescores a
finished run without a model).

Usage: .venv/bin/python scripts/erratum_bench.py --workloads hotpotqa-e,2wikimqa-e,nq-e --n 20 --seed 1 \
    --threads 1 --reference runs/results/noninferiority_seed1/qa/results.jsonl --out-dir runs/results/erratum/qa
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/ beside the package


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default=None, help="comma-separated (required unless --summarize)")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--versions", type=int, default=None)
    ap.add_argument("--target-tokens", type=int, default=3000)
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--arms", default=None, help="comma-separated (default: prefix,direct,erratum:direct,note-exact)")
    ap.add_argument("--place", default="end", choices=["end", "before-last"], help="where the note goes")
    ap.add_argument("--terse", action="store_true", help="name the changed messages only (no quotes)")
    ap.add_argument("--episodes", default=None, help="only these episode ids (comma-separated or @FILE)")
    ap.add_argument("--reference", nargs="*", default=(), help="results.jsonl files of the bench run to pool with")
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--summarize", action="store_true", help="only score OUT_DIR/results.jsonl (no model)")
    args = ap.parse_args()
    if args.summarize:
        return summarize(Path(args.out_dir), args.reference)
    if not args.workloads:
        ap.error("--workloads is required (unless --summarize)")

    import torch
    from tqdm import tqdm

    from benchmarks.bench_cli import episode_ids, only_episodes
    from benchmarks.erratum import ARMS, erratum_episode
    from patchkv_agent.engine import PatchKVEngine
    from patchkv_agent.eval.episodes import build_workload_traces
    from patchkv_agent.eval.traces import ResultsFile, plain_messages, read_results

    if args.threads:
        torch.set_num_threads(args.threads)
    eng = PatchKVEngine.from_pretrained(args.model)
    count = lambda msgs: len(eng.encode(plain_messages(msgs)))  # noqa: E731
    traces = []
    for wl in args.workloads.split(","):
        traces += build_workload_traces(wl, "all", n=args.n, target_tokens=args.target_tokens,
                                        n_versions=args.versions, seed=args.seed, count_tokens=count,
                                        context=args.context)
    if args.episodes:
        traces = only_episodes(traces, episode_ids(args.episodes))
    reference = {(r.get("id"), r.get("version")): r for f in args.reference for r in read_results(f)
                 if r.get("strategy") == "exact"} if args.reference else None
    arms = args.arms.split(",") if args.arms else list(ARMS)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with ResultsFile(out / "results.jsonl") as res:
        for tr in tqdm(traces, desc="erratum", unit="episode", file=sys.stderr):
            got = list(erratum_episode(eng, tr, arms, max_new_tokens=args.max_new_tokens, reference=reference,
                                      place=args.place, quote=not args.terse))
            res.write_many(got)
            rows += got
    return summarize(out, args.reference)


def summarize(out: Path, reference) -> int:
    """Score every arm of ``out/results.jsonl``: next action kept, the pooled non-inferiority score against the
    reference run's noise floor (its ``kv-bf16`` rows on the same calls), and per call the TTFT and the rows
    recomputed over ``prefix``'s (medians of the paired ratios); ``summary.json`` and ``summary.md``."""
    import statistics

    from benchmarks.noninferiority import non_inferiority
    from patchkv_agent.eval.traces import read_results

    rows = read_results(out / "results.jsonl")
    floor = [r for f in reference for r in read_results(f) if r.get("strategy") == "kv-bf16"]
    arms = list(dict.fromkeys(r["strategy"] for r in rows))
    by = {(r["id"], r["version"], r["strategy"]): r for r in rows}
    table = {}
    for a in arms:
        mine = [r for r in rows if r["strategy"] == a]
        pre = [by.get((r["id"], r["version"], "prefix")) for r in mine]
        ttft = [r["ttft_s"] / p["ttft_s"] for r, p in zip(mine, pre) if p and p["ttft_s"]]
        rws = [r["recompute_tokens"] / p["recompute_tokens"] for r, p in zip(mine, pre) if p and p["recompute_tokens"]]
        got = {"calls": len(mine), "kept": sum(bool(r["next_action"]) for r in mine),
               "ttft_over_prefix": statistics.median(ttft) if ttft else None,
               "rows_over_prefix": statistics.median(rws) if rws else None,
               "note_tokens": statistics.median(r["note_tokens"] for r in mine) if mine else None,
               "reference_mismatches": sum(1 for r in mine if r.get("reference_match") is False)}
        if floor:
            try:
                ni = non_inferiority(mine + floor, a)
                got.update({k: ni[k] for k in ("n", "b", "c", "floor_kept", "diff_per_100", "ci95_per_100", "meets")})
            except ValueError:
                pass
        table[a] = got
    (out / "summary.json").write_text(json.dumps(table, indent=1) + "\n")
    lines = ["| arm | calls | next action kept | floor kept | b | c | (b - c) per 100 (95 %) | TTFT / prefix | rows / prefix |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def f(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    for a, g in table.items():
        ci = g.get("ci95_per_100")
        lines.append(f"| {a} | {g['calls']} | {g['kept']} | {g.get('floor_kept', '-')} | {g.get('b', '-')} | "
                     f"{g.get('c', '-')} | {f(g.get('diff_per_100'), '+.1f')}"
                     f"{f' ({ci[0]:+.1f} to {ci[1]:+.1f})' if ci else ''} | {f(g['ttft_over_prefix'])} | "
                     f"{f(g['rows_over_prefix'])} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

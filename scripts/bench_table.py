"""Per-workload table of a bench run's strategies beside its noise floor: the figures docs/RESULTS.md quotes.

    .venv/bin/python scripts/bench_table.py runs/results/agent_n20_2026-12-04/results.jsonl \\
        [more results.jsonl ...] [--strategy patchkv] [--floor kv-bf16] [--calls-of results.jsonl]

Reads one or more ``results.jsonl`` (``docs/TRACES.md``; a later file's row replaces an earlier one's for the same
call and strategy, so a rerun of one strategy can be read beside the run that holds exact, prefix and the floor).
Per workload and pooled, for each strategy other than exact and the floors: next action agreeing with exact
(``next_action``), tool-call decisions, calls the strategy restored rows on (edited and not recomputed whole),
**rows** (recomputed rows summed over prefix's, summed), **cost** (rows plus the measured tail rule's probed rows at
``(check layer + 1) / layers`` of a row, ``--probe-share``), and the ratio of prefix's median TTFT to the strategy's
(the bench's ``speedup vs prefix``). Prints a Markdown table.

``--head-tokens STRATEGY:H`` adds ``STRATEGY+headH``: the strategy with the near-head rule (``head_tokens=H``) read
off the same run: a call whose prefix is shorter than ``H`` tokens and on which the strategy restored rows takes
prefix's row (what the rule runs there: the suffix recomputed whole, exact), every other call the strategy's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def load(paths: list[str]) -> dict[tuple[str, int, str], dict]:
    rows: dict[tuple[str, int, str], dict] = {}
    for p in paths:
        with open(p, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    rows[(r["id"], int(r["version"]), r["strategy"])] = r
    return rows


def table(rows: dict, floor: str, probe_share: float, strategies: list[str] | None = None) -> str:
    by: dict[str, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for (_, _, s), r in sorted(rows.items()):
        by[r["workload"]][s].append(r)
        by["all"][s].append(r)
    names = strategies or sorted({s for (_, _, s) in rows if s not in ("exact", "prefix") and not rows_floor(rows, s)})
    out = ["| workload | calls | floor " + floor + " | strategy | next action | tool-call decisions | restored on | "
           "rows | cost (probe counted) | x prefix (median TTFT) |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for wl, per in sorted(by.items(), key=lambda kv: (kv[0] == "all", kv[0])):
        fl = per.get(floor, [])
        prefix = {(r["id"], r["version"]): r for r in per.get("prefix", [])}
        for s in names:
            rs = [r for r in per.get(s, []) if r.get("next_action") is not None]
            if not rs:
                continue
            agree = sum(1 for r in rs if r["next_action"])
            calls = [r for r in rs if r.get("action_kind") == "call"]
            tool = f"{sum(1 for r in calls if r['next_action']) / len(calls):.3f}" if calls else "-"
            ref = [prefix.get((r["id"], r["version"])) for r in rs]
            den = sum(p["recompute_tokens"] for p in ref if p)
            rec = sum(r["recompute_tokens"] for r, p in zip(rs, ref) if p)
            probe = sum((r.get("tail_probe_tokens") or 0) for r, p in zip(rs, ref) if p)
            restored = sum(1 for r in rs if (r.get("restore_tokens") or 0) > 0)
            tt = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
            pt = [p["ttft_s"] for p in ref if p and p.get("ttft_s") is not None]
            speed = f"{statistics.median(pt) / statistics.median(tt):.2f}x" if tt and pt else "-"
            fa = sum(1 for r in fl if r.get("next_action"))
            cost = f"{rec / den:.2f} | {(rec + probe * probe_share) / den:.2f}" if den else "- | -"
            out.append(f"| {wl} | {len(rs)} | {fa} / {len(fl)} | {s} | {agree} / {len(rs)} | {tool} | {restored} | "
                       f"{cost} | {speed} |")
    return "\n".join(out)


def with_head_tokens(rows: dict, spec: str) -> dict:
    """``rows`` plus the derived ``<strategy>+head<H>`` rows of ``spec`` (``STRATEGY:H``; module docstring)."""
    name, _, h = spec.rpartition(":")
    if not name or not h.isdigit():
        raise SystemExit(f"--head-tokens wants STRATEGY:H (e.g. patchkv:150), got {spec!r}")
    out = dict(rows)
    for (i, v, s), r in rows.items():
        if s != name:
            continue
        p = rows.get((i, v, "prefix"))
        d = dict(r, strategy=f"{name}+head{h}")
        if p is not None and r.get("prefix_tokens", 0) < int(h) and (r.get("restore_tokens") or 0) > 0:
            d.update(recompute_tokens=p["recompute_tokens"], ttft_s=p.get("ttft_s"), restore_tokens=0,
                     tail_probe_tokens=0, next_action=True if p.get("next_action") is None else p["next_action"])
        out[(i, v, d["strategy"])] = d
    return out


def rows_floor(rows: dict, strategy: str) -> bool:
    return any(r.get("floor") for (_, _, s), r in rows.items() if s == strategy)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="results.jsonl files (later ones replace earlier rows)")
    ap.add_argument("--strategy", action="append", help="strategies to list (default: all but exact, prefix, floors)")
    ap.add_argument("--floor", default="kv-bf16")
    ap.add_argument("--calls-of", action="append", default=[], help="keep only the calls (id, version) these "
                    "results.jsonl hold (e.g. a rerun of a subset, read beside the run that holds its floor)")
    ap.add_argument("--probe-share", type=float, default=2 / 30,
                    help="a probed row's cost in recomputed rows: (tail_check_layer + 1) / layers (SmolLM2: 2 / 30)")
    ap.add_argument("--head-tokens", action="append", default=[], metavar="STRATEGY:H",
                    help="add STRATEGY with the near-head rule head_tokens=H, read off the same run (docstring)")
    args = ap.parse_args(argv)
    rows = load(args.results)
    for spec in args.head_tokens:
        rows = with_head_tokens(rows, spec)
    if args.calls_of:
        keep = {(i, v) for (i, v, _) in load(args.calls_of)}
        rows = {k: r for k, r in rows.items() if k[:2] in keep}
    print(table(rows, args.floor, args.probe_share, args.strategy))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Held-out recency-window selection on a real model, with the shipped profile's other settings (the agent stage of
``patchkv-agent calibrate`` run on its own: the main stages are not rerun).

    .venv/bin/python scripts/agent_window_heldout.py --workloads agent-clear --n 10 --windows 0,512,768,1024 \\
        --out runs/results/agent_stage_heldout.json

Episodes are the agent stage's (the 21st on of each workload: disjoint from ``bench --n 20``); the rule is
``choose_window_every`` (the target on every workload). Writes the selection with one row per scored version.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="agent-clear")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--windows", default="0,512,768,1024")
    ap.add_argument("--thresholds", default="", help="measured tail rule candidates at the largest window, e.g. "
                    "0.01,0.02,0.04 (none: windows only)")
    ap.add_argument("--tail-windows", default="", help="the windows the threshold candidates probe, e.g. 1024,32768 "
                    "(a window longer than the context probes the whole restored suffix; none: the largest window)")
    ap.add_argument("--min-restore", default="", help="small-restore rule candidates (min_restore_share), each run with "
                    "every threshold, e.g. 0,0.5 (none: the profile's)")
    ap.add_argument("--variants", default="", help="plan variant candidates (head-rewrite share, kappa, reader rule, "
                    "tail check layer and threshold), "
                    "comma-separated, each key=value[:key=value], e.g. 'rewrite_share=0.5,kappa=0.02,readers=none'")
    ap.add_argument("--variant-base", default=None, help="the candidate the variants run at, e.g. 1024@0.02/r0.5 "
                    "(default: the profile's own plan at the largest window)")
    ap.add_argument("--target", default="0.95", help="a share, or floor:<name> (floor:kv-bf16: the agreement a bf16 KV "
                    "cache reaches on the same calls, per workload)")
    ap.add_argument("--target-tokens", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from patchkv_agent.calibration.agent_stage import agent_traces, select_recent_window
    from patchkv_agent.calibration.stages import stage_engine, write_stage

    t0 = time.time()
    eng, count = stage_engine(args.model, threads=args.threads)
    traces = []
    for wl in (w.strip() for w in args.workloads.split(",") if w.strip()):
        traces += agent_traces(wl, n=args.n, skip=args.skip, target_tokens=args.target_tokens, count_tokens=count)
    rows: list = []
    sel = select_recent_window(eng, traces, windows=[int(w) for w in args.windows.split(",")], target=args.target,
                               max_new_tokens=48, rows=rows,
                               thresholds=[float(t) for t in args.thresholds.split(",") if t.strip()],
                               min_restore_shares=[float(m) for m in args.min_restore.split(",") if m.strip()],
                               variants=[v for v in args.variants.split(",") if v.strip()],
                               tail_windows=[int(w) for w in args.tail_windows.split(",") if w.strip()],
                               variant_base=args.variant_base)
    write_stage(sel, rows, args.out, t0, "scripts/agent_window_heldout.py", sys.argv[1:] if argv is None else argv)
    print(json.dumps(sel["grid_by_workload"]), "chosen", sel["chosen"], "tail_threshold", sel["chosen_tail_threshold"],
          "min_restore_share", sel["chosen_min_restore_share"], "variant", sel["chosen_variant"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

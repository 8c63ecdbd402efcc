"""The reader stage of ``patchkv-agent calibrate`` run on its own over a model's shipped profile (the main stages
are not rerun): the reader rule's constants chosen by edit-following on the ``calib`` split.

    .venv/bin/python scripts/reader_rule_heldout.py --workloads all --n 8 --out runs/results/reader_stage.json
    .venv/bin/python scripts/reader_rule_heldout.py --split eval --rules off,s0.1-b3-a2-g0.25,CHOSEN --out ...

Episodes: ``--n`` per edit-following workload from the ``calib`` split (``bench --workloads follow-...`` reads
``eval``; ``--split eval`` scores given rules on those held-out episodes); the rule is
:func:`patchkv_agent.calibration.reader_stage.choose_rule`. Writes the selection with one row per scored version.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workloads", default="all")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--split", default="calib", choices=("calib", "eval"))
    ap.add_argument("--rules", default="", help="rule names (off, s<min_share>-b<blocks>-a<attention>-g<budget>); "
                                                 "default: the stage's grid")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    from patchkv_agent.calibration.stages import _reader_workloads, stage_engine, write_stage
    from patchkv_agent.calibration.reader_stage import OFF, rule_grid, select_reader_rule
    from patchkv_agent.eval.follow import build_follow_traces

    t0 = time.time()
    eng, count = stage_engine(args.model, threads=args.threads)
    traces = []
    for w in _reader_workloads(args.workloads):
        traces += build_follow_traces(w, n=args.n, split=args.split, seed=args.seed, count_tokens=count)
    rules = None
    if args.rules:
        rules = []
        for name in args.rules.split(","):
            if name == OFF:
                rules.append({"name": OFF})
                continue
            m = re.fullmatch(r"s([0-9.]+)-b(\d+)-a(\d+)-g([0-9.]+)", name)
            if m is None:
                raise SystemExit(f"--rules: {name!r} is not 'off' or s<min_share>-b<blocks>-a<attention>-g<budget>")
            rules += rule_grid(min_shares=(float(m[1]),), min_blocks=(int(m[2]),), attention_blocks=(int(m[3]),),
                               budgets=(float(m[4]),), off=False)
    rows: list = []
    sel = select_reader_rule(eng, traces, rules=rules, target=args.target, rows=rows)
    sel["split"] = args.split
    write_stage(sel, rows, args.out, t0, "scripts/reader_rule_heldout.py", sys.argv[1:] if argv is None else argv)
    print(json.dumps({k: v for k, v in sel["grid"].items()}, indent=0))
    print("chosen", sel["chosen"], "target met", sel["target_met"], "exact follows", sel["n_exact_follows"],
          "of", sel["n_scored"], "resumes", sel["resumes"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a head rewrite's divergence comes from, and what repairs the next action (agent-summarize).

For each summarization version of ``agent-summarize`` traces (the call whose head the middleware replaced
by a summary), resumed from the exact KV of the call before it:

- next-action agreement with exact for ``direct``, ``patchkv`` at several ``kappa`` values, with and
  without mixed precision, and ``prefix`` (exact);
- drift of the restored rows: per layer, the relative error of restored K and V against a full prefill
  (which layers carry the stale view of the removed head);
- the share of the checkpoint's stored attention on the removed head (the statistic a plan rule can gate on).

    python scripts/rewrite_study.py --n 8 --out runs/rewrite_study.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=8, help="agent-summarize episodes")
    ap.add_argument("--target-tokens", type=int, default=4000)
    ap.add_argument("--kappas", default="0,0.15,0.3,0.5")
    ap.add_argument("--out", default="runs/rewrite_study.json")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be >= 1")
    kappas = [float(k) for k in args.kappas.split(",")]
    from tqdm import tqdm

    from patchkv_agent import PatchKVEngine
    from patchkv_agent.eval.metrics import NEXT_ACTION_TOKENS, next_action_agree
    from patchkv_agent.eval.traces import plain_messages, version_ids
    from patchkv_agent.eval.bench import build_workload_traces

    eng = PatchKVEngine.from_pretrained(args.model)
    count = lambda msgs: len(eng.encode(plain_messages(msgs)))  # noqa: E731
    traces = build_workload_traces("agent-summarize", n=args.n, target_tokens=args.target_tokens, count_tokens=count)
    cases = []
    for tr in traces:
        for k, e in enumerate(tr["meta"]["edits"]):
            if k and e == "summarize":
                cases.append((tr, k))
    text = lambda ids: eng.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    rows = []
    for tr, k in tqdm(cases, desc="rewrites", file=sys.stderr):
        old, new = version_ids(eng, tr["versions"][k - 1]), version_ids(eng, tr["versions"][k])
        ckpt = eng.checkpoint(old)
        ref = eng.resume(None, new, strategy="exact", max_new_tokens=NEXT_ACTION_TOKENS)
        ref_text = text(ref.output_ids)
        row = {"id": tr["id"], "version": k, "old_tokens": len(old), "new_tokens": len(new), "results": {}}
        edit = None
        runs = [("prefix", "prefix", {}), ("direct", "direct", {})] + [
            (f"patchkv k={kp}", "patchkv", {"kappa": kp}) for kp in kappas]
        for name, strat, opts in runs:
            t0 = time.perf_counter()
            res = eng.resume(ckpt, new, strategy=strat, max_new_tokens=NEXT_ACTION_TOKENS, **opts)
            edit = res.edit if edit is None else edit
            row["results"][name] = {"next_action": next_action_agree(text(res.output_ids), ref_text),
                                    "recompute_tokens": res.stats["recompute_tokens"],
                                    "ttft_s": res.stats["ttft_s"], "wall_s": time.perf_counter() - t0}
            if name == "direct":  # drift of restored rows per layer against the full prefill
                rest = np.setdiff1d(np.arange(len(new)), np.arange(res.exact_rows or len(new)))
                drift = []
                for layer, (kk, vv) in enumerate(zip(res.keys, res.values)):
                    rk, rv = ref.keys[layer][0][:, rest], ref.values[layer][0][:, rest]
                    dk = float((kk[0][:, rest] - rk).norm() / rk.norm().clamp_min(1e-9))
                    dv = float((vv[0][:, rest] - rv).norm() / rv.norm().clamp_min(1e-9))
                    drift.append({"layer": layer, "key_rel_err": dk, "value_rel_err": dv})
                row["drift"] = drift
        removed = np.concatenate([np.arange(sp.old_start, sp.old_end) for sp in edit.spans]) if edit.spans else []
        sc = ckpt.scores
        row["removed_tokens"] = int(len(removed))
        row["removed_attention_share"] = (float(np.asarray(sc)[removed].sum() / max(1e-12, float(np.sum(sc))))
                                          if sc is not None and len(removed) else None)
        row["suffix_tokens"] = int(edit.suffix_len)
        rows.append(row)
    summary = {}
    for name in (rows[0]["results"] if rows else {}):
        rs = [r["results"][name] for r in rows]
        summary[name] = {"next_action": sum(x["next_action"] for x in rs) / len(rs),
                         "recompute_tokens_mean": statistics.fmean(x["recompute_tokens"] for x in rs),
                         "ttft_s_median": statistics.median(x["ttft_s"] for x in rs)}
    if rows:
        layers = len(rows[0]["drift"])
        summary["drift_by_layer"] = [{"layer": i,
                                      "value_rel_err": statistics.fmean(r["drift"][i]["value_rel_err"] for r in rows),
                                      "key_rel_err": statistics.fmean(r["drift"][i]["key_rel_err"] for r in rows)}
                                     for i in range(layers)]
    out = {"model": args.model, "cases": len(rows), "summary": summary, "rows": rows,
           "command": "python scripts/rewrite_study.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for name, g in summary.items():
        if name != "drift_by_layer":
            print(f"{name:>16}: next action {g['next_action']:.2f}  recompute {g['recompute_tokens_mean']:.0f}  "
                  f"TTFT {g['ttft_s_median'] * 1e3:.0f} ms")
    print(f"wrote {args.out} ({len(rows)} summarization resumes)")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())

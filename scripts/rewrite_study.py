"""Where an agent edit's divergence comes from, and what repairs the next action (agent workloads).

For each edited version of an agent workload's traces (the call at which LangChain's middleware replaced
the history by a summary, cleared old tool results or offloaded a large one), resumed from the exact KV
of the call before it:

- next-action agreement with exact for ``direct``, ``patchkv`` (the shipped settings), ``patchkv`` at
  several ``kappa`` values, ``patchkv`` with the last ``R`` restored tokens also recomputed (a recency
  window), ``patchkv`` restored at FP16 and ``prefix`` (exact);
- drift of the restored rows: per layer, the relative error of restored K and V against a full prefill
  (which layers carry the stale view of what the edit removed);
- the share of the checkpoint's stored attention on the removed tokens (the statistic a plan rule can
  gate on) and the restored tail's size against the appended tokens.

    python scripts/rewrite_study.py --workload agent-summarize --n 8 --out runs/rewrite_study.json
    python scripts/rewrite_study.py --workload agent-clear --n 6 --recent 256,512 --out runs/clear_study.json
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


def _recent_strategy(window: int):
    """``patchkv`` whose plan also recomputes the blocks holding the last ``window`` restored tokens."""
    from patchkv_agent.core.plan import plan_blocks
    from patchkv_agent.strategies.builtin import PatchKVStrategy

    class Recent(PatchKVStrategy):
        name = f"patchkv+recent{window}"

        def plan(self, settings, ckpt, edit):
            base = super().plan(settings, ckpt, edit)
            if base.head_rewrite or not base.n_restore:
                return base
            last = base.restore_new_positions[-window:]
            ids = np.searchsorted(base.block_ends, last, side="right")
            return plan_blocks(edit, np.union1d(base.repair_blocks, ids), block_size=base.block_size,
                               strategy="patchkv")

    return Recent()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--workload", default="agent-summarize",
                    choices=("agent-summarize", "agent-clear", "agent-offload"))
    ap.add_argument("--n", type=int, default=8, help="episodes")
    ap.add_argument("--target-tokens", type=int, default=4000)
    ap.add_argument("--kappas", default="0,0.15,0.3,0.5", help="patchkv kappa values ('' for none)")
    ap.add_argument("--recent", default="", help="recency windows in tokens for patchkv+recentR ('' for none)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="runs/rewrite_study.json")
    args = ap.parse_args(argv)
    if args.n < 1:
        ap.error("--n must be >= 1")
    kappas = [float(k) for k in args.kappas.split(",") if k.strip()]
    recents = [int(r) for r in args.recent.split(",") if r.strip()]
    if args.threads:
        torch.set_num_threads(args.threads)
    from tqdm import tqdm

    from patchkv_agent import PatchKVEngine
    from patchkv_agent.eval.episodes import build_workload_traces
    from patchkv_agent.eval.metrics import NEXT_ACTION_TOKENS, next_action_agree
    from patchkv_agent.eval.traces import plain_messages, version_ids

    eng = PatchKVEngine.from_pretrained(args.model)
    count = lambda msgs: len(eng.encode(plain_messages(msgs)))  # noqa: E731
    traces = build_workload_traces(args.workload, n=args.n, target_tokens=args.target_tokens, count_tokens=count)
    cases = [(tr, k) for tr in traces for k, e in enumerate(tr["meta"]["edits"]) if k and e != "none"]
    text = lambda ids: eng.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    runs = [("prefix", "prefix", {}), ("direct", "direct", {}), ("patchkv", "patchkv", {}),
            ("patchkv fp16", "patchkv", {"precision": "fp16"})]
    runs += [(f"patchkv k={kp}", "patchkv", {"kappa": kp}) for kp in kappas]
    runs += [(f"patchkv+recent{r}", _recent_strategy(r), {}) for r in recents]
    rows = []
    for tr, k in tqdm(cases, desc=args.workload, file=sys.stderr):
        old, new = version_ids(eng, tr["versions"][k - 1]), version_ids(eng, tr["versions"][k])
        ckpt = eng.checkpoint(old)
        ref = eng.resume(None, new, strategy="exact", max_new_tokens=NEXT_ACTION_TOKENS)
        ref_text = text(ref.output_ids)
        row = {"id": tr["id"], "version": k, "edit": tr["meta"]["edits"][k], "source": tr["meta"]["source"],
               "old_tokens": len(old), "new_tokens": len(new), "results": {}}
        edit = None
        for name, strat, opts in runs:
            t0 = time.perf_counter()
            res = eng.resume(ckpt, new, strategy=eng.strategy(strat, opts or None), max_new_tokens=NEXT_ACTION_TOKENS)
            edit = res.edit if edit is None else edit
            row["results"][name] = {"next_action": next_action_agree(text(res.output_ids), ref_text),
                                    "recompute_tokens": res.stats["recompute_tokens"],
                                    "restore_tokens": res.stats.get("restore_tokens"),
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
        row["appended_tokens"] = int(len(new) - edit.prefix_len - edit.suffix_len)
        rows.append(row)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"partial": True, "rows": rows}, indent=2) + "\n")
    summary = {}
    for name in (rows[0]["results"] if rows else {}):
        rs = [r["results"][name] for r in rows]
        summary[name] = {"next_action": sum(x["next_action"] for x in rs) / len(rs),
                         "agree": sum(x["next_action"] for x in rs),
                         "recompute_tokens_mean": statistics.fmean(x["recompute_tokens"] for x in rs),
                         "ttft_s_median": statistics.median(x["ttft_s"] for x in rs)}
    if rows:
        layers = len(rows[0]["drift"])
        summary["drift_by_layer"] = [{"layer": i,
                                      "value_rel_err": statistics.fmean(r["drift"][i]["value_rel_err"] for r in rows),
                                      "key_rel_err": statistics.fmean(r["drift"][i]["key_rel_err"] for r in rows)}
                                     for i in range(layers)]
    out = {"model": args.model, "workload": args.workload, "cases": len(rows), "summary": summary, "rows": rows,
           "command": "python scripts/rewrite_study.py " + " ".join(argv or sys.argv[1:])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    for name, g in summary.items():
        if name != "drift_by_layer":
            print(f"{name:>20}: next action {g['agree']}/{len(rows)}  recompute {g['recompute_tokens_mean']:.0f}  "
                  f"TTFT {g['ttft_s_median'] * 1e3:.0f} ms")
    print(f"wrote {args.out} ({len(rows)} edited resumes of {args.workload})")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())

"""Offload stages of ``checkpoint_from`` on the default model: with the resume's own statistics (now) and with
the tail re-capture pass it ran before (``scores=None`` forces that path), side by side in one run.

    .venv/bin/python scripts/offload_breakdown.py [--tokens 3000] [--repeats 5] [--out runs/offload_breakdown.json]

Prints and writes medians of ``offload_s`` (whole call), ``stats_s`` (attention statistics), ``quantize_s``
(mixed-precision runs: per-block tags, quantization, checksums; split into ``value_residual_s``,
``key_residual_s``, ``tags_s`` and ``pack_s``) and ``copy_s`` (full-precision rows to the host), and whether
a forward (and so the model's forward lock) was needed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from patchkv_agent import PatchKVEngine
from patchkv_agent.eval.traces import version_ids
from patchkv_agent.eval.workloads import build_traces


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=3000, help="target context length (version 0)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    eng = PatchKVEngine.from_pretrained(args.model)
    tr = build_traces("hotpotqa-e", "replace_tool_result", n=1, split="eval", target_tokens=args.tokens,
                      count_tokens=lambda m: len(version_ids(eng, {"messages": m})))[0]
    v0, v1 = (version_ids(eng, v) for v in tr["versions"])
    res = eng.resume(eng.checkpoint(v0), v1, strategy="patchkv", max_new_tokens=0)
    rows = {"resume_statistics": [], "tail_recapture": []}
    for _ in range(args.repeats):
        for name, r in (("resume_statistics", res), ("tail_recapture", dataclasses.replace(res, scores=None))):
            st = eng.checkpoint_from(r).provenance.to_json()
            rows[name].append({k: float(st.get(k) or 0.0) for k in ("offload_s", "stats_s", "quantize_s", "copy_s",
                                                                    "value_residual_s", "key_residual_s", "tags_s",
                                                                    "pack_s")})
    out = {"model": args.model, "context_tokens": len(v1), "repeats": args.repeats, "resume_ttft_s": res.stats["ttft_s"]}
    for name, rs in rows.items():
        out[name] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[name]["needs_forward_lock"] = name == "tail_recapture"
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

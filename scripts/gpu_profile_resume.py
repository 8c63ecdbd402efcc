"""Where a GPU resume's time goes: torch.profiler over resumes of one edited context per strategy (random weights).

    python3 scripts/checkout_run.py scripts/gpu_profile_resume.py --out DIR [--tokens 8192] [--strategies direct,...]

Per strategy: the engine's own split (plan / restore / recompute), the wall time with and without the side-stream
restore (``PATCHKV_SYNC_RESTORE=1`` runs it on the compute stream), and the profiler's top operators by self CPU
time and by CUDA time, written as text tables to ``DIR/profile_<strategy>.txt`` and summarised on stdout.
Timing only (random weights); see scripts/gpu_check.sh for the full device run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:smollm2-135m@bf16")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--strategies", default="prefix,direct,patchkv")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    import numpy as np
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_resume_bench import _engine, _versions  # noqa: E402

    from patchkv_agent.strategies import register_spec

    ns = argparse.Namespace(model=args.model, device=None, dtype="bfloat16", profile="shape", lengths=[args.tokens],
                            edit_tokens=200, append=64, depth=0.5, seed=0)
    eng, _ = _engine(ns)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    old, new, _ = _versions(eng, args.tokens, ns, np.random.default_rng(0))
    ckpt = eng.checkpoint(old)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = {}
    for s in (register_spec(x.strip()) for x in args.strategies.split(",") if x.strip()):
        for _ in range(2):
            eng.resume(ckpt, new, s, max_new_tokens=0)
        sync()
        walls, parts = [], []
        for _ in range(args.repeats):
            sync()
            t = time.perf_counter()
            res = eng.resume(ckpt, new, s, max_new_tokens=0)
            sync()
            walls.append((time.perf_counter() - t) * 1e3)
            st = res.stats
            parts.append({k: st[k] * 1e3 for k in ("plan_s", "restore_s", "recompute_s", "ttft_s")})
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(2):
                eng.resume(ckpt, new, s, max_new_tokens=0)
            sync()
        ka = prof.key_averages()
        cpu = ka.table(sort_by="self_cpu_time_total", row_limit=30)
        dev = ""
        for key in ("device_time_total", "cuda_time_total"):
            try:
                dev = ka.table(sort_by=key, row_limit=20) if cuda else ""
                break
            except Exception:  # noqa: BLE001 - the key's name moved between torch versions
                continue
        name = s.replace(":", "_")
        (out_dir / f"profile_{name}.txt").write_text(cpu + "\n\n" + dev + "\n")
        med = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
        summary[s] = {"wall_ms": statistics.median(walls), **{k.replace("_s", "_ms"): v for k, v in med.items()},
                      "recompute_tokens": int(res.stats["recompute_tokens"]),
                      "restore_tokens": int(res.stats["restore_tokens"])}
        print(f"== {s}: {json.dumps(summary[s])}")
        print("\n".join(cpu.splitlines()[:18]))
    (out_dir / "profile_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Cost of the attention statistics (``capture``) in the checkpoint pass, against a plain prefill.

Usage::

    .venv/bin/python scripts/capture_cost.py --tokens 3000 --repeats 5 --out runs/capture_cost.json

Times the same prefill forward (``recovery.execute`` over the whole context, as ``engine.checkpoint``
runs it) with and without :class:`patchkv_agent.core.capture.AttentionCapture`, alternating the two so load
swings hit both alike, and reports the medians and the relative extra time (target: < 5 %).

Boundary: loads a model through the engine, runs forwards, prints and writes JSON; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from patchkv_agent.engine import PatchKVEngine
    from patchkv_agent.core.recovery import FullRecompute, execute
    from patchkv_agent.eval.transport_bench import _context

    eng = PatchKVEngine.from_pretrained(args.model, profile=None)
    ids = torch.tensor(_context(eng, args.tokens), dtype=torch.long)
    plan = FullRecompute(new_len=len(ids))
    times: dict[str, list[float]] = {"plain": [], "capture": []}
    with torch.inference_mode():
        execute(eng.model, eng.spec, ids, plan)  # warm-up
        for _ in range(args.repeats):
            for mode in ("plain", "capture"):
                cap = eng._capture() if mode == "capture" else None
                t = time.perf_counter()
                if cap is None:
                    execute(eng.model, eng.spec, ids, plan)
                else:
                    with cap:
                        execute(eng.model, eng.spec, ids, plan)
                    cap.scores()
                times[mode].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"model": args.model, "tokens": len(ids), "repeats": args.repeats, "threads": torch.get_num_threads(),
           "plain_s": med["plain"], "capture_s": med["capture"], "extra": med["capture"] / med["plain"] - 1.0,
           "all_s": times}
    print(f"{len(ids)} tokens: plain prefill {med['plain']:.3f} s, with capture {med['capture']:.3f} s "
          f"({out['extra'] * 100:+.1f} %; median of {args.repeats}, alternating)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

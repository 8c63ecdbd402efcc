"""The planner A/B: a baseline ``plan.py`` (e.g. ``git show <rev>:patchkv_agent/core/plan.py > /tmp/plan_old.py``)
against the installed one, alternating on the same edits, with a copy of ``--evict-mb`` MB before each call so the
caches are as cold as after a resume's KV copy; prints the medians (microseconds) per context length.

    .venv/bin/python scripts/plan_ab.py /tmp/plan_old.py --lengths 2048,8192,32768,131072

The edits and checkpoints are ``bench-host``'s (one edit replacing 10 tokens by 20, lexical readers, built-in
settings). Times only; the baseline's plans are not compared (tests/test_host_path.py checks plans).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("baseline", help="path of the baseline plan.py")
    ap.add_argument("--lengths", default="2048,8192,32768,131072")
    ap.add_argument("--calls", type=int, default=400, help="timed calls per planner and length")
    ap.add_argument("--evict-mb", type=int, default=16, help="MB copied before each call (0: warm caches)")
    args = ap.parse_args(argv)

    import torch

    from patchkv_agent.core import plan as new_plan
    from patchkv_agent.core.diff import diff_versions
    from patchkv_agent.core.settings import RecoverySettings
    from patchkv_agent.eval.host_bench import _checkpoint, _versions, host_engine

    spec = importlib.util.spec_from_file_location("patchkv_agent.core._plan_baseline", args.baseline)
    old_plan = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = old_plan
    spec.loader.exec_module(old_plan)
    torch.set_num_threads(1)
    eng = host_engine()
    big = torch.ones(max(1, args.evict_mb) * (1 << 18))
    dst = torch.empty_like(big)
    for n in (int(x) for x in args.lengths.split(",")):
        old, new = _versions(n, 1, 4096, n + 1)
        ckpt = _checkpoint(eng, old, 0)
        edit = diff_versions(ckpt.token_ids, new, words=eng.words, old_words=ckpt.words)
        edit.new_words()
        kw = dict(length_model=eng.settings.length_model, block_size=eng.settings.block_size, readers="lexical")
        settings = RecoverySettings(**kw)
        times: dict[str, list[float]] = {"baseline": [], "this tree": []}
        for _ in range(args.calls):
            for name, mod in (("baseline", old_plan), ("this tree", new_plan)):
                if args.evict_mb:
                    dst.copy_(big)
                t = time.perf_counter()
                if hasattr(mod, "PlanDraft"):  # plan_repair(edit, scores, settings)
                    mod.plan_repair(edit, ckpt.scores, settings)
                else:  # a baseline from before the settings object
                    mod.plan_repair(edit, ckpt.scores, **kw)
                times[name].append(time.perf_counter() - t)
        print(n, "  ".join(f"{k} {statistics.median(v) * 1e6:.0f} us" for k, v in times.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

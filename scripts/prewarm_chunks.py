"""How long a call of another thread waits behind a prewarm, by the prewarm's chunk size and priority.

Starts vLLM's CPU build on the embedded model (``--scheduling-policy priority``; or ``--base-url`` a running
one), caches a 2,000-token context, then for each (chunk, priority) prewarms 4,096 new ids as requests on
growing prefixes while three calls of 200 new tokens on the cached context come 0.8 s apart; prints each
call's latency beside the same call on an idle server, and each prewarm's total time. JSON to ``--out``.

Usage: .venv/bin/python scripts/prewarm_chunks.py [--base-url URL] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/ beside the package


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", default=None, help="a running vLLM's OpenAI base URL (default: start one)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    srv = None
    if args.base_url is None:
        from benchmarks.servers import vllm_server

        srv = vllm_server()  # started and ready
    url = args.base_url or srv.base_url
    rng = random.Random(1)

    def post(body: dict) -> float:
        req = urllib.request.Request(url + "/completions", data=json.dumps({"model": args.model, "max_tokens": 1,
                                     **body}).encode(), headers={"content-type": "application/json"})
        t = time.perf_counter()
        json.load(urllib.request.urlopen(req, timeout=600))
        return time.perf_counter() - t

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    try:
        ctx = ids(2000)
        post({"prompt": ctx, "cache_salt": "call"})
        out = {"idle_s": [post({"prompt": ctx + ids(200), "cache_salt": "call"}) for _ in range(3)], "runs": []}
        for chunk, prio in ((None, None), (1024, None), (512, None), (512, 1), (256, 1)):
            warm, salt, took = ids(4096), f"warm-{time.time()}", {}

            def prewarm() -> None:
                t0 = time.perf_counter()
                for end in (list(range(chunk, 4096, chunk)) + [4096]) if chunk else [4096]:
                    post({"prompt": warm[:end], "cache_salt": salt, **({"priority": prio} if prio else {})})
                took["s"] = time.perf_counter() - t0

            th = threading.Thread(target=prewarm)
            th.start()
            calls = []
            for _ in range(3):
                time.sleep(0.8)
                calls.append(post({"prompt": ctx + ids(200), "cache_salt": "call"}))
            th.join()
            out["runs"].append({"chunk": chunk, "priority": prio, "calls_s": calls, "prewarm_s": took["s"]})
            print(f"chunk {chunk}, priority {prio}: calls {[round(c, 3) for c in calls]} s, prewarm {took['s']:.2f} s")
        print(f"idle server: calls {[round(c, 3) for c in out['idle_s']]} s")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        if srv is not None:
            srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

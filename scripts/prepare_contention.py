"""A foreground resume of one thread while another thread's next context is prepared in the background.

Measures what the tool-wait preparation costs the other threads of the same model: thread A's next context
(``--tokens`` long, edited ``--depth`` deep) is prepared in chunks of ``--chunk`` rows while thread B resumes
an append of ``--append`` tokens, repeatedly. Reports B's resume time alone and during A's preparation
(medians, max), the background chunk's forward time, and A's preparation time alone and under B's load.
The forward lock hands B the model after the chunk that runs (``ForwardLock.background``), so B's delay is
bounded by one chunk; on CUDA the chunks also run on a low-priority stream of their own.

    python scripts/prepare_contention.py --model smollm2-135m --tokens 6000 --out prep.json   # GPU or CPU
    python scripts/prepare_contention.py --tiny --out prep.json                               # CI size
    python scripts/prepare_contention.py --model random:smollm2-135m@bf16 --out prep.json     # GPU, no weights
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/ beside the package

import numpy as np


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (no download; CI size)")
    ap.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    ap.add_argument("--tokens", type=int, default=6000, help="thread A's context")
    ap.add_argument("--depth", type=float, default=0.8, help="where A's edit is (share of its context)")
    ap.add_argument("--append", type=int, default=64, help="tokens B's resume appends")
    ap.add_argument("--chunk", type=int, default=256, help="background rows per forward")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from patchkv_agent.engine import PatchKVEngine
    from patchkv_agent.loading import is_random
    from benchmarks.tiny import tiny_engine
    from patchkv_agent.runtime.threads import ThreadRegistry, thread_key

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        eng = tiny_engine("llama", max_positions=max(4096, args.tokens + 512), device=device)
    else:
        eng = PatchKVEngine.from_pretrained(args.model, device=device)
    rng = np.random.default_rng(0)
    vocab = min(eng.spec.vocab_size, 30000)
    n = min(args.tokens, eng.spec.max_positions - args.append * (args.repeats + 2) - 8)
    reg = ThreadRegistry(eng, prepare_chunk_tokens=args.chunk)
    a, b = thread_key("A"), thread_key("B")
    ctx_a = rng.integers(0, vocab, n)
    ctx_b = rng.integers(0, vocab, max(256, n // 2))
    reg.generate(a, ctx_a, max_new_tokens=0)
    reg.generate(b, ctx_b, max_new_tokens=0)
    cut = int(n * args.depth)
    pred_a = np.concatenate([ctx_a[:cut], ctx_a[cut + 64:]])

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def resume_b() -> float:
        nonlocal ctx_b
        ctx_b = np.concatenate([ctx_b, rng.integers(0, vocab, args.append)])
        sync()
        t0 = time.perf_counter()
        reg.generate(b, ctx_b, max_new_tokens=0)
        sync()
        return time.perf_counter() - t0

    def prepare_a() -> tuple[float, dict]:
        fut = reg.prepare_async(a, lambda: pred_a)
        t0 = time.perf_counter()
        res = fut.result()
        sync()
        th = reg.table.peek(reg.active(a))  # the preparation's own stats (reading, not driving, the registry)
        prep = th.preparation.result if th is not None and th.preparation is not None else None
        st = prep.stats.prepare.to_dict() if prep is not None else {}
        # a new version of A so that the next preparation is one again
        reg.generate(a, np.concatenate([pred_a, rng.integers(0, vocab, 4)]), max_new_tokens=0)
        return time.perf_counter() - t0 if res is not None else float("nan"), st

    resume_b()  # warm-up
    alone = [resume_b() for _ in range(args.repeats)]
    prep_alone, st = prepare_a()
    prep_alone = [prep_alone] + [prepare_a()[0] for _ in range(max(0, args.repeats // 2))]
    chunk_s = st.get("forward_s", 0.0) / max(1, st.get("chunks", 1))
    during, prep_loaded = [], []
    for _ in range(args.repeats):
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(p=prepare_a()[0]))
        t.start()
        time.sleep(min(0.5, 2 * chunk_s))  # A's preparation is under way
        during.append(resume_b())
        t.join()
        prep_loaded.append(box.get("p"))
    random_weights = args.tiny or is_random(eng.source)
    out = {"device": device, "model": "tiny" if args.tiny else args.model,
           "label": "random weights, timing only" if random_weights else "trained weights",
           "dtype": str(next(eng.model.parameters()).dtype).removeprefix("torch."), "tokens": n, "depth": args.depth,
           "chunk": args.chunk, "append": args.append, "repeats": args.repeats,
           "b_resume_alone_s": {"median": statistics.median(alone), "max": max(alone)},
           "b_resume_during_preparation_s": {"median": statistics.median(during), "max": max(during)},
           "b_delay_median_s": statistics.median(during) - statistics.median(alone),
           "background_chunk_forward_s": chunk_s, "chunks": st.get("chunks"),
           "a_preparation_alone_s": statistics.median(prep_alone),
           "a_preparation_under_b_s": statistics.median(x for x in prep_loaded if x is not None)}
    out["b_delay_in_chunks"] = out["b_delay_median_s"] / chunk_s if chunk_s else None
    print(json.dumps(out, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    reg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``patchkv-agent bench-server``: the command line of :mod:`.server_bench`.

Checks every option before anything starts, starts the engine on the embedded model (unless ``--base-url``
names a running one), runs :func:`~benchmarks.server_bench.run_server_bench` at each thread count and
writes the rows, the summary and the plot.

Boundary: argparse and :mod:`.server_bench` / :mod:`.servers`; no serving logic of its own.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from .server_bench import WORKLOADS, markdown_server, run_server_bench, server_episodes, write_server

__all__ = ["add_cli", "cmd_bench_server"]


def _positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of seconds") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"{s!r} must be a finite number >= 0")
    return v


def _threads(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--threads takes comma-separated counts such as 1,4, got {s!r}") from None
    if not out or any(n < 1 or n > 64 for n in out):
        raise argparse.ArgumentTypeError(f"--threads takes counts from 1 to 64, got {s!r}")
    return out


def _chunk(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        n = -1
    if not 0 <= n <= 1 << 20:
        raise argparse.ArgumentTypeError(f"--chunk-tokens takes a token count from 0 (one request) up, got {s!r}")
    return n


def _priority(s: str) -> int | None:
    if s == "none":
        return None
    try:
        n = int(s)
    except ValueError:
        n = 1 << 31
    if not -(1 << 20) <= n <= 1 << 20:
        raise argparse.ArgumentTypeError(f"--priority takes an integer such as 1, or 'none', got {s!r}")
    return n


def add_cli(sub) -> None:
    """The ``bench-server`` subcommand."""
    p = sub.add_parser("bench-server", help="agents on a live vLLM / llama.cpp server with and without the tool-wait "
                                            "prewarm, side by side (JSON, markdown, plot)")
    p.add_argument("--engine", default="vllm", choices=("vllm", "llama.cpp"),
                   help="the engine to start on the embedded model (scripts/serving_setup.sh sets it up)")
    p.add_argument("--base-url", default=None, help="use a running server at this OpenAI base URL instead of starting one")
    p.add_argument("--served-model", default="smollm2", help="the model name the server serves")
    p.add_argument("--episodes", type=int, default=10, help="episodes per workload (each run twice)")
    p.add_argument("--workloads", default="clear,summarize", help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    p.add_argument("--context", type=int, default=4000, help="the context the editors keep the agent near (tokens)")
    p.add_argument("--tool-latency", type=_positive_float, default=6.0, help="seconds each tool takes")
    p.add_argument("--cover", action="store_true", help="each tool lasts at least until its thread's prewarm is over")
    p.add_argument("--threads", type=_threads, default=[1], help="comma-separated: episodes at once per phase (1,4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each call decodes at most")
    p.add_argument("--seed", type=int, default=0, help="rotates the research histories")
    p.add_argument("--keep", type=int, default=None,
                   help="tool results the editors keep (summarize: twice as many messages); default: the workloads'")
    p.add_argument("--chunk-tokens", type=_chunk, default=None,
                   help="the most ids one prewarm request adds (default: the adapter's; 0: one request)")
    p.add_argument("--priority", type=_priority, default=1,
                   help="the prewarms' scheduling priority (vLLM: a call's is 0, lower goes first), or 'none'")
    p.add_argument("--out-dir", default="runs/server_bench")
    p.set_defaults(func=cmd_bench_server)


def cmd_bench_server(args) -> int:
    """``patchkv-agent bench-server``: check the options, start the engine (unless ``--base-url``), run."""
    import sys

    from patchkv_agent.usage import UsageError

    wls = [w for w in args.workloads.split(",") if w]
    bad = [w for w in wls if w not in WORKLOADS]
    if bad or not wls:
        raise UsageError(f"--workloads: {bad or args.workloads!r} not among {', '.join(WORKLOADS)}")
    if not 1 <= args.episodes <= 1000 or not 500 <= args.context <= 32768 or not 1 <= args.max_tokens <= 4096:
        raise UsageError("--episodes takes 1-1000, --context 500-32768 tokens, --max-tokens 1-4096")
    if args.base_url is not None:
        from patchkv_agent.serving.http import Endpoint

        try:
            Endpoint.from_base_url(args.base_url)
        except ValueError as e:
            raise UsageError(f"--base-url: {e}") from None
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out-dir {out} is not a directory; pick a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / ".write-test").write_text("")
        (out / ".write-test").unlink()
    except OSError as e:
        raise UsageError(f"--out-dir {out}: not writable ({e.strerror}); pick another directory") from None
    if args.keep is not None and not 1 <= args.keep <= 64:
        raise UsageError(f"--keep takes 1-64 tool results, got {args.keep}")
    episodes = server_episodes(args.episodes, wls, context=args.context, seed=args.seed, keep=args.keep)
    srv = None
    if args.base_url is None:
        from . import servers

        try:
            srv = (servers.vllm_server() if args.engine == "vllm" else
                   servers.llama_server(parallel=max(args.threads), ctx_per_slot=max(8192, args.context * 2)))
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
        base_url, erase = srv.base_url, srv.erase_cache
    else:
        base_url, erase = args.base_url, None
    try:
        rows: list[dict] = []
        for n in args.threads:
            rows += run_server_bench(base_url, args.served_model, episodes, tool_latency=args.tool_latency,
                                     cover=args.cover, max_tokens=args.max_tokens, salt=args.engine == "vllm",
                                     threads=n, before_run=erase,
                                     options={"chunk_tokens": args.chunk_tokens, "priority": args.priority})
    finally:
        if srv is not None:
            srv.stop()
    command = "patchkv-agent " + " ".join(getattr(args, "argv", []) or [])
    summary = write_server(rows, out, engine=args.engine, command=command)
    print(markdown_server(summary, engine=args.engine, command=command))
    print(f"wrote {out}/server_results.jsonl, server_summary.json, server_summary.md, server_ttft.png", file=sys.stderr)
    return 0

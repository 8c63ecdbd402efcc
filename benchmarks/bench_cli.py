"""The ``bench`` and ``bench-loop`` commands: their parsers, checks and runs.

Registered by :func:`patchkv_agent.cli_bench.add_benchmark_parsers` when one of them runs; builds on the
command line's shared options and engine loading (:mod:`patchkv_agent.cli`) and on the runners here
(:mod:`.bench`, :mod:`.loop_bench`, :mod:`.prepared_bench`).
"""

from __future__ import annotations

import sys

from patchkv_agent import cli as _cli  # the engine loading by attribute, so a test can replace cli._engine
from patchkv_agent.cli import _CONTEXT_HELP, _at_least_two, _common, _non_negative, _workload_names
from patchkv_agent.cli_args import (DEFAULT_TOOL_LATENCIES, _check_strategies, _check_workloads, _floors, _reason,
                                    _shard, _sweep)
from patchkv_agent.usage import UsageError


def add_cli(sub) -> None:
    """Add ``bench`` and ``bench-loop`` to ``sub`` (an argparse subparsers action)."""
    from .bench import DEFAULT_WORKLOADS, FOLLOW_STRATEGIES, NOREADERS

    p = sub.add_parser("bench", help="replay the workloads' eval episodes under every strategy; summary + plots")
    _common(p)
    p.set_defaults(strategies=None)  # resolved by bench_defaults: DEFAULT_STRATEGIES, or with --follow ...
    p.add_argument("--workloads", default=None, help=f"comma-separated, from: {_workload_names()} (default: "
                                                       f"{','.join(DEFAULT_WORKLOADS)}; with --follow the four "
                                                       "follow-* workloads)")
    p.add_argument("--follow", action="store_true",
                   help="the edit-following benchmark: the follow-* workloads under "
                        f"{','.join(FOLLOW_STRATEGIES)} unless --workloads / --strategies say otherwise "
                        f"({NOREADERS}: patchkv with the reader blocks off)")
    p.add_argument("--edit", default="all", help="edit kind, or 'all' (kinds in rotation)")
    p.add_argument("--noise-floor", default=None, metavar="FLOORS",
                   help="also run accepted approximations of exact (bf16 / int8 / fp8 KV cache, bf16 weights; CPU "
                        "emulations) on the same calls; the summary and agreement_<workload>.png show them beside "
                        "the strategies: 'default', 'all', or names")
    p.add_argument("--n", type=int, default=30, help="episodes per workload")
    p.add_argument("--target-tokens", type=int, default=3000)
    p.add_argument("--context", type=int, default=None, metavar="TOKENS", help=_CONTEXT_HELP)
    p.add_argument("--versions", type=_at_least_two, default=None,
                   help="context versions per episode, >= 2 (default: 2 for QA and follow workloads, 5 for the "
                        "agent workloads: the call before the first edit and the calls after it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_out")
    p.add_argument("--resume", action="store_true", help="keep results.jsonl and skip episodes already in it")
    p.add_argument("--heal", default="patchkv",
                   help="strategies whose state is healed between versions, as the thread registry does while a "
                        "tool runs (comma-separated; 'none': every approximation is carried forward)")
    p.add_argument("--shard", default="0/1", metavar="I/K",
                   help="run only episodes I, I+K, I+2K, ... (0-based) of the list; run K processes with their own "
                        "--out-dir, then merge with --summarize DIR0/results.jsonl DIR1/results.jsonl ...")
    p.add_argument("--episodes", default=None, metavar="IDS",
                   help="run only the episodes with these ids (comma-separated, or @FILE with one id per line): a "
                        "subset of the calls of an earlier run with the same options, e.g. the calls a second "
                        "--threads run of the floor decides")
    p.add_argument("--summarize", metavar="RESULTS", nargs="+", default=None,
                   help="only summarize these results.jsonl files (merged) into --out-dir (no model is loaded)")
    p.add_argument("--floor-repeat", metavar="RESULTS", nargs="+", default=None,
                   help="with --summarize: results.jsonl files of a second run of the noise floor on the same calls "
                        "(e.g. at another --threads); a call whose floor verdict differs between the runs is a "
                        "near-tie in the non-inferiority score")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("bench-loop", help="the agent loop: call -> tool sleep L -> edited call; end-to-end TTFT vs L, "
                                          "patchkv vs prefix (JSON + plot)")
    _common(p)
    p.set_defaults(strategies="patchkv,prefix")
    p.add_argument("--workloads", default="hotpotqa-e", help=f"comma-separated, from: {_workload_names()}; with "
                                                            "--tool-latency only the agent-* ones")
    p.add_argument("--edit", default="all", help="edit kind, or 'all' (kinds in rotation)")
    p.add_argument("--n", type=_non_negative, default=3, help="episodes per workload")
    p.add_argument("--versions", type=int, default=3, help="context versions per episode (model calls per loop)")
    p.add_argument("--target-tokens", type=int, default=1200)
    p.add_argument("--context", type=int, default=None, metavar="TOKENS", help=_CONTEXT_HELP)
    p.add_argument("--tool-latencies", default=None,
                   help=f"the sweep: comma-separated tool seconds L (default {DEFAULT_TOOL_LATENCIES}); every "
                        "(strategy, L) pass over the episodes")
    p.add_argument("--tool-latency", default=None, metavar="SPEC",
                   help="instead of the sweep, the agent loop with the tool-wait preparation (agent workloads): "
                        "each call's tools take SPEC seconds: fixed ('2') or per tool name ('search=1.5,bash=4', "
                        "'*=2' for the others; tools called together run in parallel); per call: the prepared "
                        "call, today's patchkv resume, prefix and the no-edit floor (loop_prepared.json, .md, "
                        ".png)")
    p.add_argument("--cover-preparation", action="store_true",
                   help="with --tool-latency: each tool lasts at least until its thread's background work "
                        "(preparation, offload) is over, however slow the machine")
    p.add_argument("--prepare-chunk", type=int, default=None, metavar="ROWS",
                   help="with --tool-latency: rows per background forward of a preparation (default: the "
                        "registry's, 256 on an accelerator, 64 on a CPU)")
    p.add_argument("--exact-reference", action="store_true",
                   help="with --tool-latency: the next action's reference is a full prefill of each version "
                        "(default: the prefix resume, which is exact, at no extra cost)")
    p.add_argument("--agents", type=_non_negative, default=0,
                   help="also run this many agent threads concurrently (throughput, p50/p95 end-to-end TTFT)")
    p.add_argument("--agents-tool-s", type=float, default=0.1, help="tool latency of the concurrent phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="bench_loop_out")
    p.set_defaults(func=cmd_bench_loop)



def tool_latency(spec: str):
    """``--tool-latency``: a :class:`~benchmarks.prepared_bench.ToolLatency`, or a UsageError."""
    from .prepared_bench import ToolLatency

    try:
        return ToolLatency.parse(spec)
    except ValueError as e:
        raise UsageError(f"--tool-latency: {e}") from None


def check_bench_loop(args) -> None:
    """``bench-loop``: the sweep or the latency model (not both); the prepared loop runs agent workloads only."""
    from patchkv_agent.eval.agent_workloads import AGENT_WORKLOADS

    if args.tool_latency is None:
        _sweep(args.tool_latencies)
        extra = [f for f, v in (("--cover-preparation", args.cover_preparation), ("--exact-reference",
                                args.exact_reference), ("--prepare-chunk", args.prepare_chunk is not None)) if v]
        if extra:
            raise UsageError(f"{extra[0]} applies to the prepared loop; pass --tool-latency SPEC too")
        return
    if args.tool_latencies is not None:
        raise UsageError("pass --tool-latencies (the sweep) or --tool-latency (the prepared loop), not both")
    if args.agents:
        raise UsageError("--agents runs with the sweep (--tool-latencies), not with --tool-latency")
    tool_latency(args.tool_latency)
    other = [w for w in _check_workloads("--workloads", args.workloads) if w not in AGENT_WORKLOADS]
    if other:
        raise UsageError(f"--tool-latency: the prepared loop predicts with an agent workload's editor; {other} "
                         f"have none: choose from {list(AGENT_WORKLOADS)} (or use --tool-latencies)")


def bench_defaults(args) -> None:
    """``bench``'s ``--workloads`` / ``--strategies`` when not given: the defaults, or with ``--follow`` the
    edit-following ones (and ``patchkv-noreaders`` registered)."""
    from .bench import (DEFAULT_STRATEGIES, DEFAULT_WORKLOADS, FOLLOW_STRATEGIES, register_noreaders,
                             register_norecent)
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS

    register_noreaders()  # the ablation variants may be named in --strategies
    register_norecent()
    if args.workloads is None:
        args.workloads = ",".join(FOLLOW_WORKLOADS if args.follow else DEFAULT_WORKLOADS)
    if args.strategies is None:
        args.strategies = ",".join(FOLLOW_STRATEGIES if args.follow else DEFAULT_STRATEGIES)


def cmd_bench(args) -> int:
    from .bench import markdown_table, run_bench, write_summary
    from .noninferiority import markdown as ni_markdown

    if args.floor_repeat and not args.summarize:
        raise UsageError("--floor-repeat scores a summary: pass it with --summarize RESULTS (run the floor again "
                         "with `bench --noise-floor ... --threads N --out-dir OTHER` first)")
    if args.summarize:
        rows = _summary_rows(args.summarize)
        repeat = _summary_rows(args.floor_repeat) if args.floor_repeat else []
        try:
            summary = write_summary(rows, args.out_dir, floor_repeat=repeat)
        except (ValueError, TypeError, KeyError) as e:  # a row of the right shape whose values still do not add up
            raise UsageError(f"--summarize: the rows cannot be summarized ({type(e).__name__}: {_reason(e)}); pass "
                             "results.jsonl files written by `patchkv-agent bench` or `replay`") from None
    else:
        from patchkv_agent.eval.episodes import build_workload_traces
        from patchkv_agent.usage import check_writable_dir

        check_writable_dir("--out-dir", args.out_dir)  # before the model loads
        eng = _cli._engine(args)
        count = _cli._count_tokens(eng)
        traces = []
        for wl in args.workloads.split(","):
            traces += build_workload_traces(wl, args.edit, n=args.n, target_tokens=args.target_tokens,
                                            n_versions=args.versions, seed=args.seed, count_tokens=count,
                                            context=args.context)
        i, k = _shard(args.shard)
        traces = [t for j, t in enumerate(traces) if j % k == i]
        if args.episodes is not None:
            traces = only_episodes(traces, episode_ids(args.episodes))
        heal = [x.strip() for x in args.heal.split(",") if x.strip() and x.strip() != "none"]
        summary = run_bench(eng, traces, args.strategies.split(","), args.out_dir,
                            max_new_tokens=args.max_new_tokens, model_name=args.model, resume=args.resume,
                            heal=heal, floors=_floors(args))
        for e in summary["errors"]:
            print(f"skipped {e['id']}: {e['error']}", file=sys.stderr)
    print(markdown_table(summary))
    for by in summary.get("non_inferiority", {}).values():
        for scored in by.values():
            print(ni_markdown(scored))
    print("wrote " + ", ".join(summary["files"]), file=sys.stderr)
    return 0


def episode_ids(spec: str) -> list[str]:
    """``--episodes``: the ids, comma-separated or ``@FILE`` (one per line, blank lines and ``#`` comments
    skipped).

    Raises:
        UsageError: an unreadable file or no id at all.
    """
    if spec.startswith("@"):
        try:
            with open(spec[1:], encoding="utf-8") as fh:
                ids = [ln.strip() for ln in fh if ln.strip() and not ln.lstrip().startswith("#")]
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--episodes {spec}: cannot read it ({_reason(e)}); pass @FILE with one episode id "
                             "per line") from None
    else:
        ids = [x.strip() for x in spec.split(",") if x.strip()]
    if not ids:
        raise UsageError(f"--episodes {spec!r} names no episode; pass ids from an earlier run's results.jsonl "
                         "('id' field)")
    return ids


def only_episodes(traces: list[dict], ids: list[str]) -> list[dict]:
    """The traces whose ``id`` is in ``ids``, in the run's order.

    Raises:
        UsageError: an id no trace of these options has (the options differ from the run it came from).
    """
    have = {t["id"] for t in traces}
    missing = [x for x in ids if x not in have]
    if missing:
        raise UsageError(f"--episodes: {len(missing)} id(s) are not episodes of these --workloads / --n / --seed / "
                         f"--context options (first: {missing[0]!r}); pass the options of the run they came from")
    want = set(ids)
    return [t for t in traces if t["id"] in want]


_SUMMARY_NUMBERS = ("ttft_s", "recompute_ratio", "recompute_tokens", "payload_bytes", "f1", "first_token_kl",
                    "top1_agree", "tf_agree", "exact_continuation", "floor_ttft_s")


def _summary_rows(files: list[str]) -> list[dict]:
    """The rows of ``bench --summarize``'s files, each checked to be a result row (docs/TRACES.md) that the
    summary can use.

    Raises:
        UsageError: (exit status 2) a file that is not JSON Lines, or a row that is not a result row, naming
            the file, the line and the field.
    """
    import math

    from patchkv_agent.eval.traces import read_results

    rows = []
    for f in files:
        try:
            got = read_results(f)
        except (ValueError, OSError) as e:
            raise UsageError(f"--summarize: {_reason(e).replace('; remove the line or rerun without --resume', '')}; "
                             "pass results.jsonl files written by `patchkv-agent bench` or `replay`") from None
        for i, r in enumerate(got, 1):
            where = f"{f}: row {i}"
            if not isinstance(r, dict):
                raise UsageError(f"--summarize: {where} is not a JSON object; pass results.jsonl files written by "
                                 "`patchkv-agent bench` or `replay`")
            if not isinstance(r.get("strategy"), str):
                raise UsageError(f"--summarize: {where} has no strategy name; pass results.jsonl files written by "
                                 "`patchkv-agent bench` or `replay`")
            for field in _SUMMARY_NUMBERS:
                v = r.get(field)
                ok = v is None or (isinstance(v, (int, float)) and math.isfinite(v))
                # a noise-floor row (``floor``: an emulated bf16 / int8 / fp8 run) is scored, never timed
                if not ok or (field == "ttft_s" and v is None and r.get("floor") is not True):
                    raise UsageError(f"--summarize: {where}: {field} is {str(v)[:40]!r}, not a number; pass "
                                     "results.jsonl files written by `patchkv-agent bench` or `replay`")
        rows += got
    return rows


def cmd_bench_loop(args) -> int:
    """``patchkv-agent bench-loop``: the tool-latency sweep (``--tool-latencies``), or with ``--tool-latency``
    the agent loop with the tool-wait preparation (:mod:`.prepared_bench`)."""
    import json

    if args.tool_latency is not None:
        return _bench_loop_prepared(args)
    from patchkv_agent.eval.episodes import build_workload_traces
    from .loop_bench import format_loop, plot_loop, run_loop_bench

    lats = _sweep(args.tool_latencies)
    strategies = _check_strategies(args.strategies)
    out, eng, count = _loop_setup(args, "loop.json")
    traces = []
    for wl in args.workloads.split(","):
        traces += build_workload_traces(wl, args.edit, n=args.n, target_tokens=args.target_tokens,
                                        n_versions=args.versions, seed=args.seed, count_tokens=count,
                                        context=args.context)
    summary = run_loop_bench(eng, traces, strategies=strategies, tool_latencies=lats,
                             max_new_tokens=args.max_new_tokens, threads=args.agents,
                             threads_tool_s=args.agents_tool_s)
    summary["model"] = args.model
    (out / "loop.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot_loop(summary, out / "loop_ttft.png")
    print(format_loop(summary))
    print(f"wrote {out / 'loop.json'}, {out / 'loop_ttft.png'}", file=sys.stderr)
    return 0


def _loop_setup(args, result_name: str):
    """``(out_dir, engine, token counter)`` of a bench-loop run: the result file is checked writable before the
    model loads."""
    from pathlib import Path

    out = Path(args.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / result_name).touch()
    except OSError as e:
        raise UsageError(f"--out-dir: cannot write to {out}: {_reason(e)}") from None
    eng = _cli._engine(args)
    return out, eng, _cli._count_tokens(eng)




def _bench_loop_prepared(args) -> int:
    """The agent loop with the tool-wait preparation: episodes with their tool waits, the four threads per
    call, ``loop_prepared.json`` / ``.md`` / ``.png`` (the command line recorded in both)."""
    import shlex

    from patchkv_agent.eval.episodes import agent_loop_episodes
    from .prepared_bench import markdown_prepared, run_prepared_bench, write_prepared

    latency = tool_latency(args.tool_latency)
    out, eng, count = _loop_setup(args, "loop_prepared.json")
    episodes = []
    for wl in args.workloads.split(","):
        got = agent_loop_episodes(wl, n=args.n, target_tokens=args.target_tokens, n_versions=args.versions,
                                  seed=args.seed, count_tokens=count, context=args.context, progress=True)
        if not got:
            print(f"{wl}: no episode in range (try a larger --context or --target-tokens)", file=sys.stderr)
        episodes += got
    if not episodes:
        raise UsageError("no agent episode fits the window; pass a larger --context or --target-tokens")
    from patchkv_agent.eval.metrics import NEXT_ACTION_TOKENS

    # the next action needs the whole next call (decoding stops after it): as replay, at least 48 tokens
    summary = run_prepared_bench(eng, episodes, latency, cover=args.cover_preparation,
                                 max_new_tokens=max(args.max_new_tokens, NEXT_ACTION_TOKENS),
                                 chunk_tokens=args.prepare_chunk,
                                 exact_reference=args.exact_reference, model_name=args.model)
    command = "patchkv-agent " + shlex.join(getattr(args, "argv", None) or [])
    files = write_prepared(summary, out, command)
    for e in summary["errors"]:
        print(f"skipped {e['id']}: {e['error']}", file=sys.stderr)
    print(markdown_prepared(summary, command))
    print("wrote " + ", ".join(files), file=sys.stderr)
    return 0

"""The `patchkv-agent` command line: demo, replay, traces, calibrate, and the benchmark commands.

Knows the engine, replay and workload builder through their public functions; prints tables and
writes JSON Lines, nothing more. The benchmark commands (bench, bench-loop, bench-transport, bench-host,
bench-server, stress) live in the checkout's ``benchmarks/`` package, loaded only when one runs
(:mod:`.cli_bench`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from tqdm import tqdm

from .core.inputs import InvalidInput, non_negative_int
from .usage import OneLineParser, UsageError, report
from .cli_args import _check_strategies, _floors, _reason, check_args


def _max_new_tokens(text: str) -> int:
    """argparse type of ``--max-new-tokens``: the public boundary's validator (core.inputs)."""
    try:
        return non_negative_int(text, what="--max-new-tokens")
    except InvalidInput as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _table(rows: list[dict[str, Any]]) -> str:
    """A per-strategy summary table (medians over rows) as aligned text; a noise floor's rows (emulations,
    scored and never timed) show ``-`` for their timing."""
    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(r["strategy"], []).append(r)

    def median(rs, f):
        vals = [float(r[f]) for r in rs if r.get(f) is not None]
        return statistics.median(vals) if vals else None

    def mean(rs, f):
        vals = [float(r[f]) for r in rs if r.get(f) is not None]
        return statistics.fmean(vals) if vals else None

    def fmt(v, spec, scale=1.0):
        return "-" if v is None else format(v * scale, spec)

    prefix_ttft = median(by.get("prefix", []), "ttft_s")
    head = ["strategy", "ttft_ms", "vs_prefix", "recompute", "ratio", "payload_MiB", "kl", "top1", "tf", "exact_cont", "f1"]
    lines = [head]
    for s, rs in by.items():
        ttft = median(rs, "ttft_s")
        lines.append([
            s, fmt(ttft, ".1f", 1e3), fmt(prefix_ttft / ttft if prefix_ttft and ttft else None, ".2f") + "x",
            fmt(mean(rs, "recompute_tokens"), ".0f"), fmt(mean(rs, "recompute_ratio"), ".3f"),
            fmt(mean(rs, "payload_bytes"), ".2f", 2.0 ** -20), fmt(mean(rs, "first_token_kl"), ".4f"),
            fmt(mean(rs, "top1_agree"), ".2f"), fmt(mean(rs, "tf_agree"), ".2f"), fmt(mean(rs, "exact_continuation"), ".2f"),
            fmt(mean(rs, "f1"), ".2f"),
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in lines)


def _engine(args):
    import torch

    from .engine import PatchKVEngine

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    from .profiles import resolve_profile_arg

    try:
        eng = PatchKVEngine.from_pretrained(args.model, block_size=args.block_size, dirty_window=args.dirty_window,
                                            profile=resolve_profile_arg(getattr(args, "profile", "auto")))
    except OSError as e:  # not found, offline hub, unreadable files: the model cannot be had from here
        raise UsageError(f"--model {args.model}: {_reason(e)}") from None
    print(f"loaded {args.model} in {time.perf_counter() - t:.1f}s (profile: {eng.profile_path or 'none'}; "
          f"block {eng.settings.block_size}, kappa {eng.settings.kappa})", file=sys.stderr)
    return eng


def _count_tokens(eng):
    from .eval.traces import plain_messages

    return lambda msgs: len(eng.encode(plain_messages(msgs)))


def _token_counter_for(model: str):
    """Chat-template token counter of a model's tokenizer (for `traces build --model`)."""
    from transformers import AutoTokenizer

    from .loading import EMBEDDED_MODELS, ensure_embedded
    from .eval.traces import plain_messages

    if model in EMBEDDED_MODELS or model.endswith(".gguf"):
        path = ensure_embedded(model) if model in EMBEDDED_MODELS else __import__("pathlib").Path(model).resolve()
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(model)

    def count(msgs):
        text = tok.apply_chat_template(plain_messages(msgs), tokenize=False, add_generation_prompt=True)
        return len(tok(text, add_special_tokens=False)["input_ids"])

    return count


def _replay_traces(args) -> list[dict]:
    """The episodes ``replay`` runs: the whole file validated (before any model loads), then ``--limit``."""
    from .eval.traces import read_traces

    if (args.traces is None) == (args.from_checkpointer is None):
        raise UsageError("pass a traces file (JSON Lines) or --from-checkpointer sqlite:PATH (one of them)")
    if args.from_checkpointer is not None:
        from .eval.replay import traces_from_checkpointer

        try:
            traces = traces_from_checkpointer(args.from_checkpointer, args.thread or None)
        except (ValueError, OSError) as e:
            raise UsageError(f"--from-checkpointer: {_reason(e)}") from None
        if not traces:
            raise UsageError(f"no thread in {args.from_checkpointer} has two or more model contexts; nothing to "
                             "replay")
        print(f"{len(traces)} threads from {args.from_checkpointer}: "
              + ", ".join(f"{t['id']} ({len(t['versions'])} versions)" for t in traces), file=sys.stderr)
        return traces[: args.limit] if args.limit else traces
    try:
        traces = read_traces(args.traces)
    except (ValueError, OSError) as e:  # names file:line and the field; no model was loaded
        raise UsageError(f"invalid trace file: {_reason(e)}") from None
    if not traces:
        raise UsageError(f"{args.traces} holds no traces; build one with `patchkv-agent traces build` "
                         "(docs/TRACES.md)")
    return traces[: args.limit] if args.limit else traces


def cmd_replay(args) -> int:
    """``patchkv-agent replay``: every check that needs no model runs before the model loads.

    The trace file is validated whole (the reader of ``traces validate``), the strategies are checked and
    ``--out`` is opened for writing; then each result row is appended and flushed as it finishes, so a
    crash keeps what was done and ``--resume`` skips the ``(id, version, strategy)`` rows already there.
    An episode that fails (e.g. longer than the model's context) is reported and skipped; the exit status
    is then 1.
    """
    from .eval.traces import ResultsFile

    traces = _replay_traces(args)
    strategies = _check_strategies(args.strategies)
    try:
        results = ResultsFile(args.out, resume=args.resume)
    except (OSError, ValueError) as e:
        raise UsageError(f"--out: {_reason(e)}") from None
    with results:
        todo = []
        for tr in traces:  # per episode, the strategies with a row still missing (exact always runs)
            n = len(tr["versions"])
            missing = [s for s in strategies if any((tr["id"], k, s) not in results.done for k in range(1, n))]
            if missing:
                todo.append((tr, missing))
        skipped = len(traces) - len(todo)
        if args.resume:
            print(f"resume: {len(results.rows)} rows in {args.out}; {skipped} of {len(traces)} episodes complete",
                  file=sys.stderr)
        rows, errors = _run_replay(args, todo, results) if todo else ([], [])
    all_rows = results.rows + rows
    if all_rows:
        print(_table(all_rows))
    print(f"wrote {results.written} rows to {args.out}" + (f" ({len(results.rows)} kept)" if args.resume else ""))
    for tid, err in errors:
        print(f"replay: episode {tid} failed and was skipped: {err}", file=sys.stderr)
    return 1 if errors else 0


def _run_replay(args, todo, results) -> tuple[list[dict], list[tuple[str, str]]]:
    from .eval.replay import replay_episode

    eng = _engine(args)
    rows, errors = [], []
    for tr, strategies in tqdm(todo, desc="replay", unit="episode"):
        try:
            for row in replay_episode(eng, tr, strategies, max_new_tokens=args.max_new_tokens, model_name=args.model,
                                      floors=_floors(args)):
                if (row["id"], row["version"], row["strategy"]) in results.done:
                    continue  # a strategy rerun for its missing versions: keep the row already written
                try:
                    results.write(row)
                except OSError as e:
                    raise SystemExit(f"replay: {_reason(e)}; rerun with --resume to continue") from None
                rows.append(row)
        except ValueError as e:  # this episode only: its finished rows are already written
            errors.append((tr["id"], str(e)))
    return rows, errors


def cmd_demo(args) -> int:
    from .eval.replay import replay_episode
    from .eval.episodes import build_workload_traces
    from .eval.traces import ResultsFile

    results = ResultsFile(args.out) if args.out else None  # fail on an unwritable --out before the model loads

    eng = _engine(args)
    traces = build_workload_traces(args.workload, args.edit, n=1, target_tokens=args.target_tokens,
                                   seed=args.seed, count_tokens=_count_tokens(eng))
    tr = traces[0]
    strategies = args.strategies.split(",")
    print(f"episode {tr['id']} ({tr['edit']}), strategies {strategies}; warming up ...", file=sys.stderr)
    list(replay_episode(eng, tr, ["exact"], max_new_tokens=2))  # warm-up: first calls pay allocator costs
    rows = list(tqdm(replay_episode(eng, tr, strategies, max_new_tokens=args.max_new_tokens, model_name=args.model),
                     total=len(strategies) * (len(tr["versions"]) - 1), desc="resume", unit="strategy"))
    r0 = next(r for r in rows if r["strategy"] != "exact") if len(rows) > 1 else rows[0]
    print(f"\n{tr['id']}: {r0['prompt_tokens']} tokens, prefix {r0['prefix_tokens']}, new {r0['new_tokens']}, "
          f"suffix {r0['suffix_tokens']}; answers {tr.get('answers')}")
    print(_table(rows))
    for r in rows:
        print(f"  {r['strategy']:>8}: {r['output_text']!r}")
    if results is not None:
        with results:
            results.write_many(rows)
    return 0


def _int_at_least(minimum: int, why: str):
    """argparse type: an integer >= ``minimum`` (``why`` explains the bound in the error)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if n < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum} ({why}), got {n}")
        return n

    return parse


_at_least_two = _int_at_least(2, "a base version and an edited one")
_non_negative = _int_at_least(0, "0: all")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="HF id, local dir, .gguf path, 'smollm2-135m' or random:SHAPE[@DTYPE] (random weights, timing "
                        "only; shapes: patchkv_agent.loading.RANDOM_SHAPES)")
    p.add_argument("--block-size", type=int, default=None, help="default: the model's calibration profile, else 32")
    p.add_argument("--dirty-window", type=int, default=None,
                   help="fixed dirty window; default: the profile's length model, else 32 tokens")
    p.add_argument("--profile", default="auto",
                   help="calibration profile: 'auto' (the search path of patchkv_agent.profiles, by model fingerprint), 'none' (the "
                        "built-in defaults), or a profile JSON path")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--max-new-tokens", type=_max_new_tokens, default=16,
                   help="greedy tokens per resume (a non-negative int; clipped to the model's positions)")
    p.add_argument("--strategies", default="exact,prefix,direct,patchkv")


_CONTEXT_HELP = ("agent workloads: build episodes up to this many tokens (a model's window, e.g. 8000 for SmolLM2): "
                 "views from half of it, middleware triggers scaled to it, every unedited twin within it; "
                 "default: --target-tokens as before")


def _workload_names() -> str:
    """Every workload name (QA, edit-following, held-out and agent ones), for the ``--workloads`` help."""
    from .eval import workloads as wl
    from .eval.agent_workloads import AGENT_WORKLOADS
    from .eval.follow import FOLLOW_WORKLOADS, HELDOUT_WORKLOADS

    return ", ".join(list(dict.fromkeys([*wl.WORKLOADS, *FOLLOW_WORKLOADS, *HELDOUT_WORKLOADS, *AGENT_WORKLOADS])))


def build_parser(benchmarks: bool = False) -> argparse.ArgumentParser:
    """The command line's parser; the benchmark subcommands (:mod:`.cli_bench`) are listed by name and help, and
    with ``benchmarks=True`` parsed in full from the checkout's ``benchmarks/`` package.

    Raises:
        UsageError: ``benchmarks=True`` in an installed copy without the checkout's ``benchmarks/``.
    """
    ap = OneLineParser(prog="patchkv-agent", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="replay one edited episode on the embedded model and print the table")
    _common(p)
    p.add_argument("--workload", default="hotpotqa-e")
    p.add_argument("--edit", default="replace_tool_result")
    p.add_argument("--target-tokens", type=int, default=1500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the result rows (JSON Lines)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("replay", help="replay traces (docs/TRACES.md) or a LangGraph SQLite checkpointer's threads; "
                                      "write results.jsonl")
    p.add_argument("traces", nargs="?", default=None, help="a trace file (JSON Lines); validated whole before the model loads")
    p.add_argument("--from-checkpointer", default=None, metavar="sqlite:PATH",
                   help="read the message history at each checkpoint of the threads a LangGraph SqliteSaver stored")
    p.add_argument("--thread", action="append", default=[], metavar="ID",
                   help="with --from-checkpointer: only this thread (repeatable; default: all)")
    _common(p)
    p.add_argument("--limit", type=_non_negative, default=0, help="replay only the first N episodes (0: all)")
    p.add_argument("--out", default="results.jsonl", help="result rows, appended and flushed as they finish")
    p.add_argument("--noise-floor", default=None, metavar="FLOORS",
                   help="also run accepted approximations of exact on the same calls and score them like a strategy "
                        "(CPU emulations): 'default' (kv-bf16,kv-int8,kv-fp8,weights-bf16), 'all', or names")
    p.add_argument("--resume", action="store_true",
                   help="keep --out and skip the (episode, version, strategy) rows already in it")
    p.set_defaults(func=cmd_replay)

    from .calibration.cli import add_calibrate_cli
    from .cli_bench import add_benchmark_parsers
    from .eval.workloads import add_traces_cli

    add_benchmark_parsers(sub, load=benchmarks)
    add_calibrate_cli(sub)
    add_traces_cli(sub, token_counter_factory=_token_counter_for)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run ``patchkv-agent``.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The command's exit status.

    Raises:
        SystemExit: status 2 with one line on stderr for a bad argument (:class:`~patchkv_agent.usage.UsageError`
            re-raised after printing it); argparse's own errors are one line too.
    """
    from .cli_bench import wants_benchmarks

    raw = list(sys.argv[1:] if argv is None else argv)
    bench = wants_benchmarks(raw)
    try:
        parser = build_parser(benchmarks=bench)
    except UsageError as e:
        report(f"patchkv-agent {bench}", e)
        raise
    args = parser.parse_args(raw)
    args.argv = raw  # recorded by commands that write a summary
    if args.command == "calibrate":  # the options typed after it: a bare `calibrate` only shows its plan
        args._argv = raw[raw.index("calibrate") + 1:] if "calibrate" in raw else raw
    prog = f"patchkv-agent {args.command}"
    try:
        check_args(args)
        return int(args.func(args) or 0)
    except UsageError as e:
        report(prog, e)
        raise


if __name__ == "__main__":
    sys.exit(main())

"""The command line's argument checks: every option of every command checked before a model loads, and the small
parsers the commands share (strategy lists, noise floors, shards, latency sweeps).

Boundary: argparse namespaces in, ``UsageError`` (one line naming the flag and the fix) out; loads nothing, runs
nothing. :mod:`patchkv_agent.cli` builds the parser and runs the commands.
"""

from __future__ import annotations

from pathlib import Path

from .usage import UsageError, check_ranges

DEFAULT_TOOL_LATENCIES = "0,0.1,0.5,1.5"  # bench-loop's sweep of tool seconds


def _reason(e: Exception) -> str:
    """An error's message without the ``[Errno N]`` prefix of an OSError."""
    return e.strerror if isinstance(e, OSError) and e.strerror else str(e)


def _check_strategies(names: str) -> list[str]:
    from .strategies import STRATEGIES, register_spec

    strategies = [s.strip() for s in names.split(",") if s.strip()]
    for s in strategies:
        if ":" in s:  # name:key=value...: a strategy with options
            try:
                register_spec(s)
            except ValueError as e:
                raise UsageError(f"--strategies: {e}") from None
    unknown = [s for s in strategies if s not in STRATEGIES]
    if not strategies or unknown:
        raise UsageError(f"--strategies: unknown {unknown or names!r}; choose from {sorted(STRATEGIES)}")
    return strategies


def _floors(args) -> tuple[str, ...]:
    """The ``--noise-floor`` names (checked by :func:`_check_args` before any model loads)."""
    from .eval.noise_floor import parse_floors

    return parse_floors(getattr(args, "noise_floor", None))


def _shard(spec: str) -> tuple[int, int]:
    """``"I/K"`` -> ``(I, K)`` with ``0 <= I < K``; raises SystemExit naming the fix otherwise."""
    try:
        i, k = (int(x) for x in spec.split("/"))
    except ValueError:
        raise UsageError(f"--shard must look like I/K (e.g. 0/2), got {spec!r}") from None
    if not 0 <= i < k:
        raise UsageError(f"--shard {spec}: need 0 <= I < K")
    return i, k


def _sweep(spec: str | None) -> list[float]:
    """``--tool-latencies``: comma-separated seconds, each >= 0 and finite."""
    spec = DEFAULT_TOOL_LATENCIES if spec is None else spec
    try:
        lats = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--tool-latencies takes comma-separated seconds, got {spec!r}") from None
    if not lats or not all(0 <= x < float("inf") for x in lats):
        raise UsageError("need --tool-latencies >= 0 (comma-separated seconds) and --versions >= 2")
    return lats


def _check_model(args) -> None:
    from .loading import EMBEDDED_MODELS, RANDOM_PREFIX, looks_like_path, parse_random_spec

    model = getattr(args, "model", None)
    if not model or model in EMBEDDED_MODELS:
        return
    if model.startswith(RANDOM_PREFIX):
        try:
            parse_random_spec(model)
        except ValueError as e:
            raise UsageError(f"--model {model}: {e}") from None
        return
    p = Path(model).expanduser()
    if p.exists():
        if p.is_file() and p.suffix != ".gguf":
            raise UsageError(f"--model {model} is a file but not a .gguf; pass a .gguf file, a model directory, an HF id "
                             f"or one of {sorted(EMBEDDED_MODELS)}")
    elif looks_like_path(model):
        raise UsageError(f"--model {model} does not exist; pass an existing .gguf file or model directory, an HF id "
                         f"or one of {sorted(EMBEDDED_MODELS)}")


def _check_profile(args) -> None:
    prof = getattr(args, "profile", None)
    if prof in (None, "auto", "none"):
        return
    from .profiles import resolve_profile_arg

    try:
        resolve_profile_arg(prof)
    except (ValueError, OSError) as e:
        raise UsageError(f"--profile {prof}: {_reason(e)}; pass 'auto', 'none' or a profile JSON path") from None


def _check_out_file(flag: str, path: str | None) -> None:
    if path and Path(path).is_dir():
        raise UsageError(f"{flag} {path} is a directory; pass a file path")


def _check_out_dir(flag: str, path: str | None) -> None:
    if path and Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"{flag} {path} exists and is not a directory; pass a directory")


def _check_workloads(flag: str, spec: str) -> list[str]:
    """Workload names checked against the registry (eval.workloads + the edit-following ones)."""
    from .eval import workloads as wl
    from .eval.agent_workloads import AGENT_WORKLOADS
    from .eval.follow import FOLLOW_WORKLOADS, HELDOUT_WORKLOADS

    known = set(wl.WORKLOADS) | set(FOLLOW_WORKLOADS) | set(HELDOUT_WORKLOADS) | set(AGENT_WORKLOADS)
    names = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in names if w not in known]
    if not names or unknown:
        raise UsageError(f"{flag}: unknown workloads {unknown or spec!r}; choose from {sorted(known)}")
    return names


def _check_edit(args) -> None:
    from .eval.workloads import EDITS

    edit = getattr(args, "edit", None)
    if edit is not None and edit not in (*EDITS, "all"):
        raise UsageError(f"--edit: unknown edit {edit!r}; choose from {[*EDITS, 'all']}")


def _check_command(args) -> None:
    """Command-specific checks beyond :func:`patchkv_agent.usage.check_ranges`."""
    cmd = args.command
    if cmd == "bench":
        from .cli_bench import load_benchmark

        load_benchmark("bench_cli").bench_defaults(args)
    if cmd in ("demo", "replay", "bench", "bench-loop"):
        _check_strategies(args.strategies)
    if cmd in ("replay", "bench"):
        try:
            _floors(args)
        except ValueError as e:
            raise UsageError(f"--noise-floor: {e}") from None
    if cmd == "demo":
        _check_workloads("--workload", args.workload)
    if cmd in ("bench", "bench-loop") and not getattr(args, "summarize", None):
        _check_workloads("--workloads", args.workloads)
    if cmd in ("demo", "bench", "bench-loop"):
        _check_edit(args)
    if cmd == "replay" and args.traces is not None and Path(args.traces).is_file() and \
            Path(args.traces).stat().st_size == 0:
        raise UsageError(f"{args.traces} is empty; pass a trace file with at least one episode (docs/TRACES.md)")
    if cmd == "bench":
        _shard(args.shard)
        heal = [x.strip() for x in args.heal.split(",") if x.strip()]
        if heal != ["none"]:
            try:
                _check_strategies(",".join(heal) or args.heal)
            except UsageError as e:
                raise UsageError(str(e).replace("--strategies:", "--heal:", 1)) from None
        for f in args.summarize or []:
            if not Path(f).is_file():
                raise UsageError(f"--summarize: no results file at {f}")
            if Path(f).stat().st_size == 0:
                raise UsageError(f"--summarize: {f} is empty; pass results.jsonl files with rows")
        _check_out_dir("--out-dir", args.out_dir)
    if cmd == "bench-loop":
        _check_out_dir("--out-dir", args.out_dir)
        from .cli_bench import load_benchmark

        load_benchmark("bench_cli").check_bench_loop(args)
    if cmd in ("demo", "bench-transport"):
        _check_out_file("--out", args.out)
    if cmd == "stress":
        _check_out_file("--json", args.json)
        if args.root:
            _check_out_dir("--root", args.root)
        if getattr(args, "tiers", None) is not None:
            tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
            bad = [t for t in tiers if t not in ("memory", "disk", "redis")]
            if not tiers or bad:
                raise UsageError(f"--tiers: unknown {bad or args.tiers!r}; choose from memory, disk, redis")
    if cmd == "traces":
        if args.traces_command == "build":
            _check_out_file("--out", args.out)
        elif args.traces_command == "validate":
            p = Path(args.path)
            if not p.is_file():
                raise UsageError(f"no trace file at {args.path}")
            if not p.read_text(errors="replace").strip():
                raise UsageError(f"{args.path} is empty; a trace file holds one episode per line (docs/TRACES.md)")
    if cmd == "bench-host":
        if getattr(args, "device", None) not in (None, "cpu", "cuda"):
            raise UsageError(f"--device {args.device!r}: expected 'cpu' or 'cuda'")
        _check_out_dir("--out-dir", args.out_dir)
    if cmd == "calibrate":
        from .calibration.cli import check_calibrate_args

        check_calibrate_args(args)


def check_args(args) -> None:
    """Every check of a parsed command line that needs no model, run before the command starts.

    Raises:
        UsageError: (exit status 2) the first bad argument, in one line naming the fix.
    """
    check_ranges(args)
    _check_model(args)
    _check_profile(args)
    _check_command(args)

"""The ``patchkv-agent stress`` command: the load test (:mod:`.stress`), with ``--faults`` the fault mode
(:mod:`.faults`), or with ``--fuzz`` the store-entry fuzzer (:mod:`.entry_fuzz`, under AddressSanitizer when
the compiler supports it).

The command sits above both modules (the fault mode reuses the load test's episodes and tiny engine), so
neither of them imports the other's command line.
"""

from __future__ import annotations

import argparse
import json

from .faults import format_fault_summary, run_fault_stress
from .stress import format_summary, run_stress
from .tiny import tiny_engine


def add_stress_cli(subparsers) -> None:
    """Register ``patchkv-agent stress`` on the CLI's subparsers."""
    p = subparsers.add_parser("stress", help="concurrent threads x versions under a store budget; prints a summary")
    p.add_argument("--threads", type=int, default=16)
    p.add_argument("--versions", type=int, default=5)
    p.add_argument("--budget-entries", type=float, default=None,
                   help="store budget, in checkpoints (default 4; with --faults: half the threads, at least 8)")
    p.add_argument("--tier", choices=["memory", "disk", "redis"], default="memory")
    p.add_argument("--mode", choices=["threads", "asyncio"], default="threads")
    p.add_argument("--root", default=None, help="disk tier directory (default: a temporary one)")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tool-s", type=float, default=0.02, help="seconds each thread waits for its tool between versions")
    p.add_argument("--property-examples", type=int, default=1000,
                   help="Hypothesis examples of the diff + plan + recover property check (0: skip; needs the "
                        "test extra, pip install 'patchkv-agent[test]')")
    p.add_argument("--json", default=None, help="also write the summary as JSON to this path (with --faults: "
                   "default stress_faults.json)")
    p.add_argument("--faults", action="store_true",
                   help="fault mode: every tier (Redis when redis-server is installed) under bit flips in stored "
                        "metadata and payloads, SIGKILLed writer processes, Redis pauses and restarts and budget "
                        "pressure; checks results against solo runs, escaped exceptions and lost entries "
                        "(benchmarks.faults); no property check")
    p.add_argument("--tiers", default=None, help="with --faults: comma-separated tiers (default memory,disk[,redis])")
    p.add_argument("--writer-kills", type=int, default=4, help="with --faults: SIGKILLs of the disk writer process")
    p.add_argument("--fuzz", action="store_true",
                   help="fuzz mode: hostile store entries with consistent checksums through the codec and every "
                        "restore path, native.c built with AddressSanitizer when the compiler supports it "
                        "(benchmarks.entry_fuzz); needs the test extra")
    p.add_argument("--fuzz-examples", type=int, default=20000, help="with --fuzz: Hypothesis examples")
    p.set_defaults(func=cmd_stress)


def cmd_stress(args: argparse.Namespace) -> int:
    if getattr(args, "fuzz", False):
        return _cmd_fuzz(args)
    if getattr(args, "faults", False):
        return _cmd_faults(args)
    examples = args.property_examples
    if examples < 0:
        raise SystemExit("patchkv-agent stress: --property-examples must be >= 0")
    if examples:
        try:
            import hypothesis  # noqa: F401 - checked before the load test, not after it
        except ImportError:
            from .properties import HYPOTHESIS_HINT

            raise SystemExit(f"patchkv-agent stress: {HYPOTHESIS_HINT}; or pass --property-examples 0 "
                             "to run the load test alone") from None
    engine = tiny_engine(seed=args.seed)
    budget = 4.0 if args.budget_entries is None else args.budget_entries
    s = run_stress(threads=args.threads, versions=args.versions, budget_entries=budget, tier=args.tier,
                   mode=args.mode, root=args.root, redis_url=args.redis_url, seed=args.seed,
                   tool_s=args.tool_s, engine=engine)
    if examples:
        from .properties import run_properties

        s["property"] = run_properties(engine, examples, seed=args.seed)
    print(format_summary(s))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    ok = s["solo_match"] and (not examples or s["property"]["failures"] == 0)
    return 0 if ok else 1


def _cmd_faults(args: argparse.Namespace) -> int:
    if args.threads < 1 or args.versions < 2 or args.writer_kills < 0:
        raise SystemExit("patchkv-agent stress --faults: need --threads >= 1, --versions >= 2, --writer-kills >= 0")
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip()) if args.tiers else None
    import logging

    # every quarantine and unreachable-store event logs one warning line; the summary counts them instead
    logging.getLogger("patchkv_agent.runtime").setLevel(logging.ERROR)
    from .redis_server import redis_server_path

    if tiers and "redis" in tiers and redis_server_path() is None:
        raise SystemExit("patchkv-agent stress --faults: --tiers names redis but no redis-server is in this "
                         "environment's bin/ or on PATH (pip install 'patchkv-agent[test]' installs one)")
    out = args.json or "stress_faults.json"
    try:
        open(out, "a").close()  # writable before a long run, not after it
    except OSError as e:
        raise SystemExit(f"patchkv-agent stress --faults: cannot write the summary to {out}: {e}") from None
    try:
        s = run_fault_stress(threads=args.threads, versions=args.versions, tiers=tiers, seed=args.seed,
                             tool_s=args.tool_s, writer_kills=args.writer_kills,
                             budget_entries=args.budget_entries if args.budget_entries is not None
                             else max(8.0, args.threads / 2))
    except ValueError as e:
        raise SystemExit(f"patchkv-agent stress --faults: {e}") from None
    print(format_fault_summary(s))
    with open(out, "w") as f:
        json.dump(s, f, indent=2)
    return 0 if s["ok"] else 1


def _cmd_fuzz(args: argparse.Namespace) -> int:
    if args.fuzz_examples < 1:
        raise SystemExit("patchkv-agent stress --fuzz: --fuzz-examples must be >= 1")
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        from .properties import HYPOTHESIS_HINT

        raise SystemExit(f"patchkv-agent stress --fuzz: {HYPOTHESIS_HINT}") from None
    from . import entry_fuzz

    lib, why = entry_fuzz.asan_runtime()
    if lib is None:
        print(f"AddressSanitizer unavailable ({why}); fuzzing in process with the regular native build")
        s = entry_fuzz.run_fuzz(args.fuzz_examples, args.seed)
        s.update(asan=False, crashed=False, sanitizer_reports=0)
    else:
        s = entry_fuzz.run_fuzz_asan(args.fuzz_examples, args.seed, timeout=max(600.0, args.fuzz_examples * 0.1))
    ok = s["failures"] == 0 and not s["crashed"] and s["sanitizer_reports"] == 0 and s["examples"] == args.fuzz_examples
    print(f"entry fuzz: {s['examples']} examples ({s.get('refused', 0)} refused, "
          f"{s.get('accepted', 0)} accepted), {s['failures']} escaped exceptions or path differences, "
          f"{int(bool(s['crashed']))} crashes, {s['sanitizer_reports']} sanitizer reports; native: {s.get('native')}")
    if not ok:
        print(s.get("first_failure") or s.get("stderr_tail", "")[-3000:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
    return 0 if ok else 1


add_cli = add_stress_cli  # the name patchkv_agent.cli_bench loads every harness command by

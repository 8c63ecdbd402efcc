"""The benchmark subcommands of ``patchkv-agent``: listed by name, loaded from the checkout when one runs.

The benchmark harness is the top-level ``benchmarks/`` package of a clone of the repository, beside
``patchkv_agent/``, and no installed module imports it: this module names it as a string and imports it
with :mod:`importlib` only for a benchmark command. In a checkout it puts the repository root on
``sys.path`` (so the commands work from any directory); an installed copy without it gets one line naming
the fix.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

from .usage import UsageError

HARNESS = "benchmarks"
# command -> (module of the harness that adds its parser with add_cli(sub), help shown by `patchkv-agent --help`)
BENCH_COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("bench_cli", "replay the workloads' eval episodes under every strategy; summary + plots"),
    "bench-loop": ("bench_cli", "the agent loop: call -> tool sleep L -> edited call; end-to-end TTFT vs L, "
                                "patchkv vs prefix (JSON + plot)"),
    "bench-transport": ("transport_bench", "payload/store/restore of FP16, INT8, INT4, INT4K and mixed checkpoints"),
    "bench-host": ("host_bench", "host time of the resume path per stage (validate, diff, words, plan, "
                                 "bookkeeping, cache, KV copy) at 2k-128k tokens; JSON + plot"),
    "bench-server": ("server_bench_cli", "agents on a live vLLM / llama.cpp server with and without the tool-wait "
                                         "prewarm, side by side (JSON, markdown, plot)"),
    "stress": ("stress_cli", "concurrent threads x versions under a store budget; prints a summary"),
}
MISSING = ("the benchmark commands need the repository's benchmarks/ package, which an installed copy does not "
           "carry: run them from a clone of the patchkv-agent repository (in the clone: bash scripts/bootstrap.sh, "
           "then .venv/bin/patchkv-agent)")


def repository_root() -> Path | None:
    """The checkout this package sits in (the folder above ``patchkv_agent/`` holding ``benchmarks/``), or None."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / HARNESS / "__init__.py").is_file() else None


def load_benchmark(module: str) -> ModuleType:
    """Import ``benchmarks.<module>`` from the checkout.

    Raises:
        UsageError: (exit status 2) no ``benchmarks/`` package: an installed copy outside a clone.
    """
    root = repository_root()
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        return importlib.import_module(f"{HARNESS}.{module}")
    except ModuleNotFoundError as e:
        if e.name not in (HARNESS, f"{HARNESS}.{module}"):
            raise
        raise UsageError(MISSING) from None


def wants_benchmarks(argv: list[str]) -> str:
    """The benchmark command that ``argv`` runs (its first positional argument), or ``""``."""
    cmd = next((a for a in argv if not a.startswith("-")), "")
    return cmd if cmd in BENCH_COMMANDS else ""


def _not_loaded(args) -> int:
    raise UsageError(MISSING)


def add_benchmark_parsers(sub, *, load: bool) -> None:
    """Add the benchmark subcommands to ``sub``: with ``load`` their full parsers from the harness, else a
    placeholder per command carrying its help (its arguments are parsed once the harness loads).

    Raises:
        UsageError: ``load`` without the checkout's ``benchmarks/``.
    """
    if load:
        for module in dict.fromkeys(m for m, _ in BENCH_COMMANDS.values()):
            load_benchmark(module).add_cli(sub)
        return
    for name, (_, help_text) in BENCH_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, add_help=False)
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_not_loaded)

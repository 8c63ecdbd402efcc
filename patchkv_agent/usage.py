"""Command-line usage errors: one line naming the fix, exit status 2, never a traceback.

:class:`UsageError` is what every check of a command's arguments raises (before any model loads);
:class:`OneLineParser` makes argparse's own errors (unknown option, bad int, missing argument) one line
too; :func:`check_ranges` checks numeric options by their destination names against :data:`RANGES`.

Knows argparse only.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

__all__ = ["UsageError", "OneLineParser", "RANGES", "check_ranges", "report", "check_writable_dir"]


class UsageError(SystemExit):
    """A bad argument or input, found before any work starts: exit status 2, ``str()`` is the message.

    A ``SystemExit`` so that an entry point that does not catch it still exits (with status 2); the
    command-line entry points print ``str(e)`` as one line first (:func:`report`).
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split("\n")))
        self.code = 2

    def __str__(self) -> str:
        return str(self.args[0])


def check_writable_dir(flag: str, directory: Any) -> None:
    """Check that files can be written in ``directory`` (created if missing), before any work starts: a
    temporary file is made there and removed (nothing of the user's is touched).

    Args:
        flag: the option named in the error (``--out-dir``).
        directory: the directory.

    Raises:
        UsageError: it cannot be created or written, with the reason.
    """
    import tempfile
    from pathlib import Path

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".patchkv-write-check-"):
            pass
    except OSError as e:
        raise UsageError(f"{flag}: cannot write to {d}: {e.strerror or e}; pass a directory you can write") from None


def report(prog: str, err: UsageError) -> None:
    """Print a usage error as one line on stderr: ``prog: error: message``."""
    print(f"{prog}: error: {err}", file=sys.stderr)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: message (see prog --help)``), exit 2."""

    def error(self, message: str):  # noqa: D102 - argparse.ArgumentParser.error
        print(f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


_INF = math.inf
# destination name -> (low, high, low inclusive, high inclusive, what to say); applied to every command
# that has the option (tuples are checked element-wise)
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "threads": (1, _INF, True, True),
    "block_size": (1, _INF, True, True),
    "dirty_window": (0, _INF, True, True),
    "n": (1, _INF, True, True),
    "versions": (2, _INF, True, True),
    "target_tokens": (1, _INF, True, True),
    "context": (1000, _INF, True, True),
    "prepare_chunk": (1, _INF, True, True),
    "seed": (0, 2**32 - 1, True, True),
    "tokens": (1, _INF, True, True),
    "repeats": (1, _INF, True, True),
    "kl_contexts": (0, _INF, True, True),
    "engine_contexts": (0, _INF, True, True),
    "tau_ll": (0, 1, True, True),
    "max_payload": (0, 1, False, True),
    "max_kl_increase": (0, _INF, True, False),
    "agents_tool_s": (0, _INF, True, False),
    "tool_s": (0, _INF, True, False),
    "budget_entries": (0, _INF, False, False),
    "property_examples": (0, _INF, True, True),
    "writer_kills": (0, _INF, True, True),
    "follow_n": (0, _INF, True, True),
    "gamma": (0, 1, False, True),
    "quantile": (0, 1, False, False),
    "profile_block": (1, _INF, True, True),
    "ridge": (0, _INF, True, False),
    "val_share": (0, 1, False, False),
    "tol_rel": (0, _INF, True, False),
    "tol_abs": (0, _INF, True, False),
    "z": (0, _INF, True, False),
    "grid_max_pairs": (1, _INF, True, True),
    "ref_tokens": (1, _INF, True, True),
    "kappas": (0, _INF, True, False),
    "blocks": (1, _INF, True, True),
    "tau_v": (0, _INF, False, False),
}


def _interval(lo: float, hi: float, lo_in: bool, hi_in: bool) -> str:
    if hi == _INF:
        return f"{'>=' if lo_in else '>'} {lo:g}"
    return f"in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"


def check_ranges(args: argparse.Namespace) -> None:
    """Check every option of :data:`RANGES` that ``args`` has (and is not None).

    Raises:
        UsageError: a value out of its range, or a non-finite float, naming the option and the range.
    """
    for dest, (lo, hi, lo_in, hi_in) in RANGES.items():
        value: Any = getattr(args, dest, None)
        if value is None or isinstance(value, bool) or isinstance(value, str):
            continue
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if not isinstance(v, (int, float)):
                continue
            ok = (math.isfinite(v) or (hi == _INF and v == _INF and hi_in)) and \
                (v >= lo if lo_in else v > lo) and (v <= hi if hi_in else v < hi)
            if not ok:
                flag = "--" + dest.replace("_", "-")
                raise UsageError(f"{flag} must be {_interval(lo, hi, lo_in, hi_in)}, got {v!r}")

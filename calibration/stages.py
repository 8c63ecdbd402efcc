"""The opt-in stages of ``patchkv-agent calibrate`` wired to an engine and a profile dict: the agent stage
(:mod:`.agent_stage`: the recency window and the measured tail threshold by next-action agreement) and the reader
stage (:mod:`.reader_stage`: the reader rule's constants by edit-following), with the engine they run on and the
file a stage run alone writes (``scripts/agent_window_heldout.py``, ``scripts/reader_rule_heldout.py``).

Boundary: wiring only; the selection rules live in the stage modules, the argument checks in :mod:`.cli`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["stage_engine", "write_stage"]


def _agent_workloads(spec: str) -> list[str]:
    """``--agent-workloads``: the agent workloads named (``''`` / ``'none'``: none, the stage is skipped).

    Raises:
        UsageError: a name that is not an agent workload.
    """
    from patchkv_agent.eval.agent_workloads import AGENT_WORKLOADS
    from patchkv_agent.usage import UsageError

    names = [w.strip() for w in (spec or "").split(",") if w.strip()]
    if names == ["none"]:
        return []
    unknown = [w for w in names if w not in AGENT_WORKLOADS]
    if unknown:
        raise UsageError(f"--agent-workloads: unknown agent workload(s) {unknown}; choose from "
                         f"{list(AGENT_WORKLOADS)}, or 'none' to skip the agent stage")
    return list(dict.fromkeys(names))


def stage_engine(model: str, *, threads: int | None = None, profile: Any = "auto"):
    """Load the engine a calibration (or one stage of it, ``scripts/*_heldout.py``) runs on.

    Args:
        model: a model name or path (:meth:`PatchKVEngine.from_pretrained`).
        threads: torch CPU threads (None: leave torch's setting).
        profile: the engine's profile (``"auto"``: the model's shipped one; None: the built-in settings).
    Returns:
        ``(engine, count)``, ``count(messages) -> tokens`` under the model's chat template.
    """
    from patchkv_agent import PatchKVEngine
    from patchkv_agent.eval.traces import plain_messages

    if threads:
        import torch

        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    eng = PatchKVEngine.from_pretrained(model, profile=profile)
    print(f"loaded {model} in {time.perf_counter() - t0:.1f}s: {eng!r}", file=sys.stderr)

    def count(msgs):
        return len(eng.encode(plain_messages(msgs)))

    return eng, count


def write_stage(selection: dict, rows: list, out: str | Path, started: float, script: str, argv: Sequence[str]) -> None:
    """Write a stage run on its own (``scripts/*_heldout.py``): the selection, its rows, the wall time and command."""
    import json

    selection.update(rows=rows, wall_s=time.time() - started, command=" ".join([script, *argv]))
    with open(out, "w") as f:
        json.dump(selection, f, indent=1)


def _reader_workloads(spec: str) -> list[str]:
    """``--reader-workloads``: the edit-following workloads named (``'all'``: every one; ``''`` / ``'none'``:
    none, the stage is skipped).

    Raises:
        UsageError: a name that is not an edit-following workload.
    """
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS, HELDOUT_WORKLOADS
    from patchkv_agent.usage import UsageError

    known = list(FOLLOW_WORKLOADS) + list(HELDOUT_WORKLOADS)
    names = [w.strip() for w in (spec or "").split(",") if w.strip()]
    if names == ["none"]:
        return []
    if names == ["all"]:
        return known
    unknown = [w for w in names if w not in known]
    if unknown:
        raise UsageError(f"--reader-workloads: unknown workload(s) {unknown}; choose from {known}, 'all', or 'none' "
                         "to skip the reader stage")
    return list(dict.fromkeys(names))


def _reader_stage(eng, profile: dict, traces: list[dict], args: argparse.Namespace, command: str) -> dict:
    """Run the reader stage under the settings just calibrated; the profile with ``readers``, ``reader_rule``
    and ``reader_rule_selection`` (only the selection's record when nothing could be chosen)."""
    from patchkv_agent.profiles import Profile

    from .reader_stage import RULE, select_reader_rule, with_reader_rule

    t0 = time.perf_counter()
    eng.settings = Profile.from_dict(profile).settings(eng.settings)
    rows: list[dict] = []
    try:
        sel = select_reader_rule(eng, traces, target=args.reader_target, progress=not args.no_progress, rows=rows)
    except ValueError as e:
        print(f"reader stage: {e}; the profile keeps its reader setting", file=sys.stderr)
        sel = {"rule": RULE, "chosen": None, "skipped": str(e),
               "workloads": sorted({str(t.get("workload", "")) for t in traces}),
               "episodes": [str(t.get("id")) for t in traces]}
    sel.update({"episodes_from": f"{args.reader_n} episodes per workload of the calib split (seed {args.seed}); "
                                 "the benchmark reads the eval split",
                "n_per_workload": args.reader_n, "seed": args.seed, "command": command,
                "seconds": round(time.perf_counter() - t0, 1)})
    out = with_reader_rule(profile, sel)
    out.setdefault("_rows", {})["reader"] = rows
    out["timing"]["reader_stage_s"] = sel["seconds"]
    return out


def _build_agent_traces(args: argparse.Namespace, count) -> list[dict]:
    """The agent stage's episodes (none when ``--agent-workloads`` is empty).

    Raises:
        SystemExit: the stage was asked for and no episode is left after ``--agent-skip``.
    """
    from .agent_stage import agent_traces

    out: list[dict] = []
    names = _agent_workloads(args.agent_workloads)
    for w in names:
        got = agent_traces(w, n=args.agent_n, skip=args.agent_skip, target_tokens=args.agent_target_tokens,
                           count_tokens=count, seed=args.seed)
        if len(got) < args.agent_n:
            print(f"{w}: only {len(got)} agent episodes after skipping {args.agent_skip}", file=sys.stderr)
        out += got
    if names and not out:
        raise SystemExit(f"--agent-workloads: no episode of {names} is left after --agent-skip {args.agent_skip}; "
                         "lower --agent-skip or --agent-n")
    return out


def _agent_stage(eng, profile: dict, traces: list[dict], args: argparse.Namespace, command: str) -> dict:
    """Run the agent stage under the settings just calibrated; the profile with ``recent_window`` (and its
    ``recent_window_selection``; without ``recent_window`` when no version restored rows)."""
    from patchkv_agent.profiles import Profile

    from .agent_stage import RULE, select_recent_window, with_recent_window

    t0 = time.perf_counter()
    eng.settings = Profile.from_dict(profile).settings(eng.settings)  # W on top of the plan it will join
    rows: list[dict] = []
    try:
        sel = select_recent_window(eng, traces, windows=args.agent_windows, target=args.agent_target,
                                   progress=not args.no_progress, rows=rows, thresholds=args.agent_thresholds,
                                   min_restore_shares=args.agent_min_restore,
                                   variants=args.agent_variants, tail_windows=args.agent_tail_windows,
                                   variant_base=args.agent_variant_base)
    except ValueError as e:
        print(f"agent stage: {e}; the profile gets no recent_window", file=sys.stderr)
        sel = {"rule": RULE, "chosen": None, "skipped": str(e),
               "workloads": sorted({str(t.get("workload", "")) for t in traces}),
               "episodes": [str(t.get("id")) for t in traces]}
    n, skip = args.agent_n, args.agent_skip
    sel.update({
        "episodes_from": (f"the last {n} of the first {skip + n} episodes of each agent workload (seed {args.seed}, "
                          f"{args.agent_target_tokens} target tokens): disjoint from a benchmark run with --n <= "
                          f"{skip} at the same target tokens and seed, which takes the first --n"),
        "n_per_workload": n, "skip": skip, "target_tokens": args.agent_target_tokens, "seed": args.seed,
        "settings_from": "this profile (length model, kappa, block size, readers, precision policy); the other "
                         "settings at the built-in defaults",
        "command": command, "seconds": round(time.perf_counter() - t0, 1)})
    out = with_recent_window(profile, sel)
    out.setdefault("_rows", {})["agent"] = rows
    out["timing"]["agent_stage_s"] = sel["seconds"]
    return out

"""``patchkv-agent calibrate``: build calibration episodes, run the profiler, write the profile JSON.

Boundary: argument parsing and wiring only: episodes come from :func:`patchkv_agent.eval.workloads.build_traces`
(``split="calib"``), the work from :func:`.profile.run_calibration`. The lead CLI adds the command with
``add_calibrate_cli(subparsers)``; ``calibrate_main(args)`` runs it.

Default size: 3 workloads x 6 episodes x 3 versions at ~1.5k tokens (2WikiMQA at 1.8k), the 4 tau_V
candidates and the full 4 x 4 (kappa, block) grid on the validation pairs; it takes about 15 minutes
on 2 free CPU cores (the shipped profile records its own run's ``wall_s``). On a shared machine pass ``--threads 1`` (torch
threads competing with other processes for few cores are slower than one).

The agent stage (:mod:`.agent_stage`) is opt-in: ``--agent-workloads agent-clear,...`` also selects the
recency window ``recent_window`` by next-action agreement on agent-workload episodes (the last
``--agent-n`` of the first ``--agent-skip + --agent-n``, disjoint from the benchmark's first ones), under the
settings the main stages chose; off by default because its 48-token continuations of ~4k-token contexts
take tens of minutes on a CPU. The reader stage (:mod:`.reader_stage`) is opt-in too:
``--reader-workloads all`` (or a list of edit-following workloads) chooses the reader rule's constants by
whether resumes answer an edited episode's new gold where exact does (``--reader-n`` episodes per workload from
the ``calib`` split), under the main stages' settings; it runs before the agent stage, which then plans with it.

Writes three files: the profile (``--out``), the drift curves (``.drift.npz``, for figures) and the raw
resume rows (``.rows.jsonl``, to redo the selection offline).

A bare ``patchkv-agent calibrate`` (no argument at all) starts nothing: it prints what it would run (the
episodes, the stages, where the profile goes) and roughly how long that takes, and exits with status 2;
``--run`` starts that default run, and so does any other option (``--out PATH``, ``--model ...``: every
documented invocation). ``--dry-run`` prints the plan of any invocation and exits 0.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from .stages import _agent_stage, _agent_workloads, _build_agent_traces, _reader_stage, _reader_workloads, stage_engine

__all__ = ["add_calibrate_cli", "calibrate_main", "build_calibrate_parser", "calib_traces", "check_calibrate_args",
           "calibration_plan"]

# measured per-episode wall time of the default calibration on SmolLM2-135M (docs/calibration.md: 1720 s for
# its 50 episodes with --threads 1 on a shared 2-core CPU); agent-stage episodes are ~4k-token contexts
# decoded for 48 tokens under every window (docs/calibration.md, "Why opt-in")
_EPISODE_S = 35.0
_AGENT_EPISODE_S = 60.0


def _numbers(kind: type, what: str):
    """argparse type: one or more comma-separated ``kind`` values (``what`` names them in the error)."""
    def parse(s: str) -> tuple:
        try:
            out = tuple(kind(x) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {s!r}") from None
        if not out:
            raise argparse.ArgumentTypeError(f"expected one or more comma-separated {what}, got {s!r}")
        return out

    return parse


_floats = _numbers(float, "numbers")
_ints = _numbers(int, "integers")


def _add_arguments(p: argparse.ArgumentParser) -> None:
    from .config import DEFAULT_TAU_GRID

    p.add_argument("--model", default="smollm2-135m", help="HF id, local dir, .gguf path or 'smollm2-135m'")
    p.add_argument("--workload", default="hotpotqa-e,2wikimqa-e:1800,nq-e",
                   help="comma-separated workloads, each optionally ':TOKENS' to override --target-tokens (2WikiMQA's "
                        "long passages leave too few editable exchanges at 1.5k tokens)")
    p.add_argument("--edit", default="all", help="edit kind, or 'all' (kinds in rotation)")
    p.add_argument("--n", type=int, default=6, help="calibration episodes per workload")
    p.add_argument("--versions", type=int, default=3, help="context versions per episode (pairs = versions - 1)")
    p.add_argument("--target-tokens", type=int, default=1500, help="version-0 length in tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="profile JSON (default: <user cache>/profiles/<model>.json, where PatchKVEngine(profile='auto') "
                   "finds it; copy it into patchkv_agent/profiles/shipped/ to ship it)")
    p.add_argument("--drift-out", default=None, help="drift curves .npz for figures (default: beside --out)")
    p.add_argument("--tau-v", type=_floats, default=DEFAULT_TAU_GRID,
                   help="value-deviation threshold for d*; two or more (comma-separated) run the tau_V stage")
    p.add_argument("--gamma", type=float, default=0.95, help="stability coverage for d*")
    p.add_argument("--quantile", type=float, default=0.9, help="target quantile of the length model")
    p.add_argument("--metric", default="cosine", choices=["cosine", "rel_l2"])
    p.add_argument("--profile-block", type=int, default=16, help="granularity of d* in tokens")
    p.add_argument("--ridge", type=float, default=0.1, help="ridge penalty of the quantile fit")
    p.add_argument("--shift", default="none", choices=["none", "cv"],
                   help="intercept shift from grouped out-of-fold residuals (more conservative windows)")
    p.add_argument("--val-share", type=float, default=0.3, help="share of tasks held out for validation")
    p.add_argument("--kappas", type=_floats, default=(0.0, 0.01, 0.02, 0.03))
    p.add_argument("--blocks", type=_ints, default=(32, 64, 128),
                   help="block sizes to try (16 is allowed; it doubles key-scale overhead and fragments the "
                        "mixed-precision runs: see docs/calibration.md)")
    p.add_argument("--readers", default="none,lexical",
                   help="reader-block signals to try in the grid (comma-separated: none, lexical)")
    p.add_argument("--follow-workloads", default="follow-lookup,follow-twohop,follow-count,follow-retract",
                   help="edit-following workloads whose follow rate the selection must keep (comma-separated, "
                        "or 'none')")
    p.add_argument("--follow-n", type=int, default=8, help="calibration episodes per edit-following workload")
    p.add_argument("--follow-target", default="0.95",
                   help="least follow rate (answers the new gold where exact does) of the chosen configuration, "
                        "or 'none'")
    p.add_argument("--quality", default="kl", choices=["kl", "tf"], help="loss for the minimax rule")
    p.add_argument("--tol-rel", type=float, default=0.1, help="relative tolerance on the worst gap")
    p.add_argument("--tol-abs", type=float, default=1e-3, help="absolute tolerance on the worst gap")
    p.add_argument("--z", type=float, default=1.0,
                   help="standard errors of slack in the minimax rule (0: tolerance only)")
    p.add_argument("--target", default="default",
                   help="quality target on the worst per-workload loss: 'default' (no worse than the engine's "
                        "built-in setting on the same pairs), a number (e.g. --quality tf --target 0.01), or "
                        "'none' (minimax rule alone); the cheapest configuration meeting it wins")
    p.add_argument("--precision-target", default="0.2",
                   help="precision stage: allowed relative increase of direct's first-token KL at the mixed policy "
                        "over FP16 (worst workload); the smallest-payload (tau_L, tau_H) meeting it wins; 'none' skips")
    p.add_argument("--policy-grid", default=None,
                   help="precision candidates 'tau_L:tau_H,...' (default: tau_L 0.1/0.25/0.5/1 x tau_H 4/8)")
    p.add_argument("--grid-max-pairs", type=int, default=None, help="grid on at most this many validation pairs")
    p.add_argument("--ref-tokens", type=int, default=8, help="greedy reference tokens (teacher-forced agreement)")
    p.add_argument("--agent-workloads", default="",
                   help="agent stage (opt-in, tens of minutes): comma-separated agent workloads (agent-clear, "
                        "agent-summarize, agent-offload) on which to select recent_window by next-action agreement "
                        "with exact; '' or 'none' (default) skips it")
    p.add_argument("--agent-n", type=int, default=6, help="agent stage: episodes per agent workload")
    p.add_argument("--agent-skip", type=int, default=20,
                   help="agent stage: leading episodes of each agent workload left out (the benchmark takes the first "
                        "--n; the stage takes the next --agent-n)")
    p.add_argument("--agent-windows", type=_ints, default=(0, 256, 512, 1024),
                   help="agent stage: candidate recency windows in tokens (comma-separated)")
    p.add_argument("--agent-thresholds", type=_floats, default=(),
                   help="agent stage: measured tail rule candidates (tail_threshold values > 0, comma-separated), each "
                        "run at the largest --agent-windows (or each --agent-tail-windows); with any, the cheapest "
                        "candidate (recomputed rows, probed rows at their share of the layers) "
                        "that meets --agent-target on every workload is chosen")
    p.add_argument("--agent-tail-windows", type=_ints, default=(),
                   help="agent stage: the windows the --agent-thresholds candidates probe (comma-separated; a window "
                        "longer than the context probes the whole restored suffix; none: the largest --agent-windows)")
    p.add_argument("--agent-min-restore", type=_floats, default=(),
                   help="agent stage: small-restore rule candidates (min_restore_share values in [0, 1], "
                        "comma-separated), each run with every --agent-thresholds candidate; the chosen one is written "
                        "to the profile (none: the profile's own)")
    p.add_argument("--agent-variants", type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()), default=(),
                   help="agent stage: plan variant candidates, comma-separated, each key=value[:key=value] of the "
                        "head-rewrite share, kappa and the reader rule (e.g. 'rewrite_share=0.5,kappa=0.02,readers=none'), "
                        "each run on the profile's plan at the largest --agent-windows (or at --agent-variant-base); "
                        "the chosen one's options are written to the profile")
    p.add_argument("--agent-variant-base", default=None,
                   help="agent stage: the candidate the --agent-variants run at, as the stage keys it: a window "
                        "('1024') or a threshold candidate ('1024@0.02', '1024@0.02/r0.5' with --agent-min-restore), "
                        "e.g. to try tail check layers on a probed plan while the profile ships a fixed window")
    p.add_argument("--agent-target", default="0.95",
                   help="agent stage: least next-action agreement share, or floor:<name> (floor:kv-bf16: per workload, "
                        "the agreement a bf16 KV cache reaches on the same calls); the smallest window reaching it on "
                        "every workload wins (none does: the closest)")
    p.add_argument("--agent-target-tokens", type=int, default=4000,
                   help="agent stage: largest version of an agent episode in tokens (at least 2000 are used)")
    p.add_argument("--reader-workloads", default="",
                   help="reader stage (opt-in): edit-following workloads (comma-separated, or 'all': the four "
                        "templates and the four held-out shapes) on which to choose the reader rule's constants; "
                        "'' or 'none' (default) skips it")
    p.add_argument("--reader-n", type=int, default=8, help="reader stage: episodes per workload (calib split)")
    p.add_argument("--reader-target", type=float, default=0.95,
                   help="reader stage: least follow rate on every workload; the cheapest rule reaching it wins")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's choice; 1 is faster on a shared machine)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--run", action="store_true",
                   help="start the calibration (needed only when no other option is given: a bare `calibrate` "
                        "prints what it would run and how long, and starts nothing)")
    p.add_argument("--dry-run", action="store_true",
                   help="print what this invocation would run and roughly how long, then exit without loading a model")


def add_calibrate_cli(subparsers) -> argparse.ArgumentParser:
    """Add ``calibrate`` to a CLI.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.
    Returns:
        The ``calibrate`` sub-parser (``func`` set to :func:`calibrate_main`).
    """
    p = subparsers.add_parser("calibrate", help="offline calibration: fit the dirty-window model, pick kappa and "
                              "block size, write a per-model profile")
    _add_arguments(p)
    p.set_defaults(func=calibrate_main)
    return p


def build_calibrate_parser() -> argparse.ArgumentParser:
    """A stand-alone parser (``python -m patchkv_agent.calibration.cli``)."""
    from patchkv_agent.usage import OneLineParser

    ap = OneLineParser(prog="patchkv-agent calibrate", description=__doc__.splitlines()[0])
    _add_arguments(ap)
    ap.set_defaults(func=calibrate_main)
    return ap


def _safe_name(model: str) -> str:
    base = Path(model.rstrip("/")).name
    base = base[:-5] if base.endswith(".gguf") else base
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in base) or "model"


def _target(s: str) -> float | str | None:
    if s in ("default", "none"):
        return None if s == "none" else s
    try:
        return float(s)
    except ValueError:
        from patchkv_agent.usage import UsageError

        raise UsageError(f"--target must be 'default', 'none' or a number, got {s!r}") from None


def _policy_grid(spec: str | None) -> tuple[tuple[float, float], ...]:
    from patchkv_agent.usage import UsageError

    from .config import DEFAULT_POLICY_GRID

    if not spec:
        return DEFAULT_POLICY_GRID
    try:
        grid = tuple((float(a), float(b)) for a, b in (item.split(":") for item in spec.split(",")))
    except ValueError:
        raise UsageError(f"--policy-grid must look like 0.5:4,1:8 (tau_L:tau_H pairs), got {spec!r}") from None
    if not grid or any(not 0 <= a < b < float("inf") for a, b in grid):
        raise UsageError(f"--policy-grid: every pair needs 0 <= tau_L < tau_H, got {spec!r}")
    return grid


def _parse_workloads(spec: str, default_tokens: int) -> dict[str, int]:
    """``"a,b:1800"`` -> ``{"a": default_tokens, "b": 1800}``.

    Raises:
        UsageError: an empty list, an unknown workload or a bad token count.
    """
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS
    from patchkv_agent.eval.workloads import WORKLOADS
    from patchkv_agent.usage import UsageError

    known = sorted(set(WORKLOADS) | set(FOLLOW_WORKLOADS))
    out = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, _, tokens = item.partition(":")
        try:
            out[name.strip()] = int(tokens) if tokens else default_tokens
        except ValueError:
            raise UsageError(f"--workload: bad spec {item!r}: expected NAME or NAME:TOKENS") from None
        if name.strip() not in known:
            raise UsageError(f"--workload: unknown workload {name.strip()!r}; choose from {known}")
        if out[name.strip()] < 1:
            raise UsageError(f"--workload: {item!r}: the token count must be >= 1")
    if not out:
        raise UsageError("--workload names no workload")
    return out


def _number_or_none(flag: str, s: str, lo: float, hi: float) -> float | None:
    from patchkv_agent.usage import UsageError

    if s == "none":
        return None
    try:
        v = float(s)
    except ValueError:
        raise UsageError(f"{flag} must be a number or 'none', got {s!r}") from None
    if not lo <= v <= hi:
        raise UsageError(f"{flag} must be in [{lo:g}, {hi:g}] or 'none', got {s!r}")
    return v


def _check_agent_args(args: argparse.Namespace) -> None:
    """The agent stage's options (checked whether or not the stage runs: a bad value is a bad value).

    Raises:
        UsageError: the first bad one, naming the fix.
    """

    from patchkv_agent.usage import UsageError

    _agent_workloads(args.agent_workloads)
    if args.agent_n < 1:
        raise UsageError(f"--agent-n must be >= 1 (episodes per agent workload), got {args.agent_n}")
    if args.agent_skip < 0:
        raise UsageError(f"--agent-skip must be >= 0 (leading episodes left to the benchmark), got {args.agent_skip}")
    bad = [w for w in args.agent_windows if w < 0]
    if bad:
        raise UsageError(f"--agent-windows must be >= 0 (tokens; 0 turns the recency rule off), got {bad[0]}")
    bad_t = [t for t in args.agent_thresholds if not 0 < t < float("inf")]
    if bad_t:
        raise UsageError(f"--agent-thresholds must be finite numbers > 0 (0 is the fixed window), got {bad_t[0]}")
    bad_m = [m for m in args.agent_min_restore if not 0 <= m <= 1]
    if bad_m:
        raise UsageError(f"--agent-min-restore must be shares in [0, 1], got {bad_m[0]}")
    bad_w = [w for w in args.agent_tail_windows if w <= 0]
    if bad_w:
        raise UsageError(f"--agent-tail-windows must be > 0 (tokens), got {bad_w[0]}")
    if args.agent_tail_windows and not args.agent_thresholds:
        raise UsageError("--agent-tail-windows are the windows of the tail rule's candidates: "
                         "give --agent-thresholds too")
    if args.agent_min_restore and not args.agent_thresholds:
        raise UsageError("--agent-min-restore candidates run with the measured tail rule: give --agent-thresholds too")
    from .agent_stage import candidate_keys, parse_target, parse_variant

    for v in args.agent_variants:
        try:
            parse_variant(v)
        except ValueError as e:
            raise UsageError(f"--agent-variants: {e}") from None
    if args.agent_variant_base is not None:
        keys = candidate_keys(args.agent_windows, args.agent_thresholds, args.agent_min_restore,
                              args.agent_tail_windows)
        if not args.agent_variants or args.agent_variant_base not in keys:
            raise UsageError(f"--agent-variant-base {args.agent_variant_base!r} must be one of the stage's "
                             f"candidates {keys} and needs --agent-variants to run at it")

    try:
        parse_target(args.agent_target)
    except ValueError as e:
        raise UsageError(f"--agent-target: {e}") from None
    if args.agent_target_tokens < 1:
        raise UsageError(f"--agent-target-tokens must be >= 1, got {args.agent_target_tokens}")


def _check_reader_args(args: argparse.Namespace) -> None:
    """The reader stage's options (checked whether or not the stage runs).

    Raises:
        UsageError: the first bad one, naming the fix.
    """
    import math

    from patchkv_agent.usage import UsageError

    _reader_workloads(args.reader_workloads)
    if args.reader_n < 1:
        raise UsageError(f"--reader-n must be >= 1 (episodes per workload), got {args.reader_n}")
    if not (math.isfinite(args.reader_target) and 0.0 <= args.reader_target <= 1.0):
        raise UsageError(f"--reader-target must be in [0, 1] (a follow rate), got {args.reader_target!r}")


def check_calibrate_args(args: argparse.Namespace) -> None:
    """Every check of ``calibrate``'s arguments that needs no model (run before the model loads).

    Args:
        args: from :func:`add_calibrate_cli`'s parser.
    Raises:
        UsageError: (exit status 2) the first bad argument, in one line naming the fix.
    """
    from patchkv_agent.core.readers import READERS
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS
    from patchkv_agent.eval.workloads import EDITS
    from patchkv_agent.usage import UsageError, check_ranges, check_writable_dir

    check_ranges(args)
    _parse_workloads(args.workload, args.target_tokens)
    if args.edit not in (*EDITS, "all"):
        raise UsageError(f"--edit: unknown edit {args.edit!r}; choose from {[*EDITS, 'all']}")
    follow = [w.strip() for w in args.follow_workloads.split(",") if w.strip()]
    if follow != ["none"]:
        unknown = sorted(set(follow) - set(FOLLOW_WORKLOADS))
        if unknown:
            raise UsageError(f"--follow-workloads: unknown {unknown}; choose from {sorted(FOLLOW_WORKLOADS)} or 'none'")
    readers = tuple(r.strip() for r in args.readers.split(",") if r.strip())
    if not readers or set(readers) - set(READERS):
        raise UsageError(f"--readers must list some of {list(READERS)}, got {args.readers!r}")
    _number_or_none("--follow-target", args.follow_target, 0.0, 1.0)
    _number_or_none("--precision-target", args.precision_target, 0.0, float("inf"))
    _target(args.target)
    _policy_grid(args.policy_grid)
    _check_agent_args(args)
    _check_reader_args(args)
    for flag, path in (("--out", args.out), ("--drift-out", args.drift_out)):
        if path and Path(path).is_dir():
            raise UsageError(f"{flag} {path} is a directory; pass a file path")
        if path:  # hours of calibration must not end in an unwritable path
            check_writable_dir(flag, Path(path).parent)


def calibration_plan(args: argparse.Namespace) -> str:
    """What ``calibrate`` with these arguments would run and roughly how long it takes (no model loads).

    Args:
        args: checked arguments (:func:`check_calibrate_args`).
    Returns:
        Several lines of text.
    """
    from patchkv_agent.loading import cache_dir

    targets = _parse_workloads(args.workload, args.target_tokens)
    follow = [] if args.follow_workloads.strip() in ("", "none") else [
        w.strip() for w in args.follow_workloads.split(",") if w.strip()]
    follow_n = args.follow_n if follow else 0
    reader = _reader_workloads(args.reader_workloads)
    agent = _agent_workloads(args.agent_workloads)
    episodes = len(targets) * args.n + len(follow) * follow_n + len(reader) * args.reader_n
    agent_eps = len(agent) * args.agent_n
    est = episodes * _EPISODE_S * (args.versions - 1) / 2 + agent_eps * _AGENT_EPISODE_S * (
        len(args.agent_windows) + len(args.agent_thresholds) * max(1, len(args.agent_tail_windows)))
    out = Path(args.out) if args.out else cache_dir() / "profiles" / f"{_safe_name(args.model)}.json"
    lines = [
        f"calibrate {args.model}: writes {out} (+ .drift.npz, .rows.jsonl)",
        f"  episodes: {args.n} per workload of {', '.join(f'{w} at {t} tokens' for w, t in targets.items())}, "
        f"{args.versions} versions each (edit {args.edit})"
        + (f"; {follow_n} per edit-following workload ({', '.join(follow)})" if follow_n else ""),
        f"  stages: drift labels and the length model (tau_V candidates {', '.join(f'{t:g}' for t in args.tau_v)}), "
        f"the (kappa, block, readers) grid {len(args.kappas)} x {len(args.blocks)} x "
        f"{len([r for r in args.readers.split(',') if r.strip()])}"
        + ("" if args.precision_target == "none" else ", the precision policy")
        + (f", the reader stage ({len(reader)} workloads x {args.reader_n})" if reader else "")
        + (f", the agent stage ({len(agent)} workloads x {args.agent_n}, windows "
           f"{', '.join(map(str, args.agent_windows))})" if agent else ""),
        f"  time: about {est / 60:.0f} min for SmolLM2-135M on 2 free CPU cores (measured: 1720 s for the default "
        "50 episodes, docs/calibration.md); larger models, busy machines and --threads above the free cores take "
        "much longer (hours)",
    ]
    return "\n".join(lines)


def calib_traces(workload: str, edit: str, n: int, **build_kwargs) -> list[dict]:
    """Up to ``n`` calibration-split episodes of a workload, one edit kind per example where possible.

    With ``edit="all"`` the kinds rotate over examples (as :func:`patchkv_agent.eval.workloads.build_traces`
    does); when that yields fewer than ``n`` (long passages leave too few editable exchanges for some
    kinds, e.g. 2WikiMQA at 1.5k tokens), each kind is built on its own and the episodes are taken
    round-robin over kinds, distinct examples first, then further kinds of examples already taken.

    Args:
        workload: workload name.
        edit: an edit kind or ``"all"``.
        n: episodes wanted.
        **build_kwargs: passed to ``build_traces`` (``target_tokens``, ``n_versions``, ``seed``, ``count_tokens``).
    Returns:
        At most ``n`` traces with distinct ids.
    """
    from patchkv_agent.eval.workloads import EDITS, build_traces

    first = build_traces(workload, edit, n=n, split="calib", **build_kwargs)
    if edit != "all" or len(first) >= n:
        return first
    per_kind = [build_traces(workload, k, n=n, split="calib", **build_kwargs) for k in EDITS]
    pool = [t for i in range(n) for lst in per_kind if i < len(lst) for t in [lst[i]]]
    seen_ids = {t["id"] for t in first}
    seen_src = {t["meta"]["source_id"] for t in first}
    out = list(first)
    for distinct in (True, False):
        for t in pool:
            if len(out) >= n:
                return out
            if t["id"] in seen_ids or (distinct and t["meta"]["source_id"] in seen_src):
                continue
            out.append(t)
            seen_ids.add(t["id"])
            seen_src.add(t["meta"]["source_id"])
    return out


def calibrate_main(args: argparse.Namespace) -> int:
    """Run ``patchkv-agent calibrate`` with parsed arguments.

    Args:
        args: from :func:`add_calibrate_cli`'s parser.
    Returns:
        0 on success.
    Raises:
        SystemExit: no episodes could be built, or too few tasks to split.
    """
    from .config import CalibConfig
    from .outputs import save_drift, save_rows, write_profile
    from .profile import run_calibration
    from .profiling import episodes_from_traces

    check_calibrate_args(args)  # before the model loads (the lead CLI has run it already: cheap)
    given = getattr(args, "_argv", None)  # the options typed (None: called from code, which means it)
    if args.dry_run or (given is not None and not given and not args.run):
        print(calibration_plan(args))
        if args.dry_run:
            return 0
        from patchkv_agent.usage import UsageError

        raise UsageError("nothing started (a bare `calibrate` only shows its plan, above): pass --run to start it "
                         "with these defaults, or give the options you want (e.g. --out PROFILE.json); "
                         "--dry-run shows the plan of any invocation")

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    command = getattr(args, "_command", None) or "patchkv-agent " + shlex.join(sys.argv[1:])
    from patchkv_agent.loading import cache_dir

    default_out = cache_dir() / "profiles" / f"{_safe_name(args.model)}.json"
    out = Path(args.out) if args.out else default_out
    drift_out = Path(args.drift_out) if args.drift_out else out.with_suffix(".drift.npz")
    rows_out = out.with_suffix(".rows.jsonl")
    try:
        eng, count = stage_engine(args.model, profile=None)  # measure from the built-in defaults
    except OSError as e:  # not found, offline hub, unreadable files: the model cannot be had from here
        from patchkv_agent.usage import UsageError

        raise UsageError(f"--model {args.model}: {e.strerror or e}") from None

    targets = _parse_workloads(args.workload, args.target_tokens)
    workloads = list(targets)
    traces = []
    for w, tt in targets.items():
        got = calib_traces(w, args.edit, args.n, target_tokens=tt, n_versions=args.versions,
                           seed=args.seed, count_tokens=count)
        if len(got) < args.n:
            print(f"{w}: only {len(got)} calibration episodes at {tt} tokens", file=sys.stderr)
        traces += got
    follow = [] if args.follow_workloads.strip() in ("", "none") else [
        w.strip() for w in args.follow_workloads.split(",") if w.strip()]
    if follow and args.follow_n > 0:
        from patchkv_agent.eval.follow import FOLLOW_WORKLOADS, build_follow_traces

        unknown = sorted(set(follow) - set(FOLLOW_WORKLOADS))
        if unknown:
            raise SystemExit(f"--follow-workloads: unknown {unknown}; choose from {sorted(FOLLOW_WORKLOADS)} or 'none'")
        for w in follow:
            traces += build_follow_traces(w, n=args.follow_n, split="calib", seed=args.seed, count_tokens=count)
        workloads += follow
    if not traces:
        raise SystemExit("no calibration episodes could be built; check --workload/--edit/--n")
    agent = _build_agent_traces(args, count)  # before the long stages: a bad --agent-skip fails now
    reader_names = _reader_workloads(args.reader_workloads)
    readers = tuple(r.strip() for r in args.readers.split(",") if r.strip())
    from patchkv_agent.core.readers import READERS

    if not readers or set(readers) - set(READERS):
        raise SystemExit(f"--readers must list some of {READERS}, got {args.readers!r}")
    follow_target = None if args.follow_target == "none" else float(args.follow_target)
    episodes = episodes_from_traces(eng, traces)
    cfg = CalibConfig(metric=args.metric, profile_block=args.profile_block, tau_v=args.tau_v[0],
                      tau_grid=tuple(args.tau_v) if len(args.tau_v) > 1 else (), gamma=args.gamma,
                      quantile=args.quantile, ridge=args.ridge, shift=args.shift, val_share=args.val_share,
                      kappas=tuple(args.kappas), blocks=tuple(args.blocks), readers=readers, quality=args.quality,
                      follow_target=follow_target,
                      tol_abs=args.tol_abs, tol_rel=args.tol_rel, z=args.z, target=_target(args.target),
                      precision_target=None if args.precision_target == "none" else float(args.precision_target),
                      policy_grid=_policy_grid(args.policy_grid),
                      ref_tokens=args.ref_tokens, grid_max_pairs=args.grid_max_pairs)
    data = {"workloads": workloads, "edit": args.edit, "n_per_workload": args.n, "versions": args.versions,
            "target_tokens": targets, "seed": args.seed, "threads": args.threads, "trace_split": "calib",
            "follow_workloads": follow, "follow_n": args.follow_n if follow else 0}
    try:
        profile, pairs = run_calibration(eng, episodes, cfg, model_name=args.model, command=command, data=data,
                                         progress=not args.no_progress)
    except ValueError as e:
        raise SystemExit(f"calibration failed: {e}") from None
    if reader_names:
        from .reader_stage import follow_traces

        reader = follow_traces(reader_names, n=args.reader_n, seed=args.seed, count_tokens=count)
        profile = _reader_stage(eng, profile, reader, args, command)
    if agent:
        profile = _agent_stage(eng, profile, agent, args, command)
    profile["timing"]["wall_s"] = round(time.perf_counter() - t0, 1)
    write_profile(profile, out)
    save_drift(pairs, drift_out, profile)
    save_rows(profile, rows_out)
    fit = profile["fit"]
    print(f"wrote {out} (drift curves: {drift_out}, resume rows: {rows_out})")
    print(f"  length model q={cfg.quantile}: validation coverage {fit['validation']['coverage']:.3f} over "
          f"{fit['validation']['n_spans']} spans (calibration {fit['calib']['coverage']:.3f} over "
          f"{fit['calib']['n_spans']})")
    chosen = profile["selection"]["chosen"]
    fr = chosen.get("follow_rate")
    print(f"  tau_V={profile['tau_v']} kappa={profile['kappa']} block_size={profile['block_size']} "
          f"readers={profile['readers']} (worst-workload {cfg.quality} gap {chosen['worst_gap']:.4g}"
          + ("" if fr is None else f", follow rate {fr:.3f}") + ")")
    print("  d_hat examples: " + ", ".join(f"P={x['P']} E={x['E']} S={x['S']} -> {x['d_hat']}"
                                            for x in profile["d_hat_examples"]))
    rsel = profile.get("reader_rule_selection")
    if rsel is not None and rsel.get("chosen") is not None:
        g = rsel["grid"][rsel["chosen"]]
        print(f"  reader rule {rsel['chosen']} (follows {g['follows']}/{g['n']} where exact does, "
              f"{g['recompute_tokens_mean']:.0f} recomputed tokens; target {rsel['target']:g} on every workload "
              f"{'met' if rsel['target_met'] else 'not met'})")
    elif rsel is not None:
        print(f"  reader rule not selected: {rsel.get('skipped')}")
    sel = profile.get("recent_window_selection")
    if sel is not None and sel.get("chosen") is not None:
        g = sel["grid"][str(sel["chosen"])]
        print(f"  recent_window={sel['chosen']} (next-action agreement {g['agree']}/{g['n']}, target "
              f"{sel['target']:g} {'met' if sel['target_met'] else 'not met'}); grid: "
              + ", ".join(f"{w}: {r['agree']}/{r['n']} at {r['recompute_tokens_mean']:.0f} tokens"
                          for w, r in sel["grid"].items()))
    elif sel is not None:
        print(f"  recent_window not selected: {sel.get('skipped')}")
    print(f"  wall time {profile['timing']['wall_s']:.0f}s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``python -m patchkv_agent.calibration.cli``.

    Raises:
        SystemExit: status 2 with one line on stderr for a bad argument.
    """
    from patchkv_agent.usage import UsageError, report

    args = build_calibrate_parser().parse_args(argv)
    args._argv = list(sys.argv[1:] if argv is None else argv)
    args._command = "python -m patchkv_agent.calibration.cli " + shlex.join(args._argv)
    try:
        return calibrate_main(args)
    except UsageError as e:
        report("patchkv-agent calibrate", e)
        raise


if __name__ == "__main__":
    sys.exit(main())

"""``python -m patchkv_agent.calibration.analysis``: build the contexts, compute the figures, write them.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import time

import torch

from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, DEFAULT_DIRTY_WINDOW
from patchkv_agent.kernels.formats import FORMATS

from .driver import run_analysis
from .inputs import DEFAULT_WORKLOADS, DESCRIPTION, AnalysisConfig, build_contexts
from .plots import write_outputs

def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(",") if x.strip())


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m patchkv_agent.calibration.analysis``.

    Returns:
        The parser.
    """
    ap = argparse.ArgumentParser(prog="python -m patchkv_agent.calibration.analysis",
                                 description=DESCRIPTION)
    ap.add_argument("--model", default="smollm2-135m", help="HF id, local dir, .gguf path or 'smollm2-135m'")
    ap.add_argument("--n", type=int, default=3, help="edited contexts (workloads round-robin, edit kinds in rotation)")
    ap.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS))
    ap.add_argument("--target-tokens", type=int, default=3000, help="version-0 length in tokens")
    ap.add_argument("--seed", type=int, default=0, help="trace seed and random-selector seed")
    ap.add_argument("--out-dir", default="runs/figures/analysis")
    ap.add_argument("--figures", default="a,b,c,d", help="which figures, e.g. 'a,c'")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch CPU threads (default: torch's choice; 1 is faster on a shared machine)")
    ap.add_argument("--bin-size", type=int, default=32, help="(a) distance bin in tokens")
    ap.add_argument("--layers", default="all", help="(a) comma-separated layers to average over, or 'all'")
    ap.add_argument("--window", type=int, default=DEFAULT_DIRTY_WINDOW, help="(b, d) fixed dirty window in tokens")
    ap.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="(b, c) block size in tokens")
    ap.add_argument("--budget", type=float, default=0.05, help="(b) extra blocks as a share of the suffix blocks")
    ap.add_argument("--budget-blocks", type=int, default=None, help="(b) extra blocks (overrides --budget)")
    ap.add_argument("--max-blocks", type=int, default=48, help="(c) blocks probed per context, evenly spaced (0: all)")
    ap.add_argument("--quant-format", default="K8V4", choices=list(FORMATS), help="(c) format of the probed block")
    ap.add_argument("--kappas", type=_floats, default=(0.0, 0.01, 0.02, 0.03), help="(d) kappa grid")
    ap.add_argument("--blocks", type=_ints, default=(16, 32, 64, 128), help="(d) block-size grid")
    ap.add_argument("--max-new-tokens", type=int, default=16, help="greedy reference tokens")
    ap.add_argument("--precision", default="fp16", choices=["fp16", "mixed"],
                    help="(b, d) restore precision: checkpoint rows as stored, or the per-block mixed tags")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--profile-figure", default=None, metavar="PROFILE",
                    help="only draw the calibration figure of this profile JSON and its drift curves (no model): "
                         "value cosine by distance (--bin-size blocks) and d* vs d_hat, "
                         "<out-dir>/value_cosine_by_distance.png")
    ap.add_argument("--drift", default=None, help="with --profile-figure: the drift .npz (default: beside the "
                                                   "profile, else calibration/profiles/<name>.drift.npz)")
    return ap


def _profile_figure(args) -> int:
    """``--profile-figure``: the calibration figure of a profile and its drift curves (no model)."""
    import json
    from pathlib import Path

    import numpy as np

    from .plots import _plt, plot_profile

    prof_path = Path(args.profile_figure)
    drift_path = Path(args.drift) if args.drift else prof_path.with_suffix(".drift.npz")
    if not args.drift and not drift_path.is_file():  # the shipped profile's curves stay in calibration/profiles/
        drift_path = Path(__file__).resolve().parents[1] / "profiles" / f"{prof_path.stem}.drift.npz"
    try:
        prof = json.loads(prof_path.read_text())
        drift = dict(np.load(drift_path))
    except (OSError, ValueError) as e:
        raise SystemExit(f"--profile-figure: {e}") from None
    out = Path(args.out_dir) / "value_cosine_by_distance.png"
    _plt().close(plot_profile(prof, drift, out, block=args.bin_size))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point: build the contexts, compute the figures, write ``analysis.json`` and the PNGs.

    Args:
        argv: arguments (default ``sys.argv[1:]``).
    Returns:
        0 on success.
    Raises:
        SystemExit: bad arguments, or no context could be built.
    """
    args = build_parser().parse_args(argv)
    if args.profile_figure:
        return _profile_figure(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = tuple(f.strip() for f in args.figures.split(",") if f.strip())
    layers = None if args.layers.strip() == "all" else _ints(args.layers)
    try:
        cfg = AnalysisConfig(figures=figures, bin_size=args.bin_size, layers=layers, window=args.window,
                             block_size=args.block_size, budget=args.budget, budget_blocks=args.budget_blocks,
                             seed=args.seed, max_blocks=args.max_blocks or None, quant_format=args.quant_format,
                             kappas=tuple(args.kappas), blocks=tuple(args.blocks), max_new_tokens=args.max_new_tokens,
                             precision=args.precision)
    except ValueError as e:
        raise SystemExit(f"bad arguments: {e}") from None
    from patchkv_agent.engine import PatchKVEngine

    t0 = time.perf_counter()
    eng = PatchKVEngine.from_pretrained(args.model, profile=None, block_size=args.block_size,
                                        mixed_precision=args.precision == "mixed")
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    contexts = build_contexts(eng, args.n, workloads=[w.strip() for w in args.workloads.split(",") if w.strip()],
                              target_tokens=args.target_tokens, seed=args.seed)
    if not contexts:
        raise SystemExit("no edited context could be built; check --workloads/--target-tokens")
    print(f"{len(contexts)} contexts: " + ", ".join(f"{c.id} ({len(c.new_ids)} tokens)" for c in contexts),
          file=sys.stderr)
    data = run_analysis(eng, contexts, cfg, progress=not args.no_progress)
    argv_list = sys.argv[1:] if argv is None else list(argv)
    data = {"model": args.model, "command": "python -m patchkv_agent.calibration.analysis " + shlex.join(argv_list),
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "threads": torch.get_num_threads(), **data}
    data["timing"]["wall_s"] = round(time.perf_counter() - t0, 1)
    paths = write_outputs(data, args.out_dir)
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    _print_summary(data)
    return 0


def _print_summary(data: dict) -> None:
    if "drift" in data:
        s = data["drift"]["summary"]
        for j in range(min(4, len(s["bin_start"]))):
            print(f"(a) bin {s['bin_start'][j]:>4}: median cos value {s['value']['p50'][j]:.4f}, key raw "
                  f"{s['key_raw']['p50'][j]:.4f}, key corrected {s['key_corrected']['p50'][j]:.4f} "
                  f"({s['n_spans'][j]} spans)")
    for name, r in data.get("selection", {}).get("summary", {}).items():
        follow = "" if r.get("follow_rate") is None else (f", follows {r['follow_rate']:.2f} of {r['follow_n']}, "
                                                          f"stale {r['stale_rate'] or 0:.2f} of {r['stale_n']}")
        print(f"(b) {name:>13}: exact cont. {r['exact_continuation']:.2f}, TF {r['tf_agree']:.3f}, "
              f"KL {r['first_token_kl']:.4g}, recompute ratio {r['recompute_ratio']:.3f}{follow}")
    if "precision" in data:
        s = data["precision"]["summary"]
        for c, w in zip(s["per_context"], s["per_context_without_last"]):
            share, share_w = ("n/a" if x["top_share"] is None else f"{x['top_share']:.3f}" for x in (c, w))
            print(f"(c) {c['context']}: top {s['top']:.0%} of {len(c['x']) - 1} blocks hold {share} of KL "
                  f"(sum {c['total_kl']:.4g}); without the last token's block {share_w} of {len(w['x']) - 1}")
    for r in data.get("ablation", {}).get("summary", []):
        print(f"(d) kappa {r['kappa']:g} block {r['block_size']:>3}: recompute {r['recompute_ratio']:.3f}, "
              f"TF {r['tf_agree']:.3f}, KL {r['first_token_kl']:.4g}, TTFT {r['ttft_s_median']:.2f}s")

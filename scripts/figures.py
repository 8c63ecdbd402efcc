"""Calibration figures from a profile and its drift curves (written by ``patchkv-agent calibrate``).

Usage::

    python scripts/figures.py --profile calibration/profiles/smollm2-135m.json \
        --drift calibration/profiles/smollm2-135m.drift.npz --out runs/figures/value_cosine_by_distance.png

Left panel: value cosine similarity (stale restored V vs exact V, mean over profiled layers and KV
heads) by distance from the edit, in 32-token blocks: per block the least similar token (what ``d*``
compares with ``1 - tau_V``; median and 10-90 % band over spans) and the block mean (median). Right panel: oracle ``d*`` against the length model's ``d_hat`` per span
(calibration and validation tasks); points on or under the diagonal are covered.

Boundary: reads the two files, writes one PNG; no model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def cosine_by_distance(drift: dict, block: int = 32, max_distance: int = 1024, min_suffix: int = 256,
                       reduce: str = "min"):
    """Per distance block: (block starts, 10th, 50th, 90th percentile of cosine similarity, span counts).

    Args:
        drift: the loaded ``.npz`` (``metric="cosine"`` deviations).
        block: distance bin in tokens.
        max_distance: last distance shown.
        min_suffix: only spans whose segment has at least this many tokens (short segments between two
            nearby edits would only populate the first bins).
        reduce: ``"min"`` (least similar token of the block) or ``"mean"``.
    Returns:
        Arrays ``starts, p10, p50, p90, n``.
    """
    off, dev, s = drift["offsets"], drift["deviation"].astype(np.float64), drift["S"]
    starts = np.arange(0, max_distance, block)
    per_bin: list[list[float]] = [[] for _ in starts]
    for i in range(len(s)):
        if s[i] < min_suffix:
            continue
        d = dev[off[i]:off[i + 1]]
        for j, a in enumerate(starts):
            if a < d.size:
                seg = d[a:a + block]
                per_bin[j].append(1.0 - float(seg.max() if reduce == "min" else seg.mean()))
    keep = [j for j, v in enumerate(per_bin) if v]
    q = np.array([np.percentile(per_bin[j], [10, 50, 90]) for j in keep]).reshape(-1, 3)
    return starts[keep], q[:, 0], q[:, 1], q[:, 2], np.array([len(per_bin[j]) for j in keep])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="calibration/profiles/smollm2-135m.json")
    ap.add_argument("--drift", default=None, help="drift .npz (default: beside the profile)")
    ap.add_argument("--out", default="runs/figures/value_cosine_by_distance.png")
    ap.add_argument("--block", type=int, default=32)
    args = ap.parse_args(argv)
    prof = json.loads(Path(args.profile).read_text())
    drift_path = Path(args.drift) if args.drift else Path(args.profile).with_suffix(".drift.npz")
    drift = dict(np.load(drift_path))
    starts, p10, p50, p90, n = cosine_by_distance(drift, args.block)
    m_starts, _, m50, _, _ = cosine_by_distance(drift, args.block, reduce="mean")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = starts + args.block / 2
    a1.fill_between(x, p10, p90, alpha=0.25, label="least similar token: 10-90 % of spans")
    a1.plot(x, p50, marker="o", ms=3, label="least similar token: median")
    a1.plot(m_starts + args.block / 2, m50, color="gray", lw=1, label="block mean: median")
    a1.axhline(1 - prof["tau_v"], color="k", ls="--", lw=1, label=f"1 - tau_V = {1 - prof['tau_v']:.2f}")
    a1.set_xlabel(f"distance from the edit (tokens, {args.block}-token blocks)")
    a1.set_ylabel("value cosine similarity, restored vs exact")
    a1.set_title(f"{prof['model']}: {int(n.max()) if n.size else 0} spans with |S| >= 256")
    a1.legend(loc="lower right", fontsize=8)

    lab = prof.get("labels", [])
    for split, mk in (("calib", "o"), ("validation", "s")):
        rows = [r for r in lab if r.get("split") == split]
        if rows:
            a2.scatter([max(r["d_hat"], 1) for r in rows], [max(r["d_star"], 1) for r in rows], marker=mk, s=16,
                       alpha=0.7, label=f"{split} ({len(rows)} spans)")
    lim = max([2] + [max(r["d_hat"], r["d_star"]) for r in lab]) * 1.3
    a2.plot([1, lim], [1, lim], "k--", lw=1)
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("d_hat (length model)")
    a2.set_ylabel("d* (oracle; 0 drawn at 1)")
    cov = prof.get("validation_coverage")
    a2.set_title(f"q={prof['quantile']}: validation coverage {cov:.2f}" if cov is not None else "coverage")
    a2.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

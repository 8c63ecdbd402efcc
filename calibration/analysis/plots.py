"""The four figures from the analysis JSON alone (no model), the calibration figure of a profile and its
drift curves (:func:`plot_profile`), and the writer of the JSON and the PNGs.

The ``plot_*`` functions read only the JSON that :func:`..driver.run_analysis` returns, so the notebook
(``notebooks/analysis.ipynb``) redraws the committed figures without a model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .inputs import _PCT, FIGURE_NAMES, SELECTORS

def _plt():
    import matplotlib

    if matplotlib.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        try:
            matplotlib.use("Agg")
        except Exception:  # pragma: no cover - an interactive backend already running
            pass
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path):
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    return fig


def _title(data: dict) -> str:
    n = len(data.get("contexts", []))
    return f"{data.get('model') or data.get('fingerprint', '')[:24]}: {n} edited context{'s' * (n != 1)}"


def plot_drift(data: dict, path: str | Path | None = None):
    """Figure (a): median and 10-90 % band of value, raw-key and RoPE-corrected-key cosine by distance.

    Args:
        data: the analysis JSON (needs ``drift``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``drift`` section.
    """
    plt = _plt()
    sec = data["drift"]
    s, bs = sec["summary"], sec["bin_size"]
    x = np.asarray(s["bin_start"], dtype=np.float64) + bs / 2
    fig, ax = plt.subplots(figsize=(8, 4.4))
    labels = {"value": "values (stale)", "key_raw": "keys, no RoPE correction", "key_corrected": "keys, RoPE-corrected"}
    for name, color in (("value", "C0"), ("key_raw", "C3"), ("key_corrected", "C2")):
        q = s[name]
        p10, p50, p90 = (np.asarray([np.nan if v is None else v for v in q[f"p{p}"]], dtype=np.float64) for p in _PCT)
        ax.fill_between(x, p10, p90, color=color, alpha=0.18)
        ax.plot(x, p50, color=color, marker="o", ms=3, label=f"{labels[name]}: median, 10-90 % band")
    ax.set_xlabel(f"distance from the edit (tokens, {bs}-token bins)")
    ax.set_ylabel("cosine similarity to exact (mean over layers, KV heads)")
    n_sp = max(s["n_spans"], default=0)
    ax.set_title(f"{_title(data)}, {n_sp} spans")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_selection(data: dict, path: str | Path | None = None):
    """Figure (b): bars per selector of exact-continuation rate, teacher-forced agreement, first-token KL.

    Args:
        data: the analysis JSON (needs ``selection``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``selection`` section.
    """
    plt = _plt()
    sec = data["selection"]
    summ = sec["summary"]
    names = [n for n in SELECTORS if n in summ]
    rows = sec["rows"]
    panels = [("exact_continuation", "exact continuation rate"), ("tf_agree", "teacher-forced agreement"),
              ("first_token_kl", "first-token KL (nats), mean")]
    if any(summ[n].get("follow_rate") is not None for n in names):  # edit-following contexts
        panels.append(("follows", "follows the edit (where exact does)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    for ax, (key, label) in zip(axes, panels):
        if key == "follows":
            vals = [summ[n].get("follow_rate") or 0.0 for n in names]
            ax.bar(range(len(names)), vals, color=[f"C{i}" for i in range(len(names))])
            ax.set_xticks(range(len(names)))
            ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{label}, n={max(summ[n].get('follow_n', 0) for n in names)}", fontsize=10)
            ax.grid(axis="y", alpha=0.3)
            continue
        vals = [summ[n][key] for n in names]
        ax.bar(range(len(names)), vals, color=[f"C{i}" for i in range(len(names))])
        for i, n in enumerate(names):  # individual contexts
            pts = [float(r[key]) for r in rows if r["selector"] == n]
            ax.scatter(np.full(len(pts), i) + np.linspace(-0.15, 0.15, len(pts)) if len(pts) > 1 else [i] * len(pts),
                       pts, color="k", s=8, zorder=3)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
        if key != "first_token_kl":
            ax.set_ylim(0, 1.05)
        ax.set_title(label, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    b = sorted({r["budget_blocks"] for r in rows})
    fig.suptitle(f"{_title(data)}; D = first {sec['window']} tokens after each edit, "
                 f"+{b[0] if len(b) == 1 else f'{b[0]}-{b[-1]}'} blocks of {sec['block_size']} per selector",
                 fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_precision(data: dict, path: str | Path | None = None):
    """Figure (c): cumulative share of first-token KL against the share of blocks (most sensitive first),
    one curve per context; right, per-block KL by distance from the edit.

    Args:
        data: the analysis JSON (needs ``precision``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``precision`` section.
    """
    plt = _plt()
    sec = data["precision"]
    summ = sec["summary"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.3))
    a1.plot([0, 1], [0, 1], "k:", lw=1, label="uniform")
    without = summ.get("per_context_without_last") or [None] * len(summ["per_context"])
    for i, (c, w) in enumerate(zip(summ["per_context"], without)):
        def lab(x, what):
            share = x["top_share"]
            return f"{c['context'].split('/')[0]} {what} ({len(x['x']) - 1} blocks)" + (
                f": top {summ['top']:.0%} hold {share:.0%}" if share is not None else ": zero KL")
        a1.plot(c["x"], c["y"], color=f"C{i}", lw=1.5, label=lab(c, "all"))
        if w is not None and len(w["x"]) != len(c["x"]):
            a1.plot(w["x"], w["y"], color=f"C{i}", lw=1.2, ls="--", label=lab(w, "w/o last block"))
    a1.axvline(summ["top"], color="gray", lw=0.8, ls=":")
    a1.set_xlabel("share of blocks (most sensitive first)")
    a1.set_ylabel("share of summed first-token KL")
    a1.set_title(f"one {sec['format']} block at a time ({sec['block_size']} tokens)", fontsize=10)
    a1.legend(fontsize=7, loc="lower right")
    for i, c in enumerate(sec["contexts"]):
        for last, mk in ((False, "o"), (True, "x")):
            bl = [b for b in c["blocks"] if bool(b.get("last", False)) == last]
            a2.scatter([b["distance"] for b in bl], [max(b["kl"], 1e-12) for b in bl], s=14 if last else 12,
                       marker=mk, color=f"C{i}", alpha=0.8,
                       label="block of the last token" if last and bl and i == 0 else None)
    if any(b.get("last") for c in sec["contexts"] for b in c["blocks"]):
        a2.legend(fontsize=7, loc="lower right")
    a2.set_yscale("log")
    a2.set_xlabel("distance of the block from the edit (tokens)")
    a2.set_ylabel("first-token KL vs full-precision direct")
    a2.set_title(_title(data), fontsize=10)
    a2.grid(alpha=0.3)
    fig.tight_layout()
    return _save(fig, path)


def plot_ablation(data: dict, path: str | Path | None = None):
    """Figure (d): one heatmap per metric over ``kappa`` (rows) x block size (columns).

    Args:
        data: the analysis JSON (needs ``ablation``).
        path: write a PNG here (None: only return the figure).
    Returns:
        The matplotlib figure.
    Raises:
        KeyError: no ``ablation`` section.
    """
    plt = _plt()
    sec = data["ablation"]
    summ = sec["summary"]
    kappas = sorted({r["kappa"] for r in summ})
    blocks = sorted({r["block_size"] for r in summ})
    metrics = (("recompute_ratio", "mean recompute ratio", ".3f"), ("tf_agree", "mean TF agreement", ".3f"),
               ("first_token_kl", "mean first-token KL", ".2e"), ("ttft_s_median", "median TTFT (s)", ".2f"))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.6))
    for ax, (key, label, fmt) in zip(axes, metrics):
        m = np.full((len(kappas), len(blocks)), np.nan)
        for r in summ:
            if r[key] is not None:
                m[kappas.index(r["kappa"]), blocks.index(r["block_size"])] = r[key]
        im = ax.imshow(m, aspect="auto", cmap="viridis")
        for i in range(len(kappas)):
            for j in range(len(blocks)):
                if np.isfinite(m[i, j]):
                    light = float(im.norm(m[i, j])) > 0.6  # viridis is light at the top of its range
                    ax.text(j, i, format(m[i, j], fmt), ha="center", va="center", fontsize=7,
                            color="k" if light else "w")
        ax.set_xticks(range(len(blocks)))
        ax.set_xticklabels([str(b) for b in blocks])
        ax.set_yticks(range(len(kappas)))
        ax.set_yticklabels([f"{k:g}" for k in kappas])
        ax.set_xlabel("block size")
        ax.set_ylabel("kappa")
        ax.set_title(label, fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"{_title(data)}; fixed window {sec['window']} tokens", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def cosine_by_distance(drift, block: int = 32, max_distance: int = 1024, min_suffix: int = 256,
                       reduce: str = "min"):
    """Per distance block: (block starts, 10th, 50th, 90th percentile of cosine similarity, span counts).

    Args:
        drift: the drift curves ``.npz`` of a calibration (``metric="cosine"`` deviations; ``offsets``,
            ``deviation``, ``S``), loaded.
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


def plot_profile(prof: dict, drift, path: str | Path | None = None, *, block: int = 32):
    """The calibration figure of a profile (``patchkv-agent calibrate``) and its drift curves, no model.

    Left: value cosine similarity (stale restored V vs exact V, mean over profiled layers and KV heads) by
    distance from the edit, in ``block``-token blocks: per block the least similar token (what ``d*``
    compares with ``1 - tau_V``; median and 10-90 % band over spans) and the block mean (median). Right:
    oracle ``d*`` against the length model's ``d_hat`` per span (calibration and validation tasks); points
    on or under the diagonal are covered.

    Args:
        prof: the profile JSON (``model``, ``tau_v``, ``quantile``, ``labels``, ``validation_coverage``).
        drift: its drift curves (:func:`cosine_by_distance`).
        path: write a PNG here (None: only return the figure).
        block: distance bin in tokens.
    Returns:
        The matplotlib figure.
    """
    plt = _plt()
    starts, p10, p50, p90, n = cosine_by_distance(drift, block)
    m_starts, _, m50, _, _ = cosine_by_distance(drift, block, reduce="mean")

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = starts + block / 2
    a1.fill_between(x, p10, p90, alpha=0.25, label="least similar token: 10-90 % of spans")
    a1.plot(x, p50, marker="o", ms=3, label="least similar token: median")
    a1.plot(m_starts + block / 2, m50, color="gray", lw=1, label="block mean: median")
    a1.axhline(1 - prof["tau_v"], color="k", ls="--", lw=1, label=f"1 - tau_V = {1 - prof['tau_v']:.2f}")
    a1.set_xlabel(f"distance from the edit (tokens, {block}-token blocks)")
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
    return _save(fig, path)


_PLOTS = {"drift": plot_drift, "selection": plot_selection, "precision": plot_precision, "ablation": plot_ablation}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if not math.isfinite(float(x)) else float(x)
    if isinstance(x, np.bool_):
        return bool(x)
    return x


def write_outputs(data: dict, out_dir: str | Path) -> list[Path]:
    """Write ``analysis.json`` and one PNG per computed figure (``a_drift.png``, ``b_selection.png``,
    ``c_precision.png``, ``d_ablation.png``).

    Args:
        data: the result of :func:`run_analysis` (any extra keys are kept).
        out_dir: output folder (created).
    Returns:
        The written paths, JSON first.
    """
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "analysis.json"
    path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    paths = [path]
    for letter, name in FIGURE_NAMES.items():
        if name in data:
            png = out / f"{letter}_{name}.png"
            plt.close(_PLOTS[name](data, png))
            paths.append(png)
    return paths

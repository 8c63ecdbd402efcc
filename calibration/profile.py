"""The offline profiler: paired exact prefills -> drift labels -> length model -> tau_V, kappa, block -> profile.

Boundary: :func:`run_calibration` runs the whole calibration and assembles one JSON profile dict with its
report (fit and coverage summaries, ``d_hat`` examples, the selections and their summaries). It drives a
:class:`~patchkv_agent.engine.PatchKVEngine` through its public methods only (``resume(None, ids,
strategy="exact")``, ``checkpoint_from``, ``resume(ckpt, ids, strategy="patchkv", ...)``,
``length_model``), by way of the steps: :mod:`.profiling` (prefills, drift, labels), :mod:`.evaluation`
(resumes scored against the exact reference) and :mod:`.precision_stage`; the numeric pieces live in
:mod:`.drift` (labels), :mod:`.fit` (quantile fit, split) and :mod:`.select` (minimax rule), the run's
data types in :mod:`.config` and the writers in :mod:`.outputs`. The profiler's public names are
re-exported here (``__all__``).

Per episode (a chain of context versions of one task) every version is prefilled exactly once
(``exact`` resume, which also gives the greedy reference continuation); its checkpoint for the next
pair is taken with ``checkpoint_from`` (attention statistics from a short tail pass). For each adjacent
pair the stale suffix values (old version) are compared with the exact new ones: per edited span
one :class:`~.drift.SpanDrift` and its oracle boundary ``d*``. Tasks are split into calibration and
validation (never one task on both sides); the length model is fitted on calibration spans and its
coverage measured on validation spans. Real ``patchkv`` resumes on (up to ``grid_max_pairs``)
validation pairs, scored against the exact reference (first-token KL, teacher-forced agreement), then
choose by the rule of :mod:`.select` with a quality target (default: no worse than the engine's
built-in setting, ``patchkv-default``, measured on the same pairs; the cheapest configuration meeting it
wins): first ``tau_V`` among the candidates (one length model each, resumed at ``kappa=0,
block_size=32``), then ``(kappa, block_size)`` under the chosen model. Last, the precision stage: for
each ``(tau_L, tau_H)`` candidate the kept checkpoints are re-tagged and quantized and ``direct``
restores the whole suffix from them; the smallest-payload policy whose worst per-workload increase of
first-token KL over the FP16 restore stays under ``precision_target`` is written into the profile.
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from typing import Any, Sequence

import numpy as np

from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, LengthModel
from patchkv_agent.core.precision import PrecisionPolicy
from patchkv_agent.profiles import PROFILE_SCHEMA

from .config import DEFAULT_POLICY_GRID, DEFAULT_TAU_GRID, DEFAULT_TAU_V, CalibConfig, Episode, PairProfile
from .drift import default_profile_layers
from .evaluation import ResumeConfig, evaluate_configs, evaluate_grid, evaluate_references
from .fit import coverage, fit_length_model, log_target, pinball_loss, split_by_group
from .outputs import save_drift, save_rows, write_profile
from .precision_stage import evaluate_precision, select_policy
from .profiling import episodes_from_traces, label_spans, profile_episodes
from .select import select_config, summarize_grid

__all__ = ["Episode", "CalibConfig", "PairProfile", "ResumeConfig", "episodes_from_traces", "profile_episodes",
           "label_spans", "evaluate_configs", "evaluate_references", "evaluate_grid", "run_calibration",
           "evaluate_precision", "select_policy", "write_profile", "save_rows", "save_drift", "DEFAULT_TAU_V",
           "DEFAULT_TAU_GRID", "DEFAULT_POLICY_GRID"]

_GRID_KEYS = ("kappa", "block_size", "readers")


def _cols(rows: Sequence[dict]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray([r[c] for r in rows], dtype=np.int64) for c in ("P", "E", "S", "d_star"))


def _d_hat_examples(lm: LengthModel) -> list[dict[str, int]]:
    cases = [(200, 20, 1200), (300, 300, 1000), (500, 150, 800), (800, 400, 400), (1000, 100, 200)]
    p, e, s = (np.asarray(c) for c in zip(*cases))
    d_hat = lm.predict(p, e, s)
    return [{"P": int(a), "E": int(b), "S": int(c), "d_hat": int(d)} for a, b, c, d in zip(p, e, s, d_hat)]


def _fit_for_tau(pairs: Sequence[PairProfile], cfg: CalibConfig, val_tasks: Sequence[str]
                 ) -> tuple[list[dict], LengthModel]:
    """Labels (with ``split`` and ``d_hat``) and the length model fitted on the calibration spans."""
    labels = label_spans(pairs, cfg)
    for r in labels:
        r["split"] = "validation" if r["task"] in val_tasks else "calib"
    cal = [r for r in labels if r["split"] == "calib"]
    if not cal:
        raise ValueError("no edited span with a suffix among the calibration tasks")
    lm = fit_length_model(*_cols(cal), quantile=cfg.quantile, ridge=cfg.ridge, groups=[r["task"] for r in cal],
                          shift=cfg.shift, d_min=cfg.d_min)
    for r in labels:
        r["d_hat"] = int(lm.predict(np.asarray([r["P"]]), np.asarray([r["E"]]), np.asarray([r["S"]]))[0])
    return labels, lm


def _fit_summary(lm: LengthModel, rows: Sequence[dict], q: float) -> dict[str, Any]:
    if not rows:
        return {"n_spans": 0, "coverage": None}
    p, e, s, d = _cols(rows)
    d_hat = np.asarray([r["d_hat"] for r in rows], dtype=np.float64)
    return {"n_spans": len(rows), "n_pairs": len({r["pair"] for r in rows}), "n_tasks": len({r["task"] for r in rows}),
            "coverage": coverage(lm, p, e, s, d),
            "pinball": pinball_loss(log_target(d), np.log(np.maximum(d_hat, 1)), q),
            "mean_d_star": float(d.mean()), "mean_d_hat": float(d_hat.mean()), "mean_suffix": float(s.mean()),
            "window_share": float(d_hat.sum() / max(1, s.sum())),
            "coverage_by_workload": {w: coverage(lm, *_cols([r for r in rows if r["workload"] == w]))
                                     for w in sorted({r["workload"] for r in rows})}}


def _means(rows: Sequence[dict]) -> dict[str, float]:
    keys = ("first_token_kl", "tf_agree", "recompute_tokens", "prefix_recompute_tokens", "ttft_s")
    return {k: float(np.mean([r[k] for r in rows])) for k in keys}


def run_calibration(engine, episodes: Sequence[Episode], cfg: CalibConfig = CalibConfig(), *, model_name: str = "",
                    command: str | None = None, data: dict | None = None, progress: bool = False
                    ) -> tuple[dict, list[PairProfile]]:
    """The whole calibration: profile, label, split, fit, validate, (tau_V stage), grid, select, freeze.

    With ``cfg.tau_grid`` of two or more values, one length model is fitted per ``tau_V`` and the window
    stage picks ``tau_V`` by the minimax rule over resumes at ``kappa=0, block_size=32``; the
    ``(kappa, block)`` grid then runs under the chosen length model. Otherwise ``cfg.tau_v`` is used.

    Args:
        engine: the engine of the model to calibrate.
        episodes: calibration episodes (tasks with at least one pair each).
        cfg: the configuration.
        model_name: the profile's ``model`` (what :func:`patchkv_agent.profiles.load_profile` matches).
        command: the command line that made the profile (recorded).
        data: extra provenance recorded under ``"data"`` (workloads, sizes, ...).
        progress: show a tqdm bar.
    Returns:
        ``(profile dict, profiled pairs)``; the dict's ``"_rows"`` holds the raw per-pair resume rows
        (``window``, ``grid``, ``reference``) for :func:`save_rows` (:func:`write_profile` drops it).
    Raises:
        ValueError: fewer than two tasks, no span with a suffix on the calibration side, or bad settings.
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    tasks = [ep.task for ep in episodes]
    calib_tasks, val_tasks = split_by_group(tasks, val_share=cfg.val_share)
    if not calib_tasks or not val_tasks:
        raise ValueError(f"need at least two tasks for a calibration/validation split, got {len(set(tasks))}")
    n_val_pairs = sum(len(ep.versions) - 1 for ep in episodes if ep.task in val_tasks)
    keep_tasks = _grid_tasks(episodes, val_tasks, n_val_pairs if cfg.grid_max_pairs is None else cfg.grid_max_pairs)
    taus = tuple(cfg.tau_grid) if len(cfg.tau_grid) > 1 else (cfg.tau_grid[0] if cfg.tau_grid else cfg.tau_v,)
    per_pair = (len(taus) if len(taus) > 1 else 0) + len(cfg.kappas) * len(cfg.blocks) * len(cfg.readers) + 2
    n_keep_pairs = sum(len(ep.versions) - 1 for ep in episodes if ep.task in keep_tasks)
    policies = [PrecisionPolicy(tau_L=tl, tau_H=th) for tl, th in cfg.policy_grid] if cfg.precision_target is not None else []
    per_pair += len(policies) + 1 if policies else 0
    window, rows_window, rows_prec, prec = None, [], [], None
    with tqdm(total=sum(len(ep.versions) for ep in episodes) + n_keep_pairs * per_pair, desc="calibrate",
              unit="step", disable=not progress) as bar:
        bar.set_postfix_str("prefill")
        pairs = profile_episodes(engine, episodes, cfg, keep_tasks, bar)
        kept = [p for p in pairs if p.ckpt is not None]
        fits = {t: _fit_for_tau(pairs, dataclasses.replace(cfg, tau_v=t), val_tasks) for t in taus}
        t_fit = time.perf_counter()
        bar.set_postfix_str("references")
        refs = evaluate_references(engine, kept, bar, follow_tokens=cfg.follow_tokens)
        target = _resolve_target(cfg, refs)
        rule = {"quality": cfg.quality, "tol_abs": cfg.tol_abs, "tol_rel": cfg.tol_rel, "z": cfg.z}
        if len(taus) > 1:
            bar.set_postfix_str("tau_V")
            configs = [ResumeConfig(options={"kappa": 0.0, "block_size": DEFAULT_BLOCK_SIZE}, length_model=fits[t][1],
                                    tags={"tau_v": t}) for t in taus]
            rows_window = evaluate_configs(engine, kept, configs, bar, follow_tokens=cfg.follow_tokens)
            window = select_config(rows_window, **rule, target=target, keys=("tau_v",), prefer=(1,),
                                   follow_target=cfg.follow_target)
            for s_ in window["summary"]:
                lab, lm_t = fits[s_["tau_v"]]
                val_t = [r for r in lab if r["split"] == "validation"]
                s_["validation_coverage"] = _fit_summary(lm_t, val_t, cfg.quantile)["coverage"]
                s_["window_share"] = _fit_summary(lm_t, lab, cfg.quantile)["window_share"]
        tau = window["tau_v"] if window else taus[0]
        labels, lm = fits[tau]
        bar.set_postfix_str("grid")
        grid = evaluate_grid(engine, kept, lm, cfg, bar)
        sel = select_config(grid, **rule, target=target, keys=_GRID_KEYS, follow_target=cfg.follow_target)
        if policies:
            bar.set_postfix_str("precision")
            rows_prec = evaluate_precision(engine, kept, policies, block_size=int(sel["block_size"]), bar=bar)
            prec = select_policy(rows_prec, cfg.precision_target)
    pure = select_config(grid, **rule, keys=_GRID_KEYS)  # the minimax rule without targets, for comparison
    cal = [r for r in labels if r["split"] == "calib"]
    val = [r for r in labels if r["split"] == "validation"]
    spec = engine.spec
    profile = {
        "schema": PROFILE_SCHEMA,
        "model": model_name or str(getattr(engine, "source", None) or spec.model_type),
        "fingerprint": spec.fingerprint,
        "model_spec": {"model_type": spec.model_type, "num_layers": spec.num_layers,
                       "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "length_model": lm.to_dict(),
        "kappa": float(sel["kappa"]),
        "block_size": int(sel["block_size"]),
        "readers": str(sel["readers"]),
        "precision_policy": (
            {**dataclasses.asdict(PrecisionPolicy()), "calibrated": False,
             "note": "library defaults (precision stage skipped)"} if prec is None else
            {**{k: float(prec[k]) for k in ("alpha", "tau_L", "tau_H", "g4", "tau_LL", "g4k")}, "calibrated": True,
             "rule": "smallest payload among (tau_L, tau_H) whose worst per-workload increase of direct's mean "
                     "first-token KL (mixed vs FP16 restore) is <= target; alpha, g4, g4k at library defaults, "
                     "tau_LL = min(library default, tau_L)",
             "block_size": int(sel["block_size"]),
             **{k: prec[k] for k in ("worst_increase", "payload_vs_fp16", "target", "target_met", "summary")}}),
        "tau_v": float(tau),
        "gamma": cfg.gamma,
        "quantile": cfg.quantile,
        "validation_coverage": _fit_summary(lm, val, cfg.quantile)["coverage"],
        "drift": {"metric": cfg.metric, "block_reduce": cfg.block_reduce, "profile_block": cfg.profile_block,
                  "layers": list(cfg.layers or default_profile_layers(spec.num_layers)),
                  "values": "old V rows restored as-is (values never rotate) vs exact new V rows"},
        "fit": {"method": "pinball MM (Hunter-Lange), standardized features, ridge", "ridge": cfg.ridge,
                "shift": cfg.shift, "target": "log(max(d*, 1))", "d_min": cfg.d_min,
                "calib": _fit_summary(lm, cal, cfg.quantile), "validation": _fit_summary(lm, val, cfg.quantile)},
        "d_hat_examples": _d_hat_examples(lm),
        "window_selection": None if window is None else {
            "tau_grid": list(taus), "at": {"kappa": 0.0, "block_size": DEFAULT_BLOCK_SIZE},
            "chosen": {k: window[k] for k in ("tau_v", "worst_gap", "best_worst_gap", "tolerance", "target_met")},
            "minimax_without_target": select_config(rows_window, **rule, keys=("tau_v",), prefer=(1,))["tau_v"],
            "summary": window["summary"]},
        "selection": {"rule": "least mean recompute among configurations whose worst per-workload mean loss meets "
                              "the target; without a target (or when none meets it): within tolerance + z SE of "
                              "the smallest worst loss (minimax)",
                      **rule, "target": cfg.target, "target_value": target,
                      "grid_kappas": list(cfg.kappas), "grid_blocks": list(cfg.blocks),
                      "grid_readers": list(cfg.readers), "follow_target": cfg.follow_target,
                      "n_pairs": len({r["pair"] for r in grid}),
                      "n_follow_pairs": len({r["pair"] for r in grid if r.get("follows") is not None}),
                      "chosen": {k: sel[k] for k in ("kappa", "block_size", "readers", "worst_gap", "best_worst_gap",
                                                     "tolerance", "target_met", "follow_rate", "follow_target_met")},
                      "minimax_without_target": {k: pure[k] for k in ("kappa", "block_size", "readers", "worst_gap",
                                                                      "follow_rate")},
                      "summary": sel["summary"],
                      "reference": {n: _means([r for r in refs if r["strategy"] == n])
                                    for n in ("direct", "patchkv-default") if any(r["strategy"] == n for r in refs)}},
        "split": {"by": "task", "val_share": cfg.val_share, "calib_tasks": calib_tasks,
                  "validation_tasks": val_tasks, "grid_tasks": sorted(keep_tasks)},
        "data": {**(data or {}), "n_episodes": len(episodes), "n_pairs": len(pairs), "n_spans": len(labels),
                 "episodes": [ep.id for ep in episodes]},
        "labels": labels,
        "timing": {"profile_fit_s": round(t_fit - t0, 1), "total_s": round(time.perf_counter() - t0, 1)},
    }
    profile["_rows"] = {"window": rows_window, "grid": grid, "reference": refs, "precision": rows_prec}
    return profile, pairs


def _resolve_target(cfg: CalibConfig, refs: Sequence[dict]) -> float | None:
    """``cfg.target`` as a number: ``"default"`` is the worst per-workload loss of ``patchkv-default`` plus the
    selection tolerance ``max(tol_abs, tol_rel * loss)`` (a measured tie with the built-in setting meets it)."""
    if cfg.target is None or cfg.target == "none":
        return None
    if cfg.target == "default":
        rows = [{**r, "cfg": 0} for r in refs if r["strategy"] == "patchkv-default"]
        if not rows:
            return None
        worst = float(summarize_grid(rows, cfg.quality, keys=("cfg",))[0]["worst_gap"])
        return worst + max(cfg.tol_abs, cfg.tol_rel * worst)
    return float(cfg.target)


def _grid_tasks(episodes: Sequence[Episode], val_tasks: Sequence[str], n_pairs: int) -> set[str]:
    """Validation tasks whose pairs the grid evaluates: whole tasks, always from the workload with the
    fewest chosen pairs so far (balanced per-workload means), until ``n_pairs`` pairs are chosen."""
    by_w: dict[str, list[str]] = {}
    pairs_of: dict[str, int] = {}
    for ep in episodes:
        if ep.task in val_tasks:
            if ep.task not in pairs_of:
                by_w.setdefault(ep.workload, []).append(ep.task)
            pairs_of[ep.task] = pairs_of.get(ep.task, 0) + len(ep.versions) - 1
    chosen: set[str] = set()
    got = {w: 0 for w in by_w}
    while sum(got.values()) < n_pairs and any(by_w.values()):
        w = min((w for w in sorted(by_w) if by_w[w]), key=lambda w: got[w])
        t = by_w[w].pop(0)
        chosen.add(t)
        got[w] += pairs_of[t]
    return chosen

"""The offline profiler: paired exact prefills -> drift labels -> length model -> tau_V, kappa, block -> profile.

Boundary: drives a :class:`~patchkv_agent.engine.PatchKVEngine` through its public methods only
(``resume(None, ids, strategy="exact")``, ``checkpoint_from``, ``resume(ckpt, ids, strategy="patchkv",
...)``, ``length_model``) and writes one JSON profile dict; the numeric pieces live in
:mod:`.drift` (labels), :mod:`.fit` (quantile fit, split) and :mod:`.select` (minimax rule).

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
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, DEFAULT_DIRTY_WINDOW, LengthModel, plan_full
from patchkv_agent.kernels import value_residual_4bit
from patchkv_agent.core.precision import DEFAULT_G4K, PrecisionPolicy, Tag, assign_tags
from patchkv_agent.core.checkpoint import key_residual, quantize_mixed
from patchkv_agent.core.settings import RecoverySettings
from patchkv_agent.profiles import PROFILE_SCHEMA
from patchkv_agent.eval.metrics import first_token_kl, teacher_forced_agreement, top1_agree
from patchkv_agent.eval.traces import version_ids

from .drift import SpanDrift, block_deviation, default_profile_layers, oracle_boundary, span_drift
from .fit import coverage, fit_length_model, log_target, pinball_loss, split_by_group
from .select import select_config, summarize_grid

__all__ = ["Episode", "CalibConfig", "PairProfile", "ResumeConfig", "episodes_from_traces", "profile_episodes",
           "label_spans", "evaluate_configs", "evaluate_references", "evaluate_grid", "run_calibration",
           "evaluate_precision", "select_policy", "write_profile", "save_rows", "save_drift", "DEFAULT_TAU_V",
           "DEFAULT_TAU_GRID", "DEFAULT_POLICY_GRID"]

DEFAULT_TAU_V = 0.05  # 1 - cos of the block max, averaged over layers >= 1 and KV heads (see docs/calibration.md)
DEFAULT_TAU_GRID = (0.05, 0.075, 0.1, 0.15)  # the CLI's tau_V candidates (window stage)
_GRID_KEYS = ("kappa", "block_size", "readers")
DEFAULT_POLICY_GRID = tuple((tl, th) for th in (4.0, 8.0) for tl in (0.1, 0.25, 0.5, 1.0))  # (tau_L, tau_H)
_TAG_BYTES = {int(Tag.FP16): 4.0, int(Tag.K8V8): 2.25, int(Tag.K8V4): 1.75, int(Tag.K4V4): 1.25}  # K+V bytes per element pair


@dataclass(frozen=True, kw_only=True)
class Episode:
    """A chain of context versions of one task (two or more), as token ids.

    Attributes:
        id: unique episode id (a trace id).
        task: group id for the split: all episodes of one task stay on one side.
        workload: workload name (the unit of the minimax rule).
        versions: token ids per version, in order.
        answers: gold answers per version (edit-following episodes, :mod:`patchkv_agent.eval.follow`), or
            None; with them every pair also scores whether a resume answers the new gold (``follows``)
            or the previous one (``stale``).
    """

    id: str
    task: str
    workload: str
    versions: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        if len(self.versions) < 2:
            raise ValueError(f"episode {self.id!r} needs at least two versions")
        if self.answers is not None and len(self.answers) != len(self.versions):
            raise ValueError(f"episode {self.id!r} has {len(self.answers)} answer lists for "
                             f"{len(self.versions)} versions; give one per version or None")


@dataclass(frozen=True, kw_only=True)
class CalibConfig:
    """Every knob of a calibration run (all recorded in the profile).

    Attributes:
        layers: profiled layers (None: every layer but 0).
        metric: ``cosine`` (1 - cos) or ``rel_l2``; see :func:`.drift.token_deviation`.
        block_reduce: ``max`` or ``mean`` of token deviations per profiling block.
        profile_block: profiling block size in tokens (granularity of ``d*``).
        tau_v: deviation threshold for ``d*`` (when ``tau_grid`` has fewer than two values).
        tau_grid: candidate thresholds; two or more run the window stage (see :func:`run_calibration`).
        gamma: stability coverage for ``d*``.
        quantile: target quantile of the length model.
        ridge, shift: see :func:`.fit.fit_length_model`.
        val_share: share of tasks held out for validation.
        kappas, blocks, readers: the selection grid (``readers``: the reader-block signals to try,
            ``"none"`` / ``"lexical"``; see :func:`patchkv_agent.core.plan.plan_repair`).
        quality, tol_abs, tol_rel, z: see :func:`.select.select_config`.
        follow_target: the least follow rate (edit-following pairs: answers the new gold where ``exact``
            does) a grid configuration needs, or None; see :func:`.select.select_config`.
        follow_tokens: greedy tokens decoded per edit-following resume (and its exact reference) to read
            the answer.
        target: quality target on the worst per-workload loss: a number, ``"default"`` (the worst loss of
            the engine's built-in setting, measured on the same pairs, plus the tolerance: the profile must be
            no worse than running without one, at the least cost) or None (the minimax rule alone).
        policy_grid: ``(tau_L, tau_H)`` candidates of the precision stage (``alpha``, ``g4`` stay at the
            library defaults); empty: skip the stage and keep the default policy.
        precision_target: the precision stage's quality target: the largest allowed relative increase of
            ``direct``'s mean first-token KL (worst workload) when it restores at the mixed policy instead of
            FP16; the smallest-payload policy meeting it wins. None: skip the stage.
        ref_tokens: greedy reference tokens per version (teacher-forced agreement).
        grid_max_pairs: evaluate the grid on at most this many validation pairs (None: all).
        d_min: floor of the length model's prediction.
    """

    layers: tuple[int, ...] | None = None
    metric: str = "cosine"
    block_reduce: str = "max"
    profile_block: int = 16
    tau_v: float = DEFAULT_TAU_V
    tau_grid: tuple[float, ...] = ()
    gamma: float = 0.95
    quantile: float = 0.9
    ridge: float = 0.1
    shift: str = "none"
    val_share: float = 0.3
    kappas: tuple[float, ...] = (0.0, 0.01, 0.02, 0.03)
    blocks: tuple[int, ...] = (32, 64, 128)
    readers: tuple[str, ...] = ("none", "lexical")
    quality: str = "kl"
    tol_abs: float = 1e-3
    tol_rel: float = 0.1
    z: float = 1.0
    follow_target: float | None = 0.95
    follow_tokens: int = 12
    target: float | str | None = "default"
    policy_grid: tuple[tuple[float, float], ...] = DEFAULT_POLICY_GRID
    precision_target: float | None = 0.2
    ref_tokens: int = 8
    grid_max_pairs: int | None = None
    d_min: int = 0


@dataclass(eq=False)
class PairProfile:
    """One adjacent version pair after profiling.

    Attributes:
        pair_id, task, workload: identity (``pair_id`` = ``<episode id>#v<k>``).
        spans: drift after each edited span followed by a segment.
        new_ids: ids of the new version.
        ckpt, ref_logits, ref_output_ids: old-version checkpoint and the exact reference of the new
            version; kept only for pairs the grid evaluates, else None.
        answers, old_answers: the new and the previous version's gold (edit-following pairs), or None.
        exact_follows, exact_stale: whether the exact reference answers them (None without answers).
    """

    pair_id: str
    task: str
    workload: str
    spans: list[SpanDrift]
    new_ids: np.ndarray
    ckpt: Any = None
    ref_logits: torch.Tensor | None = None
    ref_output_ids: list[int] = field(default_factory=list)
    answers: tuple[str, ...] | None = None
    old_answers: tuple[str, ...] | None = None
    exact_follows: bool | None = None
    exact_stale: bool | None = None


def _answered(engine, output_ids: Sequence[int], gold: Sequence[str] | None) -> bool | None:
    from patchkv_agent.eval.metrics import answer_match

    if gold is None or engine.tokenizer is None:
        return None
    return bool(answer_match(engine.tokenizer.decode(list(output_ids), skip_special_tokens=True), list(gold)))


def episodes_from_traces(engine, traces: Sequence[dict]) -> list[Episode]:
    """Episodes from traces (``docs/TRACES.md``) (versions tokenized with the engine's chat template).

    Args:
        engine: the engine (its tokenizer renders ``messages``/``text`` versions).
        traces: trace dicts (e.g. :func:`patchkv_agent.eval.workloads.build_traces`).
    Returns:
        One :class:`Episode` per trace; ``task`` = ``<workload>/<source id>`` (from ``meta.source_id``,
        else the trace id without its edit kind), so edit kinds of one example share a task; ``answers``
        from the versions' own ``answers`` when every version has them (edit-following traces).
    """
    out = []
    for t in traces:
        meta = t.get("meta") or {}
        wl = str(t.get("workload") or "default")
        task = f"{wl}/{meta['source_id']}" if "source_id" in meta else str(t["id"]).rsplit("/", 1)[0]
        per = [v.get("answers") for v in t["versions"]]
        answers = tuple(tuple(str(a) for a in g) for g in per) if all(per) else None
        out.append(Episode(id=str(t["id"]), task=task, workload=wl, answers=answers,
                           versions=tuple(tuple(version_ids(engine, v)) for v in t["versions"])))
    return out


def _pair_d_star(sd: SpanDrift, cfg: CalibConfig) -> int:
    bd = block_deviation(sd.deviation, cfg.profile_block, cfg.block_reduce)
    return oracle_boundary(bd, block_size=cfg.profile_block, suffix_len=sd.suffix_len, tau_v=cfg.tau_v,
                           gamma=cfg.gamma)


@torch.no_grad()
def profile_episodes(engine, episodes: Sequence[Episode], cfg: CalibConfig, keep_tasks: set[str] = frozenset(),
                     bar=None) -> list[PairProfile]:
    """Paired exact prefills and drift per edited span, for every adjacent version pair.

    Args:
        engine: the engine.
        episodes: the episodes.
        cfg: the run's configuration (``layers``, ``metric``, ``ref_tokens``).
        keep_tasks: tasks whose pairs keep their checkpoint and reference for :func:`evaluate_grid`.
        bar: optional progress bar (``update(1)`` per prefilled version).
    Returns:
        The :class:`PairProfile` list, in episode order.
    """
    layers = cfg.layers or default_profile_layers(engine.spec.num_layers)
    out = []
    for ep in episodes:
        prev_ckpt = None
        n_ref = cfg.ref_tokens if ep.answers is None else max(cfg.ref_tokens, cfg.follow_tokens)
        for k, ids in enumerate(ep.versions):
            res = engine.resume(None, list(ids), strategy="exact", max_new_tokens=n_ref)
            if prev_ckpt is not None:
                edit = diff_versions(prev_ckpt.token_ids, res.context_ids)
                spans = span_drift(edit, prev_ckpt.values, res.values, layers=layers, metric=cfg.metric)
                keep = ep.task in keep_tasks
                gold, old = (None, None) if ep.answers is None else (ep.answers[k], ep.answers[k - 1])
                out.append(PairProfile(
                    pair_id=f"{ep.id}#v{k}", task=ep.task, workload=ep.workload, spans=spans,
                    new_ids=np.asarray(ids, dtype=np.int64), ckpt=prev_ckpt if keep else None,
                    ref_logits=res.logits.detach().cpu() if keep else None,
                    ref_output_ids=list(res.output_ids) if keep else [], answers=gold, old_answers=old,
                    exact_follows=_answered(engine, res.output_ids, gold),
                    exact_stale=_answered(engine, res.output_ids, old)))
            prev_ckpt = engine.checkpoint_from(res) if k + 1 < len(ep.versions) else None
            del res
            if bar is not None:
                bar.update(1)
    return out


def label_spans(pairs: Sequence[PairProfile], cfg: CalibConfig) -> list[dict[str, Any]]:
    """One label row per span: ``pair, task, workload, P, E, S, d_star``.

    Args:
        pairs: profiled pairs.
        cfg: ``tau_v``, ``gamma``, ``profile_block``, ``block_reduce``.
    Returns:
        The rows.
    """
    return [{"pair": p.pair_id, "task": p.task, "workload": p.workload, "P": sd.prefix_len, "E": sd.edit_len,
             "S": sd.suffix_len, "d_star": _pair_d_star(sd, cfg)} for p in pairs for sd in p.spans]


def _cols(rows: Sequence[dict]) -> tuple[np.ndarray, ...]:
    return tuple(np.asarray([r[c] for r in rows], dtype=np.int64) for c in ("P", "E", "S", "d_star"))


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    """One configuration to resume every grid pair with.

    Attributes:
        strategy: engine strategy name.
        options: ``engine.resume`` options (``kappa=``, ``block_size=``, ``dirty_window=``).
        length_model: set as ``engine.length_model`` for these resumes (None: leave the engine's).
        tags: fields copied into each row (e.g. ``{"kappa": 0.01, "block_size": 16}``).
    """

    strategy: str = "patchkv"
    options: dict = field(default_factory=dict)
    length_model: LengthModel | None = None
    tags: dict = field(default_factory=dict)


@torch.no_grad()
def evaluate_configs(engine, pairs: Sequence[PairProfile], configs: Sequence[ResumeConfig], bar=None, *,
                     follow_tokens: int = 12) -> list[dict]:
    """Resume every kept pair under every configuration and score it against the exact reference.

    Args:
        engine: the engine; its ``length_model`` is restored afterwards.
        pairs: pairs (those without a kept checkpoint are skipped).
        configs: the configurations.
        bar: optional progress bar (``update(1)`` per resume).
        follow_tokens: greedy tokens per edit-following resume.
    Returns:
        One row per pair and configuration: the config's ``tags`` plus ``pair, workload, strategy,
        first_token_kl, top1_agree, tf_agree, recompute_tokens, prefix_recompute_tokens, ttft_s``; rows of
        edit-following pairs also ``follows, stale, exact_follows, exact_stale`` (the resume decodes
        ``follow_tokens`` greedy tokens, default 12, to read its answer).
    """
    saved = engine.length_model
    rows = []
    try:
        for p in pairs:
            if p.ckpt is None:
                continue
            full = plan_full(diff_versions(p.ckpt.token_ids, p.new_ids), block_size=DEFAULT_BLOCK_SIZE).n_recompute
            for c in configs:
                engine.length_model = c.length_model if c.length_model is not None else saved
                n_new = 1 if p.answers is None else follow_tokens
                r = engine.resume(p.ckpt, p.new_ids, strategy=c.strategy, max_new_tokens=n_new, **c.options)
                row = {**c.tags, "pair": p.pair_id, "workload": p.workload, "strategy": c.strategy,
                       "first_token_kl": first_token_kl(p.ref_logits, r.logits.cpu()),
                       "top1_agree": top1_agree(p.ref_logits, r.logits),
                       "tf_agree": teacher_forced_agreement(engine, r, p.ref_output_ids),
                       "recompute_tokens": int(r.stats["recompute_tokens"]),
                       "prefix_recompute_tokens": int(full), "ttft_s": float(r.stats["ttft_s"])}
                if p.answers is not None:
                    row.update(follows=_answered(engine, r.output_ids, p.answers),
                               stale=_answered(engine, r.output_ids, p.old_answers),
                               exact_follows=p.exact_follows, exact_stale=p.exact_stale)
                rows.append(row)
                if bar is not None:
                    bar.update(1)
    finally:
        engine.length_model = saved
    return rows


def evaluate_references(engine, pairs: Sequence[PairProfile], bar=None, *, follow_tokens: int = 12) -> list[dict]:
    """The two reference strategies on the grid pairs: ``direct`` and ``patchkv-default`` (fixed
    ``DEFAULT_DIRTY_WINDOW``-token window, kappa 0, block 32, the built-in reader rule: the engine's
    setting without a profile).

    Args:
        engine: the engine.
        pairs: pairs with a kept checkpoint and reference.
        bar: optional progress bar.
        follow_tokens: greedy tokens per edit-following resume.
    Returns:
        Rows as :func:`evaluate_configs` with ``strategy`` set to the reference's name.
    """
    refs = [ResumeConfig(strategy="direct", tags={"reference": "direct"}),
            ResumeConfig(options={"dirty_window": DEFAULT_DIRTY_WINDOW, "kappa": 0.0, "block_size": DEFAULT_BLOCK_SIZE,
                                  "readers": RecoverySettings().readers},
                         tags={"reference": "patchkv-default"})]
    rows = evaluate_configs(engine, pairs, refs, bar, follow_tokens=follow_tokens)
    return [{**{k: v for k, v in r.items() if k != "reference"}, "strategy": r["reference"]} for r in rows]


def evaluate_grid(engine, pairs: Sequence[PairProfile], length_model: LengthModel, cfg: CalibConfig,
                  bar=None) -> list[dict]:
    """Real ``patchkv`` resumes over the ``(kappa, block, readers)`` grid under one length model.

    Args:
        engine: the engine.
        pairs: pairs with a kept checkpoint and reference.
        length_model: the fitted length model (used for every grid resume).
        cfg: ``kappas``, ``blocks``, ``readers``, ``follow_tokens``.
        bar: optional progress bar.
    Returns:
        Rows as :func:`evaluate_configs`, tagged ``kappa, block_size, readers``.
    """
    grid_cfgs = [ResumeConfig(options={"kappa": float(k), "block_size": int(b), "readers": rd},
                              length_model=length_model, tags={"kappa": float(k), "block_size": int(b), "readers": rd})
                 for k in cfg.kappas for b in cfg.blocks for rd in cfg.readers]
    return evaluate_configs(engine, pairs, grid_cfgs, bar, follow_tokens=cfg.follow_tokens)


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
        "model": model_name or str(getattr(engine.model, "patchkv_source", "") or spec.model_type),
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


def evaluate_precision(engine, pairs: Sequence[PairProfile], policies: Sequence[PrecisionPolicy], *,
                       block_size: int, bar=None) -> list[dict]:
    """``direct`` at FP16 and at each mixed-precision policy on the kept pairs.

    Each policy re-tags the pair's checkpoint (its own attention scores and 4-bit value residuals,
    blocks of ``block_size``; the residuals are computed once per pair) and quantizes each distinct
    tag layout once (:func:`patchkv_agent.core.checkpoint.quantize_mixed`); ``direct``
    then restores the whole suffix from those runs, so the KL it adds over the FP16 restore is the
    precision policy's alone (no recomputed block hides a quantization error).

    Args:
        engine: the engine.
        pairs: pairs (those without a kept checkpoint are skipped).
        policies: the candidate policies.
        block_size: tokens per block for the tags.
        bar: optional progress bar (``update(1)`` per resume).
    Returns:
        One row per pair and policy: ``pair, workload, tau_L, tau_H, alpha, g4, tau_LL, g4k, kl_fp16,
        kl_mixed, payload_vs_fp16`` (payload per element pair relative to FP16 storage: 1.0, 0.5625,
        0.4375 and 0.3125 for FP16, K8V8, K8V4 and K4V4 blocks) and the block counts per tag.
    """
    rows = []
    for p in pairs:
        ck = p.ckpt
        if ck is None:
            continue
        base = engine.resume(ck, p.new_ids, strategy="direct", max_new_tokens=1)
        kl_fp16 = first_token_kl(p.ref_logits, base.logits.cpu())
        if bar is not None:
            bar.update(1)
        resid = value_residual_4bit(torch.stack([v.float() for v in ck.values])).cpu().numpy()
        kres = key_residual(list(ck.keys), block_size) if any(pol.tau_LL > 0 for pol in policies) else None
        attn = np.ones(resid.shape[0]) if ck.scores is None else np.asarray(ck.scores, dtype=np.float64)
        seen: dict[bytes, float] = {}
        for pol in policies:
            tags = assign_tags(attn, resid, block_size, pol, kres)
            sig = tags.tobytes()
            if sig not in seen:  # policies that tag this pair identically share one quantization and resume
                mixed = quantize_mixed(list(ck.keys), list(ck.values), tags, block_size=block_size)
                r = engine.resume(dataclasses.replace(ck, mixed=mixed), p.new_ids, strategy="direct",
                                  precision="mixed", max_new_tokens=1)
                seen[sig] = first_token_kl(p.ref_logits, r.logits.cpu())
            rows.append({"pair": p.pair_id, "workload": p.workload, "tau_L": pol.tau_L, "tau_H": pol.tau_H,
                         "alpha": pol.alpha, "g4": pol.g4, "tau_LL": pol.tau_LL, "g4k": pol.g4k,
                         "kl_fp16": kl_fp16, "kl_mixed": seen[sig],
                         "payload_vs_fp16": float(np.mean([_TAG_BYTES[int(t)] for t in tags]) / 4.0) if len(tags) else 1.0,
                         **{t.name: int((tags == int(t)).sum()) for t in Tag}})
            if bar is not None:
                bar.update(1)
    return rows


def select_policy(rows: Sequence[dict], target: float) -> dict[str, Any]:
    """The smallest-payload policy whose worst per-workload relative KL increase is at most ``target``.

    Per workload and policy: ``increase = mean(kl_mixed) / mean(kl_fp16) - 1``; a policy's ``worst`` is
    its largest increase over workloads. Ties on payload go to the smaller worst increase. When no
    policy meets the target, the one with the smallest worst increase is chosen and ``target_met`` is False.

    Args:
        rows: rows of :func:`evaluate_precision`.
        target: allowed relative increase (0.2: 20 %).
    Returns:
        ``tau_L, tau_H, alpha, g4, tau_LL, g4k, worst_increase, payload_vs_fp16, target, target_met, summary``.
    Raises:
        ValueError: no rows.
    """
    if not rows:
        raise ValueError("no precision rows to select from")
    summary = []
    def _key(r):
        return r["tau_L"], r["tau_H"], r["alpha"], r["g4"], r.get("tau_LL", 0.0), r.get("g4k", DEFAULT_G4K)

    for key in sorted({_key(r) for r in rows}):
        sub = [r for r in rows if _key(r) == key]
        inc = {}
        for w in sorted({r["workload"] for r in sub}):
            ws = [r for r in sub if r["workload"] == w]
            fp = float(np.mean([r["kl_fp16"] for r in ws]))
            inc[w] = float(np.mean([r["kl_mixed"] for r in ws])) / fp - 1.0 if fp > 0 else 0.0
        summary.append({"tau_L": key[0], "tau_H": key[1], "alpha": key[2], "g4": key[3], "tau_LL": key[4],
                        "g4k": key[5], "increase": inc,
                        "worst_increase": max(inc.values()),
                        "payload_vs_fp16": float(np.mean([r["payload_vs_fp16"] for r in sub]))})
    ok = [s for s in summary if s["worst_increase"] <= target]
    pick = min(ok or summary, key=(lambda s: (s["payload_vs_fp16"], s["worst_increase"])) if ok
               else (lambda s: (s["worst_increase"], s["payload_vs_fp16"])))
    return {**{k: pick[k] for k in ("tau_L", "tau_H", "alpha", "g4", "tau_LL", "g4k", "worst_increase",
                                    "payload_vs_fp16")},
            "target": target, "target_met": bool(ok), "summary": summary}


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


def write_profile(profile: dict, path: str | Path) -> Path:
    """Write a profile as indented JSON (parent folders created).

    Args:
        profile: the profile dict (keys starting with ``_`` are dropped).
        path: output file.
    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean = {k: v for k, v in profile.items() if not k.startswith("_")}
    path.write_text(json.dumps(clean, indent=1) + "\n", encoding="utf-8")
    return path


def save_rows(profile: dict, path: str | Path) -> Path:
    """Write the raw resume rows of a run (``profile["_rows"]``) as JSON Lines, one row per resume, with a
    ``stage`` field (``window``, ``grid``, ``reference`` or ``precision``), so the selection can be redone offline.

    Args:
        profile: a profile dict from :func:`run_calibration`.
        path: output ``.jsonl``.
    Returns:
        The path written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for stage, rows in (profile.get("_rows") or {}).items():
            for r in rows:
                f.write(json.dumps({"stage": stage, **r}) + "\n")
    return path


def save_drift(pairs: Sequence[PairProfile], path: str | Path, profile: dict | None = None) -> Path:
    """Save the per-token drift curves (for figures) as a compressed ``.npz``.

    Args:
        pairs: profiled pairs.
        path: output ``.npz``.
        profile: optional profile; its ``tau_v``/``gamma``/``drift`` settings are stored alongside.
    Returns:
        The path written. Arrays: ``P, E, S`` per span, ``offsets`` (span ``i`` is
        ``deviation[offsets[i]:offsets[i+1]]``), ``deviation`` (float32), ``pair`` and ``workload`` names,
        ``meta`` (JSON string).
    """
    spans = [(p, sd) for p in pairs for sd in p.spans]
    devs = [sd.deviation.astype(np.float32) for _, sd in spans]
    offsets = np.concatenate([[0], np.cumsum([d.size for d in devs])]).astype(np.int64)
    meta = {k: profile.get(k) for k in ("model", "tau_v", "gamma", "drift")} if profile else {}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path, P=np.asarray([sd.prefix_len for _, sd in spans], dtype=np.int64),
        E=np.asarray([sd.edit_len for _, sd in spans], dtype=np.int64),
        S=np.asarray([sd.suffix_len for _, sd in spans], dtype=np.int64), offsets=offsets,
        deviation=np.concatenate(devs) if devs else np.zeros(0, dtype=np.float32),
        pair=np.asarray([p.pair_id for p, _ in spans]), workload=np.asarray([p.workload for p, _ in spans]),
        meta=np.asarray(json.dumps(meta)))
    return path

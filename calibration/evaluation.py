"""The resume evaluations: real resumes of the kept validation pairs under given configurations (the
``(kappa, block, readers)`` grid, the ``tau_V`` window stage, the two reference strategies), each scored
against the pair's exact reference (first-token KL, top-1 and teacher-forced agreement; on edit-following
pairs whether the resume answers the new gold or the previous one).

Boundary: drives the engine through ``resume(ckpt, ids, strategy=engine.strategy(name, options))`` and its
a configuration's length model as a strategy override (the engine's settings are never changed); plain dict rows out, one per pair and configuration, as
:mod:`.select` reads them. Does not profile pairs (:mod:`.profiling`), fit, choose or write anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.plan import DEFAULT_BLOCK_SIZE, DEFAULT_DIRTY_WINDOW, LengthModel, plan_full
from patchkv_agent.core.settings import RecoverySettings
from patchkv_agent.eval.metrics import first_token_kl, teacher_forced_agreement, top1_agree

from .config import CalibConfig, PairProfile
from .profiling import _answered

__all__ = ["ResumeConfig", "evaluate_configs", "evaluate_references", "evaluate_grid"]


@dataclass(frozen=True, kw_only=True)
class ResumeConfig:
    """One configuration to resume every grid pair with.

    Attributes:
        strategy: engine strategy name.
        options: ``engine.resume`` options (``kappa=``, ``block_size=``, ``dirty_window=``).
        length_model: the length model these resumes plan with (a strategy override; None: the engine's).
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
        engine: the engine (its settings are not changed).
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
    rows = []
    for p in pairs:
        if p.ckpt is None:
            continue
        full = plan_full(diff_versions(p.ckpt.token_ids, p.new_ids), block_size=DEFAULT_BLOCK_SIZE).n_recompute
        for c in configs:
            strat = engine.strategy(c.strategy, c.options)
            if c.length_model is not None:
                strat.set_overrides(**strat.overrides, length_model=c.length_model)
            n_new = 1 if p.answers is None else follow_tokens
            r = engine.resume(p.ckpt, p.new_ids, strategy=strat, max_new_tokens=n_new)
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

"""The data a calibration run hands from step to step: the defaults, :class:`Episode` (a chain of
context versions of one task), :class:`CalibConfig` (every knob of a run, all recorded in the profile)
and :class:`PairProfile` (one adjacent version pair after profiling).

Boundary: plain data and defaults, no computation. Knows neither the engine nor how pairs are profiled
(:mod:`.profiling`), resumed (:mod:`.evaluation`), fitted (:mod:`.fit`), chosen (:mod:`.select`,
:mod:`.precision_stage`) or written (:mod:`.outputs`). Light to import: tensors and drift records appear
in annotations only (no torch at import time).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .drift import SpanDrift

__all__ = ["Episode", "CalibConfig", "PairProfile", "DEFAULT_TAU_V", "DEFAULT_TAU_GRID", "DEFAULT_POLICY_GRID"]

DEFAULT_TAU_V = 0.05  # 1 - cos of the block max, averaged over layers >= 1 and KV heads (see docs/calibration.md)
DEFAULT_TAU_GRID = (0.05, 0.075, 0.1, 0.15)  # the CLI's tau_V candidates (window stage)
DEFAULT_POLICY_GRID = tuple((tl, th) for th in (4.0, 8.0) for tl in (0.1, 0.25, 0.5, 1.0))  # (tau_L, tau_H)


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

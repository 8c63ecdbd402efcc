"""Recovery strategies behind one interface: each turns an :class:`~patchkv_agent.diff.Edit` into a
plan that :func:`patchkv_agent.recovery.execute` runs.

- ``exact``: full prefill of ``C_new`` (the oracle); ignores the checkpoint.
- ``prefix``: reuse ``P``, recompute all of ``M_new + S`` (the Prefix Cache baseline; exact).
- ``direct``: recompute ``X`` and the last token, restore all of ``S`` RoPE-corrected (stale history).
- ``patchkv``: recompute ``X``, ``R = BlockRound(D ∪ H)`` and the last block; restore ``F``.
- ``cacheblend``: the CacheBlend baseline (:mod:`patchkv_agent.cacheblend`, registered on import below).

A new strategy subclasses :class:`Strategy` and is added with :func:`register_strategy`.
Knows plans and the engine's settings, not models or LangGraph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from .diff import Edit
from .plan import LengthModel, plan_direct, plan_full, plan_repair
from .recovery import FullRecompute, PlanLike, RecoveryOutput, execute
from .store import Checkpoint

if TYPE_CHECKING:
    from .engine import PatchKVEngine


class Strategy:
    """Base class: ``plan`` returns the rows to restore and to recompute."""

    name: ClassVar[str] = ""
    uses_checkpoint: ClassVar[bool] = True
    exact: ClassVar[bool] = False  # True when the result equals a full prefill by construction

    def plan(self, engine: "PatchKVEngine", ckpt: Checkpoint | None, edit: Edit) -> PlanLike:
        raise NotImplementedError

    def execute(self, engine: "PatchKVEngine", ckpt: Checkpoint | None, edit: Edit, plan: PlanLike,
                new_ids: "torch.Tensor") -> RecoveryOutput:
        """Run the plan. The default is one forward over the recompute rows
        (:func:`patchkv_agent.recovery.execute`); strategies with their own schedule (e.g. layer-wise
        selection) override this and must return the same :class:`RecoveryOutput` (full K/V of C_new,
        first-token logits, ``restore_s``/``recompute_s``/``recompute_tokens`` stats)."""
        src_k = ckpt.keys if ckpt is not None else None
        src_v = ckpt.values if ckpt is not None else None
        mixed = ckpt.mixed if ckpt is not None and getattr(self, "precision", "fp16") == "mixed" else None
        if getattr(self, "precision", "fp16") == "mixed" and ckpt is not None and mixed is None:
            raise ValueError("precision='mixed' needs a checkpoint written with mixed precision "
                             "(PatchKVEngine(..., mixed_precision=True))")
        return execute(engine.model, engine.spec, new_ids, plan, src_k, src_v, mixed=mixed)


class ExactStrategy(Strategy):
    name = "exact"
    uses_checkpoint = False
    exact = True

    def plan(self, engine, ckpt, edit):
        return FullRecompute(new_len=edit.new_len)


class PrefixStrategy(Strategy):
    name = "prefix"
    exact = True

    def plan(self, engine, ckpt, edit):
        return plan_full(edit, block_size=engine.block_size)


class DirectStrategy(Strategy):
    """Restore all of S. ``precision="fp16"`` (the baseline's definition) or ``"mixed"`` (block tags)."""

    name = "direct"

    def __init__(self, *, precision: str = "fp16"):
        self.precision = _check_precision(precision)

    def plan(self, engine, ckpt, edit):
        return plan_direct(edit, block_size=engine.block_size)


class PatchKVStrategy(Strategy):
    """Dirty window + high-attention blocks, BlockRound. Options override the engine's settings.

    Args:
        dirty_window: fixed ``d_hat`` in tokens (overrides the engine's length model).
        kappa: fraction of suffix tokens outside the window picked by attention score.
        block_size: block size in tokens.
        precision: ``"mixed"`` (default: each restored block at its checkpoint tag) or ``"fp16"``.
    """

    name = "patchkv"

    def __init__(self, *, dirty_window: int | None = None, kappa: float | None = None,
                 block_size: int | None = None, precision: str = "mixed"):
        self.dirty_window, self.kappa, self.block_size = dirty_window, kappa, block_size
        self.precision = _check_precision(precision)

    def execute(self, engine, ckpt, edit, plan, new_ids):
        if self.precision == "mixed" and ckpt is not None and ckpt.mixed is None:
            self_fp16 = PatchKVStrategy(precision="fp16")  # checkpoint written without mixed runs
            return Strategy.execute(self_fp16, engine, ckpt, edit, plan, new_ids)
        return super().execute(engine, ckpt, edit, plan, new_ids)

    def plan(self, engine, ckpt, edit):
        lm = LengthModel.fixed(self.dirty_window) if self.dirty_window is not None else engine.length_model
        kappa = engine.kappa if self.kappa is None else self.kappa
        bs = engine.block_size if self.block_size is None else self.block_size
        scores = ckpt.scores if ckpt is not None else None
        return plan_repair(edit, scores, length_model=lm, kappa=kappa, block_size=bs)


def _check_precision(precision: str) -> str:
    if precision not in ("fp16", "mixed"):
        raise ValueError(f"precision must be 'fp16' or 'mixed', got {precision!r}")
    return precision


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class under its ``name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError("a strategy needs a non-empty name")
    STRATEGIES[cls.name] = cls
    return cls


for _cls in (ExactStrategy, PrefixStrategy, DirectStrategy, PatchKVStrategy):
    register_strategy(_cls)


def get_strategy(strategy: "str | Strategy", **options) -> Strategy:
    """Resolve a strategy name (with options) or pass an instance through.

    Raises:
        ValueError: unknown name; the message lists the registered ones.
    """
    if isinstance(strategy, Strategy):
        return strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    return STRATEGIES[strategy](**options)


from . import cacheblend as _cacheblend  # noqa: E402,F401  registers "cacheblend" (it imports this module)

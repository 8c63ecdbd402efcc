"""Recovery strategies behind one interface: each turns an :class:`~patchkv_agent.diff.Edit` into a
plan that :func:`patchkv_agent.recovery.execute` runs.

- ``exact``: full prefill of ``C_new`` (the oracle); ignores the checkpoint.
- ``prefix``: reuse ``P``, recompute all of ``M_new + S`` (the Prefix Cache baseline; exact).
- ``direct``: recompute ``X`` and the last token, restore all of ``S`` RoPE-corrected (stale history).
- ``patchkv``: recompute ``X``, ``R = BlockRound(D ∪ H)`` and the last block; restore ``F``.

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
        return execute(engine.model, engine.spec, new_ids, plan, src_k, src_v)


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
    name = "direct"

    def plan(self, engine, ckpt, edit):
        return plan_direct(edit, block_size=engine.block_size)


class PatchKVStrategy(Strategy):
    """Dirty window + high-attention blocks, BlockRound. Options override the engine's settings.

    Args:
        dirty_window: fixed ``d_hat`` in tokens (overrides the engine's length model).
        kappa: fraction of suffix tokens outside the window picked by attention score.
        block_size: block size in tokens.
    """

    name = "patchkv"

    def __init__(self, *, dirty_window: int | None = None, kappa: float | None = None, block_size: int | None = None):
        self.dirty_window, self.kappa, self.block_size = dirty_window, kappa, block_size

    def plan(self, engine, ckpt, edit):
        lm = LengthModel.fixed(self.dirty_window) if self.dirty_window is not None else engine.length_model
        kappa = engine.kappa if self.kappa is None else self.kappa
        bs = engine.block_size if self.block_size is None else self.block_size
        scores = ckpt.scores if ckpt is not None else None
        return plan_repair(edit, scores, length_model=lm, kappa=kappa, block_size=bs)


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

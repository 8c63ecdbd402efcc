"""Recovery strategies behind one interface: each turns an :class:`~patchkv_agent.core.diff.Edit` into a
plan that :func:`patchkv_agent.core.recovery.execute` runs.

- ``exact``: full prefill of ``C_new`` (the oracle); ignores the checkpoint.
- ``prefix``: reuse ``P``, recompute all of ``M_new + S`` (the Prefix Cache baseline; exact).
- ``direct``: recompute ``X`` and the last token, restore all of ``S`` RoPE-corrected (stale history).
- ``patchkv``: recompute ``X``, ``R = BlockRound(D ∪ H)`` and the last block; restore ``F``.

Knows plans and the engine's settings, not models or LangGraph.
"""

from __future__ import annotations

from ..core.plan import LengthModel, plan_direct, plan_full, plan_repair
from ..core.recovery import FullRecompute
from .base import Strategy, register_strategy


@register_strategy
class ExactStrategy(Strategy):
    name = "exact"
    uses_checkpoint = False
    exact = True

    def plan(self, engine, ckpt, edit):
        return FullRecompute(new_len=edit.new_len)


@register_strategy
class PrefixStrategy(Strategy):
    name = "prefix"
    exact = True

    def plan(self, engine, ckpt, edit):
        return plan_full(edit, block_size=engine.block_size)


@register_strategy
class DirectStrategy(Strategy):
    """Restore all of S. ``precision="fp16"`` (the baseline's definition) or ``"mixed"`` (block tags)."""

    name = "direct"

    def __init__(self, *, precision: str = "fp16"):
        self.precision = _check_precision(precision)

    def plan(self, engine, ckpt, edit):
        return plan_direct(edit, block_size=engine.block_size)


@register_strategy
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



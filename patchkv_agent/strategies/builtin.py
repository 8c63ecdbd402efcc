"""Recovery strategies behind one interface: each turns an :class:`~patchkv_agent.core.diff.Edit` into a
plan that :func:`patchkv_agent.core.recovery.execute` runs.

- ``exact``: full prefill of ``C_new`` (the oracle); ignores the checkpoint.
- ``prefix``: reuse ``P``, recompute all of ``M_new + S`` (the Prefix Cache baseline; exact).
- ``direct``: recompute ``X`` and the last token, restore all of ``S`` RoPE-corrected (stale history).
- ``patchkv``: recompute ``X``, ``R = BlockRound(D ∪ H) ∪ L ∪ W`` (``L``: the edit's reader blocks, ``W``: the
  recency window, or with ``tail_threshold > 0`` the part of it whose K/V deviation at a check layer says so:
  :mod:`patchkv_agent.core.layerwise`) and the last block; restore ``F``.
- ``patchkv-strict``: ``patchkv`` with the recency window recomputed whole whatever the profile's tail rule
  (``tail_threshold=0``): fidelity first, for a profile or setting that ships a measured tail.

Knows plans and the recovery settings, not models or LangGraph.
"""

from __future__ import annotations

import dataclasses

from ..core.layerwise import execute_probed, layerwise_supported
from ..core.plan import plan_direct, plan_full, plan_repair
from ..core.recovery import FullRecompute
from ..core.settings import RecoverySettings
from .base import Strategy, register_strategy, run_plan


@register_strategy
class ExactStrategy(Strategy):
    name = "exact"
    uses_checkpoint = False
    exact = True

    def plan(self, settings, ckpt, edit):
        return FullRecompute(new_len=edit.new_len)


def full_prefill() -> Strategy:
    """The strategy of a full prefill: reads no base, exact by construction (``exact``); what a layer above runs
    when it has no usable base. The one place a caller gets it, so no caller names it.

    Returns:
        A fresh :class:`ExactStrategy`.
    """
    return ExactStrategy()


@register_strategy
class PrefixStrategy(Strategy):
    name = "prefix"
    exact = True

    def plan(self, settings, ckpt, edit):
        return plan_full(edit, block_size=settings.block_size)


def exact_reuse() -> Strategy:
    """The exact strategy that reuses a base's rows up to the first change and recomputes the rest (``prefix``):
    what a layer above runs over rows it knows are exact. The one place a caller gets it.

    Returns:
        A fresh :class:`PrefixStrategy`.
    """
    return PrefixStrategy()


@register_strategy
class DirectStrategy(Strategy):
    """Restore all of S. ``precision="fp16"`` (the baseline's definition) or ``"mixed"`` (block tags).

    Raises:
        ValueError: ``precision`` not ``"fp16"`` or ``"mixed"``.
    """

    name = "direct"

    def __init__(self, *, precision: str = "fp16"):
        self.set_overrides(restore_precision=precision)

    def plan(self, settings, ckpt, edit):
        return plan_direct(edit, block_size=self.resolve(settings).block_size)


@register_strategy
class PatchKVStrategy(Strategy):
    """Dirty window + high-attention blocks, BlockRound. Options override the engine's settings.

    Args:
        precision: ``"mixed"`` (default: each restored block at its checkpoint tag; a checkpoint
            without mixed runs is restored as stored) or ``"fp16"``.
        **settings: any :class:`~patchkv_agent.core.settings.RecoverySettings` field a strategy may override
            (``RecoverySettings.field_names(strategy=True)``: ``kappa``, ``block_size``, ``readers``, the reader
            constants, ``rewrite_share``, ``recent_window``, ``min_restore_share``, ``tail_threshold``,
            ``tail_check_layer``, ``head_tokens``, ``length_model``) or the alias ``dirty_window`` (a fixed
            ``d_hat`` in tokens); each is documented, defaulted and checked there (a field left out: the
            engine's settings).

    Raises:
        TypeError: a name that is no such setting (the message lists them).
        ValueError: an option outside its range.
    """

    name = "patchkv"

    def __init__(self, *, precision: str = "mixed", **settings):
        self.set_overrides(restore_precision=precision,
                           **RecoverySettings.overrides(settings, strategy=True, where="PatchKVStrategy"))

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """``precision`` and the settings a strategy may override (with their aliases)."""
        return ("precision",) + RecoverySettings.keyword_names(strategy=True)

    def execute(self, runner, spec, settings, ckpt, edit, plan, new_ids):
        s = self.resolve(settings)
        if s.restore_precision == "mixed" and ckpt is not None and ckpt.mixed is None:
            s = s.replace(restore_precision="fp16")  # checkpoint written without mixed runs
        if getattr(plan, "probe_blocks", None) is not None and plan.probe_blocks.size:
            why = layerwise_supported(runner.model, spec, plan.tail_check_layer)
            if why is None:
                return execute_probed(runner, spec, s, ckpt, plan, new_ids)
            # no layer-wise forward for this model: the recency window is recomputed whole (the rule's 0 setting)
            out = run_plan(runner, spec, s, ckpt, plan_repair(edit, ckpt.scores, s.replace(tail_threshold=0.0)),
                           new_ids)
            return dataclasses.replace(out, stats=out.stats.adding(tail_probe=f"off: {why}"))
        return run_plan(runner, spec, s, ckpt, plan, new_ids)

    def plan(self, settings, ckpt, edit):
        return plan_repair(edit, ckpt.scores if ckpt is not None else None, self.resolve(settings))


@register_strategy
class StrictPatchKVStrategy(PatchKVStrategy):
    """``patchkv`` with the whole recency window recomputed (``tail_threshold=0``), whatever the engine's
    profile or settings measure: the plan that meets the pooled non-inferiority criterion on every model this
    project measured, for users who want fidelity before speed. Takes ``PatchKVStrategy``'s options (an explicit
    ``tail_threshold`` is refused: that is the setting this preset fixes).

    Raises:
        TypeError: ``tail_threshold`` given, or a name that is no such setting.
        ValueError: an option outside its range.
    """

    name = "patchkv-strict"

    def __init__(self, *, precision: str = "mixed", **settings):
        if "tail_threshold" in settings:
            raise TypeError("patchkv-strict fixes tail_threshold at 0; use patchkv:tail_threshold=... for a measured "
                            "tail")
        super().__init__(precision=precision, tail_threshold=0.0, **settings)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(n for n in PatchKVStrategy.option_names() if n != "tail_threshold")

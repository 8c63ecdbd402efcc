"""The strategy interface and registry: a :class:`Strategy` turns an :class:`~patchkv_agent.core.diff.Edit`
into a plan that :func:`patchkv_agent.core.recovery.execute` runs (or runs its own schedule).

A new strategy subclasses :class:`Strategy` and is added with :func:`register_strategy`.
Knows plans and checkpoints, not models' loading or LangGraph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from ..core.checkpoint import Checkpoint
from ..core.diff import Edit
from ..core.recovery import PlanLike, RecoveryOutput, execute

if TYPE_CHECKING:
    from ..engine import PatchKVEngine


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
        (:func:`patchkv_agent.core.recovery.execute`); strategies with their own schedule (e.g. layer-wise
        selection) override this and must return the same :class:`RecoveryOutput` (full K/V of C_new,
        first-token logits, ``restore_s``/``recompute_s``/``recompute_tokens`` stats)."""
        src_k = ckpt.keys if ckpt is not None else None
        src_v = ckpt.values if ckpt is not None else None
        mixed = ckpt.mixed if ckpt is not None and getattr(self, "precision", "fp16") == "mixed" else None
        if getattr(self, "precision", "fp16") == "mixed" and ckpt is not None and mixed is None:
            raise ValueError("precision='mixed' needs a checkpoint written with mixed precision "
                             "(PatchKVEngine(..., mixed_precision=True))")
        return execute(engine.model, engine.spec, new_ids, plan, src_k, src_v, mixed=mixed)


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class under its ``name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError("a strategy needs a non-empty name")
    STRATEGIES[cls.name] = cls
    return cls


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

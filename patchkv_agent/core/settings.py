"""The settings a recovery reads: one frozen, keyword-only value instead of attributes on an engine.

:class:`RecoverySettings` holds what planning, checkpointing and restoring need: the block size, the
dirty-window length model, ``kappa``, the per-block precision policy, the precision restored rows are
read at, the attention-capture window and whether checkpoints carry mixed-precision runs. It is the one schema
of the recovery settings: every field, its default, its range check and its documentation live here, and
the other entry points take a whole value or keyword overrides checked by :meth:`RecoverySettings.overrides`
(the engine's and ``from_pretrained``'s keywords, a strategy's options, a profile's fields). The engine
builds one from its calibration profile and explicit arguments (explicit arguments win); strategies
receive it (with the model spec) and apply their options over it (:meth:`RecoverySettings.replace`).

Boundary: torch-free (imports only :mod:`.blocks`, :mod:`.readers`, :mod:`.length_model` and :mod:`.precision`, which are numpy-only; the planner imports this module), so
profiles and tools can build settings without loading a model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from .blocks import DEFAULT_BLOCK_SIZE
from .length_model import LengthModel
from .readers import DEFAULT_READER_BUDGET, READER_ATTENTION_BLOCKS, READER_MIN_BLOCKS, READER_MIN_SHARE, READERS
from .precision import PrecisionPolicy

__all__ = ["RecoverySettings", "ALIASES", "DEFAULT_DIRTY_WINDOW", "DEFAULT_REWRITE_SHARE", "DEFAULT_RECENT_WINDOW",
           "DEFAULT_MIN_RESTORE_SHARE", "DEFAULT_TAIL_CHECK_LAYER", "DEFAULT_CAPTURE_WINDOW", "RESTORE_PRECISIONS",
           "MAX_TOKENS"]

DEFAULT_DIRTY_WINDOW = 32  # fixed dirty-window length (tokens) used until a calibrated length model is given
# head-rewrite rule (plan_repair): share of the old context removed, attention-weighted (head_rewrite_share), at
# which every suffix token is recomputed; set on 8 summarization resumes of agent-summarize (SmolLM2:
# scripts/rewrite_study.py): their shares were 0.39-0.62, a 94-token removal's 0.04
DEFAULT_REWRITE_SHARE = 0.35
# recency rule (plan_repair): the last restored tokens before the generation point are recomputed too; the
# next action reads them most. Off by default; a model's profile sets its window (SmolLM2: 1024, chosen by
# next-action agreement on held-out agent-clear resumes, docs/calibration.md "The agent stage: selecting recent_window")
DEFAULT_RECENT_WINDOW = 0
# small-restore rule (plan_repair): a plan that would restore less than this share of the suffix recomputes
# all of it. Off by default; a model's profile sets it (SmolLM2: 0.5, chosen by the noise floor: the profile's
# min_restore_share_selection, docs/RESULTS.md "The measured tail rule")
DEFAULT_MIN_RESTORE_SHARE = 0.0
# measured tail rule (rule_recency with tail_threshold > 0): the layer at which the probed tail blocks' fresh K/V
# are compared with the restored rows. Layer 0's rows depend on the token alone (restored rows equal fresh ones up
# to precision); layer 1 is the first that reads the context, as in CacheBlend's check layer
DEFAULT_TAIL_CHECK_LAYER = 1
DEFAULT_CAPTURE_WINDOW = 32  # final query positions whose attention the checkpoint pass records
MAX_TOKENS = (1 << 31) - 1  # the bound of every token-count field: the kernels index blocks and rows with int32
RESTORE_PRECISIONS = ("fp16", "mixed")


def _default_length_model() -> LengthModel:
    return LengthModel.fixed(DEFAULT_DIRTY_WINDOW)


_STRATEGY = {"strategy": True}  # field metadata: a strategy may override the field by its option of that name


def _fixed_window(tokens: int) -> LengthModel:
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens <= MAX_TOKENS:
        raise ValueError(f"dirty_window must be an int in [0, 2^31), got {str(tokens)[:40]}")
    return LengthModel.fixed(tokens)


ALIASES: dict[str, tuple[str, Callable[[Any], Any]]] = {"dirty_window": ("length_model", _fixed_window)}
"""Keyword names that set a field through a conversion: ``dirty_window=n`` is ``length_model=LengthModel.fixed(n)``
(the field, when given too, wins)."""


@dataclass(frozen=True, kw_only=True)
class RecoverySettings:
    """Everything a strategy, the checkpoint pass and the restore read (frozen; copy with ``replace``).

    The fields a strategy's options may override (the planner's) carry ``metadata["strategy"]``
    (:meth:`field_names` with ``strategy=True``); the others are the checkpoint pass's and the restore's.

    Attributes:
        block_size: suffix block size in tokens (unit of selection, transfer and precision tags), in
            ``[1, 2^31)`` (every token count below is bounded by ``2^31`` too).
        length_model: the dirty-window :class:`~patchkv_agent.core.plan.LengthModel` (``d_hat`` per
            edited span); default a fixed ``DEFAULT_DIRTY_WINDOW``-token window.
        kappa: fraction of suffix tokens outside the window recomputed by attention score, in ``[0, 1]``.
        precision_policy: thresholds of the per-block FP16 / K8V8 / K8V4 / K4V4 rule for checkpoints.
        restore_precision: ``"fp16"`` (restore checkpoint rows as stored) or ``"mixed"`` (each restored
            block at its checkpoint tag).
        capture_window: final query positions the checkpoint pass records attention from, ``>= 1``.
        mixed_precision: checkpoints also carry mixed-precision runs (needed for ``"mixed"`` restores).
        readers: the reader-block signal of the planner (``"lexical"``: suffix blocks that mention what an
            edit changed are recomputed, see :func:`~patchkv_agent.core.readers.lexical_reader_scores`;
            ``"none"``).
        reader_budget: reader blocks add at most this share of the plan's other recompute (in blocks,
            rounded up), in ``[0, 1]``.
        reader_min_share: the least lexical score of a reader block, in ``[0, 1]``.
        reader_min_blocks: the reader budget's floor in blocks, ``>= 0``.
        reader_attention_blocks: restored blocks of highest stored attention an edit with readers also
            recomputes, ``>= 0``. (The reader constants: a profile sets them per model; see
            :func:`~patchkv_agent.core.plan.plan_repair`.)
        rewrite_share: an edit that removes at least this share of the old context, tokens the stored
            attention read (a head rewrite: a summary replacing the history), recomputes every suffix
            token (see :func:`~patchkv_agent.core.plan.plan_repair`), in ``[0, 1]``; 1.0 turns the rule
            off.
        recent_window: the recency rule: the last this many tokens a plan would restore are recomputed
            (see :func:`~patchkv_agent.core.plan.plan_repair`), ``>= 0`` (0: off).
        min_restore_share: a plan that would restore less than this share of the suffix recomputes all
            of it (exact: the saving no longer pays for an approximation; see
            :func:`~patchkv_agent.core.plan.plan_repair`), in ``[0, 1]`` (0: off).
        tail_threshold: the measured tail rule: ``0`` recomputes the whole recency window; ``> 0`` probes it
            instead: its blocks are recomputed up to ``tail_check_layer``, and past it only those whose
            relative K/V deviation from the restored rows there is at least this (a finite number ``>= 0``; see
            :func:`~patchkv_agent.core.plan.rule_recency` and :mod:`patchkv_agent.core.layerwise`).
        tail_check_layer: the layer the measured tail rule compares at, ``>= 1`` (layer 0's rows depend on the
            token alone); a model with no layer after it recomputes the probed blocks whole.
        head_tokens: the near-head part of the head-rewrite rule: an edit that starts within the first this many
            tokens of the context (its prefix is shorter) recomputes every suffix token, ``>= 0`` (0: off; see
            :func:`~patchkv_agent.core.plan.rule_head_rewrite`).

    Raises:
        ValueError: a field outside its range (the message names it).
    """

    block_size: int = field(default=DEFAULT_BLOCK_SIZE, metadata=_STRATEGY)
    length_model: LengthModel = field(default_factory=_default_length_model, metadata=_STRATEGY)
    kappa: float = field(default=0.0, metadata=_STRATEGY)
    precision_policy: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    restore_precision: str = "fp16"
    capture_window: int = DEFAULT_CAPTURE_WINDOW
    mixed_precision: bool = True
    readers: str = field(default="lexical", metadata=_STRATEGY)
    reader_budget: float = field(default=DEFAULT_READER_BUDGET, metadata=_STRATEGY)
    reader_min_share: float = field(default=READER_MIN_SHARE, metadata=_STRATEGY)
    reader_min_blocks: int = field(default=READER_MIN_BLOCKS, metadata=_STRATEGY)
    reader_attention_blocks: int = field(default=READER_ATTENTION_BLOCKS, metadata=_STRATEGY)
    rewrite_share: float = field(default=DEFAULT_REWRITE_SHARE, metadata=_STRATEGY)
    recent_window: int = field(default=DEFAULT_RECENT_WINDOW, metadata=_STRATEGY)
    min_restore_share: float = field(default=DEFAULT_MIN_RESTORE_SHARE, metadata=_STRATEGY)
    tail_threshold: float = field(default=0.0, metadata=_STRATEGY)
    tail_check_layer: int = field(default=DEFAULT_TAIL_CHECK_LAYER, metadata=_STRATEGY)
    head_tokens: int = field(default=0, metadata=_STRATEGY)

    def __post_init__(self) -> None:
        # token counts: ints below 2^31 (a block size of 2^32 would wrap to 0 in the kernels' int32 fields)
        for name, lo in (("block_size", 1), ("recent_window", 0), ("reader_min_blocks", 0),
                         ("reader_attention_blocks", 0), ("capture_window", 1), ("tail_check_layer", 1),
                         ("head_tokens", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= MAX_TOKENS:
                raise ValueError(f"{name} must be an int in [{lo}, 2^31), got {str(v)[:40]}")
        for name in ("kappa", "reader_budget", "reader_min_share", "rewrite_share", "min_restore_share"):  # shares in [0, 1], stored as floats
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0.0 <= v <= 1.0):
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
            object.__setattr__(self, name, float(v))
        v = self.tail_threshold
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"tail_threshold must be a finite number >= 0, got {v!r}")
        object.__setattr__(self, "tail_threshold", float(v))
        if not isinstance(self.length_model, LengthModel):
            raise ValueError(f"length_model must be a LengthModel, got {type(self.length_model).__name__}")
        if not isinstance(self.precision_policy, PrecisionPolicy):
            raise ValueError(f"precision_policy must be a PrecisionPolicy, got {type(self.precision_policy).__name__}")
        if self.restore_precision not in RESTORE_PRECISIONS:
            raise ValueError(f"precision must be 'fp16' or 'mixed', got {self.restore_precision!r}")
        if self.readers not in READERS:
            raise ValueError(f"readers must be one of {READERS}, got {self.readers!r}")
        if not isinstance(self.mixed_precision, bool):
            raise ValueError(f"mixed_precision must be a bool, got {self.mixed_precision!r}")

    def replace(self, **changes) -> "RecoverySettings":
        """A copy with ``changes`` applied (validated like the constructor).

        Raises:
            TypeError: an unknown field name.
            ValueError: a value outside its range.
        """
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls, *, strategy: bool = False) -> tuple[str, ...]:
        """The settings' fields, in declaration order.

        Args:
            strategy: only the fields a strategy's options may override (the planner's; not the checkpoint
                pass's ``precision_policy``, ``capture_window``, ``mixed_precision``, nor ``restore_precision``,
                which a strategy takes as its own ``precision``).
        """
        return tuple(f.name for f in dataclasses.fields(cls) if not strategy or f.metadata.get("strategy"))

    @classmethod
    def keyword_names(cls, *, strategy: bool = False) -> tuple[str, ...]:
        """The names :meth:`overrides` takes: the fields (see :meth:`field_names`) and the :data:`ALIASES` of
        those fields."""
        names = cls.field_names(strategy=strategy)
        return names + tuple(a for a, (target, _) in ALIASES.items() if target in names)

    @classmethod
    def overrides(cls, given: Mapping[str, Any], *, strategy: bool = False,
                  where: str = "RecoverySettings") -> dict[str, Any]:
        """Keyword overrides as checked field values: the one way an entry point that takes settings as
        keywords (``PatchKVEngine(..., kappa=0.1)``, ``PatchKVStrategy(recent_window=64)``) reads them.

        Args:
            given: names (:meth:`keyword_names`) and values; a None value is left out (not given).
            strategy: only the names a strategy may override.
            where: who takes them (named in the messages).

        Returns:
            The field values by field name (aliases converted; a field given wins over its alias).

        Raises:
            TypeError: a name that is no setting (the message lists the ones ``where`` takes).
            ValueError: a value outside its range (the message names the field).
        """
        valid = cls.keyword_names(strategy=strategy)
        unknown = sorted(k for k in given if k not in valid)
        if unknown:
            raise TypeError(f"{where} has no setting {unknown}; its settings: {', '.join(valid)}")
        out = {k: v for k, v in given.items() if v is not None and k not in ALIASES}
        for alias, (target, convert) in ALIASES.items():
            if given.get(alias) is not None and target not in out:
                out[target] = convert(given[alias])
        cls().replace(**out)  # the values' one range check, before anything is built from them
        return out

    def describe(self, sources: dict[str, str]) -> str:
        """``field=value [source]`` for every field, comma-separated (a length model by its quantile).

        Args:
            sources: where each field came from (``PatchKVEngine.settings_sources``).

        Returns:
            The description (what an engine's ``repr`` shows).
        """
        def short(v) -> str:
            q = getattr(v, "quantile", None) if isinstance(v, LengthModel) else None
            return f"LengthModel(quantile={q})" if q is not None else repr(v)

        return ", ".join(f"{k}={short(getattr(self, k))} [{sources.get(k, '?')}]" for k in self.field_names())

    def changed_fields(self) -> tuple[str, ...]:
        """The fields whose value differs from the built-in default."""
        default = RecoverySettings()
        return tuple(k for k in self.field_names() if getattr(self, k) != getattr(default, k))

"""The strategy interface and registry: a :class:`Strategy` turns an :class:`~patchkv_agent.core.diff.Edit`
into a plan that :func:`patchkv_agent.core.recovery.execute` runs (or runs its own schedule).

A strategy reads a :class:`~patchkv_agent.core.settings.RecoverySettings` (block size, length model,
kappa, precision, ...) and, to execute, the model's :class:`~patchkv_agent.core.runner.ModelRunner`
(``runner.model``: the model) and its :class:`~patchkv_agent.core.models.ModelSpec`; never the engine. Its own options (e.g. ``PatchKVStrategy(kappa=0.05)``) are overrides of those
settings, applied by :meth:`Strategy.resolve`.

A new strategy subclasses :class:`Strategy` and is added with :func:`register_strategy`.
Knows plans, settings and checkpoints, not models' loading, the engine or LangGraph.
"""

from __future__ import annotations

import inspect

from types import MappingProxyType
from typing import Any, ClassVar, Mapping

import torch

from ..core.checkpoint import Checkpoint
from ..core.diff import Edit
from ..core.models import ModelSpec
from ..core.recovery import PlanLike, RecoveryOutput, execute
from ..core.runner import ModelRunner
from ..core.settings import RecoverySettings

__all__ = ["Strategy", "RecoverySettings", "STRATEGIES", "register_strategy", "get_strategy", "run_plan"]


class Strategy:
    """Base class: ``plan`` returns the rows to restore and to recompute; ``execute`` runs it.

    Attributes:
        name: the registry name.
        uses_checkpoint: False when the strategy never reads a checkpoint (``exact``).
        exact: True when the result equals a full prefill by construction.
        overrides: :class:`RecoverySettings` fields this instance sets over the engine's (its options).
    """

    name: ClassVar[str] = ""
    uses_checkpoint: ClassVar[bool] = True
    exact: ClassVar[bool] = False
    overrides: Mapping[str, Any] = MappingProxyType({})

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options this strategy takes by name (what :func:`get_strategy` checks a mapping of options
        against): by default its ``__init__``'s keyword-only arguments."""
        params = inspect.signature(cls.__init__).parameters
        return tuple(sorted(n for n, p in params.items() if n != "self" and p.kind is p.KEYWORD_ONLY))

    def set_overrides(self, **overrides) -> None:
        """Record settings overrides (None values are skipped), validated against :class:`RecoverySettings`.

        Raises:
            TypeError: an unknown settings field.
            ValueError: a value outside its range.
        """
        given = {k: v for k, v in overrides.items() if v is not None}
        RecoverySettings().replace(**given)  # misuse raises here, at construction
        self.overrides = MappingProxyType(given)

    def resolve(self, settings: RecoverySettings) -> RecoverySettings:
        """The settings this strategy runs with: ``settings`` with :attr:`overrides` applied (memoized for the
        last ``settings`` object: both are frozen, and validating a replace costs tens of microseconds per resume)."""
        if not self.overrides:
            return settings
        memo = self.__dict__.get("_resolved")
        if memo is not None and memo[0] is settings and memo[1] is self.overrides:
            return memo[2]
        out = settings.replace(**self.overrides)
        self._resolved = (settings, self.overrides, out)  # one tuple: atomic for concurrent callers
        return out

    def plan(self, settings: RecoverySettings, ckpt: Checkpoint | None, edit: Edit) -> PlanLike:
        """The rows to restore and recompute.

        Args:
            settings: the engine's settings (this strategy's overrides are applied on top).
            ckpt: the checkpoint of the previous version (None for strategies that use none).
            edit: the diff of the checkpoint's version against ``C_new``.

        Returns:
            A plan (``prefix_len``, ``restore_old_positions``, ``restore_new_positions``,
            ``recompute_positions``).
        """
        raise NotImplementedError

    def execute(self, runner: ModelRunner, spec: ModelSpec, settings: RecoverySettings, ckpt: Checkpoint | None,
                edit: Edit, plan: PlanLike, new_ids: "torch.Tensor") -> RecoveryOutput:
        """Run the plan. The default is one forward over the recompute rows (:func:`run_plan`); strategies
        with their own schedule (e.g. layer-wise selection) override this and must return the same
        :class:`RecoveryOutput` (full K/V of C_new, first-token logits,
        ``restore_s``/``recompute_s``/``recompute_tokens`` stats; K/V ``[1, H, N, D]`` per layer).

        Args:
            runner: the HF causal LM's :class:`~patchkv_agent.core.runner.ModelRunner` (``runner.model``).
            spec: its :class:`ModelSpec`.
            settings: the engine's settings (this strategy's overrides are applied on top).
            ckpt: the checkpoint (None for strategies that use none).
            edit: the diff.
            plan: the plan from :meth:`plan`.
            new_ids: int64 ``[N_new]`` ids of ``C_new``.

        Returns:
            :class:`RecoveryOutput`.

        Raises:
            ValueError: ``restore_precision="mixed"`` with a checkpoint written without mixed runs.
            CorruptCheckpoint: a checkpoint run failed its checksum.
        """
        return run_plan(runner, spec, self.resolve(settings), ckpt, plan, new_ids)


def run_plan(runner: ModelRunner, spec: ModelSpec, settings: RecoverySettings, ckpt: Checkpoint | None, plan: PlanLike,
             new_ids: "torch.Tensor") -> RecoveryOutput:
    """:func:`patchkv_agent.core.recovery.execute` with the checkpoint's rows at ``settings.restore_precision``.

    Raises:
        ValueError: ``"mixed"`` with a checkpoint written without mixed-precision runs.
    """
    mixed = None
    if ckpt is not None and settings.restore_precision == "mixed":
        mixed = ckpt.mixed
        if mixed is None:
            raise ValueError("precision='mixed' needs a checkpoint written with mixed precision "
                             "(PatchKVEngine(..., mixed_precision=True))")
    src_k = ckpt.keys if ckpt is not None else None
    src_v = ckpt.values if ckpt is not None else None
    return execute(runner, spec, new_ids, plan, src_k, src_v, mixed=mixed)


STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Register a strategy class under its ``name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError("a strategy needs a non-empty name")
    STRATEGIES[cls.name] = cls
    return cls


def get_strategy(strategy: "str | Strategy", options: "Mapping[str, Any] | None" = None) -> Strategy:
    """Resolve a strategy name (with its options) or pass an instance through.

    The one place a name and a mapping of options (a chat model's ``strategy_options``, a command line)
    become a strategy: the options are checked against the strategy's own keyword arguments, whose
    values are checked against :class:`~patchkv_agent.core.settings.RecoverySettings`.

    Args:
        strategy: a registered name (``exact``, ``prefix``, ``direct``, ``patchkv``, ``patchkv-strict``, ``cacheblend``) or a
            :class:`Strategy` instance (built with its options: ``PatchKVStrategy(kappa=0.1)``).
        options: the strategy's keyword arguments by name (names only with a strategy name).

    Returns:
        The strategy.

    Raises:
        ValueError: an unknown name (the message lists the registered ones), an option the strategy does
            not take (the message lists the ones it does), options given with an instance, or an option
            value out of range.
    """
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(f"options {sorted(options)} given with a {type(strategy).__name__} instance: "
                             "build the instance with them instead")
        return strategy
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {sorted(STRATEGIES)}")
    cls = STRATEGIES[strategy]
    opts = dict(options or {})
    takes = cls.option_names()
    bad = sorted(k for k in opts if k not in takes)
    if bad:
        raise ValueError(f"strategy {strategy!r} takes no option {bad}; its options: {list(takes) or 'none'}")
    return cls(**opts)


def _option_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def register_spec(spec: str) -> str:
    """Register a strategy with options, named by its spec ``name:key=value[:key=value...]`` (e.g.
    ``patchkv:tail_threshold=0.02:recent_window=2048``), so a benchmark can list it beside the plain ones
    (``--strategies exact,prefix,patchkv:tail_threshold=0.02``); a spec without ``:`` is returned as it is.
    Values read as an int, else a float, else a string. Idempotent.

    Args:
        spec: the spec.

    Returns:
        The registered name (the spec itself).

    Raises:
        ValueError: an unknown base strategy or option, a value out of range, or a malformed ``key=value``.
    """
    if ":" not in spec or spec in STRATEGIES:
        return spec
    base, *pairs = spec.split(":")
    opts = {}
    for p in pairs:
        key, eq, value = p.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"strategy spec {spec!r}: {p!r} is not key=value")
        opts[key.strip()] = _option_value(value.strip())
    return register_variant(spec, base.strip(), opts, doc=f"{base} with {opts}")


def register_variant(name: str, base: str, options: Mapping[str, Any], doc: str | None = None) -> str:
    """Register ``name``: the registered strategy ``base`` with ``options`` fixed (built without arguments, so a
    benchmark can list it by name); idempotent: a name already registered is left as it is.

    Args:
        name: the new strategy's name.
        base: a registered strategy's name.
        options: its options (as :func:`get_strategy` takes them).
        doc: the variant's docstring.

    Returns:
        ``name``.

    Raises:
        ValueError: an unknown base strategy or option, or a value out of range.
    """
    if name in STRATEGIES:
        return name
    opts = dict(options)
    get_strategy(base, opts)  # validates the base name, the option names and their ranges
    parent = STRATEGIES[base]

    def __init__(self):
        parent.__init__(self, **opts)

    def option_names(cls) -> tuple[str, ...]:
        return ()  # its options are fixed

    register_strategy(type(f"Variant_{len(STRATEGIES)}", (parent,), {
        "name": name, "__init__": __init__, "option_names": classmethod(option_names),
        "__doc__": doc or f"{base} with {opts}"}))
    return name

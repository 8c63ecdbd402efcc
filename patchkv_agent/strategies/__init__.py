"""Recovery strategies behind one interface (:class:`Strategy`), resolved by name with :func:`get_strategy`.

- :mod:`.base`: the interface, the registry and :class:`RecoverySettings` (re-exported from
  :mod:`patchkv_agent.core.settings`): what every strategy reads instead of the engine.
- :mod:`.builtin`: ``exact`` (the oracle), ``prefix`` (Prefix Cache baseline), ``direct`` (Direct KV
  Reuse baseline), ``patchkv`` (selective recovery), ``patchkv-strict`` (its recency window recomputed whole
  whatever the profile's tail rule); :func:`full_prefill` and :func:`exact_reuse`, the exact
  strategies the layers above run without naming them.
- :mod:`.cacheblend`: the CacheBlend baseline.

Importing this package registers all six; nothing below imports it back.
"""

from __future__ import annotations

from .base import STRATEGIES, RecoverySettings, Strategy, get_strategy, register_spec, register_strategy, run_plan
from .builtin import (DirectStrategy, ExactStrategy, PatchKVStrategy, PrefixStrategy, StrictPatchKVStrategy, exact_reuse,
                      full_prefill)
from .cacheblend import CacheBlendStrategy

__all__ = ["STRATEGIES", "Strategy", "RecoverySettings", "get_strategy", "register_spec", "register_strategy", "run_plan",
           "ExactStrategy", "PrefixStrategy", "DirectStrategy", "PatchKVStrategy", "StrictPatchKVStrategy",
           "CacheBlendStrategy", "full_prefill",
           "exact_reuse"]

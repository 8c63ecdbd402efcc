"""Recovery strategies behind one interface (:class:`Strategy`), resolved by name with :func:`get_strategy`.

- :mod:`.base`: the interface and the registry.
- :mod:`.builtin`: ``exact`` (the oracle), ``prefix`` (Prefix Cache baseline), ``direct`` (Direct KV
  Reuse baseline), ``patchkv`` (selective recovery).
- :mod:`.cacheblend`: the CacheBlend baseline.

Importing this package registers all five; nothing below imports it back.
"""

from __future__ import annotations

from .base import STRATEGIES, Strategy, get_strategy, register_strategy
from .builtin import DirectStrategy, ExactStrategy, PatchKVStrategy, PrefixStrategy
from .cacheblend import CacheBlendStrategy

__all__ = ["STRATEGIES", "Strategy", "get_strategy", "register_strategy", "ExactStrategy", "PrefixStrategy",
           "DirectStrategy", "PatchKVStrategy", "CacheBlendStrategy"]

"""The record a :class:`~patchkv_agent.runtime.threads.ThreadRegistry` keeps per thread (context version,
resident and offloaded KV, store entry, pending job, heal state) and byte counts of KV.

Boundary: data only; the registry owns every transition (under ``ThreadState.lock``).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.fallback import Fallback
from ..results import ResumeResult
from .keys import ThreadKey
from .kvstore import CheckpointKey

__all__ = ["ThreadState", "kv_bytes", "ckpt_bytes", "shared_prefix"]

def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if len(neq) else m


def kv_bytes(res: ResumeResult) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(res.keys, res.values))


def ckpt_bytes(ckpt) -> int:
    return int(getattr(ckpt, "nbytes", 0) or 0)


@dataclass(eq=False)
class ThreadState:
    key: ThreadKey
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0                   # context versions seen so far (the current one is `version`)
    token_ids: np.ndarray | None = None
    resident: ResumeResult | None = None   # KV of `version` (context + decoded tokens), cache dropped
    checkpoint: Any = None                 # offloaded KV of `checkpoint_version`
    checkpoint_version: int = 0
    checkpoint_source: str = ""            # "background", "evicted"
    pending: Future | None = None
    lost: Fallback | None = None           # why the KV of `version` is gone (next resume says so)
    store_key: CheckpointKey | None = None  # this thread's entry in the registry's store (one at most)
    store_version: int = 0                 # the context version that entry holds
    store_source: str = ""                 # "background", "evicted", "restart", or the forked thread's
    streams: int = 0                       # open TokenStreams: their commit is pending, so no eviction
    last_used: float = 0.0
    healing: threading.Event | None = None  # set when the pending job's heal stage is over
    heal_stats: dict | None = None         # the last heal of the resident version (heal_s, healed_rows)

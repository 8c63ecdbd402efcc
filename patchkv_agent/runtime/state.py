"""The record a :class:`~patchkv_agent.runtime.threads.ThreadRegistry` keeps per thread (context version,
resident and offloaded KV, store entry, pending job, heal state; held in its :class:`~.table.ThreadTable`) and
byte counts of KV.

Boundary: data only; the registry's objects (:mod:`.calls`, :mod:`.residency`, :mod:`.preparation`) make every
transition, each through :func:`.lifecycle.transition` (under ``ThreadState.lock``, checked against the moves
:mod:`.lifecycle` allows); a preparation's stage moves only through :meth:`Preparation.advance`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from ..core.diff import Edit
from ..core.fallback import Fallback
from ..results import BaseKind, ResumeResult, RuntimePart
from .keys import ThreadKey
from .kvstore import CheckpointKey

__all__ = ["ThreadState", "Prediction", "Preparation", "PrepStage", "TakenPreparation", "kv_bytes", "ckpt_bytes",
           "shared_prefix"]


@dataclass
class Prediction:
    """A predicted next context of a thread (what a ``predict`` callable returns to
    :meth:`ThreadRegistry.prepare_async`).

    Attributes:
        token_ids: the ids of the next call's context up to the part that is not known yet (the tool
            results); None when no prediction could be made (``reason`` says why).
        reason: why there is no prediction (or a note on an assumption it made).
        info: JSON-safe notes reported in the next call's ``prepared_info`` (editors applied, outcomes).
    """

    token_ids: Any = None
    reason: str | None = None
    info: dict = field(default_factory=dict)


class PrepStage(str, Enum):
    """Where one preparation is: ``starting`` -> ``predicting`` -> ``queued`` (for the worker) -> ``computing``
    -> ``done``; any stage before ``done`` may end there (superseded, no prediction, failed)."""

    STARTING = "starting"
    PREDICTING = "predicting"
    QUEUED = "queued"
    COMPUTING = "computing"
    DONE = "done"


_STAGE_MOVES = frozenset({(PrepStage.STARTING, PrepStage.PREDICTING), (PrepStage.PREDICTING, PrepStage.QUEUED),
                          (PrepStage.QUEUED, PrepStage.COMPUTING)}
                         | {(s, PrepStage.DONE) for s in PrepStage if s is not PrepStage.DONE})


@dataclass(eq=False)
class Preparation:
    """One preparation of a thread's next context (the registry's record; fields change under its lock, its
    stage only through :meth:`advance`)."""

    version: int                          # the thread version it continues
    predict: Any                          # () -> Prediction | ids | None, run on a thread of its own
    chunk_tokens: int
    stop: threading.Event = field(default_factory=threading.Event)
    stage: PrepStage = PrepStage.STARTING
    future: Future | None = None
    ids: np.ndarray | None = None         # the predicted ids
    result: ResumeResult | None = None    # their exact KV (fewer rows when stopped)
    reason: str | None = None             # no prediction / failure
    info: dict = field(default_factory=dict)
    predict_s: float = 0.0

    def __post_init__(self) -> None:
        self.stage = PrepStage(self.stage)

    def advance(self, stage: PrepStage) -> None:
        """Move to ``stage`` (staying where it is is no move).

        Raises:
            ValueError: a move the stages do not allow (e.g. ``done`` -> ``computing``).
        """
        stage = PrepStage(stage)
        if stage is not self.stage and (self.stage, stage) not in _STAGE_MOVES:
            raise ValueError(f"a preparation moves starting -> predicting -> queued -> computing -> done, not "
                             f"{self.stage.value} -> {stage.value}")
        self.stage = stage

def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    neq = np.flatnonzero(a[:m] != b[:m])
    return int(neq[0]) if len(neq) else m


def kv_bytes(res: ResumeResult) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in zip(res.keys, res.values))


def ckpt_bytes(ckpt) -> int:
    return int(getattr(ckpt, "nbytes", 0) or 0)


@dataclass(frozen=True)
class TakenPreparation:
    """What a resume takes from its thread's preparation, built once when it is detached.

    Attributes:
        base: the prepared rows to resume from (a hit or a partial preparation), or None.
        report: the preparation's own stats, a :class:`~patchkv_agent.results.RuntimePart` with only its
            ``prepared*`` fields set (outcome, reason, tokens, wasted rows, predict / compute seconds, info);
            None: nothing was prepared.
        shared_resident: the ids the call shares with the resident context (None: nothing was prepared).
        edit: the diff of the chosen base's ids into the call's, where choosing it planned one (the resume
            reuses it instead of diffing again), else None.

    Raises:
        TypeError: ``report`` sets a field that is not the preparation's.
    """

    base: ResumeResult | None = None
    report: RuntimePart | None = None
    shared_resident: int | None = None
    edit: Edit | None = None

    def __post_init__(self) -> None:
        if self.report is not None:
            foreign = sorted(k for k, v in self.report.to_dict().items()
                             if v is not None and k not in RuntimePart.preparation_fields())
            if foreign:
                raise TypeError(f"a preparation's report sets only prepared* fields, not {foreign}")

    def runtime_fields(self, n_ids: int, recompute_tokens: int, from_prepared: bool) -> dict[str, Any]:
        """The :class:`~patchkv_agent.results.RuntimePart` fields the preparation gives the resume's runtime
        part: :attr:`report`'s, with ``prepared_hidden_share`` (the share of the call's recompute the tool
        wait did).

        Args:
            n_ids: the call's context length.
            recompute_tokens: the rows the call recomputed itself.
            from_prepared: the call resumed from the prepared rows.

        Returns:
            The ``prepared*`` fields by name (empty: nothing was prepared).
        """
        if self.report is None:
            return {}
        report, sr = self.report, self.shared_resident
        if sr is not None and n_ids > sr:
            fg = recompute_tokens if from_prepared else n_ids - sr
            report = report.replace(prepared_hidden_share=max(0.0, min(1.0, 1.0 - fg / (n_ids - sr))))
        return {k: getattr(report, k) for k in RuntimePart.preparation_fields()}


@dataclass(eq=False)
class ThreadState:
    key: ThreadKey
    lock: threading.Lock = field(default_factory=threading.Lock)
    version: int = 0                   # context versions seen so far (the current one is `version`)
    token_ids: np.ndarray | None = None
    resident: ResumeResult | None = None   # KV of `version` (context + decoded tokens), cache dropped
    checkpoint: Any = None                 # offloaded KV of `checkpoint_version`
    checkpoint_version: int = 0
    checkpoint_source: BaseKind | None = None  # BACKGROUND or EVICTED: what a resume from it reports
    pending: Future | None = None
    lost: Fallback | None = None           # why the KV of `version` is gone (next resume says so)
    store_key: CheckpointKey | None = None  # this thread's entry in the registry's store (one at most)
    store_version: int = 0                 # the context version that entry holds
    store_source: BaseKind | None = None   # BACKGROUND, EVICTED, RESTART, or the forked thread's
    streams: int = 0                       # open TokenStreams: their commit is pending, so no eviction
    last_used: float = 0.0
    healing: threading.Event | None = None  # set when the pending job's heal stage is over
    heal_stats: tuple[float | None, int | None] | None = None  # the resident version's last heal: (heal_s, healed_rows)
    preparation: Preparation | None = None  # the next context, prepared while the tools run

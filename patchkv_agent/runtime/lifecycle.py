"""A thread's lifecycle: the states of its KV, the moves between them, and the checks that hold in every state.

A thread's record (:class:`~patchkv_agent.runtime.state.ThreadState`) holds three parts that change independently,
each under the thread's lock, plus its open streams:

- **where the KV of its current version is** (:class:`Location`): nowhere yet, *resident* (what its last resume left
  on the accelerator), *offloaded* (a checkpoint in this process or an entry in the registry's store), or *lost*
  (evicted or dropped; the next resume is exact and says why);
- **the background job on it** (:class:`Job`): none, *healing* (the approximate rows of the resident version
  recomputed exactly, while the agent's tool runs), *offloading* (the checkpoint being written);
- **the preparation of its next context** (:class:`Prep`): none, *preparing* (predicted, being computed exactly in
  chunks), *prepared* (its exact KV is ready for the next call).

The parts move only along :data:`MOVES` (one registry step: a resume, a commit, a job stage, an eviction, a
``forget``), and every step that writes a record goes through :func:`transition` (or :func:`checked`, where the
caller holds the lock), which enforces that: a step that would make any other move raises
:class:`IllegalTransition` and leaves the record as it was. :func:`view_of` reads all of the parts at once as a
:class:`ThreadView`, whose :attr:`ThreadView.phase` is
the single :class:`Phase` :meth:`ThreadRegistry.phase <patchkv_agent.runtime.threads.ThreadRegistry.phase>` reports
(an open stream first, then the preparation, the job, the location). :func:`invariant_violations` lists what must
hold between the parts in every state (the tests drive registries through random operations and check it after
each one).

Boundary: reads a record and checks the moves of the registry's steps on it (the registry writes the fields,
inside those checks); nothing else.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Iterator

import numpy as np

from .state import PrepStage, ThreadState

__all__ = ["Phase", "Location", "Job", "Prep", "ThreadView", "MOVES", "is_offloaded", "view_of",
           "invariant_violations", "IllegalTransition", "illegal_moves", "transition", "checked"]


class Phase(str, Enum):
    """Where a thread's KV is, as one value (:meth:`ThreadRegistry.phase`; the view of :class:`ThreadView`).

    ``NONE`` -(resume)-> ``STREAMING`` -(stream closed)-> ``RESIDENT``; while a tool runs, ``RESIDENT``
    -> ``PREPARING`` (the next context computed exactly) -> ``PREPARED``, and/or ``HEALING`` ->
    ``OFFLOADING`` -> ``RESIDENT`` with a checkpoint (``OFFLOADED`` once the resident KV is released or
    evicted); the next resume starts from ``PREPARED``, ``RESIDENT`` or ``OFFLOADED`` and opens
    ``STREAMING`` again; ``LOST``: the KV is gone (the next resume is exact and says why).
    """

    NONE = "none"
    STREAMING = "streaming"
    RESIDENT = "resident"
    PREPARING = "preparing"
    PREPARED = "prepared"
    HEALING = "healing"
    OFFLOADING = "offloading"
    OFFLOADED = "offloaded"
    LOST = "lost"


class Location(str, Enum):
    """Where the KV of a thread's current version is."""

    NONE = "none"
    RESIDENT = "resident"
    OFFLOADED = "offloaded"
    LOST = "lost"


class Job(str, Enum):
    """The background job on a thread (the registry's worker runs one per thread at a time)."""

    IDLE = "idle"
    HEALING = "healing"
    OFFLOADING = "offloading"


class Prep(str, Enum):
    """The preparation of a thread's next context."""

    NONE = "none"
    PREPARING = "preparing"
    PREPARED = "prepared"


# every move one registry step makes, per part (a part may also stay where it is)
MOVES: dict[type, frozenset[tuple[Enum, Enum]]] = {
    Location: frozenset({
        (Location.NONE, Location.RESIDENT),       # the first resume (exact)
        (Location.RESIDENT, Location.RESIDENT),   # a resume of the next version replaces the resident KV
        (Location.RESIDENT, Location.OFFLOADED),  # released after its offload, or evicted with a checkpoint
        (Location.RESIDENT, Location.LOST),       # evicted beyond the budget with nothing written
        (Location.OFFLOADED, Location.RESIDENT),  # a resume from the checkpoint or store entry
        (Location.OFFLOADED, Location.LOST),      # the checkpoint dropped by the offload budget
        (Location.LOST, Location.RESIDENT),       # the exact resume that follows
        (Location.NONE, Location.OFFLOADED),      # expect(): a store entry found after a restart
        (Location.NONE, Location.LOST),           # expect(): a version whose entry is gone
        (Location.RESIDENT, Location.NONE),       # forget()
        (Location.OFFLOADED, Location.NONE),
        (Location.LOST, Location.NONE),
    }),
    Job: frozenset({
        (Job.IDLE, Job.HEALING),        # an offload of an approximate resident version starts by healing it
        (Job.IDLE, Job.OFFLOADING),     # an exact resident version is written as it is
        (Job.HEALING, Job.OFFLOADING),  # the heal installed the exact KV: now it is written
        (Job.HEALING, Job.IDLE),        # superseded by a resume while healing (its result is discarded)
        (Job.OFFLOADING, Job.IDLE),     # written (or failed: the reason is kept for the next resume)
    }),
    Prep: frozenset({
        (Prep.NONE, Prep.PREPARING),      # prepare_async
        (Prep.PREPARING, Prep.PREPARED),  # computed (all of it, or the rows done when the call came)
        (Prep.PREPARING, Prep.NONE),      # no prediction, failed, or superseded by a resume
        (Prep.PREPARED, Prep.NONE),       # taken (or refused) by the next resume
    }),
}


def is_offloaded(th: ThreadState) -> bool:
    """Whether the current version's KV already has a checkpoint or a store entry (caller holds the lock)."""
    return ((th.checkpoint is not None and th.checkpoint_version == th.version)
            or (th.store_key is not None and th.store_version == th.version))


@dataclass(frozen=True)
class ThreadView:
    """The parts of one thread's state, read at once (:func:`view_of`)."""

    version: int
    location: Location
    job: Job
    preparation: Prep
    streams: int

    @property
    def phase(self) -> Phase:
        """The one :class:`Phase` of this state: an open stream, else the preparation, the job, the location."""
        if self.streams:
            return Phase.STREAMING
        if self.preparation is not Prep.NONE:
            return Phase(self.preparation.value)
        if self.job is not Job.IDLE:
            return Phase(self.job.value)
        return Phase(self.location.value)


def view_of(th: ThreadState) -> ThreadView:
    """The :class:`ThreadView` of a record (the caller holds ``th.lock``, or owns the record alone)."""
    if th.resident is not None:
        location = Location.RESIDENT
    elif is_offloaded(th):
        location = Location.OFFLOADED
    else:
        location = Location.LOST if th.lost is not None else Location.NONE
    job = Job.IDLE
    if th.pending is not None and not th.pending.done():
        job = Job.HEALING if th.healing is not None and not th.healing.is_set() else Job.OFFLOADING
    prep, prep_state = th.preparation, Prep.NONE
    if prep is not None and prep.version == th.version:
        if prep.stage is not PrepStage.DONE:
            prep_state = Prep.PREPARING
        elif prep.result is not None:
            prep_state = Prep.PREPARED
    return ThreadView(version=th.version, location=location, job=job, preparation=prep_state, streams=th.streams)


def invariant_violations(th: ThreadState) -> list[str]:
    """What is wrong between the parts of a record, as sentences (empty when it is consistent; the caller holds
    ``th.lock``).

    The checks: counts are non-negative; the resident KV is of the current version (its context starts with the
    version's ids, and its K/V cover its context); no checkpoint or store entry is of a version after the current
    one; a lost version has no resident KV; a prepared context continues the version it was prepared for.
    """
    bad = []
    if th.streams < 0:
        bad.append(f"{th.streams} open streams")
    if th.version < 0 or th.checkpoint_version > th.version or th.store_version > th.version:
        bad.append(f"version {th.version}, checkpoint of {th.checkpoint_version}, store entry of {th.store_version}")
    res = th.resident
    if res is not None:
        if th.token_ids is None:
            bad.append("resident KV without a context version")
        else:
            ctx = np.asarray(res.context_ids)
            n = len(th.token_ids)
            if len(ctx) < n or not np.array_equal(ctx[:n], th.token_ids):
                bad.append("the resident KV is not of the current version's ids")
        rows = {int(k.shape[-2]) for k in res.keys} | {int(v.shape[-2]) for v in res.values}
        if rows and rows != {len(res.context_ids)}:
            bad.append(f"resident K/V rows {sorted(rows)} for {len(res.context_ids)} context tokens")
        if th.lost is not None:
            bad.append("a lost version with resident KV")
    prep = th.preparation
    if prep is not None and prep.result is not None and prep.ids is not None:
        if len(prep.result.context_ids) > len(prep.ids) or not np.array_equal(
                np.asarray(prep.result.context_ids), prep.ids[: len(prep.result.context_ids)]):
            bad.append("the prepared KV is not of the predicted ids")
    return bad


class IllegalTransition(RuntimeError):
    """A registry step that would move a part of a thread's state along a move :data:`MOVES` does not allow."""


_WRITABLE = tuple(f.name for f in dataclasses.fields(ThreadState) if f.name not in ("key", "lock"))


def illegal_moves(before: ThreadView, after: ThreadView) -> list[str]:
    """The moves from ``before`` to ``after`` that :data:`MOVES` does not allow (a part that stays is no move).

    Args:
        before, after: two views of one record.

    Returns:
        ``"<part>: <from> -> <to>"`` per illegal move (empty when every move is allowed).
    """
    bad = []
    for name, part in (("location", Location), ("job", Job), ("preparation", Prep)):
        a, b = getattr(before, name), getattr(after, name)
        if a is not b and (a, b) not in MOVES[part]:
            bad.append(f"{name}: {a.value} -> {b.value}")
    if after.streams < 0:
        bad.append(f"streams: {before.streams} -> {after.streams}")
    return bad


@contextlib.contextmanager
def checked(th: ThreadState, step: str, *, restart: bool = False) -> Iterator[ThreadState]:
    """One registry step on ``th`` (the caller holds ``th.lock``): the block writes the record's fields; when
    it ends normally every part must have moved along :data:`MOVES` (or stayed), else the fields are restored
    and :class:`IllegalTransition` names the step and the move. A block that raises is not checked (its error
    is the caller's).

    Args:
        th: the record.
        step: what the step is, for the error (``"resume"``, ``"offload"``, ...).
        restart: a step that moves the record to another version starts it from nothing (``expect`` after a
            restart): its moves are then checked from an empty record (``Location.NONE``, idle, nothing
            prepared).

    Yields:
        ``th``.

    Raises:
        IllegalTransition: a move :data:`MOVES` does not allow.
    """
    before = view_of(th)
    saved = {f: getattr(th, f) for f in _WRITABLE}
    yield th
    after = view_of(th)
    if restart and after.version != before.version:
        before = dataclasses.replace(before, location=Location.NONE, job=Job.IDLE, preparation=Prep.NONE)
    bad = illegal_moves(before, after)
    if bad:
        for f, v in saved.items():
            setattr(th, f, v)
        raise IllegalTransition(f"{step} on thread {th.key}: {'; '.join(bad)} is not a move of the lifecycle "
                                "(runtime/lifecycle.py MOVES); the record is left as it was")


@contextlib.contextmanager
def transition(th: ThreadState, step: str, *, restart: bool = False) -> Iterator[ThreadState]:
    """:func:`checked` under ``th.lock`` (acquired here, released at the end).

    Raises:
        IllegalTransition: see :func:`checked`.
    """
    with th.lock, checked(th, step, restart=restart):
        yield th

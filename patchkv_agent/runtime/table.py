"""What a registry's threads hold: the table of per-thread records, which context each thread key last used,
and the choice of the context a call continues.

A :class:`ThreadTable` maps every context key (``thread_id``, ``checkpoint_ns`` or ``ns#ctxN``) to its
:class:`~patchkv_agent.runtime.state.ThreadState` (least recently used first) and every thread key to the
context its last call used. One short table lock guards both maps; a record's own fields are guarded by its
``lock`` and written only through :func:`~patchkv_agent.runtime.lifecycle.transition` (by the call path,
:mod:`.residency` and :mod:`.preparation`). A thread lock may be held while taking the table lock (a record
removed by ``forget``), never the reverse.

*Several contexts per thread key* (:meth:`ThreadTable.choose_context`): a summarizer, a router or a sub-agent
calling the same model under one graph thread has a context of its own. A key holds up to ``contexts`` recent
contexts; a call continues the one it shares the most with (the longest common prefix, or, when no context
shares half of itself, the most tokens the diff can reuse) and opens a new one when none shares a quarter of the
new version, so two callers on one key never overwrite each other's KV.

Boundary: the records and their keys; no engine, no store, no background work.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Iterator

import numpy as np

from ..core.diff import Edit, diff_versions
from .keys import MIN_CONTINUE_SHARE, ThreadKey, context_key
from .state import ThreadState, ckpt_bytes, kv_bytes, shared_prefix

__all__ = ["ThreadTable"]


class ThreadTable:
    """The per-thread records of one registry and the context each thread key last used.

    Args:
        contexts: contexts kept apart per thread key (1: one context per key).
    """

    def __init__(self, contexts: int = 4) -> None:
        self.contexts = contexts
        self.lock = threading.Lock()  # the table lock: both maps; never held while taking a thread lock
        self._records: OrderedDict[ThreadKey, ThreadState] = OrderedDict()  # least recently used first
        self._active: dict[ThreadKey, ThreadKey] = {}  # thread key -> the context its last call used

    # ---------------------------------------------------------------- lookups

    def get(self, key: ThreadKey, create: bool = True) -> ThreadState | None:
        """The record of context ``key``, touched as used (created when ``create``; else None when unknown)."""
        with self.lock:
            th = self._records.get(key)
            if th is None and create:
                th = self._records[key] = ThreadState(key=key)
            if th is not None:
                self._records.move_to_end(key)
                th.last_used = time.monotonic()
            return th

    def peek(self, key: ThreadKey) -> ThreadState | None:
        """The record of context ``key`` (not touched), or None."""
        with self.lock:
            return self._records.get(key)

    def active(self, key: ThreadKey | None) -> ThreadKey | None:
        """The context key the last call of thread key ``key`` used (``key`` itself before any call)."""
        if key is None:
            return None
        with self.lock:
            return self._active.get(key, key)

    def known(self, key: ThreadKey | None) -> ThreadState | None:
        """The record of ``key``'s active context (touched as used), or None for None or an unknown key."""
        return self.get(self.active(key), create=False) if key is not None else None

    def use(self, primary: ThreadKey, context: ThreadKey) -> ThreadState:
        """Note that thread key ``primary``'s call runs on ``context``; returns that context's record."""
        with self.lock:
            self._active[primary] = context
        return self.get(context)

    def keys(self) -> list[ThreadKey]:
        """Known context keys, least recently used first."""
        with self.lock:
            return list(self._records)

    def records(self) -> list[ThreadState]:
        """Every record, least recently used first."""
        with self.lock:
            return list(self._records.values())

    def others(self, keep: ThreadKey) -> Iterator[ThreadState]:
        """Every record but ``keep``'s, least recently used first (the candidates of an eviction)."""
        with self.lock:
            order = [t for k, t in self._records.items() if k != keep]
        yield from order

    def remove(self, th: ThreadState) -> None:
        """Drop ``th`` and its key's active-context entry (the caller holds ``th.lock``)."""
        with self.lock:
            self._records.pop(th.key, None)
            self._active.pop(th.key, None)

    # ------------------------------------------------------------------ bytes

    def resident_bytes(self) -> int:
        """K/V bytes held resident across threads (prepared next contexts included)."""
        total = 0
        for t in self.records():
            if t.resident is not None:
                total += kv_bytes(t.resident)
            prep = t.preparation
            if prep is not None and prep.result is not None:
                total += kv_bytes(prep.result)
        return total

    def offloaded_bytes(self) -> int:
        """Checkpoint bytes held in this process across threads."""
        with self.lock:
            return sum(ckpt_bytes(t.checkpoint) for t in self._records.values() if t.checkpoint is not None)

    # ------------------------------------------------------------ the context

    def choose_context(self, key: ThreadKey, ids: np.ndarray) -> tuple[ThreadKey, Edit | None]:
        """The context of thread key ``key`` that a call with ``ids`` continues, or a new one (see the module
        docstring).

        Args:
            key: the thread key.
            ids: the call's validated ids.

        Returns:
            ``(context key, diff)``: the diff of the chosen context's resident ids into ``ids`` when the choice
            had to diff (an edit near the head), so the resume reuses it instead of diffing again; else None.
        """
        if self.contexts == 1:
            return key, None
        lanes: list[tuple[ThreadKey, np.ndarray, float]] = []
        free: ThreadKey | None = None
        for i in range(self.contexts):
            ck = context_key(key, i)
            th = self.peek(ck)
            tok = th.token_ids if th is not None else None
            if tok is None or len(tok) == 0:
                if free is None and (th is None or (th.resident is None and th.store_key is None
                                                    and th.checkpoint is None and th.lost is None)):
                    free = ck
                continue
            lanes.append((ck, tok, th.last_used))
        if not lanes:  # the key's first call (or one after a restart: its version and reason are there)
            return key, None
        for ck, _, _ in lanes:  # the context whose prepared next version this call continues
            prep = self.peek(ck).preparation
            pids = prep.ids if prep is not None else None
            if pids is not None and len(pids) <= len(ids) and shared_prefix(pids, ids) == len(pids):
                return ck, None
        shared = [shared_prefix(tok, ids) for _, tok, _ in lanes]
        best = int(np.argmax(shared))
        if shared[best] * 2 >= len(lanes[best][1]):  # continues (appends to / edits the back half of) it
            return lanes[best][0], None
        # an edit near the head, or another caller: how much is reusable. Each lane is diffed against what a
        # resume from it would restore (its resident ids, decoded tokens included), so the chosen lane's diff
        # is the resume's own and is handed on to it
        reuse, edits = [], []
        for (ck, tok, _), p in zip(lanes, shared):
            th = self.peek(ck)
            resident = th.resident if th is not None else None
            base_ids = resident.context_ids if resident is not None else tok
            try:
                e = diff_versions(base_ids, ids)
            except ValueError:
                reuse.append(p)
                edits.append(None)
                continue
            reuse.append(int(e.prefix_len + e.suffix_len))
            edits.append(e)
        best = int(np.argmax(reuse))
        if reuse[best] >= MIN_CONTINUE_SHARE * len(ids):
            return lanes[best][0], edits[best]
        if free is not None:
            return free, None
        return min(lanes, key=lambda lane: lane[2])[0], None  # the least recently used context is replaced

"""How a registry serves one call: from the request to the token stream, top to bottom in one place.

:meth:`CallPath.stream` is the whole path of a call of :meth:`ThreadRegistry.stream
<patchkv_agent.runtime.threads.ThreadRegistry.stream>`:

1. validate and resolve the request once (``engine.request``: ids, ``max_new_tokens``, the strategy);
2. a call without a thread key, or one whose strategy reads no base, needs no base: a call without a key is a
   one-off full prefill (nothing kept);
3. choose the context of the thread key the call continues (:meth:`ThreadTable.choose_context
   <.table.ThreadTable.choose_context>`) and take the thread's preparation (:meth:`Preparations.take
   <.preparation.Preparations.take>`: a hit or a partial preparation is the base);
4. wait for what the base needs: a heal in progress (its exact KV is the base this resume wants), and a pending
   offload only when the thread has no resident KV (a resident thread resumes from it at once);
5. pick the base: the prepared rows, else the resident KV, a checkpoint in this process, the thread's store
   entry of its current version, or nothing (exact; the reason the KV is gone is reported);
6. resume (a prediction's own call: exact, in background chunks, :mod:`.background`; from the store: the store
   read outside the forward lock; else one forward under the forward lock) and install the result as the
   thread's next resident version (its superseded store entry is deleted off the path);
7. record the call's runtime statistics, enforce the resident budget, and open the token stream, whose close
   commits the decoded tokens' KV (:meth:`CallPath.commit`); a later offload (:mod:`.residency`) writes it.

Boundary: the table's records (every write through :func:`~.lifecycle.transition`), the residency's waits,
store entries and budget, the preparation's hand-over, the engine's public resume; nothing about LangGraph.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from ..core.sampling import Sampler
from ..results import BaseKind, ResumeResult
from ..strategies import Strategy
from .background import check_not_stopped, prediction_stop, resume_in_background
from .keys import ThreadKey
from .kvstore import resume_from_store
from .lifecycle import transition
from .preparation import Preparations
from .residency import Residency
from .state import ThreadState
from .stream import TokenStream
from .table import ThreadTable

__all__ = ["CallPath"]


class CallPath:
    """The call path of one registry (see the module docstring).

    Args:
        engine: the :class:`~patchkv_agent.engine.PatchKVEngine`.
        table: the registry's :class:`~patchkv_agent.runtime.table.ThreadTable`.
        residency: the registry's :class:`~patchkv_agent.runtime.residency.Residency`.
        preparations: the registry's :class:`~patchkv_agent.runtime.preparation.Preparations`.
        chunk_tokens: rows per background forward of a prediction's own call.
    """

    def __init__(self, engine: Any, table: ThreadTable, residency: Residency, preparations: Preparations, *,
                 chunk_tokens: int) -> None:
        self.engine, self.table, self.residency, self.preparations = engine, table, residency, preparations
        self.chunk_tokens = chunk_tokens
        self.forward_lock = engine.forward_lock  # the engine's: one forward at a time per model, across registries

    def stream(self, key: ThreadKey | None, token_ids, strategy: "str | Strategy", max_new_tokens: int,
               sampler: Sampler | None) -> TokenStream:
        """Serve one call (see the module docstring and :meth:`ThreadRegistry.stream
        <patchkv_agent.runtime.threads.ThreadRegistry.stream>`).

        Returns:
            The call's :class:`~patchkv_agent.runtime.stream.TokenStream`.

        Raises:
            ValueError: bad ids, ``max_new_tokens`` or strategy.
        """
        # 1. the public boundary's one validation: the request is checked and resolved here, before any state
        # changes, and every layer below runs it as it is
        req = self.engine.request(token_ids, strategy, max_new_tokens)
        ids, max_new_tokens, strat = req.ids, req.max_new_tokens, req.strategy
        exact_req = req.as_full_prefill().prefill_only()
        stop = prediction_stop()  # a prediction's own call (a summary): behind every real call (.background)
        check_not_stopped(stop)
        # 2. no thread: a one-off full prefill
        if key is None:
            if stop is not None:
                res = resume_in_background(self.engine, None, exact_req, stop, self.chunk_tokens)
            else:
                with self.forward_lock:
                    res = self.engine.resume_request(None, exact_req)
            res.stats = res.stats.with_runtime(base=BaseKind.NONE, requested_strategy=strat.name, offload_wait_s=0.0)
            return TokenStream(self.engine, res, max_new_tokens, sampler, stop=stop)
        # 3. the context this call continues, and its preparation
        primary, (key, edit) = key, self.table.choose_context(key, ids)
        req = dataclasses.replace(req, edit=edit).prefill_only()
        th = self.table.use(primary, key)
        taken = self.preparations.take(th, req)  # detached once; its diff (a partial call planned one) goes on
        prepared, req = taken.base, dataclasses.replace(req, edit=taken.edit) if taken.edit is not None else req
        # 4. a heal in progress gives the exact base this resume wants (a prepared base is exact already)
        heal_wait_s = 0.0 if prepared is not None else self.residency.wait_heal(th)
        with th.lock:
            resident = th.resident is not None or prepared is not None
        # a resident thread resumes from its resident KV: a pending offload is not waited for
        wait_s = 0.0 if resident and strat.uses_checkpoint else self.residency.wait_pending(th)
        with transition(th, "resume"):
            base_heal = th.heal_stats
            base_approx = th.resident.approx_rows if th.resident is not None else None
            # 5. the base
            if not strat.uses_checkpoint:  # the strategy reads no base: do not write one
                base, base_version, source, skey = None, None, BaseKind.NONE, None
                fallback = None
            elif prepared is not None:
                base, base_version, skey = self.engine.as_checkpoint(prepared), th.version, None
                source = BaseKind.PREPARED
                fallback = None
            else:
                base, base_version, source, skey = self._base(th)
                fallback = th.lost if base is None and skey is None else None
            # 6. the resume
            if stop is not None:  # exact, in chunks from the resident rows it shares
                res = resume_in_background(self.engine, th.resident, req, stop, self.chunk_tokens)
            elif skey is not None:  # the store read runs outside the forward lock
                res = resume_from_store(self.engine, self.residency.store, skey, req, forward_lock=self.forward_lock)
                if res.stats.fallback is not None:  # nothing of the stored checkpoint was used
                    base_version, source = None, BaseKind.NONE  # evicted, corrupt, missing: exact, reason recorded
            else:
                with self.forward_lock:
                    if base is None:
                        res = self.engine.resume_request(None, exact_req)
                    else:
                        res = self.engine.resume_request(base, req)
            th.version += 1
            th.token_ids, th.lost, th.heal_stats = ids, None, None
            th.resident = dataclasses.replace(res, cache=None, output_ids=[])
            th.checkpoint, th.pending = None, None  # superseded by the resident version
            stale = th.store_key
            th.store_key = None
            version = th.version
            th.streams += 1  # until the stream's commit: see TokenStream.close
        if stale is not None:  # superseded too: free its share of the store's budget, off the critical path
            self.residency.submit_delete(stale)
        # 7. the statistics, the budget, the stream
        heal_s, healed_rows = base_heal or (None, None)
        prep_stats = taken.runtime_fields(len(ids), res.stats.recompute_tokens, source is BaseKind.PREPARED)
        res.stats = res.stats.with_runtime(
            thread_id=key[0], checkpoint_ns=primary[1], version=version, base_version=base_version,
            base=source, requested_strategy=strat.name, offload_wait_s=wait_s, context=key[1],
            heal_wait_s=heal_wait_s, base_approx_rows=base_approx if source is BaseKind.RESIDENT else None,
            base_heal_s=heal_s, base_healed_rows=healed_rows, **prep_stats)
        if res.stats.fallback is None and fallback is not None:  # the base it expected is gone: say why
            res.stats = res.stats.with_engine(fallback=fallback)
        self.residency.enforce_resident_budget(keep=key)
        return TokenStream(self.engine, res, max_new_tokens, sampler,
                           commit=functools.partial(self.commit, th, version), stop=stop)

    def _base(self, th: ThreadState):
        """Where to resume ``th`` from: ``(checkpoint, version, source, store_key)`` (caller holds ``th.lock``).

        The resident KV when it is still there (a zero-copy full-precision view: nothing is ever written
        on the critical path), else a checkpoint in this process, else the thread's store entry of its
        current version (``checkpoint`` None, ``store_key`` set), else nothing.
        """
        if th.resident is not None:
            return self.engine.as_checkpoint(th.resident), th.version, BaseKind.RESIDENT, None
        if th.checkpoint is not None:
            return th.checkpoint, th.checkpoint_version, th.checkpoint_source, None
        if th.store_key is not None and th.store_version == th.version:
            return None, th.version, th.store_source, th.store_key
        return None, None, BaseKind.NONE, None

    def commit(self, th: ThreadState, version: int, res: ResumeResult, cache) -> None:
        """Make the decoded tokens' KV part of the thread's resident version (if still current): the commit
        handle a :class:`~patchkv_agent.runtime.stream.TokenStream` calls when it closes.

        Args:
            th: the thread's record.
            version: the version the stream was opened for.
            res: the stream's result (its ``output_ids`` drawn).
            cache: the decode cache (context and decoded tokens but the last), or None.
        """
        out = res.output_ids
        keys, values, ids = res.keys, res.values, res.context_ids
        if len(out) > 1 and cache is not None:
            n = len(ids) + len(out) - 1
            try:
                ks = [layer.keys for layer in cache.layers]
                vs = [layer.values for layer in cache.layers]
            except AttributeError:
                ks = vs = []
            if ks and all(k.shape[-2] == n for k in ks) and all(v.shape[-2] == n for v in vs):
                keys, values = ks, vs
                ids = np.concatenate([ids, np.asarray(out[:-1], dtype=np.int64)])
        with transition(th, "commit"):
            th.streams = max(0, th.streams - 1)
            if th.version != version or th.resident is None:
                return
            exact = res.exact_rows
            if exact is None or exact >= len(res.context_ids):  # decoded over an exact context: exact too
                exact = len(ids)
            th.resident = dataclasses.replace(res, cache=None, output_ids=[], context_ids=ids, keys=keys,
                                              values=values, exact_rows=exact)
        self.residency.enforce_resident_budget(keep=th.key)

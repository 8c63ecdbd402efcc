"""The tool wait does the edit: a thread's predicted next context, computed exactly while its tools run.

:class:`Preparations` runs a registry's preparations (:meth:`~Preparations.prepare_async`,
:meth:`~Preparations.wait_prepared`, and the hand-over to the call path, :meth:`~Preparations.take`): a
predictor runs on a daemon thread of its own for ``predict_timeout_s`` at most (a hung or raising predictor
never holds the registry's worker, so offloads, heals and other threads go on), then ``engine.prepare``
computes the prediction's K/V in the worker (:attr:`Residency.worker <.residency.Residency.worker>`), in
chunks that give way to foreground forwards (:mod:`patchkv_agent.core.prepare`), and the next resume takes
the result as its base when the call's context continues it. A preparation is a
:class:`~patchkv_agent.runtime.state.Preparation` on the thread's record; its stages (predicting, queued for
the worker, computing, done) change under the thread lock.

Boundary: the table's records, the residency's worker and resident budget, the engine's public ``prepare``,
``planned`` and ``validate_ids``; nothing about LangChain (predictors come from the caller).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from ..results import PreparedOutcome, ResumeResult, RuntimePart
from .background import PreparationStopped, predicting
from .keys import ThreadKey
from .lifecycle import transition
from .residency import Residency
from .state import Prediction, Preparation, PrepStage, TakenPreparation, ThreadState, shared_prefix
from .table import ThreadTable

log = logging.getLogger(__name__)

__all__ = ["Preparations"]


class Preparations:
    """The preparations of one registry's threads (see the module docstring).

    Args:
        engine: the :class:`~patchkv_agent.engine.PatchKVEngine`.
        table: the registry's :class:`~patchkv_agent.runtime.table.ThreadTable`.
        residency: the registry's :class:`~patchkv_agent.runtime.residency.Residency` (its worker computes,
            its resident budget counts the prepared rows).
        events: the registry's event list (``"prepared"`` is appended).
        chunk_tokens: rows per background forward unless a call says otherwise.
        predict_timeout_s: seconds a predictor may run (None: no limit).
    """

    def __init__(self, engine: Any, table: ThreadTable, residency: Residency, events: list[dict[str, Any]], *,
                 chunk_tokens: int, predict_timeout_s: float | None) -> None:
        self.engine, self.table, self.residency, self.events = engine, table, residency, events
        self.chunk_tokens, self.predict_timeout_s = chunk_tokens, predict_timeout_s

    def prepare_async(self, key: ThreadKey | None, predict: Callable[[], "Prediction | Any"], *,
                      chunk_tokens: int | None = None) -> Future | None:
        """Compute the thread's predicted next context exactly in the background, while its tools run.

        ``predict`` runs on a daemon thread of its own and returns the next call's context up to what is
        not known yet (a :class:`~patchkv_agent.runtime.state.Prediction`, or token ids, or None); one
        that runs past the registry's ``predict_timeout_s`` is abandoned (its result, if it ever comes, is
        dropped; the preparation fails with ``"the prediction timed out ..."``). Its K/V are computed
        exactly from the thread's resident version (its leading exact rows copied, the rest recomputed in
        chunks of ``chunk_tokens`` rows, each giving way to foreground forwards). The next resume of the
        thread whose ids start with the prepared ones appends only what follows (``base`` ``"prepared"``,
        ``prepared`` ``"hit"``): exact, at the cost of the appended tokens. A call that diverges from the
        prediction, or comes before it is finished, starts from the prepared rows where they match and
        reach further than the resident ones (``"partial"``), else as without a preparation (``"miss"``,
        ``"unfinished"``); a running chunk is the most it waits for. The heal stage of the thread's
        offload is skipped while a preparation of the version exists (the preparation recomputes from the
        first approximate row the next context uses).

        Args:
            key: the thread key (its active context).
            predict: the predictor (called once, on its own thread; whatever it raises, ``BaseException``
                included, becomes ``prepared_reason``).
            chunk_tokens: rows per background forward (default: the registry's ``prepare_chunk_tokens``).

        Returns:
            The job's future (one per thread version: a second call for the same version returns the
            first one's), or None for an unknown thread or one without a context version.

        Raises:
            ValueError: ``chunk_tokens`` < 1.
        """
        if chunk_tokens is not None and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                         or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
        th = self.table.known(key)
        if th is None:
            return None
        with transition(th, "prepare"):
            if th.token_ids is None:
                return None
            old = th.preparation
            if old is not None and old.version == th.version:
                return old.future
            if old is not None:
                old.stop.set()
            prep = Preparation(version=th.version, predict=predict, future=Future(),
                               chunk_tokens=chunk_tokens or self.chunk_tokens)
            th.preparation = prep
        threading.Thread(target=self._prepare_thread, args=(th, prep), daemon=True,
                         name=f"patchkv-prepare-{str(th.key[0])[:24]}").start()
        return prep.future

    def wait_prepared(self, key: ThreadKey | None, timeout: float | None = None) -> float:
        """Wait until the preparation of ``key``'s current version is over (done, failed or stopped).

        Args:
            key: the thread key (its active context).
            timeout: seconds at most (None: no limit).

        Returns:
            The seconds waited (0.0 when nothing is being prepared).
        """
        th = self.table.peek(self.table.active(key)) if key is not None else None
        prep = th.preparation if th is not None else None
        if prep is None or prep.future is None or prep.future.done():
            return 0.0
        t0 = time.perf_counter()
        try:
            prep.future.result(timeout)
        except TimeoutError:
            pass
        except Exception:  # the job records its own failure
            log.exception("preparation of thread %s failed", th.key)
        return time.perf_counter() - t0

    def _prepare_thread(self, th: ThreadState, prep: Preparation) -> None:
        """The preparation's own thread: run :meth:`_prepare_job` and settle ``prep.future`` with its result
        (None when the job failed: the failure is recorded as the preparation's reason, never raised)."""
        try:
            out = self._prepare_job(th, prep)
        except BaseException as e:  # noqa: BLE001 - nothing a preparation does may reach a caller
            log.exception("preparation of thread %s failed", th.key)
            out = self._finish(th, prep, f"the preparation failed: {type(e).__name__}: {e}")
        prep.future.set_result(out)

    def _prepare_job(self, th: ThreadState, prep: Preparation) -> float | None:
        """Predict (:meth:`_predict`), then compute the prediction's KV in the worker (:meth:`_compute_job`).

        Returns:
            The seconds predicting and computing took, or None when nothing was computed (the reason is
            on ``prep``).
        """
        if not self._prep_current(th, prep):
            return self._finish(th, prep, "superseded before it started")
        prep.advance(PrepStage.PREDICTING)
        t0 = time.perf_counter()
        pred = self._predict(th, prep)
        prep.predict_s = time.perf_counter() - t0
        if not isinstance(pred, Prediction):
            pred = Prediction(token_ids=pred, reason=None if pred is not None else "no prediction")
        prep.info = dict(pred.info)
        if pred.token_ids is None:
            return self._finish(th, prep, pred.reason or "no prediction")
        try:
            ids = self.engine.validate_ids(pred.token_ids, "predicted token_ids")
        except ValueError as e:
            return self._finish(th, prep, f"the prediction is not a valid context: {e}")
        with transition(th, "prepare: queued"):
            if not self._prep_current(th, prep):
                return self._finish(th, prep, "superseded while predicting", locked=True)
            prep.ids, prep.reason = ids, pred.reason
            prep.advance(PrepStage.QUEUED)
        try:
            return self.residency.worker.submit(self._compute_job, th, prep).result()
        except RuntimeError as e:  # the registry closed while it predicted
            return self._finish(th, prep, f"the preparation was not computed: {e}")

    def _predict(self, th: ThreadState, prep: Preparation) -> Any:
        """Call ``prep.predict`` on a daemon thread of its own and wait ``predict_timeout_s`` at most.

        Returns:
            What the predictor returned, or a :class:`~patchkv_agent.runtime.state.Prediction` without ids
            whose reason says that it raised (any ``BaseException``: contained here, never re-raised) or ran
            past its deadline (then it is abandoned: its thread finishes on its own, its result is dropped).
        """
        out: dict[str, Any] = {}

        def call() -> None:
            try:
                with predicting(prep.stop):  # its own model calls run behind real ones, and stop with it
                    out["value"] = prep.predict()
            except BaseException as e:  # noqa: BLE001 - a predictor's fault never reaches the caller
                out["error"] = e

        hook = threading.Thread(target=call, daemon=True, name=f"patchkv-predict-{str(th.key[0])[:24]}")
        hook.start()
        hook.join(self.predict_timeout_s)
        if hook.is_alive():
            log.warning("prediction for thread %s timed out after %g s; abandoned", th.key, self.predict_timeout_s)
            return Prediction(reason=f"the prediction timed out after {self.predict_timeout_s:g} s")
        e = out.get("error")
        if e is None:
            return out.get("value")
        if isinstance(e, PreparationStopped):  # abandoned while its own model call ran: the expected end
            log.debug("prediction for thread %s stopped: %s", th.key, e)
            return Prediction(reason="the prediction was abandoned while its model call ran (a real call came)")
        log.warning("prediction for thread %s failed: %s: %s", th.key, type(e).__name__, e)
        first = str(e).splitlines()[0][:200] if str(e) else ""
        return Prediction(reason=f"the prediction raised {type(e).__name__}" + (f": {first}" if first else ""))

    def _compute_job(self, th: ThreadState, prep: Preparation) -> float | None:
        """The worker's part: compute the predicted ids' KV in chunks from the thread's resident version.

        Returns:
            The seconds predicting and computing took, or None when nothing was computed (the reason is
            on ``prep``).
        """
        with transition(th, "prepare: computing"):
            if not self._prep_current(th, prep):
                return self._finish(th, prep, "superseded before it was computed", locked=True)
            ids, base = prep.ids, th.resident
            prep.advance(PrepStage.COMPUTING)
        try:
            res = self.engine.prepare(base, ids, chunk_tokens=prep.chunk_tokens,
                                      should_stop=lambda: not self._prep_current(th, prep))
        except Exception as e:
            log.exception("preparing thread %s failed", th.key)
            return self._finish(th, prep, f"the preparation failed: {type(e).__name__}: {e}")
        with transition(th, "prepare: done"):
            prep.result = res
            prep.advance(PrepStage.DONE)
        self.events.append({"event": "prepared", "key": th.key, "version": prep.version, "tokens": len(ids),
                            "computed": res.stats.prepare.computed_rows, "stopped": res.stats.prepare.stopped,
                            "prepare_s": res.stats.ttft_s})
        self.residency.enforce_resident_budget(keep=th.key)
        return prep.predict_s + res.stats.ttft_s

    @staticmethod
    def _prep_current(th: ThreadState, prep: Preparation) -> bool:
        """Whether ``prep`` is still the preparation of ``th``'s current version (not stopped)."""
        return not prep.stop.is_set() and th.version == prep.version and th.preparation is prep

    @staticmethod
    def _finish(th: ThreadState, prep: Preparation, reason: str, locked: bool = False) -> None:
        """Mark ``prep`` done without a result, its first reason kept (``locked``: the caller holds
        ``th.lock``); returns None, the job's result."""
        with contextlib.nullcontext() if locked else transition(th, "prepare: ended"):
            prep.reason = prep.reason or reason
            prep.advance(PrepStage.DONE)

    def take(self, th: ThreadState, req: Any) -> TakenPreparation:
        """Detach ``th``'s preparation for the resume ``req`` (a validated request) and choose its base: a
        :class:`~patchkv_agent.runtime.state.TakenPreparation`, built once.

        A preparation still computing is stopped and waited for (the chunk that runs); one still queued or
        predicting is abandoned."""
        ids, strategy = req.ids, req.strategy
        with transition(th, "resume: take the preparation"):
            prep, th.preparation = th.preparation, None
            if prep is None:
                return TakenPreparation()
            prep.stop.set()
            version, stage, prev, resident = th.version, prep.stage, th.token_ids, th.resident
        if prep.version != version:
            return TakenPreparation()
        if stage is PrepStage.COMPUTING and prep.future is not None:
            try:
                prep.future.result()
            except Exception:  # the job records its own failure
                log.exception("preparation of thread %s failed", th.key)
        out: dict[str, Any] = {"prepared_info": prep.info or None, "prepared_predict_s": prep.predict_s}
        res = prep.result
        if res is not None:
            out["prepared_compute_s"] = res.stats.ttft_s
        if res is None:
            kind = PreparedOutcome.FAILED if stage is PrepStage.DONE and prep.reason else PreparedOutcome.UNFINISHED
            out.update(prepared=kind, prepared_reason=prep.reason or f"still {stage.value} when the call came")
            return TakenPreparation(report=RuntimePart(**out))
        done, reused, computed = len(res.context_ids), res.stats.prepare.reused_rows, res.stats.prepare.computed_rows
        sp = shared_prefix(res.context_ids, ids)
        sr = shared_prefix(prev, ids) if prev is not None else 0
        full = prep.ids is not None and done == len(prep.ids)
        out.update(prepared_tokens=computed, prepared_wasted=max(0, computed - max(0, min(sp, done) - reused)))

        def taken(base: ResumeResult | None, edit=None) -> TakenPreparation:
            return TakenPreparation(base=base, report=RuntimePart(**out), shared_resident=sr, edit=edit)

        if not strategy.uses_checkpoint:
            out.update(prepared=PreparedOutcome.MISS, prepared_reason=f"the call's strategy ({strategy.name}) "
                       "reads no base")
        elif sp == done and full:
            out.update(prepared=PreparedOutcome.HIT, prepared_reason=prep.reason)
            return taken(res)
        elif sp >= sr and sp > 0:
            why = (f"the call's context differs from the prediction at token {sp} of {len(prep.ids)}" if full
                   else f"stopped after {done} of {len(prep.ids)} tokens when the call came")
            # the prepared rows reach further, but the resident base may restore more of what follows: take the
            # base whose plan recomputes less (plans only, no forward; this runs on partial calls alone); the
            # chosen base's diff goes on with the request, so the resume does not diff again
            mine, mine_edit = self.engine.planned(res, req)
            theirs, their_edit = self.engine.planned(resident, req) if resident is not None else (mine + 1, None)
            if theirs < mine:
                out.update(prepared=PreparedOutcome.MISS,
                           prepared_reason=f"{why}; the resident base recomputes fewer rows ({theirs} vs {mine})")
                return taken(None, their_edit)
            out.update(prepared=PreparedOutcome.PARTIAL, prepared_reason=why)
            return taken(res, mine_edit)
        else:
            out.update(prepared=PreparedOutcome.MISS,
                       prepared_reason=f"the call's context differs from the prediction at token {sp} of "
                       f"{len(prep.ids)}; the resident context shares {sr}")
        return taken(None)

"""Model calls a prediction makes (a summary written during a tool wait) run behind every real call.

A predictor (:meth:`~patchkv_agent.runtime.threads.ThreadRegistry.prepare_async`) may call the model itself:
``SummarizationMiddleware`` writes its summary through the same :class:`PatchKVChatModel` while the tool
runs. Such a call is speculative: the real call it prepares may come before it ends, and then it must not
cost that call anything. So a call made on a predictor's thread (:func:`predicting` marks it) is computed
the way the preparation itself is: its context exactly, in chunks of rows (:func:`resume_in_background`,
the engine's ``prepare``), each chunk and each decode step holding the model's
:class:`~patchkv_agent.core.weights.ForwardLock` in background mode, behind every foreground forward; and
once its preparation is abandoned (a real call took it, a newer version superseded it, the registry closed)
its next chunk or decode step raises :class:`PreparationStopped` instead of running, so the predictor ends
without a response (nothing is stored for a real call to be served).

Boundary: a context variable and the engine's public ``prepare`` / ``resume_request`` / ``as_checkpoint``;
no registry tables, nothing about LangChain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from contextvars import ContextVar
from typing import Any, Iterator

from ..results import ResumeResult

__all__ = ["PreparationStopped", "predicting", "prediction_stop", "check_not_stopped", "resume_in_background"]

_STOP: ContextVar["threading.Event | None"] = ContextVar("patchkv_prediction_stop", default=None)


class PreparationStopped(RuntimeError):
    """A model call made by a prediction whose preparation was abandoned (it is not computed further)."""


@contextlib.contextmanager
def predicting(stop: threading.Event) -> Iterator[None]:
    """Inside the block, model calls through the registry are a prediction's: they run in background mode
    and stop once ``stop`` is set (see the module docstring).

    Args:
        stop: the preparation's stop event.
    """
    token = _STOP.set(stop)
    try:
        yield
    finally:
        _STOP.reset(token)


def prediction_stop() -> "threading.Event | None":
    """The stop event of the prediction this call belongs to, or None for a real call."""
    return _STOP.get()


def check_not_stopped(stop: "threading.Event | None") -> None:
    """Raise :class:`PreparationStopped` when ``stop`` is set.

    Raises:
        PreparationStopped: the preparation was abandoned.
    """
    if stop is not None and stop.is_set():
        raise PreparationStopped("the preparation this call belongs to was abandoned (a real call came, or a "
                                 "newer version superseded it): the call is not computed further")


def resume_in_background(engine: Any, resident: "ResumeResult | None", req: Any, stop: threading.Event,
                         chunk_tokens: int) -> ResumeResult:
    """A prediction's resume: ``req``'s context computed exactly in background chunks, then its last row
    (the logits the decode starts from) under the background lock.

    The rows the context shares with ``resident``'s exact rows are copied; every row after them is
    recomputed ``chunk_tokens`` at a time (the engine's ``prepare``), so a foreground forward waits for one
    chunk at most. The result is exact whatever strategy the call asked for.

    Args:
        engine: the :class:`~patchkv_agent.engine.PatchKVEngine`.
        resident: the thread's resident state (None: nothing to copy).
        req: the validated :class:`~patchkv_agent.core.inputs.ResumeRequest`.
        stop: the preparation's stop event (checked between chunks).
        chunk_tokens: rows per background forward.

    Returns:
        The :class:`~patchkv_agent.results.ResumeResult` (a decode cache, the last row's logits).

    Raises:
        PreparationStopped: ``stop`` was set before or while it computed.
    """
    check_not_stopped(stop)
    prep = engine.prepare(resident, req.ids, chunk_tokens=chunk_tokens, should_stop=stop.is_set)
    check_not_stopped(stop)  # a stopped preparation returns fewer rows: only when ``stop`` was set
    tail = dataclasses.replace(req, edit=None).as_exact_reuse()
    with engine.forward_lock.background():
        check_not_stopped(stop)
        # the prepared rows as the base of an exact prefix resume: it recomputes the last row only
        return engine.resume_request(engine.as_checkpoint(prep), tail)

"""Decoding a resumed thread version token by token: :class:`TokenStream` and :func:`run_stream`.

Boundary: draws tokens with the engine's model under its forward lock and, when it ends, hands the decoded
state to the commit handle it was given (the registry's :class:`~patchkv_agent.runtime.calls.CallPath` that
opened it passes one bound to the thread version; the stream never calls back into the registry); knows
nothing about stores or LangGraph.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..core.sampling import Sampler
from ..results import ResumeResult
from .background import PreparationStopped, check_not_stopped

if TYPE_CHECKING:
    from ..engine import PatchKVEngine

__all__ = ["TokenStream", "run_stream"]


class TokenStream:
    """Decode of one resumed thread version, one token per ``next()``.

    ``result`` is available at once (first-token logits, context, resume stats); ``result.output_ids``
    grows as tokens are drawn, each chosen by ``sampler`` (a :class:`~patchkv_agent.core.sampling.Sampler`:
    greedy by default; sampling parameters and a logits processor such as a grammar). The stream ends at
    ``max_new_tokens``, after an EOS token (included) or when the sampler's processor is done;
    :meth:`close` (or exhaustion) hands the decoded tokens' KV to ``commit`` (the registry's: it becomes
    the thread's resident state). Each decode step takes the engine's forward lock; the thread lock is not
    held between steps. Until it is closed (or exhausted) the stream pins its thread's resident KV against
    eviction, so close streams you stop reading: ``with registry.stream(...) as s:`` does.

    Args:
        engine: the engine whose model decodes.
        result: the resume's result (its ``cache`` holds the context's K/V).
        max_new_tokens: tokens to draw at most.
        sampler: how each token is chosen (None: greedy).
        commit: ``commit(result, cache)``, called once when the stream ends (None: nothing is kept).
        stop: the stop event of the prediction that opened the stream (None: a real call). A prediction's
            stream decodes each step in the forward lock's background mode, and raises
            :class:`~patchkv_agent.runtime.background.PreparationStopped` (after closing) at the first step
            once ``stop`` is set (:mod:`patchkv_agent.runtime.background`).
    """

    def __init__(self, engine: "PatchKVEngine", result: ResumeResult, max_new_tokens: int,
                 sampler: Sampler | None = None, commit: Callable[[ResumeResult, Any], None] | None = None,
                 stop: "threading.Event | None" = None):
        self._engine, self._commit, self._stop = engine, commit, stop
        self._sampler = sampler if sampler is not None else Sampler()
        self.result = result
        self.max_new_tokens = max_new_tokens
        self._cache = result.cache
        self._pos = len(result.context_ids)
        self._decode_s = 0.0
        self._done = False
        result.output_ids = []

    @property
    def stats(self) -> Any:
        """The resume stats (``result.stats``, a :class:`~patchkv_agent.results.ResumeStats`), with the
        decode's ``decode_s`` and ``output_tokens`` in its call part once the stream has ended."""
        return self.result.stats

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> int:
        out = self.result.output_ids
        eos = self._engine.eos_ids
        if self._done or len(out) >= self.max_new_tokens or (out and out[-1] in eos) or (out and self._sampler.done):
            self.close()
            raise StopIteration
        t0 = time.perf_counter()
        if not out:
            tok = self._sampler(self.result.logits)
        else:
            if self._stop is None:
                with self._engine.forward_lock:
                    logits = self._engine.runner.decode_step(self._cache, out[-1], self._pos)
            else:  # a prediction's call: each step behind every foreground forward, none once it is abandoned
                try:
                    with self._engine.forward_lock.background():
                        check_not_stopped(self._stop)
                        logits = self._engine.runner.decode_step(self._cache, out[-1], self._pos)
                except PreparationStopped:
                    self.close()
                    raise
            self._pos += 1
            tok = self._sampler(logits)
        self._decode_s += time.perf_counter() - t0
        out.append(tok)
        return tok

    def __enter__(self) -> "TokenStream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the stream early (or after exhaustion) and commit the thread's resident state."""
        if self._done:
            return
        self._done = True
        self.result.stats = self.result.stats.with_call(decode_s=self._decode_s,
                                                        output_tokens=len(self.result.output_ids))
        if self._commit is not None:
            self._commit(self.result, self._cache)


def run_stream(stream: TokenStream, on_token: Callable[[int], bool | None] | None = None) -> ResumeResult:
    """Drain a :class:`TokenStream`, calling ``on_token(tok)`` after each token; a truthy return stops it.

    Returns:
        The stream's result.
    """
    try:
        for tok in stream:
            if on_token is not None and on_token(tok):
                break
    finally:
        stream.close()
    return stream.result

"""Resume a thread from a stored checkpoint: selective recovery, or exact recomputation that says why.

:func:`resume_from_store` is the one place where store failures turn into fallbacks. Whatever goes wrong
between the store and the engine (the entry is missing or evicted, its bytes are damaged, it belongs to
another thread or model, the tier is unreachable) the caller gets the exact result of a full prefill with
``stats.fallback`` naming the reason; never stale or foreign KV, never an exception for a condition
the caller cannot fix. An entry whose declared K/V do not fit the engine's model (layers, KV heads, head_dim,
positions) although it carries the model's fingerprint is refused before its blobs are read and
quarantined like a damaged one. Misuse (a key of another deployment, an unknown strategy, bad token ids) raises
``ValueError``/``TypeError`` naming the fix.

Knows the engine's public ``resume`` and the store interface; nothing about tiers or LangGraph.
"""

from __future__ import annotations

import contextlib
import logging
import time

from ...resume import ResumeRequest
from ...core.checkpoint import CorruptCheckpoint
from ...core.fallback import FALLBACK_PREFIX, Fallback, FallbackKind
from .base import CheckpointMissing, KVStore, StoreUnavailable
from .codec import CheckpointKey, EntryLimits, ForeignCheckpoint

__all__ = ["load_for_resume", "resume_from_store", "FALLBACK_PREFIX"]

log = logging.getLogger(__name__)


def load_for_resume(engine, store: KVStore, key: CheckpointKey):
    """Fetch ``key`` for ``engine``, or say why it cannot be used.

    Returns:
        ``(checkpoint, None)`` or ``(None, reason)``; ``reason`` is a
        :class:`~patchkv_agent.core.fallback.Fallback` (its text starts with ``"exact recompute: "``).

    Raises:
        TypeError, ValueError: ``key`` is not a key of ``store``'s deployment.
    """
    store.check_key(key)
    current = engine.refresh_fingerprint()  # notices in-place weight changes
    if key.fingerprint != current and engine.weights_changed_since(key.fingerprint):
        return None, Fallback(FallbackKind.WEIGHTS_CHANGED, f"the model's weights changed since the checkpoint of "
                                                            f"{key.describe()} was written; not loaded")
    if key.fingerprint != current:
        return None, Fallback(FallbackKind.FOREIGN_MODEL,
                              f"the checkpoint of {key.describe()} was written by another model "
                              f"({key.fingerprint[:24]}...) than this engine's ({current[:24]}...); "
                              "not loaded")
    try:
        # the model's shape bounds what the entry may declare: one that does not fit is refused (and
        # quarantined: it claims this model's fingerprint, so it is damaged or hostile) before its blobs are read
        return store.get(key, limits=EntryLimits.of(engine.spec)), None
    except CheckpointMissing as e:
        return None, Fallback(FallbackKind.MISSING, e.reason)
    except ForeignCheckpoint as e:
        return None, Fallback(FallbackKind.FOREIGN, e)
    except CorruptCheckpoint as e:
        return None, Fallback(FallbackKind.CORRUPT_CHECKPOINT, e)
    except StoreUnavailable as e:
        return None, Fallback(FallbackKind.STORE_UNAVAILABLE, e)
    except Exception as e:  # noqa: BLE001 - last line of defence: a store fault never escapes a resume
        detail = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        log.warning("%s store failed reading %s: %s", store.tier, key.describe(), detail)
        return None, Fallback(FallbackKind.STORE_ERROR, detail)


def resume_from_store(engine, store: KVStore, key: CheckpointKey, new_token_ids, *, strategy="patchkv",
                      max_new_tokens: int = 16, forward_lock=None):
    """Resume the context ``new_token_ids`` from the checkpoint stored under ``key``.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine`.
        store: the tier holding the thread's checkpoint.
        key: the checkpoint's key (thread, version, fingerprint, ids hash), e.g. from ``store.key_for``.
        new_token_ids: ids of the new context version, or a :class:`~patchkv_agent.resume.ResumeRequest`
            already validated by ``engine.request`` (then ``strategy`` and ``max_new_tokens`` are its own).
        strategy: the strategy (a name or a :class:`~patchkv_agent.strategies.Strategy` built with its
            options) when the checkpoint is usable (``exact`` never reads the store).
        max_new_tokens: greedy tokens to decode.
        forward_lock: an extra lock held around the engine call (not the store read); None: none. The
            engine serialises its forward passes with its own ``forward_lock`` in any case.

    Returns:
        The engine's :class:`~patchkv_agent.engine.ResumeResult`; its ``stats`` get a runtime part with
        ``store_tier``, ``store_get_s``, ``store_key`` and ``requested_strategy``, and ``fallback`` is None or
        why the exact path was taken.

    Raises:
        ValueError: a key of another deployment, an unknown strategy, bad token ids or ``max_new_tokens``.
        TypeError: ``key`` is not a :class:`CheckpointKey`.
    """
    # misuse raises before any I/O: the engine validates and resolves the request once
    req = new_token_ids if isinstance(new_token_ids, ResumeRequest) else engine.request(
        new_token_ids, strategy, max_new_tokens)
    t0 = time.perf_counter()
    if not req.strategy.uses_checkpoint:  # nothing to read: the key is still checked
        store.check_key(key)
        ckpt, reason = None, None
    else:
        ckpt, reason = load_for_resume(engine, store, key)
    get_s = time.perf_counter() - t0
    with forward_lock if forward_lock is not None else contextlib.nullcontext():
        if ckpt is None:
            res = engine.resume_request(None, req.as_full_prefill())
            res.stats = res.stats.with_engine(fallback=reason)  # the reason this layer ran exactly
        else:
            res = engine.resume_request(ckpt, req)
    res.stats = res.stats.with_runtime(store_tier=store.tier, store_get_s=get_s, store_key=key.digest,
                                       requested_strategy=req.strategy.name)
    return res

"""What a thread reads back after a restart is bound to what it wrote.

Entries: after a restart the registry picks a store entry by thread, version, model and the handle's
``ids_hash``, so an entry of other tokens planted under the thread and version is never served (picked by the
first three alone it would be: |dlogit| ~2 against exact, no fallback); the resume is exact, with the reason.

Handles: checkpoint metadata of thread A naming thread B's KV handle cannot act on B (drop B's resident KV),
and a malformed handle raises nothing (no ValueError / KeyError / TypeError out of ``get_tuple``): a handle
acts only for its own thread and namespace; anything else is skipped with a warning.

Oracles: the exact resume of the same context (logits), and a registry that never saw the hostile data.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from langgraph.checkpoint.base import empty_checkpoint
from langgraph.checkpoint.memory import InMemorySaver

from patchkv_agent.langgraph import PatchKVCheckpointSaver
from patchkv_agent.runtime.kvstore import MemoryStore
from patchkv_agent.runtime.threads import ThreadRegistry, ids_hash, thread_key
from tiny_models import chat_engine

pytestmark = pytest.mark.usefixtures("one_torch_thread")
A, B = thread_key("a"), thread_key("b")


ENGINE = chat_engine  # the `engine` fixture (conftest.py)


def ctx(seed: int, n: int = 200) -> list[int]:
    return np.random.default_rng(seed).integers(5, 100, n).tolist()


def edited(ids: list[int], at: int = 60) -> list[int]:
    return ids[:at] + [7, 8, 9, 10, 11, 12] + ids[at + 4:]


def exact(engine, ids, n=3):
    return engine.resume(None, ids, strategy="exact", max_new_tokens=n)


def _written(engine, store, ids):
    """A registry writes ``ids`` as thread A's version 1 into ``store`` and ends (the process "restarts")."""
    reg = ThreadRegistry(engine, store=store)
    reg.generate(A, ids, max_new_tokens=3)  # the KV holds the context and two decoded tokens
    reg.offload(A, release=True)
    handle = reg.handle(A)
    reg.close()
    return handle


# ------------------------------------------------------------------ entries bound to their ids


def test_an_entry_of_other_tokens_under_the_threads_version_is_never_served_after_a_restart(engine):
    real, other = ctx(300), ctx(301)
    nxt = edited(real)
    want = exact(engine, nxt)

    honest = MemoryStore(deployment="t")  # the genuine restart: the entry is served (the control)
    h = _written(engine, honest, real)
    fresh = ThreadRegistry(engine, store=honest)
    fresh.expect(A, h)
    genuine = fresh.generate(A, nxt, max_new_tokens=3)
    assert genuine.stats["strategy"] == "patchkv" and genuine.stats["base"] == "restart"
    assert genuine.stats["fallback"] is None

    planted = engine.checkpoint(other)  # KV of other tokens, this model, under thread a / version 1
    for keep_genuine in (True, False):
        store = MemoryStore(deployment="t")
        handle = _written(engine, store, real)
        assert handle["ids_hash"] == ids_hash(real) and handle["version"] == 1
        (genuine_key,) = store.keys()
        assert genuine_key.ids_hash == handle["kv_ids_hash"] != handle["ids_hash"]
        if not keep_genuine:
            store.delete(genuine_key)
        store.put(store.key_for(planted, thread_id="a", version=1), planted)  # the most recently used entry
        fresh = ThreadRegistry(engine, store=store)
        fresh.expect(A, handle)
        r = fresh.generate(A, nxt, max_new_tokens=3)
        if keep_genuine:  # the entry of the handle's tokens is the one served
            assert r.stats["strategy"] == "patchkv" and r.stats["fallback"] is None
            assert r.output_ids == genuine.output_ids and torch.equal(r.logits, genuine.logits)
        else:  # only the planted one: exact, and the reason says why
            assert r.stats["strategy"] == "exact" and r.stats["base"] == "none"
            assert "other tokens" in r.stats["fallback"] and ids_hash(other) in r.stats["fallback"]
            assert r.output_ids == want.output_ids
            torch.testing.assert_close(r.logits, want.logits, atol=1e-4, rtol=1e-4)
        fresh.close()


def test_a_handle_without_a_usable_ids_hash_is_not_served_from_the_store(engine):
    store = MemoryStore(deployment="t")
    real = ctx(302)
    handle = _written(engine, store, real)
    for bad in (None, 5):  # not a hash at all: the handle is refused, naming the field
        fresh = ThreadRegistry(engine, store=store)
        with pytest.raises(ValueError, match=r"the KV handle has ids_hash=.* \(need a str\)"):
            fresh.expect(A, {**handle, "ids_hash": bad, "kv_ids_hash": bad})
        assert fresh.table.peek(A) is None or fresh.table.peek(A).version == 0  # nothing noted
        fresh.close()
    fresh = ThreadRegistry(engine, store=store)  # the hash of other tokens: the entry is never served
    fresh.expect(A, {**handle, "ids_hash": ids_hash(ctx(303)), "kv_ids_hash": ids_hash(ctx(303))})
    r = fresh.generate(A, edited(real), max_new_tokens=1)
    assert r.stats["strategy"] == "exact" and "other tokens" in r.stats["fallback"]
    fresh.close()


@pytest.mark.parametrize("handle,field", [
    ({"version": "7"}, "version='7'"), ({"version": 1.5}, "version=1.5"), ({"version": True}, "version=True"),
    ({"version": float("nan")}, "version=nan"), ({"version": 2 ** 80}, "outside"), ({"version": -1}, "outside"),
    ({"kv_ids_hash": ["a"]}, "kv_ids_hash=['a']"), ("a string", "is a str"), (None, "is a NoneType")])
def test_a_forged_handle_is_refused_before_it_changes_anything(engine, handle, field):
    store = MemoryStore(deployment="t")
    good = _written(engine, store, ctx(304))
    reg = ThreadRegistry(engine, store=store)
    forged = {**good, **handle} if isinstance(handle, dict) else handle
    with pytest.raises(ValueError, match="the KV handle") as e:
        reg.expect(A, forged)
    assert field in str(e.value) and "ThreadRegistry.handle()" in str(e.value)
    th = reg.table.peek(A)
    assert th is None or (th.version == 0 and th.store_key is None)
    reg.close()


# ------------------------------------------------------------------ handles act for their own thread


def _cfg(tid: str) -> dict:
    return {"configurable": {"thread_id": tid, "checkpoint_ns": ""}}


def _plant(saver: PatchKVCheckpointSaver, tid: str, entry) -> None:
    """A checkpoint of thread ``tid`` whose metadata holds ``entry`` (written to the inner saver directly,
    as a hostile or damaged database would hold it)."""
    saver.inner.put(_cfg(tid), empty_checkpoint(), {"source": "input", "step": 0, "patchkv": entry}, {})


def test_a_checkpoint_of_one_thread_cannot_touch_another_threads_kv(engine, caplog):
    cb = ctx(310)
    ref = ThreadRegistry(engine)  # never sees the hostile checkpoint
    ref.generate(B, cb, max_new_tokens=2)
    want = ref.generate(B, edited(cb), max_new_tokens=3)

    reg = ThreadRegistry(engine)
    saver = PatchKVCheckpointSaver(InMemorySaver(), reg)
    reg.generate(B, cb, max_new_tokens=2)
    hb = reg.handle(B)
    _plant(saver, "a", {"threads": [{**hb, "version": 9}, {**hb, "thread_id": "b", "version": 10}]})
    with caplog.at_level(logging.WARNING, logger="patchkv_agent.langgraph.checkpointer"):
        assert saver.get_tuple(_cfg("a")) is not None
    assert "names thread 'b', not its own" in caplog.text
    assert reg.handle(B) == hb  # B's resident KV and version are untouched
    got = reg.generate(B, edited(cb), max_new_tokens=3)
    assert got.stats["base"] == "resident" and got.stats["strategy"] == "patchkv" and got.stats["version"] == 2
    assert got.output_ids == want.output_ids and torch.equal(got.logits, want.logits)
    # its own handle still acts: a checkpoint of b naming b's later version (a restart's view of b)
    _plant(saver, "b", {"threads": [{**hb, "version": 7}]})
    saver.get_tuple(_cfg("b"))
    r = reg.generate(B, edited(cb, at=90), max_new_tokens=1)
    assert r.stats["version"] == 8 and r.stats["strategy"] == "exact" and "does not hold" in r.stats["fallback"]


GOOD = {"thread_id": "a", "checkpoint_ns": "", "version": 3, "ids_hash": "0" * 16, "tokens": 5, "kv": "resident"}
MALFORMED = [
    ("junk", "not {'threads'"),
    ({"threads": "abc"}, "found a str"),
    ({"threads": [5]}, "is a int, not a mapping"),
    ({"threads": [{"thread_id": "a"}]}, "checkpoint_ns=None"),  # was KeyError
    ({"threads": [{**GOOD, "version": "x"}]}, "version='x'"),  # was ValueError
    ({"threads": [{**GOOD, "version": [1]}]}, "version=[1]"),  # was TypeError
    ({"threads": [{**GOOD, "version": True}]}, "version=True"),
    ({"threads": [{**GOOD, "version": -1}]}, "outside [0, 2^62]"),
    ({"threads": [{**GOOD, "version": (1 << 62) + 1}]}, "outside [0, 2^62]"),
    ({"threads": [{**GOOD, "ids_hash": 5}]}, "ids_hash=5"),
    ({"threads": [{**GOOD, "thread_id": 7}]}, "thread_id=7"),
    ({"threads": [{**GOOD, "kv_ids_hash": 7}]}, "kv_ids_hash=7"),
    ({"threads": [{**GOOD, "checkpoint_ns": "sub"}]}, "names namespace 'sub'"),
]


@pytest.mark.parametrize("entry,warning", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_handles_are_skipped_with_a_warning(engine, caplog, entry, warning):
    reg = ThreadRegistry(engine)
    saver = PatchKVCheckpointSaver(InMemorySaver(), reg)
    _plant(saver, "a", entry)
    with caplog.at_level(logging.WARNING, logger="patchkv_agent.langgraph.checkpointer"):
        tup = saver.get_tuple(_cfg("a"))
    assert tup is not None and tup.metadata["patchkv"] == entry
    assert warning in caplog.text and "thread 'a'" in caplog.text and "skipped" in caplog.text
    assert reg.keys() == []  # nothing reached the registry


def test_the_warning_is_given_once_per_thread_and_reason(engine, caplog):
    saver = PatchKVCheckpointSaver(InMemorySaver(), ThreadRegistry(engine))
    _plant(saver, "a", {"threads": [5]})
    with caplog.at_level(logging.WARNING, logger="patchkv_agent.langgraph.checkpointer"):
        for _ in range(3):
            saver.get_tuple(_cfg("a"))
    assert caplog.text.count("not a mapping") == 1

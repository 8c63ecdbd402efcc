"""The thread lifecycle (runtime/lifecycle.py): registries driven through random operations keep every record
consistent, every settled move of a part is one of MOVES, and the phase is the view of the parts."""

from __future__ import annotations

import numpy as np
import pytest

from patchkv_agent.runtime.kvstore import MemoryStore
from patchkv_agent.runtime.lifecycle import MOVES, Job, Location, Phase, Prep, invariant_violations, view_of
from patchkv_agent.runtime.state import Prediction
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key

pytestmark = pytest.mark.usefixtures("one_torch_thread")
KEYS = (thread_key("a"), thread_key("b"))


def _records(reg):
    return [reg.table.peek(k) for k in reg.keys() if reg.table.peek(k) is not None]


def _check_all(reg, when: str) -> None:
    for th in _records(reg):
        with th.lock:
            bad = invariant_violations(th)
        assert not bad, f"{th.key} after {when}: {bad}"


def _settled(reg):
    """The view of every record once its background work is over."""
    for _ in range(20):  # a finished job may start another (an eviction offloads the other thread): until none runs
        running = []
        for k in reg.keys():  # every context's record (wait() and wait_prepared() act on a key's active one)
            th = reg.table.peek(k)
            with th.lock:
                jobs = [th.pending, th.preparation.future if th.preparation is not None else None]
            running += [f for f in jobs if f is not None and not f.done()]
        if not running:
            break
        for fut in running:
            fut.exception(timeout=120)  # over, whichever way it ended
    out = {}
    for k in reg.keys():
        th = reg.table.peek(k)
        with th.lock:
            out[k] = view_of(th)
    return out


def _next_version(rng, ids: np.ndarray, vocab: int) -> np.ndarray:
    kind = rng.integers(0, 3)
    if kind == 0:  # a tool result appended
        return np.concatenate([ids, rng.integers(0, vocab, 20)])
    at = int(rng.integers(10, max(11, len(ids) - 10)))
    if kind == 1:  # a span replaced (an edit anywhere, near the head included)
        return np.concatenate([ids[:at], rng.integers(0, vocab, 12), ids[at + 8:]])
    return np.concatenate([ids[:at], ids[at + 30:], rng.integers(0, vocab, 10)])  # a span cleared


@pytest.mark.parametrize("seed,kw", [
    (0, {}),
    (1, {"store": "memory", "resident_budget_bytes": 30_000}),  # about one thread's KV: resumes evict the other
    (2, {"resident_budget_bytes": 30_000, "offload_budget_bytes": 20_000}),  # evicted checkpoints dropped: lost
    (3, {"resident_budget_bytes": 30_000, "on_evict": "drop"}),
])
def test_random_operations_keep_records_consistent_and_moves_legal(engine, seed, kw):
    rng = np.random.default_rng(seed)
    kw = dict(kw, store=MemoryStore()) if kw.get("store") else kw
    reg = ThreadRegistry(engine, **kw)
    vocab = engine.spec.vocab_size
    ids = {k: rng.integers(0, vocab, 160) for k in KEYS}
    seen_moves = set()
    try:
        before = _settled(reg)
        for step in range(36):
            k = KEYS[int(rng.integers(0, 2))]
            op = ["resume", "resume", "offload", "release", "prepare", "stream", "forget"][int(rng.integers(0, 7))]
            if op == "resume":
                if reg.table.peek(reg.active(k)) is not None and reg.table.peek(reg.active(k)).token_ids is not None:
                    ids[k] = _next_version(rng, ids[k], vocab)
                reg.generate(k, ids[k], max_new_tokens=2)
            elif op == "offload":
                reg.offload_async(k)
            elif op == "release":
                reg.offload(k, release=True)
            elif op == "prepare":
                predicted = _next_version(rng, ids[k], vocab)
                reg.prepare_async(k, lambda p=predicted: Prediction(p))
            elif op == "stream":
                with reg.stream(k, ids[k], max_new_tokens=2) as s:
                    next(s)
                    assert reg.phase(k) is Phase.STREAMING
                    _check_all(reg, f"step {step}: an open stream")
            else:
                reg.forget(k[0])
                ids[k] = rng.integers(0, vocab, 160)
            _check_all(reg, f"step {step}: {op}")  # background work may still run: the records hold anyway
            after = _settled(reg)
            _check_all(reg, f"step {step}: {op}, settled")
            for key, view in after.items():
                assert view.job is Job.IDLE and view.streams == 0
                assert view.phase is Phase(view.preparation.value if view.preparation is not Prep.NONE
                                           else view.location.value)
                old = before.get(key)
                loc0 = old.location if old is not None else Location.NONE
                if loc0 is not view.location:
                    assert (loc0, view.location) in MOVES[Location], f"step {step} {op} {key}: {loc0} -> {view.location}"
                    seen_moves.add((loc0, view.location))
            for k2 in KEYS:  # the registry's phase is the view of the key's active context
                if reg.active(k2) in after:
                    assert reg.phase(k2) is after[reg.active(k2)].phase
            before = after
    finally:
        reg.close()
    assert (Location.NONE, Location.RESIDENT) in seen_moves and len(seen_moves) >= 3  # the walk went somewhere


def test_the_checks_can_fail(engine):
    reg = ThreadRegistry(engine)
    try:
        k = KEYS[0]
        ids = np.random.default_rng(5).integers(0, engine.spec.vocab_size, 120)
        reg.generate(k, ids, max_new_tokens=2)
        th = reg.table.peek(reg.active(k))
        with th.lock:
            assert invariant_violations(th) == [] and view_of(th).location is Location.RESIDENT
            th.token_ids = ids[::-1].copy()  # a record whose resident KV is of other ids
            assert any("not of the current version" in v for v in invariant_violations(th))
            th.token_ids = ids
            th.streams = -1
            assert any("open streams" in v for v in invariant_violations(th))
            th.streams = 0
        assert (Location.LOST, Location.OFFLOADED) not in MOVES[Location]  # a lost version is never found again
        assert (Job.OFFLOADING, Job.HEALING) not in MOVES[Job]  # a job heals before it writes, never after
    finally:
        reg.close()


def test_an_illegal_move_raises_and_leaves_the_record_as_it_was(engine):
    from patchkv_agent.core.fallback import Fallback, FallbackKind
    from patchkv_agent.runtime.lifecycle import IllegalTransition, transition
    from patchkv_agent.runtime.state import Preparation

    reg = ThreadRegistry(engine)
    try:
        k = KEYS[0]
        reg.generate(k, np.random.default_rng(6).integers(0, engine.spec.vocab_size, 90), max_new_tokens=2)
        th = reg.table.peek(reg.active(k))
        res = th.resident
        with transition(th, "evict without an offload"):  # resident -> lost: a move of the lifecycle
            th.resident, th.lost = None, Fallback(FallbackKind.EVICTED, "test")
        with pytest.raises(IllegalTransition, match=r"forged find .*location: lost -> offloaded"):
            with transition(th, "forged find"):
                th.checkpoint, th.checkpoint_version, th.lost = object(), th.version, None
        assert th.checkpoint is None and th.lost is not None and view_of(th).location is Location.LOST
        with pytest.raises(IllegalTransition, match=r"preparation: none -> prepared"):
            with transition(th, "prepared from nowhere"):  # a preparation is computed before it is ready
                th.preparation = Preparation(version=th.version, predict=None, chunk_tokens=8, stage="done",
                                             ids=np.asarray(res.context_ids), result=res)
        assert th.preparation is None and not th.lock.locked()
    finally:
        reg.close()


def test_every_registry_step_goes_through_the_check(engine, monkeypatch):
    from patchkv_agent.runtime import lifecycle
    from patchkv_agent.runtime.lifecycle import IllegalTransition

    reg = ThreadRegistry(engine)
    try:
        k = KEYS[1]
        ids = np.random.default_rng(7).integers(0, engine.spec.vocab_size, 90)
        monkeypatch.setitem(lifecycle.MOVES, Location, MOVES[Location] - {(Location.NONE, Location.RESIDENT)})
        with pytest.raises(IllegalTransition, match=r"resume on thread .*location: none -> resident"):
            reg.generate(k, ids, max_new_tokens=2)
        th = reg.table.peek(reg.active(k))
        assert th.version == 0 and th.token_ids is None and th.resident is None and th.streams == 0
        monkeypatch.undo()
        assert reg.generate(k, ids, max_new_tokens=2).stats.base == "none"  # the same call, once the move is legal
        monkeypatch.setitem(lifecycle.MOVES, Location, MOVES[Location] - {(Location.RESIDENT, Location.OFFLOADED)})
        with pytest.raises(IllegalTransition, match=r"offload: install"):
            reg.offload(k, release=True)
        assert view_of(th).location is Location.RESIDENT and th.checkpoint is None
    finally:
        reg.close()


def test_a_preparation_moves_through_its_stages_in_order_only():
    from patchkv_agent.runtime.state import Preparation, PrepStage

    prep = Preparation(version=1, predict=None, chunk_tokens=8)
    assert prep.stage is PrepStage.STARTING
    for stage in (PrepStage.PREDICTING, PrepStage.QUEUED, PrepStage.COMPUTING, PrepStage.DONE):
        prep.advance(stage)
    assert prep.stage is PrepStage.DONE
    with pytest.raises(ValueError, match="not done -> computing"):
        prep.advance(PrepStage.COMPUTING)
    early = Preparation(version=1, predict=None, chunk_tokens=8, stage="predicting")  # a stage by its name
    with pytest.raises(ValueError, match="not predicting -> computing"):  # never computed without being queued
        early.advance(PrepStage.COMPUTING)
    early.advance(PrepStage.DONE)  # any stage may end (superseded, no prediction, failed)

"""LangGraph's own checkpointer conformance suite (``langgraph-checkpoint-conformance``) over
:class:`PatchKVCheckpointSaver` wrapping InMemorySaver, AsyncSqliteSaver and an in-memory saver with
``copy_thread``; the wrapper must detect, and pass, exactly the capabilities of the saver it wraps.

``python tests/test_checkpoint_conformance.py`` prints the table of the README (pass / fail / skip per
capability, inner saver alone and wrapped).
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import pytest
from langgraph.checkpoint.base import BaseCheckpointSaver
from langgraph.checkpoint.conformance import checkpointer_test, validate
from langgraph.checkpoint.conformance.capabilities import Capability, DetectedCapabilities
from langgraph.checkpoint.memory import InMemorySaver

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import chat_engine  # noqa: E402

from patchkv_agent.langgraph import PatchKVCheckpointSaver  # noqa: E402
from patchkv_agent.langgraph.checkpointer import DELEGATED, overridden  # noqa: E402
from patchkv_agent.runtime.threads import ThreadRegistry, thread_key  # noqa: E402


class CopyingMemorySaver(InMemorySaver):
    """InMemorySaver plus ``copy_thread`` / ``acopy_thread`` (an extended capability InMemorySaver lacks)."""

    def copy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        src, dst = str(source_thread_id), str(target_thread_id)
        if src in self.storage:
            self.storage[dst] = copy.deepcopy(self.storage[src])
        for (tid, ns, cid), w in list(self.writes.items()):
            if tid == src:
                self.writes[(dst, ns, cid)] = copy.deepcopy(w)
        for (tid, ns, ch, ver), b in list(self.blobs.items()):
            if tid == src:
                self.blobs[(dst, ns, ch, ver)] = b

    async def acopy_thread(self, source_thread_id: str, target_thread_id: str) -> None:
        self.copy_thread(source_thread_id, target_thread_id)


_REGISTRY: list[ThreadRegistry] = []


def registry() -> ThreadRegistry:
    if not _REGISTRY:
        _REGISTRY.append(ThreadRegistry(chat_engine()))
    return _REGISTRY[0]


def factories(tmp: Path) -> dict[str, object]:
    """Registered conformance factories: each inner saver alone and wrapped."""
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    def memory():
        return InMemorySaver()

    def copying():
        return CopyingMemorySaver()

    out = {}
    n = [0]

    for name, make in (("InMemorySaver", memory), ("CopyingMemorySaver", copying)):
        for wrapped in (False, True):
            label = f"PatchKV({name})" if wrapped else name

            async def gen(make=make, wrapped=wrapped):
                inner = make()
                yield PatchKVCheckpointSaver(inner, registry()) if wrapped else inner

            out[label] = checkpointer_test(name=label)(gen)

    for wrapped in (False, True):
        label = "PatchKV(AsyncSqliteSaver)" if wrapped else "AsyncSqliteSaver"

        async def agen(wrapped=wrapped):
            n[0] += 1
            async with AsyncSqliteSaver.from_conn_string(str(tmp / f"c{n[0]}.sqlite")) as inner:
                yield PatchKVCheckpointSaver(inner, registry()) if wrapped else inner

        out[label] = checkpointer_test(name=label)(agen)
    return out


def run_all(tmp: Path) -> dict[str, dict]:
    return {label: asyncio.run(validate(reg)).to_dict() for label, reg in factories(tmp).items()}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    return run_all(tmp_path_factory.mktemp("conformance"))


@pytest.mark.parametrize("inner", ["InMemorySaver", "AsyncSqliteSaver", "CopyingMemorySaver"])
def test_wrapper_passes_exactly_the_capabilities_of_its_inner_saver(reports, inner):
    alone, wrapped = reports[inner]["results"], reports[f"PatchKV({inner})"]["results"]
    assert {c: r["detected"] for c, r in wrapped.items()} == {c: r["detected"] for c, r in alone.items()}
    for cap, r in wrapped.items():
        assert r["tests_failed"] == 0, (inner, cap, r["failures"])
        assert r["tests_passed"] == alone[cap]["tests_passed"]
        if r["detected"]:
            assert r["passed"] is True and r["tests_passed"] > 0
    base = {c.value for c in (Capability.PUT, Capability.PUT_WRITES, Capability.GET_TUPLE, Capability.LIST,
                              Capability.DELETE_THREAD)}
    assert all(wrapped[c]["detected"] for c in base)
    assert wrapped["copy_thread"]["detected"] is (inner == "CopyingMemorySaver")


def test_wrapper_classes_mirror_overrides():
    from langgraph.checkpoint.sqlite import SqliteSaver

    for inner in (InMemorySaver(), CopyingMemorySaver(), SqliteSaver.__new__(SqliteSaver)):
        if isinstance(inner, SqliteSaver):
            inner.serde = InMemorySaver().serde
        w = PatchKVCheckpointSaver(inner, registry())
        assert isinstance(w, PatchKVCheckpointSaver) and isinstance(w, BaseCheckpointSaver)
        for name in DELEGATED:
            assert overridden(type(w), name) == overridden(type(inner), name), (type(inner).__name__, name)
        assert DetectedCapabilities.from_instance(w) == DetectedCapabilities.from_instance(inner)
    # SqliteSaver (sync) has no async put_writes: neither has its wrapper
    assert not overridden(type(PatchKVCheckpointSaver(inner, registry())), "aput_writes")
    assert type(PatchKVCheckpointSaver(InMemorySaver(), registry())) is type(PatchKVCheckpointSaver(InMemorySaver(), registry()))
    with pytest.raises(TypeError, match="BaseCheckpointSaver"):
        PatchKVCheckpointSaver(object(), registry())


def test_copy_thread_through_the_wrapper_forks_the_kv():
    reg = ThreadRegistry(chat_engine())
    saver = PatchKVCheckpointSaver(CopyingMemorySaver(), reg)
    ids = reg.engine.encode("hello there, this is a thread")
    reg.generate(thread_key("src"), ids, max_new_tokens=1)
    asyncio.run(saver.acopy_thread("src", "dst"))
    res = reg.generate(thread_key("dst"), ids + reg.engine.encode(" more"), max_new_tokens=1)
    assert res.stats["base_version"] == 1 and res.stats["strategy"] == "patchkv" and res.stats["fallback"] is None


def table(reports: dict[str, dict]) -> str:
    """Markdown: one row per saver, one column per capability (pass / fail / skip counts)."""
    caps = [c.value for c in Capability]
    rows = ["| saver | " + " | ".join(caps) + " |", "|---|" + "---:|" * len(caps)]
    for label, rep in reports.items():
        cells = []
        for c in caps:
            r = rep["results"][c]
            cells.append(f"{r['tests_passed']}/{r['tests_failed']}/0" if r["detected"] else "skip (not implemented)")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        print("pass/fail/skip per capability (langgraph-checkpoint-conformance 0.0.2)\n")
        print(table(run_all(Path(d))))

"""Checkpointer databases read from outside the process (``replay --from-checkpointer``), through the
allowlist deserializer of ``patchkv_agent/langgraph/serde.py``.

- code: a database crafted to run code never runs it (a marker file is never written), other hostile
  files give one line and a non-zero exit; the serializer reads what LangGraph writes;
- decoding costs: a database of empty msgpack maps is not decoded at 74x amplification: every blob's values
  are counted (and containers' declared lengths checked) before it is decoded.
"""

from __future__ import annotations

import json
import pickle
import sqlite3
import subprocess
import sys
from pathlib import Path

import ormsgpack
import pytest

from patchkv_agent import cli
from patchkv_agent.eval.replay import traces_from_checkpointer
from patchkv_agent.langgraph.serde import AllowlistSerializer, UntrustedCheckpointError

# --------------------------------------------------------------------------- checkpointer databases


def _graph_db(path: Path, threads=("t1",)) -> Path:
    """A real SqliteSaver database: a MessagesState graph run twice per thread."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.checkpoint.sqlite import SqliteSaver
    from langgraph.graph import END, START, MessagesState, StateGraph

    conn = sqlite3.connect(path, check_same_thread=False)
    try:
        g = StateGraph(MessagesState)
        g.add_node("model", lambda s: {"messages": [AIMessage(content=f"answer {len(s['messages'])}")]})
        g.add_edge(START, "model")
        g.add_edge("model", END)
        app = g.compile(checkpointer=SqliteSaver(conn))
        for tid in threads:
            cfg = {"configurable": {"thread_id": tid}}
            app.invoke({"messages": [HumanMessage(content="hello")]}, cfg)
            app.invoke({"messages": [HumanMessage(content="again")]}, cfg)
    finally:
        conn.close()
    return path


@pytest.fixture(scope="module")
def good_db(tmp_path_factory) -> Path:
    return _graph_db(tmp_path_factory.mktemp("db") / "good.sqlite")


def _with_last_blob(src: Path, dst: Path, blob: bytes, type_: str = "msgpack") -> Path:
    dst.write_bytes(src.read_bytes())
    conn = sqlite3.connect(dst)
    conn.execute("UPDATE checkpoints SET checkpoint = ?, type = ? WHERE checkpoint_id = "
                 "(SELECT max(checkpoint_id) FROM checkpoints)", (blob, type_))
    conn.commit()
    conn.close()
    return dst


def _checkpoint(messages) -> bytes:
    return ormsgpack.packb({"v": 4, "id": "x", "ts": "", "channel_values": {"messages": messages},
                            "channel_versions": {}, "versions_seen": {}})


class _Evil:
    """Unpickling it writes the marker file."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('pwned')",))


def _hostile_blobs(marker: Path) -> dict[str, tuple[str, bytes]]:
    """Checkpoint blobs crafted to run code (each would write ``marker`` under LangGraph's default serde)."""
    code = f"open({str(marker)!r}, 'w').write('pwned')"
    pos = ormsgpack.Ext(1, ormsgpack.packb(["builtins", "exec", [code]]))
    single = ormsgpack.Ext(0, ormsgpack.packb(["builtins", "exec", code]))
    method = ormsgpack.Ext(3, ormsgpack.packb(["builtins", "str", code, "__class__"]))
    pyd = ormsgpack.Ext(5, ormsgpack.packb(["subprocess", "Popen", {"args": ["touch", str(marker)]},
                                            "model_validate_json"]))
    kw = ormsgpack.Ext(2, ormsgpack.packb(["subprocess", "run", {"args": ["touch", str(marker)]}]))
    nested = ormsgpack.Ext(5, ormsgpack.packb(["langchain_core.messages.human", "HumanMessage",
                                               {"content": "hi", "additional_kwargs": {"x": pos}}, "m"]))
    lc_json = json.dumps({"v": 1, "channel_values": {"messages": [
        {"lc": 2, "type": "constructor", "id": ["subprocess", "Popen"], "kwargs": {"args": ["touch", str(marker)]}}]}})
    return {
        "constructor, positional args": ("msgpack", _checkpoint([pos])),
        "constructor, single arg": ("msgpack", _checkpoint([single])),
        "method call": ("msgpack", _checkpoint([method])),
        "pydantic class": ("msgpack", _checkpoint([pyd])),
        "keyword constructor": ("msgpack", _checkpoint([kw])),
        "inside a message's fields": ("msgpack", _checkpoint([nested])),
        "json lc:2 constructor": ("json", lc_json.encode()),
        "pickle": ("pickle", pickle.dumps({"channel_values": {"messages": [_Evil(str(marker))]}})),
    }


def test_a_real_database_reads_through_the_allowlist(good_db):
    traces = traces_from_checkpointer(f"sqlite:{good_db}")
    assert [t["id"] for t in traces] == ["t1"]
    assert [v["messages"] for v in traces[0]["versions"]] == [
        [{"role": "user", "content": "hello"}],
        [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "answer 1"},
         {"role": "user", "content": "again"}]]


@pytest.mark.parametrize("case", list(_hostile_blobs(Path("m"))))
def test_a_database_crafted_to_run_code_never_runs_it(good_db, tmp_path, case, monkeypatch):
    marker = tmp_path / "MARKER"
    type_, blob = _hostile_blobs(marker)[case]
    db = _with_last_blob(good_db, tmp_path / "evil.sqlite", blob, type_)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"refused|not in the allowlist") as e:
        traces_from_checkpointer(f"sqlite:{db}")
    assert "\n" not in str(e.value) and "evil.sqlite" in str(e.value)
    loads = []
    monkeypatch.setattr(cli, "_engine", lambda args: loads.append(args) or None)
    with pytest.raises(SystemExit) as ex:
        cli.main(["replay", "--from-checkpointer", f"sqlite:{db}", "--out", str(tmp_path / "r.jsonl")])
    assert ex.value.code not in (0, None) and "\n" not in str(ex.value) and "refused" in str(ex.value)
    assert not marker.exists() and loads == []


@pytest.mark.parametrize("what,make", [
    ("garbage blob", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", b"\xc1\xff\x00garbage")),
    ("truncated blob", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", _checkpoint([])[:-7])),
    ("deep nesting", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", b"\x91" * 100_000 + b"\xc0")),
    ("deep JSON", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", b"[" * 100_000, "json")),
    ("unknown type", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", b"x", "yaml")),
    ("numpy array", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", _checkpoint(
        [ormsgpack.Ext(6, ormsgpack.packb(["|O", [1], "C", b"\x00" * 8]))]))),
    ("bad message fields", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", _checkpoint(
        [ormsgpack.Ext(5, ormsgpack.packb(["langchain_core.messages.ai", "AIMessage", {"content": 3}, "m"]))]))),
    ("lc secret", lambda db, tmp: _with_last_blob(db, tmp / "x.sqlite", json.dumps(
        {"channel_values": {"messages": [{"lc": 1, "type": "secret", "id": ["HOME"]}]}}).encode(), "json")),
    ("not a sqlite file", lambda db, tmp: _file(tmp / "x.sqlite", b"SQLite? no.\n" * 100)),
    ("empty file", lambda db, tmp: _file(tmp / "x.sqlite", b"")),
    ("no checkpoints table", lambda db, tmp: _other_db(tmp / "x.sqlite")),
    ("checkpoints is a view", lambda db, tmp: _view_db(tmp / "x.sqlite")),
])
def test_hostile_databases_give_one_line_and_a_nonzero_exit(good_db, tmp_path, what, make, monkeypatch):
    db = make(good_db, tmp_path)
    loads = []
    monkeypatch.setattr(cli, "_engine", lambda args: loads.append(args) or None)
    with pytest.raises(SystemExit) as ex:
        cli.main(["replay", "--from-checkpointer", f"sqlite:{db}", "--out", str(tmp_path / "r.jsonl")])
    msg = str(ex.value)
    assert ex.value.code not in (0, None) and "\n" not in msg and "x.sqlite" in msg, msg
    assert loads == []


def _file(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _other_db(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (a)")
    conn.commit()
    conn.close()
    return path


def _view_db(path: Path) -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE VIEW checkpoints AS SELECT 1 AS thread_id, '' AS checkpoint_ns, '1' AS checkpoint_id, "
                 "'msgpack' AS type, x'90' AS checkpoint")
    conn.commit()
    conn.close()
    return path


def test_the_cli_prints_one_line_for_a_hostile_database(good_db, tmp_path):
    marker = tmp_path / "MARKER"
    type_, blob = _hostile_blobs(marker)["constructor, positional args"]
    db = _with_last_blob(good_db, tmp_path / "evil.sqlite", blob, type_)
    proc = subprocess.run([sys.executable, "-m", "patchkv_agent.cli", "replay", "--from-checkpointer", f"sqlite:{db}",
                           "--out", str(tmp_path / "r.jsonl")], capture_output=True, text=True, cwd=tmp_path,
                          timeout=120)
    assert proc.returncode != 0 and not marker.exists()
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "refused to build builtins.exec" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_serializer_reads_what_langgraph_writes_and_round_trips_plain_values():
    import datetime as dt
    import uuid
    from collections import deque
    from decimal import Decimal

    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    s = AllowlistSerializer()
    value = {"messages": [HumanMessage(content="hi", id="1"),
                          AIMessage(content="", tool_calls=[{"name": "f", "args": {"a": 1}, "id": "c1"}]),
                          ToolMessage(content="r", tool_call_id="c1")],
             "when": dt.datetime(2024, 5, 1, 12, 0, tzinfo=dt.timezone.utc), "day": dt.date(2024, 5, 1),
             "span": dt.timedelta(seconds=3), "id": uuid.UUID(int=7), "d": Decimal("1.5"), "s": {1, 2},
             "q": deque([1]), "t": dt.time(1, 2, 3)}
    back = s.loads_typed(s.dumps_typed(value))
    assert back == value
    assert back["messages"][1].tool_calls[0]["args"] == {"a": 1}
    with pytest.raises(UntrustedCheckpointError, match="over the limit"):
        AllowlistSerializer(max_blob_bytes=10).loads_typed(("msgpack", b"\x90" * 11))


# --------------------------------------------------------------------------- decoding costs


def _db(path: Path, blob: bytes, type_: str = "msgpack") -> Path:
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE checkpoints (thread_id TEXT, checkpoint_ns TEXT, checkpoint_id TEXT, "
                 "parent_checkpoint_id TEXT, type TEXT, checkpoint BLOB, metadata BLOB)")
    for i in range(3):
        conn.execute("INSERT INTO checkpoints VALUES ('t', '', ?, NULL, ?, ?, NULL)", (f"c{i}", type_, blob))
    conn.commit()
    conn.close()
    return path


EMPTY_MAPS = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000  # 2 MB of empty maps: ~150 MB decoded
HOSTILE_BLOBS = {
    "empty maps": ("msgpack", EMPTY_MAPS),
    "empty maps inside an extension": ("msgpack", ormsgpack.packb(
        {"v": 4, "channel_values": {"x": ormsgpack.Ext(7, EMPTY_MAPS)}})),
    "a length beyond the blob": ("msgpack", b"\xdf\xff\xff\xff\xff" + b"\xc0" * 16),
    "JSON empty objects": ("json", b"[" + b"{}," * 1_500_000 + b"{}]"),
}


@pytest.mark.parametrize("case", list(HOSTILE_BLOBS))
def test_a_blob_that_would_decode_far_beyond_its_size_is_refused_before_decoding(tmp_path, case, monkeypatch):
    from patchkv_agent import cli
    from patchkv_agent.eval.replay import traces_from_checkpointer

    type_, blob = HOSTILE_BLOBS[case]
    db = _db(tmp_path / "amp.sqlite", blob, type_)

    def never(*a, **k):
        raise AssertionError("the blob was decoded")

    monkeypatch.setattr(ormsgpack, "unpackb", never)
    monkeypatch.setattr(json, "loads", never)
    with pytest.raises(ValueError, match=r"more than \d+ values|more than the \d+ bytes left") as e:
        traces_from_checkpointer(f"sqlite:{db}")
    assert "\n" not in str(e.value) and "amp.sqlite" in str(e.value)
    loads = []
    monkeypatch.setattr(cli, "_engine", lambda args: loads.append(args))
    with pytest.raises(SystemExit) as ex:
        cli.main(["replay", "--from-checkpointer", f"sqlite:{db}", "--out", str(tmp_path / "r.jsonl")])
    assert ex.value.code == 2 and "\n" not in str(ex.value) and loads == []


def test_the_census_accepts_what_langgraph_writes():
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langgraph.checkpoint.serde.jsonplus import JsonPlusSerializer

    from patchkv_agent.langgraph.serde import AllowlistSerializer, msgpack_census

    msgs = []
    for i in range(300):
        msgs += [HumanMessage(f"question {i} " * 20), AIMessage("", tool_calls=[
            {"name": "search", "args": {"q": f"x{i}", "k": [1, 2.5, None]}, "id": f"c{i}"}]),
            ToolMessage("result " * 50, tool_call_id=f"c{i}")]
    type_, blob = JsonPlusSerializer().dumps_typed({"v": 4, "channel_values": {"messages": msgs}})
    assert 0 < msgpack_census(blob) < 100_000
    got = AllowlistSerializer().loads_typed((type_, blob))
    assert got["channel_values"]["messages"] == msgs
    with pytest.raises(ValueError, match="more than 1000 values"):
        AllowlistSerializer(max_objects=1000).loads_typed((type_, blob))

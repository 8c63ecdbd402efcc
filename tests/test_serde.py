"""The trust boundary of files read from outside the process (issue 22).

- checkpointer databases (``replay --from-checkpointer``): read through the allowlist deserializer; a
  database crafted to run code never runs it (a marker file is never written), other hostile files give
  one line and a non-zero exit;
- the dequantized-weights cache (``core.models``): hashed when written, verified on load, rebuilt with
  a log line when tampered with, replaced, truncated or unreadable.
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


# --------------------------------------------------------------------------- the dequantized-weights cache


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A ``.gguf`` path whose "dequantization" saves a tiny llama + char tokenizer (no real model);
    the list records each build."""
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from patchkv_agent.eval.tiny import tiny_chat_tokenizer, tiny_model

    from patchkv_agent import loading as models

    monkeypatch.setenv("PATCHKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF not really, but hashed like one")
    builds = []

    def build(src, out, attn):
        builds.append(src)
        tiny_model("llama", seed=0).save_pretrained(out, safe_serialization=True)
        tiny_chat_tokenizer().save_pretrained(out)

    monkeypatch.setattr(models, "_build_dequantized", build)
    models._VERIFIED.clear()
    torch.manual_seed(0)
    return gguf, builds


def _weights(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _cache_dir(gguf: Path) -> Path:
    from patchkv_agent.loading import gguf_cache_path

    return gguf_cache_path(gguf)


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x5A
    path.write_bytes(bytes(data))


def _other_model(path: Path) -> None:
    from safetensors.torch import save_file
    from patchkv_agent.eval.tiny import tiny_model

    save_file({k: v.contiguous() for k, v in tiny_model("llama", seed=1).state_dict().items()
               if k != "lm_head.weight"}, str(path), metadata={"format": "pt"})


def _unreadable(path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("tamper,reason", [
    (lambda d: _flip(d / "model.safetensors", -100), "does not match its recorded sha256"),
    (lambda d: _other_model(d / "model.safetensors"), "does not match its recorded sha256|bytes, the manifest"),
    (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:1000]), "truncated"),
    (lambda d: _unreadable(d / "model.safetensors"), "not a regular file"),
    (lambda d: (d / "patchkv_manifest.json").unlink(), "no patchkv_manifest.json"),
    (lambda d: (d / "patchkv_manifest.json").write_text("{not json"), "unreadable patchkv_manifest.json"),
    (lambda d: (d / "pytorch_model.bin").write_bytes(b"pickle"), "unexpected \\['pytorch_model.bin'\\]"),
    (lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("64", "65", 1)),
     "config.json does not match"),
])
def test_a_tampered_weight_cache_is_rebuilt_with_a_log_line(fake_gguf, tamper, reason, caplog):
    from patchkv_agent.loading import load_model

    gguf, builds = fake_gguf
    model, _ = load_model(str(gguf))
    good = _weights(model)
    assert len(builds) == 1 and (_cache_dir(gguf) / "patchkv_manifest.json").is_file()
    tamper(_cache_dir(gguf))
    with caplog.at_level("WARNING", logger="patchkv_agent.core.models"):
        again, _ = load_model(str(gguf))
    assert len(builds) == 2, "the tampered cache was loaded instead of rebuilt"
    assert _same(_weights(again), good)
    lines = [r.getMessage() for r in caplog.records if "failed verification" in r.getMessage()]
    assert len(lines) == 1 and __import__("re").search(reason, lines[0]), lines
    assert not list(_cache_dir(gguf).parent.glob("*.bad-*"))  # the bad copy is gone


def test_an_intact_cache_is_hashed_once_per_process(fake_gguf, monkeypatch):
    from patchkv_agent import loading as models

    gguf, builds = fake_gguf
    first, _ = models.load_model(str(gguf))
    hashed = []
    real = models._sha256
    monkeypatch.setattr(models, "_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    for _ in range(2):
        again, _ = models.load_model(str(gguf))
        assert _same(_weights(again), _weights(first))
    assert len(builds) == 1
    assert hashed == ["tiny.gguf", "tiny.gguf"]  # the source's own key; no cached file hashed again
    files = sorted(p.name for p in _cache_dir(gguf).iterdir() if p.name != "patchkv_manifest.json")
    del hashed[:]
    models._VERIFIED.clear()  # a new process: every cached file hashed once
    models.load_model(str(gguf))
    assert hashed == ["tiny.gguf", *files] and len(builds) == 1


def test_a_forged_manifest_over_a_broken_file_is_rebuilt_when_loading_fails(fake_gguf, caplog):
    from patchkv_agent.loading import load_model, write_cache_manifest

    gguf, builds = fake_gguf
    good = _weights(load_model(str(gguf))[0])
    d = _cache_dir(gguf)
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    write_cache_manifest(d, json.loads((d / "patchkv_manifest.json").read_text())["source_sha256"])
    with caplog.at_level("WARNING", logger="patchkv_agent.core.models"):
        again, _ = load_model(str(gguf))
    assert len(builds) == 2 and _same(_weights(again), good)
    assert any("loading it failed" in r.getMessage() for r in caplog.records)

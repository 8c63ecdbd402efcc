"""The packaged coding-agent histories (``patchkv_agent/eval/data/agent_histories.jsonl``): shape, caps, licences.

Fast, no model; the file is rebuilt by ``scripts/build_agent_histories.py`` (never at test time).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "patchkv_agent" / "eval" / "data" / "agent_histories.jsonl"
KEYS = {"id", "source", "licence", "origin", "system", "messages"}
MAX_TOOL_OUTPUT = 6000
MAX_TOOL_CALLS = 40
MAX_HISTORY_CHARS = 60000
_CUT = re.compile(r"\n\[\.\.\. (\d+) characters cut\]\Z")


def _load() -> list[dict]:
    with open(DATA, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


HISTORIES = _load()


def _chars(h: dict) -> int:
    n = len(h["system"])
    for m in h["messages"]:
        n += len(m["content"])
        for c in m.get("tool_calls", ()):
            n += len(c["name"]) + len(json.dumps(c["args"], ensure_ascii=False))
    return n


def test_file_level():
    assert DATA.stat().st_size <= 1_500_000
    ids = [h["id"] for h in HISTORIES]
    assert len(ids) == len(set(ids)), "ids unique"
    assert ids == sorted(ids), "sorted by id"
    by_source = {s: sum(h["source"] == s for h in HISTORIES) for s in ("mini-swe-agent", "swe-agent")}
    assert by_source["mini-swe-agent"] >= 12 and by_source["swe-agent"] >= 6
    assert sum(by_source.values()) == len(HISTORIES)
    sources = (DATA.parent / "SOURCES.md").read_text(encoding="utf-8")
    assert "agent_histories.jsonl" in sources and "Kilian A. Lieret and Carlos E. Jimenez" in sources


@pytest.mark.parametrize("h", HISTORIES, ids=[h["id"] for h in HISTORIES])
def test_history(h):
    assert KEYS <= set(h)
    assert h["source"] in ("mini-swe-agent", "swe-agent")
    assert h["id"].startswith(h["source"] + "/")
    assert h["licence"] == "MIT"
    repo = {"mini-swe-agent": "SWE-agent/mini-swe-agent", "swe-agent": "princeton-nlp/SWE-agent"}[h["source"]]
    assert re.match(rf"https://github\.com/{re.escape(repo)}/blob/[0-9a-f]{{40}}/\S+$", h["origin"])
    assert isinstance(h["system"], str) and h["system"].strip()

    msgs = h["messages"]
    assert msgs[0]["role"] == "user" and msgs[0]["content"].strip()
    assert len(msgs) % 2 == 1
    call_ids = []
    for a, t in zip(msgs[1::2], msgs[2::2]):
        assert a["role"] == "assistant" and isinstance(a["content"], str)
        assert set(a) <= {"role", "content", "tool_calls"}
        (call,) = a["tool_calls"]
        assert set(call) == {"id", "name", "args"}
        assert isinstance(call["name"], str) and call["name"] and isinstance(call["args"], dict)
        assert t["role"] == "tool" and set(t) == {"role", "tool_call_id", "content"}
        assert t["tool_call_id"] == call["id"], "tool message answers the preceding assistant's call"
        out = t["content"]
        m = _CUT.search(out)
        if m:
            assert m.start() <= MAX_TOOL_OUTPUT
        else:
            assert len(out) <= MAX_TOOL_OUTPUT
        call_ids.append(call["id"])
    assert len(call_ids) == len(set(call_ids))
    assert 8 <= len(call_ids) <= MAX_TOOL_CALLS
    assert _chars(h) <= MAX_HISTORY_CHARS
    assert not re.search(r"sk-[A-Za-z0-9_\-]{20,}|gh[pousr]_[A-Za-z0-9]{30,}|AKIA[0-9A-Z]{16}", json.dumps(h))

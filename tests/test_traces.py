"""The trace and result formats (patchkv_agent.eval.traces): the one validated reader, rendering, result files."""

from __future__ import annotations

import copy
import json
import os

import pytest

from patchkv_agent.eval.traces import (
    RESULT_FIELDS,
    ResultsFile,
    plain_messages,
    read_results,
    read_traces,
    validate_trace,
    version_ids,
    write_traces,
)
from patchkv_agent.langgraph import tools as lg_tools

GOOD = {"id": "x/1", "workload": "w", "edit": "e", "versions": [{"text": "a"}, {"token_ids": [1, 2]}]}


@pytest.mark.parametrize("mutate,msg", [
    (lambda t: ("raw", "not json {"), "not valid JSON"),
    (lambda t: ("raw", json.dumps([t])), "must be a JSON object"),
    (lambda t: t.pop("id"), "missing or empty string 'id'"),
    (lambda t: t.pop("versions"), "missing 'versions'"),
    (lambda t: t["versions"].pop(), "two or more"),
    (lambda t: t["versions"].__setitem__(1, {"meta": 1}), r"versions\[1\]: a version needs one of"),
    (lambda t: t["versions"].__setitem__(0, {"messages": []}), "'messages' must be a non-empty list"),
    (lambda t: t["versions"].__setitem__(0, {"messages": [{"content": "hi"}]}), "string 'role'"),
    (lambda t: t["versions"].__setitem__(0, {"messages": [{"role": "user", "content": 3}]}), "'content'"),
    (lambda t: t["versions"].__setitem__(1, {"token_ids": [1, "2"]}), "'token_ids'"),
    (lambda t: t["versions"].__setitem__(1, {"token_ids": [1, 2.0]}), "'token_ids'"),
    (lambda t: t["versions"].__setitem__(1, {"token_ids": [1, True]}), "'token_ids'"),
    (lambda t: t["versions"].__setitem__(1, {"text": ""}), "'text'"),
    (lambda t: t.__setitem__("answers", "Paris"), "'answers' must be a list"),
    (lambda t: t.__setitem__("edit", 3), "'edit' must be a string"),
])
def test_read_traces_rejects_malformed(tmp_path, mutate, msg):
    t = copy.deepcopy(GOOD)
    out = mutate(t)  # edits t in place, or returns ("raw", line)
    line = out[1] if isinstance(out, tuple) and out[0] == "raw" else json.dumps(t)
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GOOD).replace("x/1", "x/0") + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=msg) as err:
        read_traces(path)
    assert "bad.jsonl:3" in str(err.value)


def test_read_traces_duplicate_ids(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text((json.dumps(GOOD) + "\n") * 2)
    with pytest.raises(ValueError, match=r"duplicate id 'x/1' \(first on line 1\)"):
        read_traces(path)


def test_read_traces_names_the_line_of_a_non_utf8_byte(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(ValueError, match=r"b\.jsonl:2: not UTF-8"):
        read_traces(path)


def test_write_traces_validates_before_opening(tmp_path):
    out = tmp_path / "t.jsonl"
    with pytest.raises(ValueError, match=r"traces\[1\]"):
        write_traces([GOOD, {"id": "y"}], out)
    assert not out.exists()
    write_traces([GOOD], out)
    assert read_traces(out) == [GOOD]


# --------------------------------------------------------------------------------------------- rendering

def test_plain_messages_uses_the_tags_the_tool_parser_reads():
    msgs = [{"role": "system", "content": "s"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": "search", "args": {"q": "x"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "result"},
            {"content": "no role"}]
    validate_trace({"id": "m", "versions": [{"messages": msgs[:3]}, {"text": "t"}]})
    out = plain_messages(msgs)
    assert out[0] == {"role": "system", "content": "s"}
    assert out[1]["content"] == lg_tools.TOOL_CALL_OPEN + '{"name": "search", "arguments": {"q": "x"}}' + \
        lg_tools.TOOL_CALL_CLOSE
    assert out[2]["content"] == f"{lg_tools.TOOL_RESPONSE_OPEN}\nresult\n{lg_tools.TOOL_RESPONSE_CLOSE}"
    assert out[3]["role"] == "user"
    parsed = lg_tools.parse_tool_calls(out[1]["content"], ["search"])
    assert [(c["name"], c["args"]) for c in parsed.tool_calls] == [("search", {"q": "x"})]
    assert plain_messages is lg_tools.plain_messages  # one owner


def test_version_ids_per_kind():
    class Enc:
        def __init__(self):
            self.seen = []

        def encode(self, x):
            self.seen.append(x)
            return [7, 8]

    e = Enc()
    assert version_ids(e, {"token_ids": [3, 4]}) == [3, 4] and e.seen == []
    assert version_ids(e, {"text": "hi"}) == [7, 8] and e.seen == ["hi"]
    version_ids(e, {"messages": [{"role": "tool", "content": "r"}]})
    assert e.seen[-1] == [{"role": "tool", "content": "<tool_response>\nr\n</tool_response>"}]
    with pytest.raises(ValueError, match="needs one of"):
        version_ids(e, {"meta": 1})


# --------------------------------------------------------------------------------------------- results

def _row(i, s="exact", v=1):
    return {f: None for f in RESULT_FIELDS} | {"id": f"e{i}", "version": v, "strategy": s, "ttft_s": 0.1 * i}


def test_results_file_appends_flushes_and_resumes(tmp_path):
    path = tmp_path / "sub" / "r.jsonl"
    with ResultsFile(path) as rf:
        rf.write(_row(0))
        assert read_results(path) == [_row(0)]  # flushed before close: a crash keeps it
        rf.write_many([_row(1), _row(1, "prefix")])
        assert rf.written == 3
    # a crash mid-line: the cut tail is ignored on read and cut off on resume, the rest is kept
    with open(path, "a") as f:
        f.write(json.dumps(_row(2))[:30])
    assert len(read_results(path)) == 3
    with ResultsFile(path, resume=True) as rf:
        assert rf.done == {("e0", 1, "exact"), ("e1", 1, "exact"), ("e1", 1, "prefix")}
        rf.write(_row(2))
    assert read_results(path) == [_row(0), _row(1), _row(1, "prefix"), _row(2)]
    with ResultsFile(path):  # without resume: started afresh
        pass
    assert path.read_text() == ""


def test_results_file_refuses_an_unwritable_path_up_front(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError, match="cannot write results to"):
        ResultsFile(tmp_path / "d")  # a folder
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OSError, match="cannot write results to"):
        ResultsFile(blocker / "r.jsonl")  # a parent that is a file
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(OSError, match="cannot write results to"):
                ResultsFile(ro / "r.jsonl")
        finally:
            ro.chmod(0o700)


def test_results_file_reports_a_full_disk_and_keeps_earlier_rows(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    rf = ResultsFile("/dev/full", resume=False)
    with pytest.raises(OSError, match=r"writing results to /dev/full failed after 0 rows"):
        rf.write(_row(0))
    rf.close()


def test_read_results_names_a_bad_middle_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(_row(0)) + "\n{oops\n" + json.dumps(_row(1)) + "\n")
    with pytest.raises(ValueError, match=r"r\.jsonl:2: not a JSON result row"):
        read_results(path)
    assert read_results(tmp_path / "missing.jsonl") == []

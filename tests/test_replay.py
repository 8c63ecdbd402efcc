"""``patchkv-agent replay`` on a tiny llama: validation before the model loads, rows written as they
finish, ``--resume``, a failing episode after good ones, ``--limit``, an unwritable ``--out``.

The CLI's model loading is replaced by a tiny engine (``cli._engine``); every test counts the loads.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from patchkv_agent import cli
from patchkv_agent.eval.replay import replay_episode
from patchkv_agent.eval.traces import RESULT_FIELDS, read_results, write_traces

STRATS = "exact,prefix,patchkv"


ENGINE = dict(profile="auto")  # the `engine` fixture (conftest.py)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _trace(i: int, vocab: int = 211, n_versions: int = 3, length: int = 60) -> dict:
    rng = np.random.default_rng(i)
    v = [rng.integers(3, vocab, length).tolist()]
    for _ in range(n_versions - 1):
        old = v[-1]
        v.append(old[:15] + rng.integers(3, vocab, 5).tolist() + old[19:])
    return {"id": f"tiny/{i}", "workload": "tiny", "edit": "replace_tool_result", "answers": ["x"],
            "versions": [{"token_ids": ids} for ids in v]}


@pytest.fixture
def loads(engine, monkeypatch):
    """Replace the CLI's model loading by the tiny engine; the list records each load."""
    calls = []

    def fake(args):
        calls.append(args.model)
        return engine

    monkeypatch.setattr(cli, "_engine", fake)
    return calls


def _run(*argv) -> int:
    return cli.main(["replay", *map(str, argv), "--strategies", STRATS, "--max-new-tokens", "2"])


def test_replay_writes_every_row_like_the_library(engine, loads, tmp_path, capsys):
    traces = [_trace(0), _trace(1, n_versions=2)]
    write_traces(traces, tmp_path / "t.jsonl")
    assert _run(tmp_path / "t.jsonl", "--out", tmp_path / "r.jsonl") == 0
    rows = read_results(tmp_path / "r.jsonl")
    assert [(r["id"], r["version"], r["strategy"]) for r in rows] == [
        (t["id"], k, s) for t in traces for k in range(1, len(t["versions"])) for s in STRATS.split(",")]
    assert all(f in r for r in rows for f in RESULT_FIELDS)
    lib = list(replay_episode(engine, traces[0], STRATS.split(","), max_new_tokens=2))
    assert [r["output_ids"] for r in rows[:6]] == [r["output_ids"] for r in lib]
    assert loads == ["smollm2-135m"] and "wrote 9 rows" in capsys.readouterr().out


def test_replay_with_a_noise_floor_scores_its_untimed_rows_and_exits_0(engine, loads, tmp_path, capsys):
    write_traces([_trace(0)], tmp_path / "t.jsonl")
    assert _run(tmp_path / "t.jsonl", "--out", tmp_path / "r.jsonl", "--noise-floor", "kv-bf16") == 0
    rows = read_results(tmp_path / "r.jsonl")
    floor = [r for r in rows if r.get("floor")]
    assert [(r["version"], r["strategy"]) for r in floor] == [(1, "kv-bf16"), (2, "kv-bf16")]
    assert all(r["ttft_s"] is None and r["top1_agree"] in (0.0, 1.0) for r in floor)  # scored, never timed
    table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:] if line.strip()}
    assert table["kv-bf16"][1] == "-" and table["kv-bf16"][2] == "-x"  # no timing, no speed-up
    assert float(table["prefix"][1]) > 0 and table["prefix"][2] == "1.00x"


@pytest.mark.parametrize("content,where", [
    (lambda good: good + "\n{not json\n", r"t\.jsonl:3: not valid JSON"),
    (lambda good: good + "\n" + json.dumps({"id": "b", "versions": [{"token_ids": [1]}]}) + "\n",
     r"t\.jsonl:3 \(id 'b'\): 'versions' has 1 entries"),
    (lambda good: json.dumps({"id": "b", "versions": [{"token_ids": [1]}, {"token_ids": [-1]}]}) + "\n" + good,
     r"t\.jsonl:1 \(id 'b'\) versions\[1\]: 'token_ids'"),
])
def test_a_malformed_line_fails_before_the_model_loads(loads, tmp_path, content, where):
    good = json.dumps(_trace(0)) + "\n" + json.dumps(_trace(1))
    (tmp_path / "t.jsonl").write_text(content(good))
    with pytest.raises(SystemExit, match=where):
        _run(tmp_path / "t.jsonl", "--out", tmp_path / "r.jsonl")
    assert loads == [] and not (tmp_path / "r.jsonl").exists()


def test_missing_trace_file_and_unknown_strategy_fail_before_the_model_loads(loads, tmp_path):
    with pytest.raises(SystemExit, match="invalid trace file: .*No such file"):
        _run(tmp_path / "none.jsonl")
    write_traces([_trace(0)], tmp_path / "t.jsonl")
    with pytest.raises(SystemExit, match="unknown"):
        cli.main(["replay", str(tmp_path / "t.jsonl"), "--strategies", "exact,magic", "--out", str(tmp_path / "r")])
    assert loads == []


def test_unwritable_out_fails_before_the_model_loads(loads, tmp_path):
    write_traces([_trace(0)], tmp_path / "t.jsonl")
    (tmp_path / "dir").mkdir()
    with pytest.raises(SystemExit, match="--out: cannot write results to"):
        _run(tmp_path / "t.jsonl", "--out", tmp_path / "dir")
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit, match="--out: cannot write results to"):
        _run(tmp_path / "t.jsonl", "--out", tmp_path / "file" / "r.jsonl")
    assert loads == []


def test_negative_limit_is_an_error_and_limit_takes_the_first_episodes(loads, tmp_path, capsys):
    write_traces([_trace(0, n_versions=2), _trace(1, n_versions=2)], tmp_path / "t.jsonl")
    with pytest.raises(SystemExit):
        _run(tmp_path / "t.jsonl", "--limit", "-1", "--out", tmp_path / "r.jsonl")
    assert ">= 0" in capsys.readouterr().err and loads == []
    assert _run(tmp_path / "t.jsonl", "--limit", "1", "--out", tmp_path / "r.jsonl") == 0
    assert {r["id"] for r in read_results(tmp_path / "r.jsonl")} == {"tiny/0"}


def test_a_failing_episode_keeps_the_finished_rows_and_the_others_run(loads, engine, tmp_path, capsys):
    too_long = _trace(7, length=engine.spec.max_positions + 10, n_versions=2)  # valid format, refused by the engine
    write_traces([_trace(0, n_versions=2), too_long, _trace(1, n_versions=2)], tmp_path / "t.jsonl")
    assert _run(tmp_path / "t.jsonl", "--out", tmp_path / "r.jsonl") == 1
    rows = read_results(tmp_path / "r.jsonl")
    assert sorted({r["id"] for r in rows}) == ["tiny/0", "tiny/1"] and len(rows) == 6
    assert "episode tiny/7 failed and was skipped" in capsys.readouterr().err


def test_rows_are_on_disk_as_they_finish_and_resume_skips_them(loads, engine, tmp_path, monkeypatch):
    traces = [_trace(0), _trace(1)]
    write_traces(traces, tmp_path / "t.jsonl")
    out = tmp_path / "r.jsonl"
    assert _run(tmp_path / "t.jsonl", "--out", out) == 0
    full = read_results(out)

    # a crash in the middle of episode tiny/1: the rows finished before it are on disk
    real = engine.resume
    count = {"n": 0}

    def crashing(ckpt, ids, strategy="patchkv", **kw):
        if strategy == "patchkv" and ckpt is not None:
            count["n"] += 1
            if count["n"] == 3:  # tiny/0 v1, tiny/0 v2, then tiny/1 v1: crash
                raise RuntimeError("killed")
        return real(ckpt, ids, strategy=strategy, **kw)

    monkeypatch.setattr(engine, "resume", crashing)
    with pytest.raises(RuntimeError, match="killed"):
        _run(tmp_path / "t.jsonl", "--out", out)
    partial = read_results(out)
    assert [(r["id"], r["version"], r["strategy"]) for r in partial] == \
        [(r["id"], r["version"], r["strategy"]) for r in full[:8]]  # tiny/0 whole, tiny/1 v1 exact + prefix
    with open(out, "a") as f:
        f.write('{"id": "tiny/1", "vers')  # and a cut-off line, as a kill mid-write leaves
    monkeypatch.setattr(engine, "resume", real)

    seen = []
    orig = cli._run_replay

    def spy(args, todo, results):
        seen.extend((tr["id"], tuple(s)) for tr, s in todo)
        return orig(args, todo, results)

    monkeypatch.setattr(cli, "_run_replay", spy)
    assert _run(tmp_path / "t.jsonl", "--out", out, "--resume") == 0
    assert seen == [("tiny/1", ("exact", "prefix", "patchkv"))]  # tiny/0 is complete: not replayed
    again = read_results(out)
    keys = [(r["id"], r["version"], r["strategy"]) for r in again]
    assert len(keys) == len(set(keys)) == len(full)
    assert sorted(keys) == sorted((r["id"], r["version"], r["strategy"]) for r in full)
    by = {(r["id"], r["version"], r["strategy"]): r["output_ids"] for r in again}
    assert all(by[(r["id"], r["version"], r["strategy"])] == r["output_ids"] for r in full)

    seen.clear()
    assert _run(tmp_path / "t.jsonl", "--out", out, "--resume") == 0  # nothing left: no model load
    assert seen == [] and read_results(out) == again


def test_a_full_disk_stops_with_a_clear_message(loads, tmp_path):
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    write_traces([_trace(0, n_versions=2)], tmp_path / "t.jsonl")
    with pytest.raises(SystemExit, match="writing results to /dev/full failed after 0 rows: .*rerun with --resume"):
        _run(tmp_path / "t.jsonl", "--out", "/dev/full")

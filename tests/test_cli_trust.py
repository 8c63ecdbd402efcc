"""Issue 32, part A: the command line's last tracebacks and its one surprising default.

Findings (each test below fails on the code before the fix):

- ``bench --summarize`` on a file that is not a results file printed a traceback (ValueError, KeyError);
- an offline ``demo --model <hub id>`` printed a traceback around a good message;
- ``calibrate`` with no arguments started a run of hours instead of saying what it would do.

Now: one line naming the fix, exit status 2; a bare ``calibrate`` prints its plan (episodes, stages, output,
time) and starts nothing unless given ``--run`` or any option (every documented invocation has one).
"""

from __future__ import annotations

import re

import pytest

from patchkv_agent import cli


def _one_line(capsys, exc) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert exc.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("content,pattern", [
    (b"\x89PNG\r\n\x1a\n\x00\x00garbage\xff\n", r"not a JSON result row"),
    (b"hello world\n", r"not a JSON result row"),
    (b'[1, 2, 3]\n', r"row 1 is not a JSON object"),
    (b'{"id": "x", "ttft_s": 0.1}\n', r"row 1 has no strategy name"),
    (b'{"strategy": "exact", "ttft_s": "fast"}\n', r"ttft_s is 'fast', not a number"),
    (b'{"strategy": "exact", "ttft_s": 0.1, "recompute_ratio": [1]}\n', r"recompute_ratio is .*not a number"),
])
def test_bench_summarize_of_a_file_that_is_not_results_gives_one_line(tmp_path, capsys, no_model, content, pattern):
    f = tmp_path / "results.jsonl"
    f.write_bytes(content)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--summarize", str(f), "--out-dir", str(tmp_path / "out")])
    line = _one_line(capsys, e)
    assert "--summarize" in line and str(f) in line and re.search(pattern, line), line


def test_an_offline_hub_model_gives_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--model", "no-such-org/no-such-model"])
    line = _one_line(capsys, e)
    assert "--model no-such-org/no-such-model" in line and "HF_HUB_OFFLINE is set" in line and "Fix:" in line


class _Started(Exception):
    pass


@pytest.fixture
def no_calibration(monkeypatch):
    """Starting the calibration (loading its model) raises _Started instead."""
    from patchkv_agent.calibration import cli as ccli

    def start(*a, **k):
        raise _Started

    monkeypatch.setattr(ccli, "stage_engine", start)
    import torch

    threads = torch.get_num_threads()  # --threads sets them for the process before the model loads
    yield ccli
    torch.set_num_threads(threads)


def test_a_bare_calibrate_prints_its_plan_and_starts_nothing(capsys, no_calibration):
    with pytest.raises(SystemExit) as e:
        cli.main(["calibrate"])
    out = capsys.readouterr()
    lines = [ln for ln in out.err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "nothing started" in lines[0] and "--run" in lines[0]
    assert "episodes: 6 per workload" in out.out and "time: about" in out.out and "min" in out.out
    with pytest.raises(SystemExit) as e:
        no_calibration.main([])  # the stand-alone entry point alike
    assert e.value.code == 2


@pytest.mark.parametrize("argv", [
    ["calibrate", "--run"],
    ["calibrate", "--model", "smollm2-135m", "--threads", "1", "--out", "{d}/p.json"],  # docs/calibration.md
    ["calibrate", "--threads", "1", "--out", "{d}/p.json"],
    ["calibrate", "--model", "smollm2-135m", "--reader-workloads", "all", "--reader-n", "8", "--out", "{d}/p.json"],
])
def test_calibrate_with_run_or_any_option_starts(tmp_path, no_calibration, argv):
    with pytest.raises(_Started):
        cli.main([a.replace("{d}", str(tmp_path)) for a in argv])


def test_calibrate_dry_run_prints_the_plan_of_any_invocation(capsys, no_calibration):
    assert cli.main(["calibrate", "--dry-run", "--agent-workloads", "agent-clear", "--out", "x.json"]) == 0
    out = capsys.readouterr().out
    assert "writes x.json" in out and "the agent stage" in out

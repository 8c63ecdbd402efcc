"""Every subcommand's bad arguments: one line on stderr naming the fix, exit status 2, no traceback, and
no model loaded. Also: empty inputs are errors, out-of-range values are rejected.

Bad files, offline hub ids and a bare ``calibrate``: ``bench --summarize`` on a file that is not a results
file, and an offline ``demo --model <hub id>``, give one line naming the fix and exit status 2 (no traceback
around it); a bare ``calibrate`` prints its plan (episodes, stages, output, time) and starts nothing (rather
than a run of hours) unless given ``--run`` or any option (every documented invocation has one).

Runs ``cli.main([...])`` in-process with every model loader replaced by one that fails the test.
"""

from __future__ import annotations

import re

import pytest

from patchkv_agent import cli


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    (tmp_path / "adir").mkdir()
    (tmp_path / "notgguf.txt").write_text("x")
    return tmp_path


# (argv, a regex the one error line must match); {d} is a temporary directory with the files above
BAD = [
    # argparse's own errors
    (["nope"], r"invalid choice"),
    (["demo", "--no-such-flag"], r"unrecognized arguments"),
    (["demo", "--target-tokens", "lots"], r"--target-tokens: invalid int value"),
    (["replay", "--max-new-tokens", "-1"], r"--max-new-tokens"),
    (["calibrate", "--kappas", "a,b"], r"--kappas: expected comma-separated numbers"),
    (["calibrate", "--blocks", ","], r"--blocks: expected one or more"),
    (["traces", "build", "--dataset", "nope", "--out", "x"], r"--dataset: invalid choice"),
    (["traces"], r"required: traces_command|arguments are required"),
    # common options
    (["demo", "--threads", "0"], r"--threads must be >= 1"),
    (["demo", "--block-size", "0"], r"--block-size must be >= 1"),
    (["demo", "--dirty-window", "-3"], r"--dirty-window must be >= 0"),
    (["demo", "--seed", "-1"], r"--seed must be in \[0, "),
    (["demo", "--model", "./no/such/model.gguf"], r"--model \./no/such/model\.gguf does not exist"),
    (["demo", "--model", "{d}/notgguf.txt"], r"is a file but not a \.gguf"),
    (["demo", "--profile", "{d}/missing.json"], r"--profile .*missing\.json.*'auto', 'none'"),
    (["demo", "--strategies", "exact,magic"], r"--strategies: unknown \['magic'\]"),
    (["demo", "--workload", "nope-e"], r"--workload: unknown workloads \['nope-e'\]"),
    (["demo", "--edit", "swap"], r"--edit: unknown edit 'swap'"),
    (["demo", "--target-tokens", "0"], r"--target-tokens must be >= 1"),
    (["demo", "--out", "{d}/adir"], r"--out .*adir is a directory"),
    # replay
    (["replay"], r"pass a traces file .* or --from-checkpointer"),
    (["replay", "{d}/empty.jsonl"], r"empty\.jsonl is empty"),
    (["replay", "{d}/blank.jsonl"], r"blank\.jsonl holds no traces"),
    (["replay", "{d}/missing.jsonl"], r"invalid trace file: .*No such file"),
    (["replay", "--limit", "-2", "{d}/empty.jsonl"], r"--limit: must be >= 0"),
    (["replay", "--from-checkpointer", "redis:x"], r"--from-checkpointer takes sqlite:PATH"),
    (["replay", "--from-checkpointer", "sqlite:{d}/none.sqlite"], r"no SQLite checkpoint database"),
    (["replay", "--from-checkpointer", "sqlite:{d}/empty.jsonl"], r"not a LangGraph SqliteSaver database"),
    (["replay", "--from-checkpointer", "sqlite:{d}/notgguf.txt"], r"SqliteSaver database|SQLite checkpoint database"),
    # bench
    (["bench", "--workloads", "hotpotqa-e,nope"], r"--workloads: unknown workloads \['nope'\]"),
    (["bench", "--n", "0"], r"--n must be >= 1"),
    (["bench", "--out-dir", "{d}/notgguf.txt/out"], r"--out-dir: cannot write to .*notgguf\.txt"),
    (["bench", "--shard", "2/2"], r"--shard 2/2: need 0 <= I < K"),
    (["bench", "--shard", "x"], r"--shard must look like I/K"),
    (["bench", "--heal", "patchkv,bogus"], r"--heal: unknown \[.bogus.\]"),
    (["bench", "--summarize", "{d}/missing.jsonl"], r"--summarize: no results file"),
    (["bench", "--summarize", "{d}/empty.jsonl"], r"--summarize: .*empty"),
    (["bench", "--out-dir", "{d}/notgguf.txt"], r"--out-dir .* is not a directory"),
    (["bench", "--edit", "nope"], r"--edit: unknown edit"),
    # bench-loop
    (["bench-loop", "--tool-latencies", "0,x"], r"--tool-latencies takes comma-separated seconds"),
    (["bench-loop", "--tool-latencies", "-1"], r"--tool-latencies >= 0"),
    (["bench-loop", "--versions", "1"], r"--versions must be >= 2"),
    (["bench-loop", "--agents-tool-s", "nan"], r"--agents-tool-s must be >= 0"),
    (["bench-loop", "--workloads", "x"], r"--workloads: unknown workloads"),
    (["bench-loop", "--context", "10"], r"--context must be >= 1000"),
    (["bench-loop", "--tool-latency", "x", "--workloads", "agent-clear-hop"], r"--tool-latency: .*expected seconds"),
    (["bench-loop", "--tool-latency", "search=-1", "--workloads", "agent-clear"], r"--tool-latency: .*>= 0"),
    (["bench-loop", "--tool-latency", "2", "--tool-latencies", "1", "--workloads", "agent-clear"],
     r"--tool-latencies .* or --tool-latency .*not both"),
    (["bench-loop", "--tool-latency", "2"], r"--tool-latency: .*\['hotpotqa-e'\] have none"),
    (["bench-loop", "--tool-latency", "2", "--workloads", "agent-clear", "--agents", "2"], r"--agents runs with"),
    (["bench-loop", "--cover-preparation"], r"--cover-preparation applies to the prepared loop"),
    (["bench-loop", "--tool-latency", "2", "--workloads", "agent-clear", "--prepare-chunk", "0"],
     r"--prepare-chunk must be >= 1"),
    (["bench", "--context", "999"], r"--context must be >= 1000"),
    # bench-transport
    (["bench-transport", "--tau-ll", "5"], r"--tau-ll must be in \[0, 1\], got 5"),
    (["bench-transport", "--tau-ll", "-0.1"], r"--tau-ll must be in \[0, 1\]"),
    (["bench-transport", "--tokens", "0"], r"--tokens must be >= 1"),
    (["bench-transport", "--repeats", "0"], r"--repeats must be >= 1"),
    (["bench-transport", "--max-payload", "0"], r"--max-payload must be in \(0, 1\]"),
    (["bench-transport", "--max-kl-increase", "inf"], r"--max-kl-increase must be >= 0"),
    (["bench-transport", "--out", "{d}/adir"], r"--out .* is a directory"),
    # bench-host
    (["bench-host", "--repeats", "0"], r"--repeats"),
    (["bench-host", "--seed", "-1"], r"--seed must be in \[0, "),
    (["bench-host", "--device", "tpu"], r"--device 'tpu': expected 'cpu' or 'cuda'"),
    (["bench-host", "--model", "./none.gguf"], r"--model .* does not exist"),
    (["bench-host", "--out-dir", "{d}/notgguf.txt"], r"--out-dir .* is not a directory"),
    # bench-server
    (["bench-server", "--engine", "sglang"], r"--engine: invalid choice"),
    (["bench-server", "--workloads", "clear,nope"], r"--workloads: \['nope'\] not among"),
    (["bench-server", "--episodes", "0"], r"--episodes takes 1-1000"),
    (["bench-server", "--context", "10"], r"--context must be >= 1000"),
    (["bench-server", "--threads", "0"], r"--threads takes counts from 1 to 64"),
    (["bench-server", "--threads", "a,b"], r"--threads takes comma-separated counts"),
    (["bench-server", "--tool-latency", "-1"], r"--tool-latency: .*>= 0"),
    (["bench-server", "--base-url", "ftp://x/v1"], r"--base-url: a server address must be http\(s\)"),
    (["bench-server", "--out-dir", "{d}/notgguf.txt"], r"--out-dir .* is not a directory"),
    # stress
    (["stress", "--threads", "0"], r"--threads must be >= 1"),
    (["stress", "--versions", "1"], r"--versions must be >= 2"),
    (["stress", "--budget-entries", "0"], r"--budget-entries must be > 0"),
    (["stress", "--tool-s", "-1"], r"--tool-s must be >= 0"),
    (["stress", "--property-examples", "-5"], r"--property-examples must be >= 0"),
    (["stress", "--faults", "--writer-kills", "-1"], r"--writer-kills must be >= 0"),
    (["stress", "--faults", "--tiers", "memory,tape"], r"--tiers: unknown \['tape'\]"),
    (["stress", "--json", "{d}/adir"], r"--json .* is a directory"),
    (["stress", "--root", "{d}/notgguf.txt"], r"--root .* is not a directory"),
    # calibrate
    (["calibrate", "--gamma", "0"], r"--gamma must be in \(0, 1\]"),
    (["calibrate", "--quantile", "1"], r"--quantile must be in \(0, 1\)"),
    (["calibrate", "--val-share", "1.5"], r"--val-share must be in \(0, 1\)"),
    (["calibrate", "--kappas", "0,-0.1"], r"--kappas must be >= 0, got -0\.1"),
    (["calibrate", "--blocks", "32,0"], r"--blocks must be >= 1, got 0"),
    (["calibrate", "--tau-v", "0"], r"--tau-v must be > 0"),
    (["calibrate", "--workload", "nope"], r"--workload: unknown workload 'nope'"),
    (["calibrate", "--workload", "hotpotqa-e:x"], r"--workload: bad spec"),
    (["calibrate", "--workload", "hotpotqa-e:0"], r"token count must be >= 1"),
    (["calibrate", "--edit", "nope"], r"--edit: unknown edit"),
    (["calibrate", "--readers", "magic"], r"--readers must list some of"),
    (["calibrate", "--follow-workloads", "follow-nope"], r"--follow-workloads: unknown"),
    (["calibrate", "--follow-target", "2"], r"--follow-target must be in \[0, 1\]"),
    (["calibrate", "--follow-target", "high"], r"--follow-target must be a number or 'none'"),
    (["calibrate", "--precision-target", "x"], r"--precision-target must be a number or 'none'"),
    (["calibrate", "--target", "best"], r"--target must be 'default', 'none' or a number"),
    (["calibrate", "--policy-grid", "1:0.5"], r"--policy-grid: every pair needs 0 <= tau_L < tau_H"),
    (["calibrate", "--policy-grid", "a"], r"--policy-grid must look like"),
    (["calibrate", "--n", "0"], r"--n must be >= 1"),
    (["calibrate", "--threads", "0"], r"--threads must be >= 1"),
    (["calibrate", "--out", "{d}/adir"], r"--out .* is a directory"),
    (["calibrate", "--out", "{d}/notgguf.txt/p.json"], r"--out: cannot write to .*notgguf\.txt"),
    (["calibrate", "--drift-out", "{d}/notgguf.txt/d.npz"], r"--drift-out: cannot write to"),
    # traces
    (["traces", "build", "--dataset", "hotpotqa-e", "--out", "x", "--versions", "1"], r"--versions must be >= 2"),
    (["traces", "build", "--dataset", "hotpotqa-e", "--out", "x", "--n", "0"], r"--n must be >= 1"),
    (["traces", "build", "--dataset", "hotpotqa-e", "--out", "{d}/adir"], r"--out .* is a directory"),
    (["traces", "build", "--dataset", "hotpotqa-e", "--out", "x", "--model", "./none.gguf"], r"--model .* does not exist"),
    (["traces", "validate", "{d}/empty.jsonl"], r"empty\.jsonl is empty"),
    (["traces", "validate", "{d}/missing.jsonl"], r"no trace file at"),
]


@pytest.mark.parametrize("argv,pattern", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_arguments_give_one_line_and_exit_2_before_any_model_loads(argv, pattern, files, no_model, capsys,
                                                                      monkeypatch):
    monkeypatch.chdir(files)  # default output paths (results.jsonl, bench_out/ ...) land here, if anywhere
    argv = [a.replace("{d}", str(files)) for a in argv]
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert e.value.code == 2, (e.value.code, err)
    assert len(lines) == 1, err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in err and lines[0].startswith("patchkv-agent")


def test_every_subcommand_is_in_the_table():
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    covered = {argv[0] for argv, _ in BAD}
    assert set(sub.choices) - covered == set(), "add bad-argument rows for the new subcommand"


def test_bench_follow_and_capture_cost_options_resolve_their_defaults(no_model):
    """``bench --follow``: the follow-* workloads under FOLLOW_STRATEGIES, ``patchkv-noreaders`` registered
    (patchkv with the reader blocks off), unless --workloads / --strategies are given; without it the
    defaults. ``bench-transport --capture-cost``: its own --tokens / --out defaults. No model loads."""
    from benchmarks.bench import DEFAULT_STRATEGIES, DEFAULT_WORKLOADS, FOLLOW_STRATEGIES, NOREADERS
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS
    from patchkv_agent.strategies import STRATEGIES, PatchKVStrategy, get_strategy
    from patchkv_agent.core.settings import RecoverySettings

    saved = dict(STRATEGIES)
    try:
        plain = cli.build_parser(benchmarks=True).parse_args(["bench"])
        cli.check_args(plain)
        assert (plain.workloads, plain.strategies) == (",".join(DEFAULT_WORKLOADS), ",".join(DEFAULT_STRATEGIES))
        args = cli.build_parser(benchmarks=True).parse_args(["bench", "--follow"])
        cli.check_args(args)
        assert args.workloads == ",".join(FOLLOW_WORKLOADS) and args.strategies == ",".join(FOLLOW_STRATEGIES)
        s = get_strategy(NOREADERS)
        assert isinstance(s, PatchKVStrategy) and s.resolve(RecoverySettings()).readers == "none"
        mine = cli.build_parser(benchmarks=True).parse_args(["bench", "--follow", "--workloads", "nq-e", "--strategies", "exact"])
        cli.check_args(mine)
        assert (mine.workloads, mine.strategies) == ("nq-e", "exact")
    finally:
        STRATEGIES.clear()
        STRATEGIES.update(saved)
    cap = cli.build_parser(benchmarks=True).parse_args(["bench-transport", "--capture-cost"])
    cli.check_args(cap)
    assert cap.capture_cost and cap.tokens is None and cap.out is None  # resolved by the command: 3000, capture_cost.json


def test_the_calibration_entry_point_prints_one_line(capsys):
    from patchkv_agent.calibration.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--gamma", "2"])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "--gamma must be in (0, 1]" in lines[0]


# ----------------------------------------------------------------------------- bad files, offline hub ids, a bare calibrate


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


@pytest.mark.parametrize("command", [["demo"], ["calibrate", "--n", "1"]])
def test_an_offline_hub_model_gives_one_line(tmp_path, capsys, monkeypatch, command):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main([*command, "--model", "no-such-org/no-such-model", *(
            ["--out", str(tmp_path / "p.json")] if command[0] == "calibrate" else [])])
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

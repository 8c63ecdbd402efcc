"""Edited-context workload builder: trace format, edits, determinism, splits, budgets, file io, CLI."""

from __future__ import annotations

import argparse
import functools
import json

import pytest

from patchkv_agent.eval import workloads as W
from patchkv_agent.eval.workloads import (
    EDITS, WORKLOADS, answer_passage_indices, build_traces, estimate_tokens, load_qa, read_traces,
    split_of, validate_trace, write_traces,
)

CASES = [(w, e) for w in WORKLOADS for e in EDITS]


@functools.lru_cache(maxsize=None)
def _built(workload: str, edit: str, n: int = 4, n_versions: int = 2, seed: int = 0, split: str = "eval",
           target: int = 3000) -> tuple:
    return tuple(build_traces(workload, edit, n=n, split=split, target_tokens=target, n_versions=n_versions,
                              seed=seed))


def _examples(dataset: str) -> dict:
    return {ex["_id"]: ex for ex in W._load(dataset)}


def _tool_texts(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "tool"]


def test_load_qa_packaged_copies():
    sizes = {"hotpotqa": 100, "2wikimqa": 102, "nq": 500}
    for name, n in sizes.items():
        rows = load_qa(name)
        assert len(rows) == n
        assert {"_id", "input", "answers", "passages"} <= rows[0].keys()
    rows = load_qa("nq")
    rows[0]["passages"].clear()  # a copy: the cache is untouched
    assert load_qa("nq")[0]["passages"]
    assert (W._DATA_DIR / "SOURCES.md").read_text().count("copies") >= 1
    with pytest.raises(ValueError, match="unknown dataset"):
        load_qa("triviaqa")


@pytest.mark.parametrize("workload,edit", CASES)
def test_format_valid(workload, edit):
    traces = _built(workload, edit, n_versions=3)
    assert len(traces) == 4
    for t in traces:
        validate_trace(t)
        assert t["id"].startswith(workload + "/") and t["workload"] == workload and t["edit"] == edit
        assert t["answers"] and all(isinstance(a, str) for a in t["answers"])
        assert len(t["versions"]) == 3 and len(t["meta"]["edits"]) == 2
        assert len(t["meta"]["tokens"]) == 3
        for v in t["versions"]:
            msgs = v["messages"]
            assert [m["role"] for m in msgs[:2]] == ["system", "user"] and msgs[-1]["role"] == "user"
            last = msgs[-1]["content"]
            assert last.startswith("Question: ") and last.endswith("Answer in a few words.")
            ids = []
            for k, m in enumerate(msgs):
                assert set(m) <= {"role", "content", "tool_calls", "tool_call_id"}
                if m.get("tool_calls"):
                    (call,) = m["tool_calls"]
                    assert call["name"] == "search" and call["args"]["query"] and m["content"] == ""
                    assert msgs[k + 1]["role"] == "tool" and msgs[k + 1]["tool_call_id"] == call["id"]
                    ids.append(call["id"])
                if m["role"] == "tool":
                    assert msgs[k - 1].get("tool_calls") and m["content"]
            assert len(ids) == len(set(ids)) >= 3


@pytest.mark.parametrize("workload,edit", CASES)
def test_edits_change_only_the_recorded_middle_spans(workload, edit):
    for t in _built(workload, edit, n_versions=3):
        vs = [v["messages"] for v in t["versions"]]
        for k, rec in enumerate(t["meta"]["edits"]):
            old, new = vs[k], vs[k + 1]
            assert rec["kind"] == edit and rec["version"] == k + 1
            assert old != new
            assert old[:2] == new[:2] and old[-1] == new[-1]  # system prompt, task, question
            spans = rec["spans"]
            assert len(spans) == (2 if edit == "multi" else 1)
            o_prev = n_prev = 0
            for sp in spans:  # identical outside the spans, different inside
                (o0, o1), (n0, n1) = sp["old"], sp["new"]
                assert old[o_prev:o0] == new[n_prev:n0]
                assert old[o0:o1] != new[n0:n1]
                assert 2 <= o0 < o1 < len(old) - 1 and 2 <= n0 < n1 < len(new) - 1
                assert any(m["role"] == "tool" for m in old[o1:-1])  # evidence after the edit
                o_prev, n_prev = o1, n1
            assert old[o_prev:] == new[n_prev:]
            if edit == "multi":
                assert spans[1]["old"][0] > spans[0]["old"][1]  # non-adjacent
            if edit == "refresh_evidence":
                assert (spans[0]["old"][1] - spans[0]["old"][0]) // 2 in (2, 3)
            if edit == "compact_history":
                (summary,) = new[spans[0]["new"][0]:spans[0]["new"][1]]
                assert summary["role"] == "assistant" and summary["content"].startswith("Summary of earlier searches:")
                assert len(summary["content"]) < sum(len(m["content"]) for m in old[slice(*spans[0]["old"])])
            if edit in ("replace_tool_result", "refresh_evidence", "multi"):  # same call ids, new results
                assert [m.get("tool_call_id") for m in old] == [m.get("tool_call_id") for m in new]


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_answer_passages_survive_every_version(workload):
    dataset = WORKLOADS[workload]
    exs = _examples(dataset)
    traces = build_traces(workload, "all", n=8, n_versions=4)
    assert {t["edit"] for t in traces} == set(EDITS)
    for t in traces:
        ex = exs[t["meta"]["source_id"]]
        keep = answer_passage_indices(ex, dataset)
        assert keep and t["meta"]["answer_passages"] == len(keep)
        if dataset != "2wikimqa":  # gold marks are among the kept passages
            assert {i for i, p in enumerate(ex["passages"]) if p.get("is_supporting")} <= set(keep)
        for v in t["versions"]:
            tools = _tool_texts(v["messages"])
            for i in keep:
                p = ex["passages"][i]
                assert sum(p["text"] in x for x in tools) == 1, (t["id"], i)
            assert v["messages"][-1]["content"] == f"Question: {ex['input']} Answer in a few words."


def test_answer_passage_rules():
    nq = load_qa("nq")[0]
    assert nq["gold_index"] in answer_passage_indices(nq, "nq")
    ex = {"input": "Who is younger, Altuğ Çelikbilek or Guy Dolsin?", "answers": ["Altuğ Çelikbilek"],
          "passages": [{"title": "", "text": "altug celikbilek ( born 1996 ) is a turkish chess player."},
                       {"title": "", "text": "the weather was fine."}, {"title": "", "text": "nothing here."}]}
    assert answer_passage_indices(ex, "2wikimqa") == [0]  # accents and case folded, no overlap elsewhere
    yes = {"input": "Is it?", "answers": ["yes"], "passages": [{"title": "", "text": "yes it is"}]}
    assert answer_passage_indices(yes, "hotpotqa") == []  # yes/no answers are not matched as strings


def test_determinism_and_seed():
    a = build_traces("hotpotqa-e", "multi", n=3, n_versions=3, seed=7)
    b = build_traces("hotpotqa-e", "multi", n=3, n_versions=3, seed=7)
    c = build_traces("hotpotqa-e", "multi", n=3, n_versions=3, seed=8)
    assert json.dumps(a) == json.dumps(b)
    assert [t["id"] for t in a] == [t["id"] for t in c]
    assert json.dumps([t["versions"] for t in a]) != json.dumps([t["versions"] for t in c])
    assert all(t["meta"]["seed"] == 7 for t in a)


def test_version0_shared_by_all_edit_kinds():
    base = [[t["versions"][0] for t in _built("nq-e", e)] for e in EDITS]
    assert all(b == base[0] for b in base)


def test_split_disjoint_and_share():
    for workload, dataset in WORKLOADS.items():
        ids = [ex["_id"] for ex in W._load(dataset)]
        share = sum(split_of(i) == "calib" for i in ids) / len(ids)
        assert 0.2 <= share <= 0.4, (dataset, share)
    cal = build_traces("hotpotqa-e", "replace_tool_result", split="calib")
    ev = build_traces("hotpotqa-e", "replace_tool_result", split="eval")
    src = lambda ts: {t["meta"]["source_id"] for t in ts}  # noqa: E731
    assert cal and ev and not src(cal) & src(ev)
    assert len(src(cal)) + len(src(ev)) == 100
    assert all(split_of(t["meta"]["source_id"]) == t["meta"]["split"] for t in cal + ev)
    cal_ids = src(cal)  # padding and distractors come from the same split only
    eval_texts = {p["text"] for ex in W._load("hotpotqa") if ex["_id"] not in cal_ids for p in ex["passages"]}
    assert not any(x.split("\n", 1)[-1] in eval_texts for t in cal for v in t["versions"]
                   for x in _tool_texts(v["messages"]))


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_target_tokens_pad_and_trim(workload):
    for target in (1500, 3000):
        for t in _built(workload, "replace_tool_result", n=6, target=target):
            m = t["meta"]
            assert m["target_tokens"] == target and m["token_counter"] == "chars/4"
            assert m["tokens"][0] == estimate_tokens(t["versions"][0]["messages"])
            assert 0.85 * target <= m["tokens"][0] <= target, m
    pads = [t["meta"]["padded_passages"] for t in _built("nq-e", "replace_tool_result", n=6)]
    assert min(pads) > 0  # NQ (~1.2k tokens) is padded to 3k
    drops = [t["meta"]["dropped_passages"] for t in _built("2wikimqa-e", "replace_tool_result", n=6)]
    assert min(drops) > 0  # 2WikiMQA (~5.5k tokens) is trimmed


def test_custom_token_counter():
    def words(messages):
        return sum(len((m.get("content") or "").split()) + 3 for m in messages)

    (t,) = build_traces("nq-e", "refresh_evidence", n=1, target_tokens=1000, count_tokens=words)
    assert t["meta"]["token_counter"] == "words"
    assert t["meta"]["tokens"] == [words(v["messages"]) for v in t["versions"]]
    assert 850 <= t["meta"]["tokens"][0] <= 1000


def test_pieces_and_estimate():
    text = " ".join(f"Sentence number {i} has a few words in it." for i in range(120))
    parts = W._pieces(text)
    assert len(parts) > 1 and all(len(p) <= W._PIECE_CHARS for p in parts)
    assert " ".join(parts).split() == text.split()
    assert W._pieces("short.") == ["short."]
    assert estimate_tokens([{"role": "user", "content": "abcdefgh"}]) == 6


def test_bad_arguments():
    for kwargs, msg in [({"workload": "x-e", "edit": "multi"}, "unknown workload"),
                        ({"workload": "nq-e", "edit": "swap"}, "unknown edit"),
                        ({"workload": "nq-e", "edit": "multi", "split": "test"}, "unknown split"),
                        ({"workload": "nq-e", "edit": "multi", "n_versions": 1}, "n_versions")]:
        with pytest.raises(ValueError, match=msg):
            build_traces(**kwargs)


def test_write_read_roundtrip(tmp_path):
    traces = list(_built("2wikimqa-e", "compact_history"))
    path = tmp_path / "sub" / "t.jsonl"
    write_traces(traces, path)
    assert read_traces(path) == traces
    with pytest.raises(ValueError, match="duplicate id"):
        write_traces(traces[:1] * 2, tmp_path / "dup.jsonl")


def _parser(factory=None):
    parser = argparse.ArgumentParser(prog="patchkv-agent")
    W.add_traces_cli(parser.add_subparsers(dest="command", required=True), factory)
    return parser


def test_cli_build_and_validate(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    args = _parser().parse_args(["traces", "build", "--dataset", "hotpotqa-e", "--edit", "all", "--n", "5",
                                 "--split", "calib", "--target-tokens", "2000", "--versions", "3",
                                 "--seed", "1", "--out", str(out)])
    assert args.func(args) == 0
    traces = read_traces(out)
    assert len(traces) == 5 and len({t["edit"] for t in traces}) == 4
    assert all(t["meta"]["split"] == "calib" and len(t["versions"]) == 3 for t in traces)
    assert traces == build_traces("hotpotqa-e", "all", n=5, split="calib", target_tokens=2000, n_versions=3, seed=1)
    args = _parser().parse_args(["traces", "validate", str(out)])
    assert args.func(args) == 0 and "5 valid traces" in capsys.readouterr().out
    args = _parser().parse_args(["traces", "build", "--dataset", "nq-e", "--model", "m", "--out", str(out)])
    with pytest.raises(SystemExit):
        args.func(args)
    seen = []

    def factory(model):
        seen.append(model)
        return estimate_tokens

    args = _parser(factory).parse_args(["traces", "build", "--dataset", "nq-e", "--n", "2", "--model", "m",
                                        "--out", str(out)])
    assert args.func(args) == 0 and seen == ["m"] and len(read_traces(out)) == 2

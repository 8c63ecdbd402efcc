"""The reader stage of calibration (calibration/reader_stage.py): the reader rule's constants chosen by whether
resumes answer an edited episode's new gold; oracle = resumes with each rule run here directly and the exact
resume's output; the selection rule; the profile's ``reader_rule`` and the ``calibrate`` options."""

from __future__ import annotations

import json

import numpy as np
import pytest

from patchkv_agent.calibration.reader_stage import (
    OFF,
    choose_rule,
    rule_grid,
    rule_name,
    select_reader_rule,
    with_reader_rule,
)
from patchkv_agent.strategies.builtin import PatchKVStrategy
from tiny_models import tiny_profile

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models: one intra-op thread (conftest.py)

TOKENS = 4


# --- the grid and the selection rule ----------------------------------------------------------------------------------


def test_builtin_names_the_default_constants_and_is_in_the_default_grid():
    from patchkv_agent.calibration.reader_stage import BUILTIN
    from patchkv_agent.core.settings import RecoverySettings

    s = RecoverySettings()
    assert BUILTIN == rule_name({"min_share": s.reader_min_share, "min_blocks": s.reader_min_blocks,
                                 "attention_blocks": s.reader_attention_blocks, "budget": s.reader_budget})
    assert BUILTIN in [r["name"] for r in rule_grid()]


def test_rule_grid_is_the_product_with_off_first_and_checks_values():
    g = rule_grid(min_shares=(0.1, 0.2), min_blocks=(3,), attention_blocks=(0, 2), budgets=(0.25,))
    assert [r["name"] for r in g] == [OFF, "s0.1-b3-a0-g0.25", "s0.1-b3-a2-g0.25", "s0.2-b3-a0-g0.25",
                                      "s0.2-b3-a2-g0.25"]
    assert g[2] == {"name": "s0.1-b3-a2-g0.25", "min_share": 0.1, "min_blocks": 3, "attention_blocks": 2,
                    "budget": 0.25}
    assert len(rule_grid()) == 1 + 3 * 2 * 2 * 2 and rule_name({"name": OFF}) == OFF
    for bad in (dict(min_shares=(1.5,)), dict(min_blocks=(-1,)), dict(attention_blocks=(0.5,)),
                dict(budgets=(True,))):
        with pytest.raises(ValueError, match="reader rule"):
            rule_grid(**bad)
    with pytest.raises(ValueError, match="empty"):
        rule_grid(min_shares=(), off=False)


def _cell(follows, n, cost=0.0):
    return {"follows": follows, "n": n, "recompute_tokens_mean": cost}


def test_choose_rule_takes_the_cheapest_rule_meeting_the_target_on_every_workload():
    grid = {"off": _cell(0, 0, 100), "cheap": _cell(0, 0, 120), "wide": _cell(0, 0, 200), "huge": _cell(0, 0, 300)}
    a = {"off": _cell(7, 10), "cheap": _cell(10, 10), "wide": _cell(10, 10), "huge": _cell(10, 10)}
    b = {"off": _cell(3, 4), "cheap": _cell(3, 4), "wide": _cell(4, 4), "huge": _cell(4, 4)}
    assert choose_rule({"a": a, "b": b}, grid, 0.95) == "wide"  # pooled, cheap would reach 13/14 = 0.93 < 0.95
    assert choose_rule({"a": a}, grid, 0.95) == "cheap"
    assert choose_rule({"a": a, "b": b}, grid, 0.7) == "off"
    # a workload without a version where exact follows does not count
    empty = {k: _cell(0, 0) for k in grid}
    assert choose_rule({"a": a, "empty": empty}, grid, 0.95) == "cheap"
    # none reaches it: the highest worst-workload rate, ties to the cheaper rule
    c = {"off": _cell(1, 4), "cheap": _cell(2, 4), "wide": _cell(3, 4), "huge": _cell(3, 4)}
    assert choose_rule({"a": a, "c": c}, grid, 0.95) == "wide"
    # the agreement floor (the built-in rule's count of continuations equal to exact's): a rule that follows as
    # well but agrees less is not chosen, however cheap
    # per workload: pooled, cheap agrees as often as wide; on workload b it agrees less
    agreeing = {k: {**v, "agree": x} for (k, v), x in zip(grid.items(), (50, 55, 56, 59))}
    a2 = {k: {**v, "agree": x} for (k, v), x in zip(a.items(), (40, 44, 40, 45))}
    b2 = {k: {**v, "agree": x} for (k, v), x in zip(b.items(), (10, 11, 16, 14))}
    floor = {"a": 40, "b": 16}  # the built-in rule's ("wide")
    assert choose_rule({"a": a2, "b": {**b2, "cheap": {**b2["cheap"], "follows": 4}}}, agreeing, 0.95,
                       agree_floor=floor) == "wide"
    assert choose_rule({"a": a2, "b": {**b2, "cheap": {**b2["cheap"], "follows": 4}}}, agreeing, 0.95,
                       agree_floor={"a": 40, "b": 11}) == "cheap"
    # no rule reaches 0.95 on c (3 / 4 at best): the target becomes 0.75, reached by wide and huge; then the
    # floor and the cost choose, as before (a version no rule follows must not make the choice cost-blind)
    c2 = {k: {**v, "agree": 1} for k, v in c.items()}
    assert choose_rule({"a": a2, "c": c2}, agreeing, 0.95, agree_floor={"a": 40}) == "wide"
    assert choose_rule({"a": a2, "c": c2}, agreeing, 0.95, agree_floor={"a": 45}) == "huge"
    # ... and when neither meets the floor, the more agreeing one
    assert choose_rule({"a": a2, "c": c2}, agreeing, 0.95, agree_floor={"a": 46}) == "huge"
    with pytest.raises(ValueError, match="other rules"):
        choose_rule({"a": {"off": _cell(1, 1)}}, grid, 0.95)
    with pytest.raises(ValueError, match="follows <= n"):
        choose_rule({"a": {**a, "off": _cell(5, 4)}}, grid, 0.95)
    with pytest.raises(ValueError, match="target"):
        choose_rule({"a": a}, grid, 1.5)
    with pytest.raises(ValueError, match="empty"):
        choose_rule({}, {}, 0.9)


# --- the stage end to end on a tiny engine, against resumes run here -----------------------------------------------------


# the `engine` fixture (conftest.py); token ids only (the lexical signal reads token ids)
ENGINE = dict(max_positions=1024)


def _follow_like_trace(i: int, rng, n: int = 240, vocab: int = 211) -> dict:
    """An edited record early on whose changed tokens recur in later records (readers of the edit)."""
    v0 = rng.integers(3, vocab, n).tolist()
    old_val, new_val = [int(x) for x in rng.choice(np.arange(3, vocab), 2, replace=False)]
    v0[30:34] = [old_val] * 4
    for at in (120, 170, 215):  # later records mention the edited value
        v0[at] = old_val
    v1 = list(v0)
    v1[30:34] = [new_val] * 4
    for at in (120, 170, 215):
        v1[at] = new_val
    return {"id": f"follow-syn/{i}", "workload": "follow-syn" if i % 2 else "follow-syn2",
            "versions": [{"token_ids": v0}, {"token_ids": v1}]}


def _with_gold(eng, traces):
    """Each version's gold: its exact greedy output (so 'follows' means 'takes exact's answer')."""
    out = []
    for tr in traces:
        vs = [dict(v, answers=[tuple(eng.resume(None, v["token_ids"], strategy="exact",
                                                max_new_tokens=TOKENS).output_ids)]) for v in tr["versions"]]
        out.append({**tr, "versions": vs})
    return out


def _judge(out, gold):
    return None if not gold else tuple(out[:TOKENS]) in gold  # the stage may decode more tokens than the gold has


def test_stage_scores_every_rule_as_a_direct_resume_does(engine):
    rng = np.random.default_rng(5)
    traces = _with_gold(engine, [_follow_like_trace(i, rng) for i in range(3)])
    rules = rule_grid(min_shares=(0.05, 0.5), min_blocks=(0, 6), attention_blocks=(0, 2), budgets=(0.25,))
    rows: list[dict] = []
    out = select_reader_rule(engine, traces, rules=rules, max_new_tokens=TOKENS, judge=_judge, progress=False,
                             rows=rows)
    json.dumps(out)
    assert out["n_scored"] == 3 and out["n_exact_follows"] == 3 and len(rows) == 3
    assert out["resumes"] < len(rules) * 3  # rules planning the same rows share one resume
    for tr, row in zip(traces, rows):
        ids0, ids1 = tr["versions"][0]["token_ids"], tr["versions"][1]["token_ids"]
        ckpt = engine.checkpoint(ids0)
        ref = tr["versions"][1]["answers"][0]
        for rule in rules:
            kw = ({"readers": "none"} if rule["name"] == OFF else
                  {"readers": "lexical", "reader_min_share": rule["min_share"], "reader_min_blocks": rule["min_blocks"],
                   "reader_attention_blocks": rule["attention_blocks"], "reader_budget": rule["budget"]})
            got = engine.resume(ckpt, ids1, strategy=PatchKVStrategy(**kw), max_new_tokens=TOKENS)
            cell = row["results"][rule["name"]]
            assert cell["follows"] == (tuple(got.output_ids) == ref) == cell["agree"]
            assert cell["recompute_tokens"] == got.stats["recompute_tokens"]
    # the readers fire: some rule recomputes more than off, and a wider rule never recomputes less
    cost = {k: v["recompute_tokens_mean"] for k, v in out["grid"].items()}
    assert max(cost.values()) > cost[OFF]
    assert cost["s0.05-b6-a2-g0.25"] >= cost["s0.05-b0-a0-g0.25"]
    assert out["agree_floor"] is None  # the built-in rule is not in this grid
    assert out["chosen"] == choose_rule(out["grid_by_workload"], out["grid"], 0.95)
    assert out["chosen_rule"]["name"] == out["chosen"] and out["workloads"] == ["follow-syn", "follow-syn2"]
    assert out["settings"]["recent_window"] == 0
    whole = select_reader_rule(engine, traces, rules=rules, max_new_tokens=TOKENS, judge=_judge, recent_window=4096,
                               progress=False)
    assert whole["resumes"] == 3 and len({v["recompute_tokens_mean"] for v in whole["grid"].values()}) == 1
    assert whole["chosen"] == OFF  # every rule ties (the whole suffix recomputed): the first, cheapest one


def test_stage_needs_a_version_where_exact_follows_and_checks_its_options(engine):
    rng = np.random.default_rng(2)
    tr = _follow_like_trace(0, rng)
    with pytest.raises(ValueError, match="exact answers the gold in none"):
        select_reader_rule(engine, [tr], rules=rule_grid(min_shares=(0.1,), min_blocks=(3,), attention_blocks=(2,),
                                                         budgets=(0.25,)), max_new_tokens=TOKENS,
                           judge=lambda out, gold: False, progress=False)
    with pytest.raises(ValueError, match="no edit-following traces"):
        select_reader_rule(engine, [], judge=_judge, progress=False)
    with pytest.raises(ValueError, match="distinct reader rules"):
        select_reader_rule(engine, [tr], rules=[{"name": OFF}, {"name": OFF}], judge=_judge, progress=False)
    with pytest.raises(ValueError, match="target"):
        select_reader_rule(engine, [tr], target=-0.1, judge=_judge, progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):
        select_reader_rule(engine, [tr], max_new_tokens=0, judge=_judge, progress=False)
    with pytest.raises(ValueError, match="recent_window"):
        select_reader_rule(engine, [tr], recent_window=-1, judge=_judge, progress=False)


# --- the profile's reader_rule --------------------------------------------------------------------------------------------


def _profile(**extra):
    return {"schema": 1, "model": "tiny", "fingerprint": "f", "length_model": {"weights": [2.0] + [0.0] * 6},
            "kappa": 0.0, "block_size": 8, "readers": "lexical", **extra}


def test_with_reader_rule_writes_what_the_profile_loader_turns_into_settings(engine):
    from patchkv_agent.engine import PatchKVEngine
    from patchkv_agent.profiles import Profile

    rule = {"name": "s0.2-b1-a0-g0.5", "min_share": 0.2, "min_blocks": 1, "attention_blocks": 0, "budget": 0.5}
    out = with_reader_rule(_profile(recent_window=64), {"chosen": rule["name"], "chosen_rule": rule})
    keys = list(out)
    assert keys.index("reader_rule") == keys.index("readers") + 1 and out["recent_window"] == 64
    s = PatchKVEngine(engine.model, profile=Profile.from_dict(out)).settings
    assert (s.readers, s.reader_min_share, s.reader_min_blocks, s.reader_attention_blocks, s.reader_budget) == (
        "lexical", 0.2, 1, 0, 0.5)
    off = with_reader_rule(out, {"chosen": OFF, "chosen_rule": {"name": OFF}})
    assert off["readers"] == "none" and "reader_rule" not in off
    skipped = with_reader_rule(_profile(), {"chosen": None, "skipped": "why"})
    assert skipped["readers"] == "lexical" and "reader_rule" not in skipped
    assert skipped["reader_rule_selection"]["skipped"] == "why"
    # a profile without reader_rule keeps the built-in constants
    base = PatchKVEngine(engine.model, profile=Profile.from_dict(_profile())).settings
    assert (base.reader_min_share, base.reader_min_blocks, base.reader_attention_blocks) == (0.1, 3, 2)


@pytest.mark.parametrize("rule,match", [
    ([1, 2], "not an object"),
    ({"min_share": 2.0}, "min_share"),
    ({"min_blocks": -1}, "min_blocks"),
    ({"attention_blocks": 1.5}, "attention_blocks"),
    ({"budget": float("nan")}, "budget"),
    ({"min_share": True}, "min_share"),
    ({"typo": 1}, "unknown keys"),
])
def test_a_malformed_reader_rule_names_the_field_and_the_fix(rule, match):
    from patchkv_agent.profiles import Profile

    with pytest.raises(ValueError, match=match) as e:
        Profile.from_dict(_profile(reader_rule=rule), path="p.json")
    assert "recalibrate" in str(e.value) and "p.json" in str(e.value)


def test_settings_and_strategy_check_the_reader_constants():
    from patchkv_agent.core.settings import RecoverySettings

    for bad in (dict(reader_min_share=1.5), dict(reader_min_blocks=-1), dict(reader_attention_blocks=True)):
        with pytest.raises(ValueError, match="reader_"):
            RecoverySettings(**bad)
        with pytest.raises(ValueError, match="reader_"):
            PatchKVStrategy(**bad)


# --- calibrate's options ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv,match", [
    (["--reader-workloads", "follow-nope"], "--reader-workloads"),
    (["--reader-workloads", "all", "--reader-n", "0"], "--reader-n"),
    (["--reader-target", "1.5"], "--reader-target"),
])
def test_calibrate_rejects_bad_reader_options_before_loading_a_model(argv, match):
    from patchkv_agent.calibration.cli import build_calibrate_parser, check_calibrate_args
    from patchkv_agent.usage import UsageError

    with pytest.raises(UsageError, match=match):
        check_calibrate_args(build_calibrate_parser().parse_args(argv))


def test_reader_workloads_all_names_the_templates_and_the_held_out_shapes():
    from patchkv_agent.calibration.cli import _reader_workloads
    from patchkv_agent.eval.follow import FOLLOW_WORKLOADS, HELDOUT_WORKLOADS

    assert _reader_workloads("all") == list(FOLLOW_WORKLOADS) + list(HELDOUT_WORKLOADS)
    assert _reader_workloads("none") == [] == _reader_workloads("")
    assert _reader_workloads("follow-alias,follow-alias") == ["follow-alias"]


def test_calibrate_wiring_writes_the_chosen_rule_and_its_rows(engine, tmp_path, monkeypatch):
    import patchkv_agent.calibration.reader_stage as stage
    from patchkv_agent.calibration.cli import _reader_stage, build_calibrate_parser
    from patchkv_agent.calibration.outputs import save_rows, write_profile
    from patchkv_agent.profiles import read_profile

    profile = tiny_profile(engine, readers=("lexical",), model_name="tiny-reader")
    args = build_calibrate_parser().parse_args(["--reader-workloads", "all", "--no-progress"])
    traces = _with_gold(engine, [_follow_like_trace(i, np.random.default_rng(9)) for i in range(2)])
    before = engine.settings
    monkeypatch.setattr(stage, "_judge", lambda eng: _judge)  # no tokenizer: the gold is exact's output ids
    try:
        out = _reader_stage(engine, profile, traces, args, "pytest")
        skipped = _reader_stage(engine, profile, [{**t, "versions": [{"token_ids": v["token_ids"]} for v in
                                                                       t["versions"]]} for t in traces], args, "pytest")
    finally:
        engine.settings = before  # the module's engine is shared
    sel = out["reader_rule_selection"]
    assert sel["chosen"] in sel["grid"] and sel["n_per_workload"] == 8 and out["timing"]["reader_stage_s"] >= 0
    assert sel["settings"]["block_size"] == profile["block_size"]
    loaded = read_profile(write_profile(out, tmp_path / "tiny-reader.json"))
    if sel["chosen"] == OFF:
        assert loaded.readers == "none" and not loaded.reader_rule
    else:
        assert loaded.reader_rule["reader_min_share"] == sel["chosen_rule"]["min_share"]
    stages = [json.loads(x)["stage"] for x in save_rows(out, tmp_path / "r.jsonl").read_text().splitlines()]
    assert stages.count("reader") == 2
    # versions without gold answers: nothing to choose by, the profile keeps its setting and says why
    assert "reader_rule" not in skipped and skipped["readers"] == profile["readers"]
    assert "exact answers the gold in none" in skipped["reader_rule_selection"]["skipped"]

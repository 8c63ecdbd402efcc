"""Edit-following: the template workloads, answer matching, follow/stale rates, and the lexical reader blocks."""

from __future__ import annotations

import numpy as np
import pytest

from patchkv_agent.core.diff import diff_versions
from patchkv_agent.core.plan import LengthModel, plan_repair, plan_suffix_blocks
from patchkv_agent.core.readers import READER_MIN_BLOCKS, lexical_reader_scores
from patchkv_agent.core.settings import RecoverySettings
from benchmarks.bench import summarize
from patchkv_agent.eval.follow import FOLLOW_WORKLOADS, HELDOUT_WORKLOADS, build_follow_traces
from patchkv_agent.eval.metrics import answer_match
from patchkv_agent.eval.traces import validate_trace
from patchkv_agent.eval.workloads import build_traces
from kv_helpers import plan_settings


@pytest.mark.parametrize("workload", sorted(FOLLOW_WORKLOADS) + sorted(HELDOUT_WORKLOADS))
def test_follow_episodes_change_their_gold_answer_through_one_early_edit(workload):
    traces = build_follow_traces(workload, n=40)
    assert len(traces) == 40 and len({t["id"] for t in traces}) == 40
    for t in traces:
        validate_trace(t)
        v0, v1 = (v["messages"] for v in t["versions"])
        a0, a1 = (v["answers"] for v in t["versions"])
        assert not set(a0) & set(a1) and t["answers"] == a1 and t["meta"]["old_answers"] == a0
        # one tool result differs, the question (last message) is the same and far from it
        diff = [i for i, (x, y) in enumerate(zip(v0, v1)) if x != y]
        assert len(v0) == len(v1) and len(diff) == 1 and v0[diff[0]]["role"] == "tool"
        assert v0[-1] == v1[-1] and v0[-1]["role"] == "user" and len(v0) - diff[0] >= 6
        assert t["meta"]["edits"][0]["spans"] == [{"old": [diff[0], diff[0] + 1], "new": [diff[0], diff[0] + 1]}]
        # the gold of each version is stated in that version's tool results (retraction: v1 says no record)
        tools0 = " ".join(m["content"] for m in v0 if m["role"] == "tool")
        if workload not in ("follow-count",):
            assert a0[0] in tools0
        if workload in HELDOUT_WORKLOADS and workload != "follow-repeated":
            assert a1[0] in " ".join(m["content"] for m in v1 if m["role"] == "tool")
    assert build_follow_traces(workload, n=40) == traces  # deterministic
    assert build_traces(workload, "all", n=5) == traces[:5]  # reachable through the common builder
    calib = build_follow_traces(workload, n=5, split="calib")
    assert not {t["id"] for t in calib} & {t["id"] for t in traces}


def test_follow_builder_refuses_bad_arguments():
    with pytest.raises(ValueError, match="unknown edit-following workload"):
        build_follow_traces("follow-nothing")
    with pytest.raises(ValueError, match="split"):
        build_follow_traces("follow-lookup", split="test")
    with pytest.raises(ValueError, match="n_fillers"):
        build_follow_traces("follow-lookup", n_fillers=1)


def test_two_hop_gold_follows_the_edited_relation():
    for t in build_follow_traces("follow-twohop", n=10):
        for v in t["versions"]:
            boss = v["messages"][2]["content"].split(" is ")[1].rstrip(".")  # "<person>'s boss is <M>."
            room = next(m["content"] for m in v["messages"] if m["role"] == "tool"
                        and m["content"].startswith(f"{boss} works in room "))
            assert room.endswith(f"room {v['answers'][0]}.")


@pytest.mark.parametrize("text, answers, expected", [
    ("Oscar lives in Nairobi.", ["Nairobi"], True),
    ("The city is nairobi!", ["Nairobi"], True),
    ("Nairobians are nice.", ["Nairobi"], False),  # whole words only
    ("\n\nThe room is 63.", ["63"], True),
    ("The room is 630.", ["63"], False),
    ("There are two open tickets.", ["2", "two"], True),
    ("The tool found no record for the parcel.", ["unknown", "no record"], True),
    ("It is in Perth.\nNot in Oslo.", ["Oslo"], False),  # the first non-empty line only
    ("", ["Oslo"], False),
    ("Oslo", [], False),
])
def test_answer_match(text, answers, expected):
    assert answer_match(text, answers) is expected


def test_answer_match_looks_at_leading_words_only():
    text = " ".join(["word"] * 30) + " Oslo"
    assert not answer_match(text, ["Oslo"]) and answer_match(text, ["Oslo"], words=31)


def _row(ep, strategy, follows, stale, ttft=0.1):
    return {"id": ep, "version": 1, "workload": "follow-x", "strategy": strategy, "ttft_s": ttft,
            "follows": follows, "stale": stale, "model": "m", "recompute_tokens": 10}


def test_follow_and_stale_rates_are_conditioned_on_exact():
    rows = [_row("a", "exact", True, False), _row("b", "exact", True, False), _row("c", "exact", False, True),
            _row("d", "exact", False, False),
            _row("a", "direct", False, True), _row("b", "direct", True, False), _row("c", "direct", False, True),
            _row("d", "direct", False, True)]
    g = summarize(rows)["by_workload"]["follow-x"]
    # follow: among a, b (exact follows): direct follows b -> 1/2; stale: among a, b, d (exact not stale):
    # direct is stale on a and d -> 2/3 (c does not count: exact itself gives the old answer there)
    assert g["direct"]["follow_rate"] == pytest.approx(0.5) and g["direct"]["follow_n"] == 2
    assert g["direct"]["stale_rate"] == pytest.approx(2 / 3) and g["direct"]["stale_n"] == 3
    assert g["exact"]["follow_rate"] == 1.0 and g["exact"]["stale_rate"] == 0.0
    qa = summarize([{"id": "a", "strategy": "exact", "ttft_s": 1.0, "workload": "w"}])["by_workload"]["w"]
    assert qa["exact"]["follow_rate"] is None and qa["exact"]["follow_n"] == 0


# ------------------------------------------------------------------------------------- lexical reader blocks

def _context(n_blocks=8, size=4, edit_block=1, reader_block=5, rare=900, new_rare=901):
    """A context of ``n_blocks`` blocks of ``size`` tokens; block ``edit_block`` holds the rare token that
    the edit replaces; block ``reader_block`` mentions it too; every block holds common token 7."""
    old = np.arange(n_blocks * size, dtype=np.int64) + 100
    old[::size] = 7  # a token in every block: never rare
    old[edit_block * size + 1] = rare
    old[reader_block * size + 2] = rare
    new = old.copy()
    new[edit_block * size + 1] = new_rare
    return old, new


def test_lexical_readers_find_the_blocks_that_mention_the_edit():
    old, new = _context()
    edit = diff_versions(old, new, min_match=2)
    blocks = plan_suffix_blocks(edit, block_size=4)
    scores = lexical_reader_scores(edit, blocks)
    reader = np.searchsorted(blocks.starts, 5 * 4 + 2, side="right") - 1
    assert scores[reader] > 0 and np.count_nonzero(scores) == 1
    plan0 = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4, readers="none"))
    plan1 = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4, readers="lexical",
                                                  reader_budget=1.0))
    assert reader not in plan0.repair_blocks and reader in plan1.repair_blocks and plan1.n_readers == 1
    assert set(plan1.recompute_positions) - set(plan0.recompute_positions) == set(range(blocks.starts[reader],
                                                                                          blocks.ends[reader]))
    # the plan still partitions the context
    assert plan1.prefix_len + plan1.n_restore + plan1.n_recompute == len(new)


def test_lexical_readers_an_inserted_entity_counts_as_well():
    old, new = _context(rare=7)  # nothing rare removed ...
    new[5 * 4 + 3] = 950  # ... but the reader block already names the entity the edit brings in
    old[5 * 4 + 3] = 950
    new[1 * 4 + 1] = 950
    edit = diff_versions(old, new, min_match=2)
    blocks = plan_suffix_blocks(edit, block_size=4)
    scores = lexical_reader_scores(edit, blocks)
    assert np.count_nonzero(scores) == 1 and scores[np.searchsorted(blocks.starts, 23, side="right") - 1] > 0


def test_lexical_readers_budget_common_tokens_and_missing_ids():
    old, new = _context(n_blocks=40)
    for b in (3, 4, 6):  # more blocks mention the rare token (df 5 <= 0.1 * 41 blocks ... or READER_MIN_DF)
        old[b * 4 + 3] = 900
        new[b * 4 + 3] = 900
    edit = diff_versions(old, new, min_match=2)
    blocks = plan_suffix_blocks(edit, block_size=4)
    assert np.count_nonzero(lexical_reader_scores(edit, blocks)) == 4
    base = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4))
    for budget in (0.25, 1.0):
        plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4,
                                                     readers="lexical", reader_budget=budget))
        # reader blocks add at most `budget` of the other recompute (in blocks, rounded up) or
        # READER_MIN_BLOCKS blocks, whichever is more
        want = min(4, max(READER_MIN_BLOCKS, int(np.ceil(budget * base.n_recompute / 4))))
        assert plan.n_readers == want and plan.n_recompute - base.n_recompute == 4 * plan.n_readers
    assert READER_MIN_BLOCKS < 4  # the floor, not the candidates, bounded the first case
    assert plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4, readers="lexical",
                                                 reader_budget=0.0)).n_readers == 0
    # a token in more than max_df of the blocks (and more than READER_MIN_DF blocks) is not rare
    for b in (10, 12, 14, 16, 18):
        old[b * 4 + 3] = 900
        new[b * 4 + 3] = 900
    edit = diff_versions(old, new, min_match=2)
    assert np.count_nonzero(lexical_reader_scores(edit, plan_suffix_blocks(edit, block_size=4))) == 0
    # an Edit built without ids has no lexical signal
    bare = type(edit)(old_len=edit.old_len, new_len=edit.new_len, prefix_len=edit.prefix_len, spans=edit.spans,
                      segments=edit.segments)
    assert not lexical_reader_scores(bare, blocks).any()
    with pytest.raises(ValueError, match="max_df"):
        lexical_reader_scores(edit, blocks, max_df=0.0)
    with pytest.raises(ValueError, match="readers"):
        plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), readers="semantic"))
    with pytest.raises(ValueError, match="reader_budget"):
        plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), reader_budget=1.5))


def test_settings_validate_reader_fields():
    assert RecoverySettings().readers == "lexical"
    with pytest.raises(ValueError, match="readers"):
        RecoverySettings(readers="attention")
    with pytest.raises(ValueError, match="reader_budget"):
        RecoverySettings(reader_budget=-0.1)
    with pytest.raises(ValueError, match="reader_budget"):
        RecoverySettings(reader_budget=True)


def test_diff_keeps_the_callers_arrays_writable():
    old, new = _context()
    edit = diff_versions(old, new, min_match=2)
    old[0] = 1  # still writable, and the edit keeps what was diffed
    assert not edit.old_ids.flags.writeable and edit.old_ids[0] == 7 and np.array_equal(edit.new_ids, new)


def test_a_block_sharing_one_word_with_a_replaced_passage_is_not_a_reader():
    """A bulk replacement (a passage of many rare tokens): one shared token is a small share of the edit's
    signature, so the block stays restored; the entity swap of the same block is a reader."""
    old, new = _context(n_blocks=40)
    span = slice(1 * 4, 3 * 4)  # the edit replaces two whole blocks with tokens seen nowhere else ...
    new = np.concatenate([new[:span.start], np.arange(2000, 2030), new[span.stop:]])
    old[5 * 4 + 3] = 2005  # ... and one later block of the old context already held one of them
    new[5 * 4 + 3 + 22] = 2005
    edit = diff_versions(old, new, min_match=2)
    blocks = plan_suffix_blocks(edit, block_size=4)
    scores = lexical_reader_scores(edit, blocks)
    assert 0 < scores.max() < 0.1  # the shared token is 1 of ~40 rare changed tokens
    plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4, readers="lexical"))
    assert plan.n_readers == 0


def test_an_edit_with_readers_also_refreshes_the_top_attention_blocks():
    from patchkv_agent.core.readers import READER_ATTENTION_BLOCKS

    old, new = _context(n_blocks=20)
    edit = diff_versions(old, new, min_match=2)
    blocks = plan_suffix_blocks(edit, block_size=4)
    scores = np.zeros(len(old), dtype=np.float32)
    scores[[9 * 4 + 1, 13 * 4 + 2, 16 * 4]] = [0.3, 0.5, 0.2]  # old positions in blocks 9, 13, 16
    base = plan_repair(edit, scores, plan_settings(length_model=LengthModel.fixed(0), block_size=4, readers="lexical"))
    no_scores = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4,
                                                      readers="lexical"))
    assert base.n_readers == no_scores.n_readers + READER_ATTENTION_BLOCKS
    added = set(base.recompute_positions) - set(no_scores.recompute_positions)
    top = {int(blocks.token_block[np.searchsorted(blocks.old_positions, p)]) for p in (13 * 4 + 2, 9 * 4 + 1)}
    want = set()
    for b in top:
        want |= set(range(blocks.starts[b], blocks.ends[b]))
    assert added == want  # the two highest-attention blocks, not the third
    # no reader, no top-up: an edit whose changed tokens appear nowhere else
    lone_old = np.arange(80, dtype=np.int64) + 100
    lone_new = lone_old.copy()
    lone_new[5] = 999
    e2 = diff_versions(lone_old, lone_new, min_match=2)
    p2 = plan_repair(e2, scores, plan_settings(length_model=LengthModel.fixed(0), block_size=4, readers="lexical"))
    assert p2.n_readers == 0


# ---------------------------------------------------------------- words, not token ids

_PIECES = {0: "ĠSofia", 1: "S", 2: "of", 3: "ia", 4: "Ġworks", 5: ".", 6: '"', 7: "Marc", 8: "us", 9: "ĠMarcus",
           10: "Ġroom", 11: "Ġ", 12: "9", 13: "6", 14: "ĠSOFIA", 15: "ila", 16: 'ia"', 17: "▁Sofia", 18: "Ċ"}


def test_word_index_gives_one_id_per_word_whatever_its_tokenization():
    from patchkv_agent.core.lexicon import WordIndex

    w = WordIndex(_PIECES.__getitem__)
    ids = np.asarray([0, 18, 1, 2, 3, 4, 6, 7, 8, 6, 9, 5, 11, 12, 13, 14, 17], dtype=np.int64)
    got = w(ids)
    sofia = got[0]
    # " Sofia" (one token), "S" "of" "ia" after a newline, " SOFIA", "▁Sofia": one word, every position of it
    assert sofia >= 0 and got[2] == got[3] == got[4] == got[15] == got[16] == sofia
    assert got[7] == got[8] == got[10] != sofia  # "Marc" "us" inside quotes == " Marcus"
    assert len({got[5], sofia, got[7]}) == 3
    assert got[1] == got[6] == got[9] == got[11] == got[12] == -1  # newline, quotes, period, a bare space
    assert got[13] == got[14] and got[13] >= 0  # "9" "6" is the number 96
    assert np.array_equal(w(ids), got)  # deterministic (cached pieces)
    # a token that ends in punctuation closes its word: 'ia"' then "Marc" are two words
    w2 = w(np.asarray([1, 2, 16, 7, 8], dtype=np.int64))
    assert w2[0] == w2[2] == sofia and w2[3] == w2[4] == got[7]
    assert w(np.zeros(0, dtype=np.int64)).shape == (0,)
    with pytest.raises(TypeError, match="callable"):
        WordIndex("not a function")
    with pytest.raises(TypeError, match="convert_ids_to_tokens"):
        WordIndex.from_tokenizer(object())


def test_lexical_readers_compare_words_so_a_name_respelled_later_is_found():
    """The edit swaps " Sofia" for " Marcus" (single tokens after a space); later records spell the names
    "S" "of" "ia" and "Marc" "us". Token ids miss both readers, words find both."""
    from patchkv_agent.core.lexicon import WordIndex

    w = WordIndex(_PIECES.__getitem__)
    filler = [10, 4, 5] * 12  # " room works ." boilerplate
    old = np.asarray([4, 10, 0, 5] + filler + [1, 2, 3, 4, 10, 12, 13, 5] + filler + [7, 8, 4, 10, 13, 12, 5]
                     + filler, dtype=np.int64)
    new = old.copy()
    new[2] = 9
    for kw in ({}, {"words": w}):
        edit = diff_versions(old, new, min_match=2, **kw)
        blocks = plan_suffix_blocks(edit, block_size=4)
        scores = lexical_reader_scores(edit, blocks)
        hit = {int(blocks.starts[b]) for b in np.flatnonzero(scores)}
        if not kw:
            assert not hit and edit.words() is None
        else:
            s_at, m_at = 4 + 36, 4 + 36 + 8 + 36  # the respelled Sofia, the respelled Marcus
            want = {int(blocks.starts[np.searchsorted(blocks.starts, p, side="right") - 1]) for p in
                    (s_at, s_at + 2, m_at, m_at + 1)}
            assert hit == want
            w1, w2 = edit.words(), edit.words()
            assert not w1[1].flags.writeable and w1[0] is w2[0] and w1[1] is w2[1]  # computed once
            plan = plan_repair(edit, None, plan_settings(length_model=LengthModel.fixed(0), block_size=4,
                                                         readers="lexical"))
            assert plan.n_readers == len(want)
    with pytest.raises(ValueError, match="one (word id per position|per position)"):
        diff_versions(old, new, words=lambda ids: np.zeros(3, dtype=np.int64)).words()


def test_calibration_pairs_of_follow_traces_score_follows_like_the_exact_reference():
    """Calibration on edit-following traces: the exact reference's answer is read from ``follow_tokens``
    greedy tokens; an ``exact`` resume of the pair then follows (and is stale) exactly when the reference
    does, and every row carries the fields the selection's follow target reads."""
    from tiny_models import chat_engine

    from patchkv_agent.calibration.config import CalibConfig
    from patchkv_agent.calibration.evaluation import ResumeConfig, evaluate_configs
    from patchkv_agent.calibration.profiling import episodes_from_traces, profile_episodes

    eng = chat_engine()
    traces = build_follow_traces("follow-lookup", n=2, split="calib")
    eps = episodes_from_traces(eng, traces)
    assert [e.answers for e in eps] == [tuple(tuple(v["answers"]) for v in t["versions"]) for t in traces]
    assert len({e.task for e in eps}) == 2  # each episode is its own task
    cfg = CalibConfig(ref_tokens=2, follow_tokens=6)
    pairs = profile_episodes(eng, eps, cfg, keep_tasks={e.task for e in eps})
    assert len(pairs) == 2 and all(len(p.ref_output_ids) == 6 for p in pairs)
    for p, t in zip(pairs, traces):
        text = eng.tokenizer.decode(p.ref_output_ids, skip_special_tokens=True)
        assert p.answers == tuple(t["versions"][1]["answers"]) and p.old_answers == tuple(t["versions"][0]["answers"])
        assert p.exact_follows == answer_match(text, list(p.answers))
        assert p.exact_stale == answer_match(text, list(p.old_answers))
    rows = evaluate_configs(eng, pairs, [ResumeConfig(strategy="exact", tags={"c": "exact"}),
                                         ResumeConfig(options={"readers": "lexical"}, tags={"c": "patchkv"})],
                            follow_tokens=6)
    assert len(rows) == 4
    for r in rows:
        assert {type(r[k]) for k in ("follows", "stale", "exact_follows", "exact_stale")} == {bool}
        if r["c"] == "exact":
            assert (r["follows"], r["stale"]) == (r["exact_follows"], r["exact_stale"])
            assert r["first_token_kl"] == pytest.approx(0.0, abs=1e-9) and r["tf_agree"] == 1.0

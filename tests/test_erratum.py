"""The erratum repair's note (what changed, from a message-level diff) and its replay: the note-exact arm is a full
prefill of the noted context, an exact strategy over the noted context gives the same tokens, and every row is
scored against exact on the true context."""

from __future__ import annotations

import pytest

from benchmarks.erratum import NOTE_EXACT, erratum_episode, erratum_note, noted_messages
from patchkv_agent.eval.traces import plain_messages
from tiny_models import chat_engine

ENGINE = chat_engine

SYS = {"role": "system", "content": "You answer with a short phrase."}
Q = {"role": "user", "content": "Where was the author born?"}


def _tool(text):
    return {"role": "tool", "content": text}


def test_a_replaced_result_is_quoted_old_and_new():
    old = [SYS, Q, _tool("Alpha Beta was born in Paris in 1901 and wrote novels."), _tool("Gamma is a river.")]
    new = [SYS, Q, _tool("Alpha Beta was born in Lyon in 1903 and wrote plays."), _tool("Gamma is a river.")]
    note = erratum_note(old, new)
    assert "tool result 3 was replaced" in note and "born in Lyon" in note and "born in Paris" in note
    terse = erratum_note(old, new, quote=False)
    assert terse == "[Context update: tool result 3 was replaced. The text shown is the current one.]"


def test_cleared_summarized_removed_and_appended():
    long = [_tool(f"result {i}: " + "word " * 30) for i in range(3)]
    old = [SYS, Q, *long]
    cleared = [SYS, Q, _tool("[cleared]"), _tool("[cleared]"), long[2]]
    assert erratum_note(old, cleared).startswith("Note on the context: 2 tool result(s) were cleared (tool result 3, "
                                                 "tool result 4)")
    summary = [SYS, {"role": "user", "content": "Summary: three results were read."}]
    last = _tool("the newest result")
    assert "the 4 messages from position 2 were replaced by a summary of 1 message(s)" in erratum_note(
        old + [last], summary + [last])
    assert "2 earlier message(s) were removed" in erratum_note(old, [SYS, Q, long[2]])
    # messages appended after the old ones are the call's own: nothing changed, no note
    assert erratum_note(old, old + [{"role": "assistant", "content": "ok"}, _tool("more")]) is None


def test_the_note_goes_at_the_end_or_before_the_last_message():
    old = [SYS, Q, _tool("Alpha Beta was born in Paris in 1901 and wrote many novels.")]
    new = [SYS, Q, _tool("Alpha Beta was born in Lyon in 1903 and wrote many plays.")]
    end, note = noted_messages(old, new)
    assert end[:-1] == new and end[-1] == {"role": "system", "content": note}
    before, _ = noted_messages(old, new, place="before-last")
    assert before[-1] == new[-1] and before[-2]["role"] == "system"
    same, none = noted_messages(old, old)
    assert same == old and none is None
    with pytest.raises(ValueError, match="place"):
        noted_messages(old, new, place="middle")


def _trace():
    facts = [f"Passage {i}: the river number {i} runs through the valley of town {i}." for i in range(6)]
    v0 = [SYS, Q] + [_tool(f) for f in facts]
    v1 = [SYS, Q] + [_tool(f) for f in facts[:2]] + [_tool("Passage 2: the author was born in the harbour town.")] \
        + [_tool(f) for f in facts[3:]]
    return {"id": "tiny/erratum", "workload": "tiny", "edit": "replace_tool_result",
            "versions": [{"messages": v0}, {"messages": v1}]}


def test_erratum_rows_against_exact_and_a_full_prefill_of_the_noted_context(engine, one_torch_thread):
    tr = _trace()
    rows = {r["strategy"]: r for r in erratum_episode(engine, tr, ["prefix", "direct", "erratum:prefix",
                                                                  "erratum:direct", NOTE_EXACT], max_new_tokens=6)}
    v0, v1 = (v["messages"] for v in tr["versions"])
    noted, note = noted_messages(v0, v1)
    ids, noted_ids = engine.encode(plain_messages(v1)), engine.encode(plain_messages(noted))
    exact = engine.resume(None, ids, strategy="exact", max_new_tokens=6)
    full_noted = engine.resume(None, noted_ids, strategy="exact", max_new_tokens=6)
    # the oracle: prefix is exact on the true context, and over the noted context it equals its full prefill
    assert rows["prefix"]["output_ids"] == list(exact.output_ids) and rows["prefix"]["next_action"]
    assert rows[NOTE_EXACT]["output_ids"] == list(full_noted.output_ids)
    assert rows["erratum:prefix"]["output_ids"] == list(full_noted.output_ids)
    assert rows[NOTE_EXACT]["next_action"] == (list(full_noted.output_ids) == list(exact.output_ids))
    # the erratum restores the suffix and recomputes the edit and the note: fewer rows than prefix
    assert rows["erratum:direct"]["note_tokens"] == len(noted_ids) - len(ids) > 0
    assert rows["erratum:direct"]["recompute_tokens"] < rows["erratum:prefix"]["recompute_tokens"]
    assert rows["erratum:direct"]["prompt_tokens"] == len(noted_ids) and rows["direct"]["prompt_tokens"] == len(ids)
    assert all(r["note"] == note and r["call_kind"] != "append" for r in rows.values())


def test_an_unknown_arm_is_refused(engine):
    with pytest.raises(ValueError, match="unknown arm"):
        list(erratum_episode(engine, _trace(), ["magic"]))
    with pytest.raises(ValueError, match="unknown arm"):
        list(erratum_episode(engine, _trace(), ["exact"]))

"""The erratum repair: instead of recomputing the stale readers of an edit, append a short note that says what
changed, and restore the rest of the suffix as it was.

A plan of this kind recomputes the edit's new tokens, the note and the last block; every other row of the
retained suffix is the checkpoint's (RoPE-corrected), computed against the content the edit replaced. The
note is one ``system`` message after the last message (so the next call's decision is made right after it),
built from a message-level diff of the two versions (:func:`erratum_note`): which messages were replaced,
cleared, summarized or removed, and what a replaced tool result reads now against what it read before.

Scored like any approximation: the next action on the noted context against exact's on the *true* edited
context (:func:`erratum_episode` yields result rows in the benchmark's format, so ``bench --summarize`` pools
them with the noise floor's rows of the same calls). ``note-exact`` (a full prefill of the noted context)
separates what the note itself does to the decision from what the stale rows do.

Boundary: the engine's public ``checkpoint`` / ``resume`` / ``checkpoint_from`` / ``encode`` and the trace and
metric helpers of :mod:`patchkv_agent.eval`; nothing about LangGraph.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterator, Sequence

from patchkv_agent.eval.metrics import NEXT_ACTION_TOKENS, fidelity, next_action_agree
from patchkv_agent.eval.replay import action_kind, version_call_kind
from patchkv_agent.eval.traces import APPEND, plain_messages

__all__ = ["erratum_note", "noted_messages", "erratum_episode", "ARMS", "NOTE_EXACT"]

NOTE_EXACT = "note-exact"  # a full prefill of the noted context (the note's own effect on the decision)
ARMS = ("prefix", "direct", "erratum:direct", NOTE_EXACT)  # default arms: prefix's time, no note, the erratum, the note alone
_QUOTE_WORDS = 14  # words of a replaced result quoted in the note (old and new)


def _text(m: dict) -> str:
    c = m.get("content")
    return c if isinstance(c, str) else str(c or "")


def _quote(s: str, words: int = _QUOTE_WORDS) -> str:
    w = s.split()
    return " ".join(w[:words]) + (" ..." if len(w) > words else "")


def _name(m: dict, i: int) -> str:
    role = m.get("role") or "message"
    return {"tool": f"tool result {i + 1}", "user": f"user message {i + 1}",
            "assistant": f"assistant message {i + 1}", "system": f"system message {i + 1}"}.get(role, f"message {i + 1}")


def erratum_note(old: Sequence[dict], new: Sequence[dict], *, quote: bool = True) -> str | None:
    """The note that states what changed between two versions of a conversation, or None when nothing before
    the new version's appended messages changed (an append-only call).

    The messages are aligned by (role, content) (:class:`difflib.SequenceMatcher`): a message replaced by one of
    the same role is *replaced* (a tool result whose new text is ``[cleared]``-like, shorter than 40 characters,
    is *cleared*; otherwise both texts are quoted, :data:`_QUOTE_WORDS` words each), several messages replaced
    by fewer are *summarized*, messages removed are *removed*. Messages appended at the end are the call's own
    and not mentioned.

    Args:
        old: the previous version's messages (role / content dicts).
        new: this version's messages.
        quote: quote a replaced result's old and new text (False: name the message only).

    Returns:
        The note's text, or None.
    """
    a = [(m.get("role"), _text(m)) for m in old]
    b = [(m.get("role"), _text(m)) for m in new]
    ops: list[tuple[str, int, int, int, int]] = []
    for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if ops and op[0] != "equal" and ops[-1][0] != "equal":  # adjacent changes are one change
            ops[-1] = ("replace", ops[-1][1], op[2], ops[-1][3], op[4])
        else:
            ops.append(op)
    # the messages appended after the last old message are the call's own: drop a trailing insert
    if ops and ops[-1][0] == "insert" and ops[-1][1] == len(a):
        ops = ops[:-1]
    parts: list[str] = []
    cleared: list[str] = []
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        if tag == "delete":
            parts.append(f"{i2 - i1} earlier message(s) were removed")
        elif tag == "insert":
            parts.append(f"{j2 - j1} message(s) were inserted at position {j1 + 1}")
        elif i2 - i1 == j2 - j1:  # replaced one for one
            for i, j in zip(range(i1, i2), range(j1, j2)):
                was, now = a[i][1], b[j][1]
                if len(now.strip()) < 40 and len(was) > len(now):
                    cleared.append(_name(new[j], j))
                elif quote:
                    parts.append(f"{_name(new[j], j)} was replaced: it now reads \"{_quote(now)}\" (it read "
                                 f"\"{_quote(was)}\")")
                else:
                    parts.append(f"{_name(new[j], j)} was replaced")
        elif j2 - j1 < i2 - i1:
            parts.append(f"the {i2 - i1} messages from position {i1 + 1} were replaced by a summary of "
                         f"{j2 - j1} message(s)")
        else:
            parts.append(f"{i2 - i1} message(s) from position {i1 + 1} were replaced by {j2 - j1} new ones")
    if cleared:
        parts.insert(0, f"{len(cleared)} tool result(s) were cleared ({', '.join(cleared[:6])}"
                        f"{', ...' if len(cleared) > 6 else ''}); what they said no longer holds")
    if not parts:
        return None
    if not quote:
        return "[Context update: " + "; ".join(parts) + ". The text shown is the current one.]"
    return ("Note on the context: " + "; ".join(parts) + ". The conversation above shows the current version; "
            "where anything after the change relies on what it replaced, the current version holds.")


PLACES = ("end", "before-last")  # the note after the last message, or just before it


def noted_messages(old: Sequence[dict], new: Sequence[dict], *, place: str = "end",
                   quote: bool = True) -> tuple[list[dict], str | None]:
    """``new`` with the erratum note as a ``system`` message (unchanged when there is no note): after the last
    message (``place="end"``), or just before it (``"before-last"``: the call's own last message, a question or
    the newest tool result, stays the last thing the model reads).

    Returns:
        ``(messages, note)``.

    Raises:
        ValueError: ``place`` not in :data:`PLACES`.
    """
    if place not in PLACES:
        raise ValueError(f"place must be one of {PLACES}, got {place!r}")
    note = erratum_note(old, new, quote=quote)
    msgs = [dict(m) for m in new]
    if note is not None:
        msgs.insert(len(msgs) if place == "end" else max(0, len(msgs) - 1), {"role": "system", "content": note})
    return msgs, note


def _row(engine, trace: dict, k: int, arm: str, res, ref, ref_text: str, note_tokens: int) -> dict[str, Any]:
    st = res.stats
    text = engine.tokenizer.decode(res.output_ids, skip_special_tokens=True)
    row: dict[str, Any] = {"id": trace.get("id"), "workload": trace.get("workload"), "edit": trace.get("edit"),
                           "call_kind": version_call_kind(trace, k), "version": k, "strategy": arm, "model": "",
                           "note_tokens": note_tokens}
    for f in ("prompt_tokens", "prefix_tokens", "new_tokens", "suffix_tokens", "recompute_tokens",
              "recompute_ratio", "payload_bytes", "ttft_s"):
        row[f] = st.get(f)
    row["output_ids"], row["output_text"] = list(res.output_ids), text
    row.update(fidelity(engine, res, ref))
    row["next_action"] = next_action_agree(text, ref_text)
    row["action_kind"] = action_kind(ref_text)
    row["fallback"] = st.fallback
    return row


def erratum_episode(engine, trace: dict, arms: Sequence[str] = ARMS, *, max_new_tokens: int = 16,
                    reference: dict | None = None, place: str = "end", quote: bool = True) -> Iterator[dict[str, Any]]:
    """Replay one episode's edited calls with the erratum arms; yields one result row per edited version and arm.

    Every version's base is the exact checkpoint of the version before it (what a healed chain holds when the
    call comes). A strategy spec (``prefix``, ``direct``, ``patchkv:tail_threshold=0.02`` ...) resumes the true
    context from it; ``erratum:<strategy>`` resumes the noted context with that strategy (``erratum:direct``: the new tokens, the note and the last block recomputed, the rest
    restored); :data:`NOTE_EXACT` is a full prefill of the noted context. Each is scored against exact's greedy
    continuation of the true context.

    Args:
        engine: a :class:`~patchkv_agent.engine.PatchKVEngine` with a tokenizer.
        trace: a trace with ``messages`` versions.
        arms: strategy specs, ``erratum:<strategy spec>`` and / or :data:`NOTE_EXACT`.
        max_new_tokens: greedy tokens (agent workloads: at least :data:`NEXT_ACTION_TOKENS`).
        reference: ``{(id, version): exact row}`` of an earlier run: each exact continuation here is checked
            against it (the row's ``reference_match``), so the rows pool with that run's floor.
        place, quote: where the note goes and whether it quotes (:func:`noted_messages`).

    Raises:
        ValueError: a version without ``messages``, or an arm that names no strategy.
    """
    from patchkv_agent.strategies import STRATEGIES, register_spec

    specs = {arm: register_spec(arm.split(":", 1)[1] if arm.startswith("erratum:") else arm)
             for arm in arms if arm != NOTE_EXACT}
    unknown = [a for a, s in specs.items() if s not in STRATEGIES or s == "exact"]
    if unknown:
        raise ValueError(f"unknown arm {unknown[0]!r}: use a strategy spec other than exact, erratum:<strategy> or "
                         f"{NOTE_EXACT}")
    versions = trace["versions"]
    if any("messages" not in v for v in versions):
        raise ValueError(f"trace {trace.get('id')!r}: the erratum arms need messages versions")
    if str(trace.get("workload") or "").startswith("agent-"):
        max_new_tokens = max(max_new_tokens, NEXT_ACTION_TOKENS)
    base = engine.checkpoint(engine.encode(plain_messages(versions[0]["messages"])))
    for k in range(1, len(versions)):
        msgs = versions[k]["messages"]
        ids = engine.encode(plain_messages(msgs))
        ref = engine.resume(None, ids, strategy="exact", max_new_tokens=max_new_tokens)
        ref_text = engine.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
        if version_call_kind(trace, k) != APPEND:
            noted, note = noted_messages(versions[k - 1]["messages"], msgs, place=place, quote=quote)
            noted_ids = engine.encode(plain_messages(noted))
            note_tokens = len(noted_ids) - len(ids)
            match = None
            if reference is not None:
                got = reference.get((trace.get("id"), k))
                match = None if got is None else list(got.get("output_ids") or []) == list(ref.output_ids)
            for arm in arms:
                if arm == NOTE_EXACT:
                    res = engine.resume(None, noted_ids, strategy="exact", max_new_tokens=max_new_tokens)
                else:
                    res = engine.resume(base, noted_ids if arm.startswith("erratum:") else ids, strategy=specs[arm],
                                        max_new_tokens=max_new_tokens)
                row = _row(engine, trace, k, arm, res, ref, ref_text, note_tokens)
                row["note"], row["reference_match"] = note, match
                yield row
        base = engine.checkpoint_from(ref)

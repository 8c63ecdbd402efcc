"""Trace replay: run every version of an episode under several strategies and score them against exact.

Follows the replay semantics of TRACES.md: version 0 is prefilled in a checkpoint-creation pass;
each later version is resumed from the thread's checkpoint with each strategy (every strategy from
its own chain of checkpoints, starting at the same version-0 checkpoint), decodes greedily, and the
resumed state becomes that strategy's checkpoint for the next version. ``exact`` is a full prefill
of each version and the reference for the fidelity fields.

Knows the engine's public methods and the trace/result formats; nothing about LangGraph.
"""

from __future__ import annotations

import collections
import json
import re
import string
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from ..engine import PatchKVEngine, ResumeResult
from ..core.recovery import to_dynamic_cache

RESULT_FIELDS = (
    "id", "workload", "edit", "version", "strategy", "model", "prompt_tokens", "prefix_tokens", "new_tokens",
    "suffix_tokens", "recompute_tokens", "recompute_ratio", "payload_bytes", "ttft_s", "plan_s", "restore_s",
    "recompute_s", "offload_s", "stats_s", "quantize_s", "output_ids", "output_text", "first_token_kl",
    "top1_agree", "tf_agree", "exact_continuation", "f1",
)


def version_ids(engine: PatchKVEngine, version: dict) -> list[int]:
    """Token ids of one trace version (``messages``, ``text`` or ``token_ids``).

    Raises:
        ValueError: the version has none of the three keys.
    """
    if "token_ids" in version:
        return [int(t) for t in version["token_ids"]]
    if "messages" in version:
        return engine.encode(plain_messages(version["messages"]))
    if "text" in version:
        return engine.encode(version["text"])
    raise ValueError("a trace version needs one of 'messages', 'text' or 'token_ids'")


def plain_messages(messages: list[dict]) -> list[dict]:
    """Messages a plain chat template can render: tool calls and results written out as text."""
    out = []
    for m in messages:
        role, content = m.get("role", "user"), m.get("content") or ""
        if m.get("tool_calls"):
            calls = "\n".join(
                "<tool_call>" + json.dumps({"name": c.get("name"), "arguments": c.get("args", {})}) + "</tool_call>"
                for c in m["tool_calls"])
            content = (content + "\n" + calls).strip()
        if role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    return out


# --------------------------------------------------------------------------- scoring

def normalize_answer(s: str) -> str:
    """SQuAD answer normalisation: lower case, no punctuation, no articles, single spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def token_f1(prediction: str, answers: Iterable[str]) -> float:
    """Max SQuAD token F1 of ``prediction`` over ``answers``."""
    best = 0.0
    pred = normalize_answer(prediction).split()
    for ans in answers:
        gold = normalize_answer(ans).split()
        common = collections.Counter(pred) & collections.Counter(gold)
        same = sum(common.values())
        if not pred or not gold:
            f1 = float(pred == gold)
        elif same == 0:
            f1 = 0.0
        else:
            p, r = same / len(pred), same / len(gold)
            f1 = 2 * p * r / (p + r)
        best = max(best, f1)
    return best


@torch.no_grad()
def teacher_forced_agreement(engine: PatchKVEngine, res: ResumeResult, ref_ids: list[int]) -> float:
    """Fraction of steps whose argmax equals ``ref_ids`` when feeding ``ref_ids`` over ``res``'s KV."""
    if not ref_ids:
        return 1.0
    preds = [int(res.logits.argmax())]
    if len(ref_ids) > 1:
        cache = to_dynamic_cache(engine.model, res.keys, res.values)
        n = len(res.context_ids)
        feed = torch.tensor([ref_ids[:-1]], device=engine.device)
        pos = torch.arange(n, n + len(ref_ids) - 1, device=engine.device)[None]
        logits = engine.model(input_ids=feed, position_ids=pos, cache=cache, use_cache=True).logits[0]
        preds += logits.argmax(-1).tolist()
    return sum(int(a == b) for a, b in zip(preds, ref_ids)) / len(ref_ids)


def first_token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """KL(ref || other) of the first-token distributions, in nats."""
    p = torch.log_softmax(ref_logits.double(), -1)
    q = torch.log_softmax(logits.double(), -1)
    return float((p.exp() * (p - q)).sum().clamp_min(0.0))


# --------------------------------------------------------------------------- replay

def replay_episode(engine: PatchKVEngine, trace: dict, strategies: list[str], *, max_new_tokens: int = 16,
                   model_name: str = "") -> Iterator[dict[str, Any]]:
    """Replay one episode; yields one result row (TRACES.md fields) per version >= 1 and strategy.

    Args:
        engine: the engine.
        trace: a TRACES.md episode.
        strategies: names; ``exact`` is always run (it is the reference) and reported if listed.
        max_new_tokens: greedy tokens per resume.
        model_name: value of the ``model`` field.

    Raises:
        ValueError: malformed trace (fewer than two versions).
    """
    versions = trace.get("versions") or []
    if len(versions) < 2:
        raise ValueError(f"trace {trace.get('id')!r} needs at least two versions to replay")
    ids = [version_ids(engine, v) for v in versions]
    base = engine.checkpoint(ids[0])
    chain = {s: base for s in strategies if s != "exact"}
    answers = trace.get("answers")
    for k in range(1, len(ids)):
        ref = engine.resume(None, ids[k], strategy="exact", max_new_tokens=max_new_tokens)
        for s in strategies:
            res = ref if s == "exact" else engine.resume(chain[s], ids[k], strategy=s, max_new_tokens=max_new_tokens)
            row = _row(engine, trace, k, s, res, ref, answers, model_name)
            if s != "exact" and k < len(ids) - 1:  # the last version has no successor to resume
                chain[s] = engine.checkpoint_from(res)
            yield row


def _row(engine, trace, k, strategy, res: ResumeResult, ref: ResumeResult, answers, model_name) -> dict:
    st = res.stats
    text = engine.tokenizer.decode(res.output_ids, skip_special_tokens=True) if engine.tokenizer else ""
    row: dict[str, Any] = {
        "id": trace.get("id"), "workload": trace.get("workload"), "edit": trace.get("edit"), "version": k,
        "strategy": strategy, "model": model_name,
    }
    for f in ("prompt_tokens", "prefix_tokens", "new_tokens", "suffix_tokens", "recompute_tokens",
              "recompute_ratio", "payload_bytes", "ttft_s", "plan_s", "restore_s", "recompute_s", "offload_s",
              "stats_s", "quantize_s"):
        row[f] = st.get(f)
    if strategy in ("exact", "prefix"):
        row["payload_bytes"] = 0
    row["output_ids"] = list(res.output_ids)
    row["output_text"] = text
    if strategy == "exact":
        row.update(first_token_kl=None, top1_agree=None, tf_agree=None, exact_continuation=None)
    else:
        row.update(
            first_token_kl=first_token_kl(ref.logits, res.logits),
            top1_agree=bool(int(ref.logits.argmax()) == int(res.logits.argmax())),
            tf_agree=teacher_forced_agreement(engine, res, ref.output_ids),
            exact_continuation=bool(res.output_ids == ref.output_ids),
        )
    row["f1"] = token_f1(text, answers) if answers else None
    row["fallback"] = st.get("fallback")
    for key, val in st.items():  # optional extras (TRACES.md allows new fields): restore_tokens, cacheblend_*
        if key not in row and key != "strategy" and isinstance(val, (int, float, str, bool, list, type(None))):
            row[key] = val
    return row


def read_jsonl(path: str | Path) -> list[dict]:
    """Read a JSON Lines file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(rows: Iterable[dict], path: str | Path) -> None:
    """Write rows as JSON Lines (parent directories created)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


# ------------------------------------------------------------------ traces from a LangGraph checkpointer

def traces_from_checkpointer(spec: str, thread_ids: Iterable[str] | None = None, *, workload: str = "checkpointer",
                             checkpoint_ns: str = "") -> list[dict]:
    """Episodes (TRACES.md) from the message histories of LangGraph threads stored by a SQLite saver.

    Every checkpoint of a thread (oldest first) whose ``messages`` channel ends in something other than an
    AI message is a context the model was (about to be) called on; each distinct such history is one
    version, so a thread whose controller edited its context between turns replays those edits.

    Args:
        spec: ``sqlite:PATH`` (a database written by ``SqliteSaver`` / ``AsyncSqliteSaver``).
        thread_ids: threads to read (None: every thread in the database).
        workload: the traces' ``workload`` field.
        checkpoint_ns: the graph namespace to read (``""``: the root graph).

    Returns:
        One trace per thread with two or more versions (``edit: "live"``); threads with fewer are skipped.

    Raises:
        ValueError: a spec that is not ``sqlite:PATH``, or an unknown thread id.
        FileNotFoundError: the database does not exist.
    """
    import sqlite3

    from langchain_core.messages import AIMessage, BaseMessage
    from langgraph.checkpoint.sqlite import SqliteSaver

    from ..langgraph.tools import to_trace_messages

    kind, _, path = spec.partition(":")
    if kind != "sqlite" or not path:
        raise ValueError(f"--from-checkpointer takes sqlite:PATH (a LangGraph SqliteSaver database), got {spec!r}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no SQLite checkpoint database at {path}")
    conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, check_same_thread=False)
    try:
        saver = SqliteSaver(conn)
        known = [r[0] for r in conn.execute("SELECT DISTINCT thread_id FROM checkpoints ORDER BY thread_id")]
        wanted = list(thread_ids) if thread_ids else known
        missing = [t for t in wanted if t not in known]
        if missing:
            raise ValueError(f"threads {missing} are not in {path}; it holds {known[:20]}")
        traces = []
        for tid in wanted:
            tuples = list(saver.list({"configurable": {"thread_id": tid, "checkpoint_ns": checkpoint_ns}}))
            versions, last = [], None
            for tup in reversed(tuples):  # oldest first
                msgs = (tup.checkpoint.get("channel_values") or {}).get("messages") or []
                if not msgs or not all(isinstance(m, BaseMessage) for m in msgs) or isinstance(msgs[-1], AIMessage):
                    continue
                trace_msgs = to_trace_messages(msgs)
                if trace_msgs != last:
                    versions.append({"messages": trace_msgs, "checkpoint_id": tup.config["configurable"]["checkpoint_id"]})
                    last = trace_msgs
            if len(versions) >= 2:
                traces.append({"id": str(tid), "workload": workload, "edit": "live", "versions": versions})
        return traces
    finally:
        conn.close()

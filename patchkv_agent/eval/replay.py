"""Trace replay: run every version of an episode under several strategies and score them against exact.

Follows the replay semantics of ``docs/TRACES.md``: version 0 is prefilled in a checkpoint-creation
pass; each later version is resumed from the thread's checkpoint with each strategy (every strategy from
its own chain of checkpoints, starting at the same version-0 checkpoint), decodes greedily, and the
resumed state becomes that strategy's checkpoint for the next version. ``exact`` is a full prefill
of each version and the reference for the fidelity fields (:mod:`.metrics`).

Knows the engine's public methods and the trace/result formats (:mod:`.traces`); nothing about LangGraph.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..engine import PatchKVEngine
from ..results import ResumeResult
from .metrics import (NEXT_ACTION_TOKENS, answer_match, fidelity, first_token_kl, next_action, next_action_agree,
                      token_f1, top1_agree)
from .noise_floor import run_floor
from .traces import RESULT_FIELDS, call_kind, version_ids

__all__ = ["RESULT_FIELDS", "replay_episode", "action_kind", "version_call_kind"]


# --------------------------------------------------------------------------- replay

def replay_episode(engine: PatchKVEngine, trace: dict, strategies: list[str], *, max_new_tokens: int = 16,
                   model_name: str = "", heal: Iterable[str] = (), floors: Iterable[str] = ()) -> Iterator[dict[str, Any]]:
    """Replay one episode; yields one result row (``docs/TRACES.md`` fields) per version >= 1 and strategy.

    Rows come out as they finish (version by version, strategies in the given order), so a caller can
    write each one before the next resume starts. Agent workloads (``workload`` starting with ``agent-``)
    decode at least :data:`~.metrics.NEXT_ACTION_TOKENS` tokens so that ``next_action`` sees the whole next
    call. A version with ``unedited`` (the same call had the context not been edited) adds
    ``floor_ttft_s``: the previous version's exact KV served from cache, the appended messages computed
    (``prefix`` from it), the no-edit floor.

    Args:
        engine: the engine.
        trace: a trace-format episode (validate it with :func:`.traces.validate_trace` first).
        strategies: names; ``exact`` is always run (it is the reference) and reported if listed.
        max_new_tokens: greedy tokens per resume.
        model_name: value of the ``model`` field.
        heal: strategies whose state is healed (:meth:`~patchkv_agent.engine.PatchKVEngine.heal`, what the
            thread registry does while a tool runs) before it becomes their next version's base; the row
            records ``heal_s`` (off the resume path).
        floors: noise floors (:data:`~.noise_floor.FLOORS`: ``kv-bf16``, ``kv-int8``, ``kv-fp8``,
            ``weights-bf16`` ...) run on the same calls as ``exact`` and scored against it like a strategy;
            their rows carry ``floor: true``, ``strategy`` = the floor's name and no TTFT (emulations).

    Raises:
        ValueError: malformed trace (fewer than two versions), or as ``engine.checkpoint`` / ``resume``
            (e.g. a version longer than the model's context).
    """
    versions = trace.get("versions") or []
    if len(versions) < 2:
        raise ValueError(f"trace {trace.get('id')!r} needs at least two versions to replay")
    heal = set(heal)
    if str(trace.get("workload") or "").startswith("agent-"):
        max_new_tokens = max(max_new_tokens, NEXT_ACTION_TOKENS)
    ids = [version_ids(engine, v) for v in versions]
    base = engine.checkpoint(ids[0])
    chain = {s: base for s in strategies if s != "exact"}
    restored = {s: False for s in strategies}
    answers = trace.get("answers")
    prev_exact = base
    for k in range(1, len(ids)):
        ref = engine.resume(None, ids[k], strategy="exact", max_new_tokens=max_new_tokens)
        floor = None
        if isinstance(versions[k].get("unedited"), dict):
            floor = engine.resume(prev_exact, version_ids(engine, versions[k]["unedited"]), strategy="prefix",
                                  max_new_tokens=0).stats["ttft_s"]
        for f in floors:
            yield _floor_row(engine, trace, k, f, ids[k], ref, max_new_tokens, model_name)
        for s in strategies:
            res = ref if s == "exact" else engine.resume(chain[s], ids[k], strategy=s, max_new_tokens=max_new_tokens)
            row = _row(engine, trace, k, s, res, ref, versions[k].get("answers") or answers, model_name)
            row["floor_ttft_s"] = floor
            row["after_restore"] = restored.get(s, False)  # the previous call of this chain restored rows
            restored[s] = bool(res.stats.get("restore_tokens"))
            if s != "exact" and k < len(ids) - 1:  # the last version has no successor to resume
                if s in heal:
                    healed = engine.heal(res)
                    row["heal_s"] = healed.stats.get("heal_s", 0.0) if healed is not res else 0.0
                    res = healed
                chain[s] = engine.checkpoint_from(res)
            yield row
        if k < len(ids) - 1 and isinstance(versions[k + 1].get("unedited"), dict):  # the next version's floor
            prev_exact = engine.checkpoint_from(ref)


def action_kind(text: str) -> str:
    """``"call"`` when the text's next action is a tool call (parsed or not), else ``"text"``."""
    return "call" if next_action(text)[0] != "text" else "text"


def _floor_row(engine, trace, k, floor: str, ids, ref: ResumeResult, max_new_tokens: int, model_name: str) -> dict:
    """A noise floor's result row (:mod:`.noise_floor`): the fidelity fields against ``exact``, no timings."""
    fr = run_floor(engine.model, ids, floor, max_new_tokens=max_new_tokens, eos_ids=engine.eos_ids,
                   ref_ids=ref.output_ids)
    dec = engine.tokenizer.decode if engine.tokenizer is not None else None
    text = dec(fr.output_ids, skip_special_tokens=True) if dec else ""
    ref_text = dec(ref.output_ids, skip_special_tokens=True) if dec else ""
    row: dict[str, Any] = {"id": trace.get("id"), "workload": trace.get("workload"), "edit": trace.get("edit"),
                           "call_kind": version_call_kind(trace, k), "version": k, "strategy": floor, "model": model_name,
                           "floor": True,
                           "prompt_tokens": len(ids), "ttft_s": None, "recompute_ratio": 1.0,
                           "recompute_tokens": len(ids), "payload_bytes": 0, "output_ids": fr.output_ids,
                           "output_text": text, "first_token_kl": first_token_kl(ref.logits, fr.logits),
                           "top1_agree": top1_agree(ref.logits, fr.logits), "tf_agree": fr.tf_agree,
                           "exact_continuation": fr.output_ids == list(ref.output_ids),
                           "next_action": next_action_agree(text, ref_text) if dec else fr.output_ids == list(ref.output_ids),
                           "action_kind": action_kind(ref_text), "fallback": None}
    gold, old = trace["versions"][k].get("answers"), trace["versions"][k - 1].get("answers")
    if gold and old:
        row["follows"], row["stale"] = answer_match(text, gold), answer_match(text, old)
    return row


def version_call_kind(trace: dict, k: int) -> str:
    """The call kind of version ``k`` (:func:`~.traces.call_kind`): its own ``edit`` where versions carry one
    (agent episodes: an edit, then the append-only calls after it), else the trace's."""
    v = trace["versions"][k]
    return call_kind(v.get("edit") if isinstance(v, dict) and "edit" in v else trace.get("edit"))


def _row(engine, trace, k, strategy, res: ResumeResult, ref: ResumeResult, answers, model_name) -> dict:
    st = res.stats
    text = engine.tokenizer.decode(res.output_ids, skip_special_tokens=True) if engine.tokenizer else ""
    row: dict[str, Any] = {
        "id": trace.get("id"), "workload": trace.get("workload"), "edit": trace.get("edit"),
        "call_kind": version_call_kind(trace, k), "version": k, "strategy": strategy, "model": model_name,
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
        row.update(first_token_kl=None, top1_agree=None, tf_agree=None, exact_continuation=None, next_action=None)
    else:
        row.update(fidelity(engine, res, ref))
        ref_text = engine.tokenizer.decode(ref.output_ids, skip_special_tokens=True) if engine.tokenizer else ""
        row["next_action"] = next_action_agree(text, ref_text) if engine.tokenizer else \
            bool(list(res.output_ids) == list(ref.output_ids))
        row["action_kind"] = action_kind(ref_text)
    row["f1"] = token_f1(text, answers) if answers else None
    gold, old = trace["versions"][k].get("answers"), trace["versions"][k - 1].get("answers")
    if gold and old:  # edit-following episodes carry a gold answer per version
        row["follows"] = answer_match(text, gold)
        row["stale"] = answer_match(text, old)
    row["fallback"] = st.fallback
    for key, val in st.to_json(arrays=False).items():  # optional extras (docs/TRACES.md allows new fields): restore_tokens, cacheblend_*
        if key not in row and key != "strategy" and isinstance(val, (int, float, str, bool, list, type(None))):
            row[key] = val
    return row


# ------------------------------------------------------------------ traces from a LangGraph checkpointer

def traces_from_checkpointer(spec: str, thread_ids: Iterable[str] | None = None, *, workload: str = "checkpointer",
                             checkpoint_ns: str = "") -> list[dict]:
    """Episodes (TRACES.md) from the message histories of LangGraph threads stored by a SQLite saver.

    Every checkpoint of a thread (oldest first) whose ``messages`` channel ends in something other than an
    AI message is a context the model was (about to be) called on; each distinct such history is one
    version, so a thread whose controller edited its context between turns replays those edits.

    The database is untrusted: it is opened read-only and every checkpoint blob is decoded by
    :class:`~patchkv_agent.langgraph.serde.AllowlistSerializer` (LangChain messages and plain data only;
    a blob that names any other class, a pickle, garbage, or a file that is not a SqliteSaver database
    raises, and nothing in the file is ever built or called).

    Args:
        spec: ``sqlite:PATH`` (a database written by ``SqliteSaver`` / ``AsyncSqliteSaver``).
        thread_ids: threads to read (None: every thread in the database).
        workload: the traces' ``workload`` field.
        checkpoint_ns: the graph namespace to read (``""``: the root graph).

    Returns:
        One trace per thread with two or more versions (``edit: "live"``); threads with fewer are skipped.

    Raises:
        ValueError: a spec that is not ``sqlite:PATH``, an unknown thread id, a file that is not a SQLite
            checkpoint database, or a blob outside the allowlist (one line naming the thread, checkpoint
            and what was refused).
        FileNotFoundError: the database does not exist.
    """
    from langchain_core.messages import AIMessage, BaseMessage

    from ..langgraph.serde import AllowlistSerializer
    from ..langgraph.tools import to_trace_messages

    kind, _, path = spec.partition(":")
    if kind != "sqlite" or not path:
        raise ValueError(f"--from-checkpointer takes sqlite:PATH (a LangGraph SqliteSaver database), got {spec!r}")
    if not Path(path).is_file():
        raise FileNotFoundError(f"no SQLite checkpoint database at {path}")
    serde = AllowlistSerializer()
    with _checkpoint_db(path) as rows:
        known = rows.threads()
        wanted = [str(t) for t in thread_ids] if thread_ids else known
        missing = [t for t in wanted if t not in known]
        if missing:
            raise ValueError(f"threads {missing} are not in {path}; it holds {known[:20]}")
        traces = []
        for tid in wanted:
            versions, last = [], None
            for checkpoint_id, type_, blob in rows.checkpoints(tid, checkpoint_ns):  # oldest first
                try:
                    checkpoint = serde.loads_typed((type_, blob))
                except ValueError as e:
                    raise ValueError(f"{path}: thread {tid!r} checkpoint {checkpoint_id!r}: {e}") from None
                values = checkpoint.get("channel_values") if isinstance(checkpoint, dict) else None
                msgs = values.get("messages") if isinstance(values, dict) else None
                if not isinstance(msgs, list) or not msgs or not all(isinstance(m, BaseMessage) for m in msgs) \
                        or isinstance(msgs[-1], AIMessage):
                    continue
                try:
                    trace_msgs = to_trace_messages(msgs)
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{path}: thread {tid!r} checkpoint {checkpoint_id!r}: {e}") from None
                if trace_msgs != last:
                    versions.append({"messages": trace_msgs, "checkpoint_id": checkpoint_id})
                    last = trace_msgs
            if len(versions) >= 2:
                traces.append({"id": tid, "workload": workload, "edit": "live", "versions": versions})
        return traces


class _CheckpointRows:
    """The rows of a SqliteSaver database's ``checkpoints`` table, read as untrusted data."""

    def __init__(self, conn, path: str, max_blob_bytes: int):
        self.conn, self.path, self.max_blob_bytes = conn, path, max_blob_bytes

    def threads(self) -> list[str]:
        got = self.conn.execute("SELECT DISTINCT thread_id FROM checkpoints").fetchall()
        return sorted({str(r[0]) for r in got})

    def checkpoints(self, thread_id: str, checkpoint_ns: str) -> Iterator[tuple[str, str, bytes]]:
        q = ("SELECT checkpoint_id, type, length(checkpoint), typeof(checkpoint) FROM checkpoints "
             "WHERE CAST(thread_id AS TEXT) = ? AND checkpoint_ns = ? ORDER BY checkpoint_id")
        for checkpoint_id, type_, size, kind in self.conn.execute(q, (thread_id, checkpoint_ns)).fetchall():
            where = f"{self.path}: thread {thread_id!r} checkpoint {str(checkpoint_id)[:80]!r}"
            if kind not in ("blob", "null"):
                raise ValueError(f"{where}: the checkpoint column holds {kind}, not a blob")
            if size is not None and size > self.max_blob_bytes:
                raise ValueError(f"{where}: a checkpoint blob of {size} bytes is over the limit of "
                                 f"{self.max_blob_bytes} bytes")
            (blob,) = self.conn.execute(
                "SELECT checkpoint FROM checkpoints WHERE CAST(thread_id AS TEXT) = ? AND checkpoint_ns = ? "
                "AND checkpoint_id = ?", (thread_id, checkpoint_ns, checkpoint_id)).fetchone()
            yield str(checkpoint_id), str(type_), blob


@contextmanager
def _checkpoint_db(path: str) -> Iterator[_CheckpointRows]:
    """A read-only connection to a SqliteSaver database, checked to have a ``checkpoints`` table.

    The file is untrusted: opened read-only (``query_only``), with ``trusted_schema`` off (a view or
    trigger cannot call functions with side effects), the table checked to be a real table with the
    saver's columns, and every SQLite error raised as a one-line ``ValueError``.
    """
    import sqlite3

    from ..langgraph.serde import MAX_BLOB_BYTES

    conn = None
    try:
        conn = sqlite3.connect(f"file:{Path(path).resolve()}?mode=ro", uri=True, check_same_thread=False)
        conn.execute("PRAGMA trusted_schema = OFF")
        conn.execute("PRAGMA query_only = ON")
        kind = conn.execute("SELECT type FROM sqlite_master WHERE name = 'checkpoints'").fetchone()
        if kind is None or kind[0] != "table":
            raise ValueError(f"{path} is not a LangGraph SqliteSaver database (no checkpoints table)")
        cols = {r[1] for r in conn.execute("PRAGMA table_info(checkpoints)").fetchall()}
        need = {"thread_id", "checkpoint_ns", "checkpoint_id", "type", "checkpoint"}
        if not need <= cols:
            raise ValueError(f"{path}: the checkpoints table lacks columns {sorted(need - cols)}; is it a LangGraph "
                             "SqliteSaver database?")
        yield _CheckpointRows(conn, path, MAX_BLOB_BYTES)
    except sqlite3.Error as e:
        raise ValueError(f"{path} is not a readable SQLite checkpoint database ({e})") from None
    finally:
        if conn is not None:
            conn.close()

"""The trace and result formats (``docs/TRACES.md``): schema, validated file io, rendering of versions.

- Traces (input): :func:`validate_trace`, :func:`read_traces` (the one reader: ``traces validate``,
  ``patchkv-agent replay`` and the recorder's tests all go through it; errors name ``file:line`` and the
  field), :func:`write_traces`.
- Rendering: :func:`version_ids` turns a version (``messages``, ``text`` or ``token_ids``) into the token
  ids the engine sees; messages go through :func:`~patchkv_agent.langgraph.tools.plain_messages`, whose
  module owns the tool-call tags (:data:`TOOL_CALL_OPEN` ...), so a call a live agent wrote and the same
  call replayed from its trace are the same tokens.
- Results (output): :data:`RESULT_FIELDS`, :func:`read_results` (tolerates a last line cut off by a
  crash) and :class:`ResultsFile`, an append-only writer that flushes each row and, when resuming,
  knows which ``(id, version, strategy)`` rows are already there.

Boundary: JSON and Python only (no torch, no model): :func:`version_ids` takes any object with an
``encode`` method (the engine).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from ..langgraph.tools import (TOOL_CALL_CLOSE, TOOL_CALL_OPEN, TOOL_RESPONSE_CLOSE, TOOL_RESPONSE_OPEN,
                               plain_messages)

__all__ = ["RESULT_FIELDS", "TRACE_VERSION_KEYS", "TOOL_CALL_OPEN", "TOOL_CALL_CLOSE", "TOOL_RESPONSE_OPEN",
           "TOOL_RESPONSE_CLOSE", "plain_messages", "version_ids", "validate_trace", "read_traces",
           "write_traces", "read_results", "ResultsFile", "row_key", "call_kind", "APPEND"]

TRACE_VERSION_KEYS = ("messages", "text", "token_ids")
RESULT_FIELDS = (
    "id", "workload", "edit", "version", "strategy", "model", "prompt_tokens", "prefix_tokens", "new_tokens",
    "suffix_tokens", "recompute_tokens", "recompute_ratio", "payload_bytes", "ttft_s", "plan_s", "restore_s",
    "recompute_s", "offload_s", "stats_s", "quantize_s", "output_ids", "output_text", "first_token_kl",
    "top1_agree", "tf_agree", "exact_continuation", "f1",
)
APPEND = "append"  # the call kind of a version that edits nothing (its context continues the previous one)


def call_kind(edit: str | None) -> str:
    """The kind of a call from its version's ``edit``: ``clear``, ``summarize``, ``offload``, ``replace`` ...
    or :data:`APPEND` (nothing edited: ``none``, ``base`` or empty).

    Args:
        edit: a version's (or, where versions carry none, the trace's) ``edit`` field.

    Returns:
        The kind (the part before a ``:``).
    """
    e = str(edit or "none").split(":", 1)[0]
    return APPEND if e in ("none", "base", "") else e


# --------------------------------------------------------------------------------------------- rendering

def version_ids(engine, version: dict) -> list[int]:
    """Token ids of one trace version.

    Args:
        engine: anything with ``encode(messages | text) -> list[int]`` (a
            :class:`~patchkv_agent.engine.PatchKVEngine`); not called for ``token_ids`` versions.
        version: a version dict with ``token_ids``, ``messages`` (rendered by :func:`plain_messages`
            and the model's chat template) or ``text`` (first present key wins, in that order).

    Returns:
        The ids.

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


# --------------------------------------------------------------------------------------------- traces

def _check_messages(msgs, where: str) -> None:
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for j, m in enumerate(msgs):
        w = f"{where}.messages[{j}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"{w}: a message must be an object with a string 'role'")
        if not isinstance(m.get("content"), str) and not (m.get("content") is None and m.get("tool_calls")):
            raise ValueError(f"{w}: 'content' must be a string")
        calls = m.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)):
            raise ValueError(f"{w}: 'tool_calls' must be a list of objects with a string 'name'")


def validate_trace(trace: object, where: str = "trace") -> None:
    """Check one trace against the trace format (``docs/TRACES.md``).

    Args:
        trace: a decoded trace line.
        where: location prefix for error messages (e.g. ``file.jsonl:3``).

    Raises:
        ValueError: naming the first problem (missing id, fewer than two versions, a version with none
            of messages/text/token_ids, malformed messages, token ids or answers).
    """
    if not isinstance(trace, dict):
        raise ValueError(f"{where}: a trace must be a JSON object, got {type(trace).__name__}")
    if not isinstance(trace.get("id"), str) or not trace["id"]:
        raise ValueError(f"{where}: missing or empty string 'id'")
    where = f"{where} (id {trace['id']!r})"
    for key in ("workload", "edit"):
        if key in trace and not isinstance(trace[key], str):
            raise ValueError(f"{where}: '{key}' must be a string")
    vs = trace.get("versions")
    if not isinstance(vs, list):
        raise ValueError(f"{where}: missing 'versions' list")
    if len(vs) < 2:
        raise ValueError(f"{where}: 'versions' has {len(vs)} entries; a trace needs two or more")
    for k, v in enumerate(vs):
        w = f"{where} versions[{k}]"
        if not isinstance(v, dict) or not any(key in v for key in TRACE_VERSION_KEYS):
            raise ValueError(f"{w}: a version needs one of 'messages', 'text', 'token_ids'")
        if "messages" in v:
            _check_messages(v["messages"], w)
        if "text" in v and (not isinstance(v["text"], str) or not v["text"]):
            raise ValueError(f"{w}: 'text' must be a non-empty string")
        if "token_ids" in v and (not isinstance(v["token_ids"], list) or not v["token_ids"] or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v["token_ids"])):
            raise ValueError(f"{w}: 'token_ids' must be a non-empty list of non-negative integers")
        va = v.get("answers")
        if va is not None and (not isinstance(va, list) or not all(isinstance(a, str) for a in va)):
            raise ValueError(f"{w}: 'answers' must be a list of strings")
    ans = trace.get("answers")
    if ans is not None and (not isinstance(ans, list) or not all(isinstance(a, str) for a in ans)):
        raise ValueError(f"{where}: 'answers' must be a list of strings")


def write_traces(traces: Sequence[dict], path: str | Path) -> None:
    """Validate and write traces as JSON Lines (UTF-8, one episode a line), creating parent folders.

    Everything is validated before the file is opened, so a bad trace leaves no partial file.

    Args:
        traces: trace dicts.
        path: output file.

    Raises:
        ValueError: a trace is malformed or two traces share an id.
    """
    ids = set()
    for i, t in enumerate(traces):
        validate_trace(t, f"traces[{i}]")
        if t["id"] in ids:
            raise ValueError(f"traces[{i}]: duplicate id {t['id']!r}")
        ids.add(t["id"])
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for t in traces:
            f.write(json.dumps(t, ensure_ascii=False) + "\n")


def read_traces(path: str | Path) -> list[dict]:
    """Read and validate a whole trace file (blank lines are ignored).

    Args:
        path: a JSON Lines trace file.

    Returns:
        The traces, in file order.

    Raises:
        ValueError: a line is not UTF-8, not JSON or not a valid trace (the message names file, line
            and problem), or two traces share an id.
        FileNotFoundError: no such file.
        IsADirectoryError: ``path`` is a folder.
    """
    out, ids = [], {}
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 text ({e})") from None
            if not line.strip():
                continue
            try:
                t = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e})") from None
            validate_trace(t, where)
            if t["id"] in ids:
                raise ValueError(f"{where}: duplicate id {t['id']!r} (first on line {ids[t['id']]})")
            ids[t["id"]] = lineno
            out.append(t)
    return out


# --------------------------------------------------------------------------------------------- results

def row_key(row: dict) -> tuple[Any, Any, Any]:
    """The identity of a result row: ``(id, version, strategy)``."""
    return row.get("id"), row.get("version"), row.get("strategy")


def read_results(path: str | Path) -> list[dict]:
    """Read a results file, ignoring a last line cut off by an interrupted write.

    Args:
        path: a JSON Lines results file.

    Returns:
        The rows (empty if the file does not exist).

    Raises:
        ValueError: a malformed line other than an unterminated last one (the message names file and line).
    """
    p = Path(path)
    if not p.exists():
        return []
    text = p.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]  # an unterminated tail was never completely written
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}:{i}: not a JSON result row ({e}); remove the line or rerun without --resume") from e
    return rows


def _truncate_partial_tail(p: Path) -> None:
    if not p.exists():
        return
    data = p.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(p, "r+b") as f:
            f.truncate(data.rfind(b"\n") + 1)


class ResultsFile:
    """An append-only JSON Lines results file: each row is written and flushed as it finishes.

    Opening checks that the file can be written (before any model work); a crash keeps every row
    written so far (at most one cut-off last line, dropped when the file is reopened with
    ``resume=True``). Use as a context manager.

    Args:
        path: the results file (parent folders are created).
        resume: keep the rows already there (:attr:`rows`, :attr:`done`) and append; otherwise the file
            is started afresh.

    Attributes:
        path: the file.
        rows: the rows found when resuming (empty otherwise).
        done: their :func:`row_key` set.
        written: rows written by this object.

    Raises:
        OSError: the file cannot be created or written (the message names the path).
        ValueError: resuming from a file with a malformed line.
    """

    def __init__(self, path: str | Path, *, resume: bool = False):
        self.path = Path(path)
        self.written = 0
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume:
                _truncate_partial_tail(self.path)
            self.rows = read_results(self.path) if resume else []
            self._f = open(self.path, "a" if resume else "w", encoding="utf-8")
        except OSError as e:
            raise OSError(e.errno, f"cannot write results to {self.path}: {e.strerror or e}") from e
        self.done = {row_key(r) for r in self.rows}

    def write(self, row: dict) -> None:
        """Append one row and flush it to the OS.

        Args:
            row: a JSON-serialisable result row.

        Raises:
            OSError: the write failed (e.g. a full disk); the rows before it stay in the file.
        """
        self.write_many([row])

    def write_many(self, rows: Iterable[dict]) -> None:
        """Append rows in one write and flush (a whole episode at once keeps the file episode-granular).

        Args:
            rows: JSON-serialisable result rows.

        Raises:
            OSError: the write failed; rows of earlier calls stay in the file.
        """
        rows = list(rows)
        if not rows:
            return
        text = "".join(json.dumps(r) + "\n" for r in rows)
        try:
            self._f.write(text)
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as e:
            raise OSError(e.errno, f"writing results to {self.path} failed after {self.written} rows: "
                                   f"{e.strerror or e}") from e
        self.written += len(rows)
        self.done.update(row_key(r) for r in rows)

    def close(self) -> None:
        """Close the file (rows are already flushed)."""
        try:
            self._f.close()
        except OSError:
            pass

    def __enter__(self) -> "ResultsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

"""Edited-context (-E) agent workloads: build trace files (``docs/TRACES.md``; written and read by :mod:`.traces`).

Boundary: pure Python over the packaged QA data (``patchkv_agent/eval/data``). No model, no torch, no
tokenizer: token counts come through a ``count_tokens(messages) -> int`` callable that the caller
supplies (the benchmark passes its model's chat-template count); without one, :func:`estimate_tokens`
(a documented chars/4 estimate) is used.

An episode is one QA example rendered as an agent thread:

    system prompt, user task, (assistant ``search`` call + tool result) per passage, user question

and ``n_versions`` successive versions, each made from the previous one by one edit kind:

- ``replace_tool_result``: one non-answer exchange in the middle gets a new query and a new result
  (a distractor passage from another example); its tool-call id is kept.
- ``refresh_evidence``: a contiguous run of 2-3 non-answer exchanges gets new passages.
- ``compact_history``: a contiguous run of 2-4 non-answer exchanges (earlier summaries may join
  the run) is replaced by one assistant message "Summary of earlier searches: ..." built from titles
  and first sentences (lossy).
- ``multi``: two non-adjacent non-answer exchanges are replaced (two separate spans).

Non-answer passages longer than 1,600 characters (the 2WikiMQA chunks) are split at sentence
boundaries into search results of at most ~1,200 characters, so that a 3k-token context still holds
several editable exchanges. Answer passages are never split, dropped or edited: ``is_supporting``
(HotpotQA, NQ ``gold_index``) plus any passage containing a normalised answer string (accents, case and
punctuation folded; not for yes/no answers). 2WikiMQA has no gold marks, so there the answer-string
passages plus the (up to) two passages with the highest IDF-weighted overlap with the question are kept
(comparison and bridge questions need the passage of the other entity too). Every edited span has at least one exchange after it. Examples that cannot
take the requested edits (too few editable exchanges, no answer passage) are skipped and logged.

Determinism: version 0 depends on (dataset, example id, seed, target_tokens, count_tokens) only, so all
edit kinds share it; edits draw from ``random.Random`` seeded by (seed, id, edit kind). The
calibration/evaluation split is a hash of the example id (about 30 % calib), independent of the seed;
padding and distractor passages come from other examples of the same split.
"""

from __future__ import annotations

import argparse
import copy
import functools
import hashlib
import json
import logging
import math
import random
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from .traces import read_traces, validate_trace, write_traces  # noqa: F401  (re-exported: the trace file io)

log = logging.getLogger(__name__)

WORKLOADS: dict[str, str] = {"hotpotqa-e": "hotpotqa", "2wikimqa-e": "2wikimqa", "nq-e": "nq"}
EDITS: tuple[str, ...] = ("replace_tool_result", "refresh_evidence", "compact_history", "multi")
SPLITS: tuple[str, ...] = ("calib", "eval")
CALIB_SHARE = 0.30
_FILES = {"hotpotqa": "hotpotqa.jsonl", "2wikimqa": "2wikimqa.jsonl", "nq": "nq_open.jsonl"}
_DATA_DIR = Path(__file__).resolve().parent / "data"

SYSTEM_PROMPT = (
    "You are a research assistant with a `search` tool that returns one encyclopedia passage per call. "
    "Search for evidence, then answer the user's question with a short phrase."
)
_TASK = "Find evidence with the search tool to answer this question: {q}"
_QUESTION = "Question: {q} Answer in a few words."
_SUMMARY_HEAD = "Summary of earlier searches: "
_SPLIT_ABOVE, _PIECE_CHARS = 1600, 1200  # non-answer passages longer than this become several results
_STOP = frozenset(
    "what which where when who whom whose were was did does the and for from with that this have has "
    "both same film films person born died than other their there about into".split()
)

CountTokens = Callable[[list[dict]], int]


def estimate_tokens(messages: list[dict]) -> int:
    """Rough token count of a chat: 4 template tokens per message plus ceil(chars / 4) of its content
    and of its serialised tool calls (about 4 characters a token for English text).

    Args:
        messages: chat messages (``role``, ``content``, optional ``tool_calls``).
    Returns:
        The estimated prompt length in tokens.
    """
    total = 0
    for m in messages:
        chars = len(m.get("content") or "")
        if m.get("tool_calls"):
            chars += len(json.dumps(m["tool_calls"], ensure_ascii=False))
        total += 4 + math.ceil(chars / 4)
    return total


# --------------------------------------------------------------------------------------------- data


@functools.lru_cache(maxsize=None)
def _load(dataset: str) -> tuple[dict, ...]:
    if dataset not in _FILES:
        raise ValueError(f"unknown dataset {dataset!r}; expected one of {sorted(_FILES)}")
    with open(_DATA_DIR / _FILES[dataset], encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def load_qa(dataset: str) -> list[dict]:
    """Load a packaged multi-document QA set (see ``patchkv_agent/eval/data/SOURCES.md``).

    Args:
        dataset: ``hotpotqa``, ``2wikimqa`` or ``nq`` (NQ-open, file ``nq_open.jsonl``).
    Returns:
        One dict per example: ``_id``, ``input``, ``answers``, ``passages`` (``title``, ``text``,
        optional ``is_supporting``), ``context`` and source-specific fields; a fresh copy each call.
    Raises:
        ValueError: unknown dataset name.
    """
    return copy.deepcopy(list(_load(dataset)))


@functools.lru_cache(maxsize=None)
def split_of(example_id: str) -> str:
    """Calibration/evaluation split of an example: a SHA-256 hash of its id, ~30 % ``calib``.

    Args:
        example_id: the example's ``_id``.
    Returns:
        ``"calib"`` or ``"eval"``.
    """
    h = int.from_bytes(hashlib.sha256(example_id.encode("utf-8")).digest()[:8], "big")
    return "calib" if h % 10_000 < CALIB_SHARE * 10_000 else "eval"


def _norm(s: str) -> str:
    s = "".join(c for c in unicodedata.normalize("NFKD", s) if not unicodedata.combining(c))
    return " " + " ".join(re.sub(r"[\W_]+", " ", s.lower()).split()) + " "


def _answer_keys(answers: list[str]) -> list[str]:
    keys = [_norm(a) for a in answers]
    return [k for k in keys if k.strip() and k.strip() not in ("yes", "no")]


def _contains_answer(passage: dict, keys: list[str]) -> bool:
    text = _norm(passage.get("title", "") + " " + passage["text"])
    return any(k in text for k in keys)


def answer_passage_indices(example: dict, dataset: str) -> list[int]:
    """Indices of the passages an example's question needs: they survive trimming and every edit.

    Args:
        example: one record of :func:`load_qa`.
        dataset: its dataset name (``hotpotqa``, ``2wikimqa``, ``nq``).
    Returns:
        Sorted passage indices (empty when none can be identified).
    """
    ps = example["passages"]
    keys = _answer_keys(example["answers"])
    keep = {i for i, p in enumerate(ps) if p.get("is_supporting") or _contains_answer(p, keys)}
    if dataset == "nq" and isinstance(example.get("gold_index"), int):
        keep.add(example["gold_index"])
    if dataset == "2wikimqa":  # no gold marks: add the passages that best match the question's words
        words = {w for w in _norm(example["input"]).split() if len(w) >= 4 and w not in _STOP}
        toks = [set(_norm(p.get("title", "") + " " + p["text"]).split()) for p in ps]
        df = {w: sum(w in t for t in toks) for w in words}
        score = [sum(1.0 / df[w] for w in words if w in t) for t in toks]
        keep.update(i for i in sorted(range(len(ps)), key=lambda i: -score[i])[:2] if score[i] > 0)
    return sorted(keep)


# ------------------------------------------------------------------------------------------ episode


@dataclass
class _Item:
    """One context unit between the task and the question: a search exchange or a summary."""

    title: str = ""
    text: str = ""
    call_id: str = ""
    protected: bool = False
    notes: list[str] = field(default_factory=list)  # non-empty: a summary message

    @property
    def editable(self) -> bool:
        return not self.protected and not self.notes


def _pieces(text: str) -> list[str]:
    """Split a long non-answer passage (2WikiMQA chunks) into search results at sentence boundaries."""
    if len(text) <= _SPLIT_ABOVE:
        return [text]
    out, cur = [], ""
    for sent in re.split(r"(?<=[.!?])\s+", text.strip()):
        while len(sent) > _PIECE_CHARS:  # one overlong "sentence": cut at a word boundary
            cut = sent.rfind(" ", 0, _PIECE_CHARS)
            cut = cut if cut > 0 else _PIECE_CHARS
            out, cur, sent = out + [x for x in (cur, sent[:cut]) if x], "", sent[cut:].strip()
        if cur and len(cur) + 1 + len(sent) > _PIECE_CHARS:
            out.append(cur)
            cur = ""
        cur = f"{cur} {sent}" if cur else sent
    return out + ([cur] if cur else [])


def _render(question: str, items: list[_Item]) -> list[dict]:
    msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": _TASK.format(q=question)}]
    for it in items:
        if it.notes:
            msgs.append({"role": "assistant", "content": _SUMMARY_HEAD + " ".join(it.notes)})
            continue
        query = it.title or " ".join(it.text.split()[:8])
        call = {"id": it.call_id, "name": "search", "args": {"query": query}}
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        body = f"{it.title}\n{it.text}" if it.title else it.text
        msgs.append({"role": "tool", "tool_call_id": it.call_id, "content": body})
    msgs.append({"role": "user", "content": _QUESTION.format(q=question)})
    return msgs


def _msg_range(items: list[_Item], start: int, stop: int) -> list[int]:
    """Half-open message-index range covering items[start:stop] in :func:`_render`'s output."""
    pos = [2]
    for it in items:
        pos.append(pos[-1] + (1 if it.notes else 2))
    return [pos[start], pos[stop]]


def _note(it: _Item) -> str:
    first = ""
    for sent in re.split(r"(?<=[.!?])\s+", it.text.strip()):  # skip abbreviation stubs ("Dr.")
        first = f"{first} {sent}".strip()
        if len(first) >= 40:
            break
    words = first.split()
    first = " ".join(words[:20]) + (" ..." if len(words) > 20 else "")
    return f"[{it.title}] {first}" if it.title else f"[{first}]"


def _candidates(dataset: str, own_id: str, split: str, keys: list[str], rng: random.Random) -> Iterator[_Item]:
    """Distractor passages from other examples of the same split, in a seeded random order."""
    pool = [(e, j) for e, ex in enumerate(_load(dataset)) if ex["_id"] != own_id and split_of(ex["_id"]) == split
            for j in range(len(ex["passages"]))]
    rng.shuffle(pool)
    for e, j in pool:
        p = _load(dataset)[e]["passages"][j]
        if not _contains_answer(p, keys):
            yield from (_Item(title=p.get("title", ""), text=t) for t in _pieces(p["text"]))


class _Skip(Exception):
    """The example cannot take the requested workload/edit; it is skipped."""


def _base(dataset: str, ex: dict, split: str, seed: int, target: int, count: CountTokens):
    rng = random.Random(f"base:{dataset}:{ex['_id']}:{seed}")
    prot = set(answer_passage_indices(ex, dataset))
    if not prot:
        raise _Skip("no answer passage")
    items = [_Item(title=p.get("title", ""), text=t, protected=i in prot) for i, p in enumerate(ex["passages"])
             for t in ([p["text"]] if i in prot else _pieces(p["text"]))]
    seen = {(it.title, it.text) for it in items}
    pool = _candidates(dataset, ex["_id"], split, _answer_keys(ex["answers"]), rng)

    def measure(its: list[_Item]) -> int:  # number the calls first: ids are part of the rendering
        for k, it in enumerate(its):
            it.call_id = f"c{k + 1}"
        return count(_render(ex["input"], its))

    n_tok = measure(items)
    dropped = padded = 0
    if n_tok > target:
        victims = [it for it in items if not it.protected]
        rng.shuffle(victims)
        for victim in victims:
            items = [it for it in items if it is not victim]
            dropped += 1
            n_tok = measure(items)
            if n_tok <= target:
                break
    misses = 0
    while n_tok < target and misses < 4:
        cand = next(pool, None)
        if cand is None:
            break
        if (cand.title, cand.text) in seen:
            continue
        trial = list(items)
        trial.insert(rng.randint(0, len(items)), cand)
        t = measure(trial)
        if t <= target:
            items, n_tok, misses, padded = trial, t, 0, padded + 1
            seen.add((cand.title, cand.text))
        else:
            misses += 1
    measure(items)
    meta = {"passages": len(items), "source_passages": len(ex["passages"]),
            "answer_passages": sum(it.protected for it in items), "padded_passages": padded,
            "dropped_passages": dropped}
    return items, meta, pool, seen


def _fresh(pool: Iterator[_Item], seen: set) -> _Item:
    for cand in pool:
        if (cand.title, cand.text) not in seen:
            seen.add((cand.title, cand.text))
            return cand
    raise _Skip("distractor pool exhausted")


def _windows(items: list[_Item], length: int, ok: Callable[[_Item], bool]) -> list[int]:
    """Starts of runs items[s:s+length] that all satisfy ok and leave at least one exchange after."""
    last_ex = max((i for i, it in enumerate(items) if not it.notes), default=-1)
    return [s for s in range(len(items) - length + 1)
            if s + length <= last_ex and all(ok(it) for it in items[s:s + length])]


def _apply_edit(kind: str, items: list[_Item], rng: random.Random, pool, seen) -> tuple[list[_Item], list[dict]]:
    """One edit on a copy of ``items``; returns the new items and the edited spans (message ranges)."""
    new = [copy.copy(it) for it in items]

    def swap(i: int) -> None:
        d = _fresh(pool, seen)
        new[i] = _Item(title=d.title, text=d.text, call_id=items[i].call_id)

    if kind == "replace_tool_result":
        starts = _windows(items, 1, lambda it: it.editable)
        middle = [s for s in starts if s > 0] or starts
        if not middle:
            raise _Skip("no editable exchange with evidence after it")
        i = rng.choice(middle)
        swap(i)
        spans = [(i, i + 1, i, i + 1)]
    elif kind == "refresh_evidence":
        lengths = [3, 2] if rng.random() < 0.5 else [2, 3]
        starts, k = [], 0
        for k in lengths:
            starts = _windows(items, k, lambda it: it.editable)
            if starts:
                break
        if not starts:
            raise _Skip("no run of 2-3 editable exchanges")
        s = rng.choice(starts)
        for i in range(s, s + k):
            swap(i)
        spans = [(s, s + k, s, s + k)]
    elif kind == "compact_history":
        ok = lambda it: not it.protected  # noqa: E731  exchanges or earlier summaries
        found = [(k, s) for k in (2, 3, 4) for s in _windows(items, k, ok)
                 if any(not it.notes for it in items[s:s + k])]
        if not found:
            raise _Skip("no run of 2+ editable exchanges to compact")
        k, s = rng.choice(found)
        notes = [n for it in items[s:s + k] for n in (it.notes or [_note(it)])]
        new[s:s + k] = [_Item(notes=notes)]
        spans = [(s, s + k, s, s + 1)]
    elif kind == "multi":
        starts = _windows(items, 1, lambda it: it.editable)
        pairs = [(a, b) for a in starts for b in starts if b - a >= 2]
        if not pairs:
            raise _Skip("no two non-adjacent editable exchanges")
        a, b = rng.choice(pairs)
        swap(a)
        swap(b)
        spans = [(a, a + 1, a, a + 1), (b, b + 1, b, b + 1)]
    else:
        raise ValueError(f"unknown edit {kind!r}; expected one of {EDITS}")
    return new, [{"old": _msg_range(items, o0, o1), "new": _msg_range(new, n0, n1)} for o0, o1, n0, n1 in spans]


def _episode(workload, dataset, ex, kind, split, target, n_versions, seed, count, counter_name) -> dict:
    items, meta, pool, seen = _base(dataset, ex, split, seed, target, count)
    rng = random.Random(f"edit:{dataset}:{ex['_id']}:{seed}:{kind}")
    versions, tokens, edits = [_render(ex["input"], items)], [], []
    for v in range(1, n_versions):
        items, spans = _apply_edit(kind, items, rng, pool, seen)
        versions.append(_render(ex["input"], items))
        edits.append({"version": v, "kind": kind, "spans": spans})
    tokens = [count(m) for m in versions]
    meta = {"source": dataset, "source_id": ex["_id"], "split": split, "seed": seed, "target_tokens": target,
            "token_counter": counter_name, "tokens": tokens, **meta, "edits": edits}
    return {"id": f"{workload}/{ex['_id']}/{kind}", "workload": workload, "edit": kind,
            "versions": [{"messages": m} for m in versions], "answers": list(ex["answers"]), "meta": meta}


def _build(workload, edit, n, split, target_tokens, n_versions, seed, count_tokens) -> tuple[list[dict], dict]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; expected one of {sorted(WORKLOADS)}")
    if edit != "all" and edit not in EDITS:
        raise ValueError(f"unknown edit {edit!r}; expected one of {list(EDITS)} or 'all'")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    if n_versions < 2:
        raise ValueError(f"n_versions must be >= 2, got {n_versions}")
    if target_tokens <= 0 or (n is not None and n < 0):
        raise ValueError(f"target_tokens must be > 0 and n >= 0 (got {target_tokens}, {n})")
    dataset = WORKLOADS[workload]
    count = count_tokens or estimate_tokens
    counter_name = "chars/4" if count_tokens is None else getattr(count_tokens, "__name__", "custom")
    traces, skipped = [], {}
    for ex in _load(dataset):
        if n is not None and len(traces) >= n:
            break
        if split_of(ex["_id"]) != split:
            continue
        kind = EDITS[len(traces) % len(EDITS)] if edit == "all" else edit
        try:
            traces.append(_episode(workload, dataset, ex, kind, split, target_tokens, n_versions, seed,
                                   count, counter_name))
        except _Skip as why:
            skipped[str(why)] = skipped.get(str(why), 0) + 1
    if skipped:
        log.info("%s/%s: skipped %s", workload, edit, skipped)
    return traces, skipped


def build_traces(workload: str, edit: str, *, n: int | None = None, split: str = "eval",
                 target_tokens: int = 3000, n_versions: int = 2, seed: int = 0,
                 count_tokens: CountTokens | None = None) -> list[dict]:
    """Build edited-context agent episodes in the trace format (``docs/TRACES.md``).

    Args:
        workload: ``hotpotqa-e``, ``2wikimqa-e`` or ``nq-e``.
        edit: one of :data:`EDITS`, or ``all`` (edit kinds in rotation over the episodes).
        n: at most this many episodes: the first examples of the split, in file order, that can take
            the edits (others are skipped and logged, so fewer may come back); all if None.
        split: ``calib`` or ``eval`` (by a hash of the example id; see :func:`split_of`).
        target_tokens: version-0 length target; short examples are padded with passages of other
            examples, long ones lose non-answer passages, so that the count is at most the target and
            within about one passage of it (answer passages alone may exceed it).
        n_versions: versions per episode (>= 2); each edit applies to the previous version.
        seed: seed for padding, trimming, positions and distractors.
        count_tokens: ``messages -> token count`` (e.g. a chat-template count); None: :func:`estimate_tokens`.
    Returns:
        Trace dicts: ``id`` (``<workload>/<example id>/<edit>``, unique across edit kinds), ``workload``,
        ``edit``, ``versions`` (``messages``), ``answers`` and ``meta``: ``source``, ``source_id``,
        ``split``, ``seed``, ``target_tokens``, ``token_counter``, ``tokens`` (per version),
        ``passages`` (search results in version 0), ``source_passages``, ``answer_passages``,
        ``padded_passages`` (added from other examples), ``dropped_passages`` (non-answer results
        dropped), and ``edits``: per version k >= 1 its ``kind`` and ``spans``, each ``{"old": [a, b],
        "new": [c, d]}``, the half-open message ranges that differ between versions k-1 and k.
    The edit-following workloads (``follow-lookup``, ``follow-twohop``, ``follow-count``,
    ``follow-retract``; :mod:`.follow`) are built here too: their episodes are templates with their own
    fixed edit and length, so ``edit``, ``target_tokens`` and ``n_versions`` do not apply to them, and
    ``n=None`` means 40.

    Raises:
        ValueError: unknown workload, edit or split, or n_versions < 2.
    """
    from .follow import build_follow_traces, is_follow_workload

    if is_follow_workload(workload):
        return build_follow_traces(workload, n=40 if n is None else n, split=split, seed=seed,
                                   count_tokens=count_tokens)
    return _build(workload, edit, n, split, target_tokens, n_versions, seed, count_tokens)[0]


# ---------------------------------------------------------------------------------------------- cli


def add_traces_cli(subparsers, token_counter_factory: Callable[[str], CountTokens] | None = None) -> None:
    """Add ``traces build`` and ``traces validate`` to a CLI.

    Args:
        subparsers: the object returned by ``ArgumentParser.add_subparsers()``.
        token_counter_factory: optional ``model -> count_tokens``; enables ``traces build --model`` so
            that padding/trimming counts real chat-template tokens.
    """
    p = subparsers.add_parser("traces", help="build and check edited-context agent trace files")
    sub = p.add_subparsers(dest="traces_command", required=True)
    b = sub.add_parser("build", help="build -E workload episodes (docs/TRACES.md format)")
    b.add_argument("--dataset", required=True, choices=sorted(WORKLOADS), help="workload name")
    b.add_argument("--edit", default="replace_tool_result", choices=[*EDITS, "all"])
    b.add_argument("--n", type=int, default=None, help="at most this many episodes (default: all)")
    b.add_argument("--split", default="eval", choices=SPLITS)
    b.add_argument("--target-tokens", type=int, default=3000)
    b.add_argument("--versions", type=int, default=2, help="context versions per episode (>= 2)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--model", default=None, help="count tokens with this model's chat template"
                   + ("" if token_counter_factory else " (not available in this build)"))
    b.add_argument("--out", required=True, help="output .jsonl")
    b.set_defaults(func=functools.partial(_cmd_build, factory=token_counter_factory))
    v = sub.add_parser("validate", help="check a trace file against the trace format (docs/TRACES.md)")
    v.add_argument("path")
    v.set_defaults(func=_cmd_validate)


def _cmd_build(args: argparse.Namespace, factory: Callable[[str], CountTokens] | None = None) -> int:
    if args.model and factory is None:
        raise SystemExit("--model needs a token counter factory (wire add_traces_cli with one)")
    count = factory(args.model) if args.model else None
    traces, skipped = _build(args.dataset, args.edit, args.n, args.split, args.target_tokens,
                             args.versions, args.seed, count)
    write_traces(traces, args.out)
    msg = f"wrote {len(traces)} traces ({args.dataset}, {args.edit}, {args.split}) to {args.out}"
    print(msg + (f"; skipped {skipped}" if skipped else ""))
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    try:
        traces = read_traces(args.path)
    except (ValueError, OSError) as e:  # the message names file, line and field
        raise SystemExit(f"invalid trace file: {e}") from None
    print(f"{args.path}: {len(traces)} valid traces")
    return 0

"""Edit-following workloads: agent threads whose correct answer changes because of an edit far from the question.

The QA workloads (:mod:`.workloads`) measure fidelity to ``exact`` (KL, top-1, teacher-forced agreement),
but their answers rarely depend on the edited span, so they cannot see whether a recovered cache makes
the model *act on the new content*. Here every episode has two versions and a gold answer per version,
known by construction; version 1 is version 0 with one early tool result replaced, and the question at
the end asks something whose answer that replacement changes. Templates (one workload each):

- ``follow-lookup`` (one hop): a record states a value (a locker code); the edit changes it; the question
  asks for it directly.
- ``follow-twohop`` (two hops): an early record says who someone reports to; a later record lists the
  managers' rooms; the edit changes the manager; the question asks for the person's manager's room. The
  later record is not edited, but its restored K/V were computed while the old relation was in view.
- ``follow-count`` (aggregation): several ticket records with a status; the edit flips one; the question
  asks how many are open.
- ``follow-retract`` (retraction): a record states a value; the edit replaces the whole tool result by an
  error; the question asks for the value or ``unknown``.

Held-out shapes (:data:`HELDOUT_WORKLOADS`: the reader rule's constants were set on the four above, these
measure it on shapes it was not written for): ``follow-alias`` (later records name the edited manager only
by a nickname: three hops), ``follow-directory`` (the edited building is looked up in one long directory
result), ``follow-repeated`` (the old value of the edited name recurs in many later log records) and
``follow-paraphrase`` (later records refer to the edited person only by role, "the project lead").

Each episode is a thread of ``system``, (assistant ``lookup`` call + tool result) per record, and the ``user``
question: the edited record comes first, then unrelated notices, then the template's later records, so the
edit lies outside the dirty window and the last block. The texts are short and plain so that a 135M
model's ``exact`` answers them often; the rates count only the episodes where ``exact`` follows.

Trace format: ``docs/TRACES.md``; each version carries its own ``answers`` (the top-level ``answers`` are
the last version's), and the replay scores a row as *following* (its output contains the version's gold)
or *stale* (it contains the previous version's gold) with :func:`.metrics.answer_match`.

Boundary: pure Python (no model, torch or tokenizer); deterministic in (workload, index, seed). The split
(``calib`` / ``eval``) is by episode index parity of a hash, as for the QA workloads.
"""

from __future__ import annotations

import hashlib
import random
from typing import Callable

__all__ = ["FOLLOW_WORKLOADS", "HELDOUT_WORKLOADS", "build_follow_traces", "is_follow_workload"]

SYSTEM_PROMPT = "Answer the question using the tool results."

_PEOPLE = ("Alice", "Brian", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hugo", "Irene", "Jonas", "Kavya",
           "Liam", "Maya", "Nora", "Oscar", "Priya", "Rosa", "Samir", "Tara", "Wei")
_MANAGERS = ("Helen", "Marcus", "Sofia", "Victor", "Nadia", "Oliver", "Ingrid", "Rafael", "Leila", "Tomas")
_CITIES = ("Denver", "Lisbon", "Osaka", "Nairobi", "Oslo", "Lima", "Dublin", "Perth", "Cairo", "Quebec",
           "Bergen", "Porto", "Seville", "Tallinn", "Geneva")
_NOTICES = (
    ("cafeteria", "The cafeteria opens at noon."),
    ("weather", "It is sunny and warm today."),
    ("parking", "The parking garage closes at ten."),
    ("library", "The library is a quiet space."),
    ("shuttle", "The shuttle leaves every twenty minutes."),
    ("gym", "The gym is on the first floor."),
    ("drill", "The fire drill is on Thursday."),
    ("recycling", "Recycling is collected on Mondays."),
)

FOLLOW_WORKLOADS: dict[str, str] = {
    "follow-lookup": "one hop: the edited value is asked directly",
    "follow-twohop": "two hops: an edited relation, its attribute stated later",
    "follow-count": "aggregation: a count over records, one of which is edited",
    "follow-retract": "retraction: a tool result replaced by an error",
}
HELDOUT_WORKLOADS: dict[str, str] = {
    "follow-alias": "three hops: an edited relation; later records name the entity only by its alias",
    "follow-directory": "two hops through a long directory (one tool result of twelve lines)",
    "follow-repeated": "the edited name's old value repeated in many later records",
    "follow-paraphrase": "later records refer to the edited entity by its role, never by its name",
}
"""Shapes the reader rule was not written for: measured, never used to set its constants."""
_NICKS = ("Ace", "Bear", "Coach", "Duke", "Echo", "Falcon", "Gizmo", "Hawk", "Iggy", "Jazz")
_STREETS = ("Elm Street", "Oak Avenue", "Pine Road", "Maple Lane", "Cedar Way", "Birch Court", "Willow Drive",
            "Ash Boulevard", "Spruce Place", "Linden Row", "Poplar Walk", "Hazel Square")
_ACTS = ("restarted the server", "updated the firewall", "rotated the keys", "patched the database",
         "cleared the queue", "renewed the certificate")
_N_WORDS = {0: "zero", 1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def is_follow_workload(name: str) -> bool:
    """True for the names in :data:`FOLLOW_WORKLOADS` and :data:`HELDOUT_WORKLOADS`."""
    return name in FOLLOW_WORKLOADS or name in HELDOUT_WORKLOADS


class _Thread:
    """Builds one version's messages: lookups, each an assistant call and its tool result."""

    def __init__(self):
        self.messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        self._n = 0

    def lookup(self, query: str, result: str) -> int:
        self._n += 1
        cid = f"call_{self._n}"
        self.messages.append({"role": "assistant", "content": "",
                              "tool_calls": [{"id": cid, "name": "lookup", "args": {"query": query}}]})
        self.messages.append({"role": "tool", "tool_call_id": cid, "content": result})
        return len(self.messages) - 1  # index of the tool result

    def ask(self, question: str) -> list[dict]:
        self.messages.append({"role": "user", "content": question})
        return self.messages


def _episode(workload: str, rng: random.Random, n_fillers: int) -> tuple[list[list[dict]], list[list[str]]]:
    """``(messages per version, answers per version)`` of one episode (two versions)."""
    fillers = rng.sample(_NOTICES, k=min(n_fillers, len(_NOTICES)))
    # each template: (edited record and what precedes it, later records); fillers go between the two
    if workload == "follow-lookup":
        people, cities = rng.sample(_PEOPLE, k=5), rng.sample(_CITIES, k=6)
        k = rng.randrange(2)  # the asked person's record is the first or the second
        olds = [cities[:5], cities[:k] + [cities[5]] + cities[k + 1:5]]
        question, answers = f"Which city does {people[k]} live in?", [[cities[k]], [cities[5]]]

        def records(v):
            recs = [(p, f"{p} lives in {c}.") for p, c in zip(people, olds[v])]
            return recs[:2], recs[2:]
    elif workload == "follow-twohop":
        person = rng.choice(_PEOPLE)
        managers = rng.sample(_MANAGERS, k=3)
        rooms = dict(zip(managers, (str(r) for r in rng.sample(range(10, 99), k=3))))
        listed = rng.sample(managers, k=3)
        question, answers = f"{person}'s boss works in which room?", [[rooms[managers[0]]], [rooms[managers[1]]]]

        def records(v):
            return [("boss", f"{person}'s boss is {managers[v]}.")], [(m, f"{m} works in room {rooms[m]}.")
                                                                        for m in listed]
    elif workload == "follow-count":
        status = [rng.random() < 0.5 for _ in range(3)]
        flipped = [not status[0]] + status[1:]
        question = "Count the open tickets. Answer with a number."
        answers = [[str(sum(st)), _N_WORDS[sum(st)]] for st in (status, flipped)]

        def records(v):
            recs = [(f"ticket {i + 1}", f"Ticket {i + 1}: {'open' if s else 'closed'}")
                    for i, s in enumerate((status, flipped)[v])]
            return recs[:1], recs[1:]
    elif workload == "follow-retract":
        cities = rng.sample(_CITIES, k=3)
        parcels = [f"{c}{rng.randint(10, 99)}" for c in rng.sample("ABCDEFHKLMNPRSTW", k=3)]
        question = f"Which city is parcel {parcels[0]} in? If the tool found no record, answer unknown."
        answers = [[cities[0]], ["unknown", "no record"]]

        def records(v):
            first = (f"Parcel {parcels[0]} is in {cities[0]}.", f"Error: no record found for parcel {parcels[0]}.")[v]
            return [(f"parcel {parcels[0]}", first)], [(f"parcel {p}", f"Parcel {p} is in {c}.")
                                                       for p, c in zip(parcels[1:], cities[1:])]
    elif workload == "follow-alias":
        person = rng.choice(_PEOPLE)
        managers, nicks = rng.sample(_MANAGERS, k=3), rng.sample(_NICKS, k=3)
        rooms = [str(r) for r in rng.sample(range(10, 99), k=3)]
        order, room_order = rng.sample(range(3), k=3), rng.sample(range(3), k=3)
        question, answers = f"{person}'s boss works in which room?", [[rooms[0]], [rooms[1]]]

        def records(v):
            return [("boss", f"{person}'s boss is {managers[v]}.")], (
                [(f"alias {managers[i]}", f"{managers[i]} is called {nicks[i]} at work.") for i in order]
                + [(f"room {nicks[i]}", f"{nicks[i]} works in room {rooms[i]}.") for i in room_order])
    elif workload == "follow-directory":
        person = rng.choice(_PEOPLE)
        streets = rng.sample(_STREETS, k=12)
        blds = [f"B{n}" for n in rng.sample(range(1, 40), k=12)]
        question, answers = f"On which street is {person}'s office?", [[streets[0]], [streets[1]]]
        lines = [f"Building {b} is on {st}." for b, st in zip(blds, streets)]
        rng.shuffle(lines)

        def records(v):
            return ([("office", f"{person}'s office is in building {blds[v]}.")],
                    [("building directory", "\n".join(lines))])
    elif workload == "follow-repeated":
        old, new = rng.sample(_PEOPLE, k=2)
        acts = rng.sample(_ACTS, k=5)
        question, answers = "Who is the on-call engineer this week?", [[old], [new]]

        def records(v):
            return ([("on-call", f"The on-call engineer this week is {(old, new)[v]}.")],
                    [(f"log {i + 1}", f"Log {i + 1}: {old} {a} last month.") for i, a in enumerate(acts)])
    elif workload == "follow-paraphrase":
        leads = rng.sample(_PEOPLE, k=2)
        k = rng.randrange(1, 4)
        question, answers = f"Who reviewed ticket {k}?", [[leads[0]], [leads[1]]]

        def records(v):
            return ([("project lead", f"The project lead is {leads[v]}.")],
                    [(f"ticket {i}", f"Ticket {i} was reviewed by the project lead.") for i in range(1, 4)])
    else:
        known = sorted(FOLLOW_WORKLOADS) + sorted(HELDOUT_WORKLOADS)
        raise ValueError(f"unknown edit-following workload {workload!r}; choose from {known}")
    versions = []
    for v in (0, 1):
        t = _Thread()
        head, tail = records(v)
        for item in head + fillers + tail:
            t.lookup(*item)
        versions.append(t.ask(question))
    return versions, answers


def _split(workload: str, index: int) -> str:
    h = int.from_bytes(hashlib.sha256(f"{workload}/{index}".encode()).digest()[:8], "big")
    return "calib" if h % 10 < 3 else "eval"


def _changed(a: list[dict], b: list[dict]) -> list[dict]:
    lo = 0
    while lo < min(len(a), len(b)) and a[lo] == b[lo]:
        lo += 1
    hi_a, hi_b = len(a), len(b)
    while hi_a > lo and hi_b > lo and a[hi_a - 1] == b[hi_b - 1]:
        hi_a, hi_b = hi_a - 1, hi_b - 1
    return [{"old": [lo, hi_a], "new": [lo, hi_b]}]


def build_follow_traces(workload: str, *, n: int = 40, split: str = "eval", seed: int = 0, n_fillers: int = 2,
                        count_tokens: Callable[[list[dict]], int] | None = None) -> list[dict]:
    """Build ``n`` edit-following episodes (two versions each) in the trace format.

    Args:
        workload: a name in :data:`FOLLOW_WORKLOADS`.
        n: episodes to return (all of the requested split).
        split: ``calib`` or ``eval`` (a hash of the episode index; about 30 % ``calib``).
        seed: seed of names, values and record order.
        n_fillers: unrelated records between the edited record and the question (>= 2).
        count_tokens: ``messages -> token count`` for ``meta.tokens`` (None: not recorded).

    Returns:
        Trace dicts with ``id`` (``<workload>/<index>``), ``workload``, ``edit`` (``replace_tool_result``),
        ``versions`` (each with ``messages`` and ``answers``), ``answers`` (the last version's) and ``meta``
        (``source: "template"``, ``source_id`` (the index: each episode is its own task for a
        calibration split), ``split``, ``seed``, ``index``, ``old_answers``, ``edits``, ``tokens``).

    Raises:
        ValueError: unknown workload or split, ``n < 0`` or ``n_fillers < 2``.
    """
    if not is_follow_workload(workload):
        known = sorted(FOLLOW_WORKLOADS) + sorted(HELDOUT_WORKLOADS)
        raise ValueError(f"unknown edit-following workload {workload!r}; choose from {known}")
    if split not in ("calib", "eval"):
        raise ValueError(f"split must be 'calib' or 'eval', got {split!r}")
    if n < 0 or n_fillers < 2:
        raise ValueError(f"need n >= 0 and n_fillers >= 2, got n={n}, n_fillers={n_fillers}")
    out: list[dict] = []
    index = 0
    while len(out) < n:
        index += 1
        if _split(workload, index) != split:
            continue
        rng = random.Random(f"{seed}/{workload}/{index}")
        versions, answers = _episode(workload, rng, n_fillers)
        if answers[0][0] == answers[1][0]:  # the edit must change the answer (a count flip always does)
            continue
        meta = {"source": "template", "source_id": str(index), "split": split, "seed": seed, "index": index,
                "old_answers": answers[0],
                "edits": [{"version": 1, "kind": "replace_tool_result", "spans": _changed(*versions)}]}
        if count_tokens is not None:
            meta["tokens"] = [int(count_tokens(v)) for v in versions]
        out.append({"id": f"{workload}/{index}", "workload": workload, "edit": "replace_tool_result",
                    "versions": [{"messages": v, "answers": a} for v, a in zip(versions, answers)],
                    "answers": answers[-1], "meta": meta})
    return out

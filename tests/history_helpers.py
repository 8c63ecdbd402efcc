"""What the project's code, tests and documents never contain: accounts of past work (issue numbers, dates,
numbered work sessions, "stops"). They speak about the software in the present tense; what was measured when lives in the
results archive under ``runs/``, which is not scanned.

Shared by ``test_readme.py`` (the README) and ``test_no_history.py`` (every source and document folder).
"""

from __future__ import annotations

import re

ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth"

# name -> pattern; a hit names an issue, a date or a work session ("stop"). A date joined to a word by "_" or
# a letter (a dated result file name, runs/results/qa_n20_<date>/) has no word boundary and does not match;
# a stop token / sequence / string (decoding) is not a work session.
HISTORY_PATTERNS: dict[str, re.Pattern[str]] = {
    "an issue number": re.compile(r"\b[Ii]ssues?\s+#?\d+"),
    "a date": re.compile(r"\b20\d\d-\d\d-\d\d\b"),
    "an N-th stop": re.compile(rf"\b(?:{ORDINALS}|\d+(?:st|nd|rd|th)|this|later|last)\s+stop\b"
                               r"(?!\s+(?:tokens?|sequences?|strings?|words?|ids?)\b)", re.I),
}


def history_hits(text: str) -> list[tuple[str, int, str]]:
    """``(what, line number, line)`` for every line of ``text`` that one of :data:`HISTORY_PATTERNS` matches."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pat in HISTORY_PATTERNS.items():
            if pat.search(line):
                hits.append((what, n, line.strip()))
    return hits

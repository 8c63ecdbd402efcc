"""Code, tests, scripts and documents carry no accounts of past work: no issue numbers, no ISO dates, no
"N-th stop". Each file says what the thing is or guards, in the present tense (the patterns are
``history_helpers.HISTORY_PATTERNS``, shared with ``test_readme.py``). Results with their dates live under
``runs/``, which is not scanned.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from history_helpers import HISTORY_PATTERNS, history_hits

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("patchkv_agent", "tests", "scripts", "docs", "examples", "kernels", "calibration", "notebooks",
           "README.md")
# written text; data files (.json profiles, .jsonl data sets, .npz) are left out: the data sets are third-party
# text (questions about dates and years), and a profile's provenance fields are data a calibration run writes
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".ipynb", ".c", ".h", ".txt", ".cfg", ".ini", ".yaml", ".yml"}
SKIPPED_DIRS = {"__pycache__", ".pytest_cache", "build", "node_modules"}

# (path relative to the root, exact line text) -> why that hit is not history. Keep this short: every entry
# needs a reason that the text is not an account of past work.
ALLOWED: dict[tuple[str, str], str] = {}


def scanned_files() -> list[Path]:
    out = []
    for name in SCANNED:
        p = ROOT / name
        if p.is_file():
            out.append(p)
            continue
        for dirpath, dirnames, filenames in os.walk(p):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
            out += [Path(dirpath) / f for f in sorted(filenames) if Path(f).suffix in TEXT_SUFFIXES]
    return out


def written_text(path: Path) -> str:
    """A file's text; a notebook's cell sources (markdown and code), not its outputs."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if path.suffix == ".ipynb":
        return "\n".join("".join(c.get("source", "")) for c in json.loads(text).get("cells", []))
    return text


def test_the_scan_sees_the_tree():
    files = {p.relative_to(ROOT).as_posix() for p in scanned_files()}
    assert "README.md" in files and "tests/test_no_history.py" in files
    assert any(f.startswith("patchkv_agent/") for f in files) and any(f.endswith(".ipynb") for f in files)
    assert not any(f.startswith("runs/") for f in files)


@pytest.mark.parametrize("line, what", [
    ("see " + "issue " + "13", "an issue number"),
    ("(" + "Issue #" + "22, item 3)", "an issue number"),
    ("issues " + "3 and 15", "an issue number"),
    ("measured on " + "2026" + "-12-04", "a date"),
    ("the " + "fifth" + " stop", "an N-th stop"),
    ("since the " + "3rd" + " stop", "an N-th stop"),
    ("done in " + "this" + " stop", "an N-th stop"),
])
def test_the_patterns_catch_history(line, what):
    assert [h[0] for h in history_hits(line)] == [what]


@pytest.mark.parametrize("line", [
    "stops at the first stop token",  # a stop token is not a work session
    "runs/results/agent_n20_2026-12-04/results.jsonl",  # a dated result file name (no word boundary before it)
    "the tissue 3 times",  # 'issue' inside a word
    "torch==2.13.0",  # a version string
])
def test_the_patterns_pass_what_is_not_history(line):
    assert history_hits(line) == []


def test_no_issue_numbers_dates_or_stops():
    found = []
    used = set()
    for path in scanned_files():
        rel = path.relative_to(ROOT).as_posix()
        for what, n, line in history_hits(written_text(path)):
            if (rel, line) in ALLOWED:
                used.add((rel, line))
                continue
            found.append(f"{rel}:{n}: {what}: {line[:160]}")
    assert not found, "accounts of past work (say what the thing is or guards, in the present tense):\n" + \
        "\n".join(found)
    assert used == set(ALLOWED), f"allow-list entries that match nothing any more: {set(ALLOWED) - used}"


"""A structure-aware fuzzer over the entry codec (``benchmarks.entry_fuzz``).

Random structural edits (header fields, blob shapes and dtypes, row indices, block tags, runs, format
labels incl. K4V4, missing or extra blobs) under consistent checksums: 0 escaped exceptions and torch ==
native on every accepted entry over 2,000 examples in process, and again with ``native.c`` built with
AddressSanitizer (0 crashes, 0 sanitizer reports), where the hostile native argument cases (block sizes
past int32, an inner stride of 0, an fp16 destination) run too. ``patchkv-agent stress --fuzz`` runs longer.
"""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis", reason="the fuzzer needs the test extra: pip install 'patchkv-agent[test]'")

from benchmarks import entry_fuzz  # noqa: E402
from patchkv_agent.runtime.kvstore import codec  # noqa: E402

EXAMPLES = 2000


def test_fuzzed_entries_are_refused_or_restore_alike_on_every_path():
    s = entry_fuzz.run_fuzz(EXAMPLES, seed=0)
    assert s["failures"] == 0, s["first_failure"]
    assert s["examples"] == EXAMPLES and s["refused"] > EXAMPLES // 2 and s["accepted"] > 50, s


def test_the_fuzzer_finds_a_missing_structure_check(monkeypatch):
    # its teeth: with the header-vs-blob-table check switched off, hostile entries reach the kernels
    monkeypatch.setattr(codec, "_check_structure", lambda *a: None)
    s = entry_fuzz.run_fuzz(500, seed=0)
    assert s["failures"] == 1 and s["examples"] < 500, s


def test_fuzzed_entries_under_address_sanitizer():
    lib, why = entry_fuzz.asan_runtime()
    if lib is None:
        pytest.skip(f"AddressSanitizer run skipped: {why}")
    s = entry_fuzz.run_fuzz_asan(EXAMPLES, seed=0, timeout=540)
    assert not s["crashed"] and s["returncode"] == 0, s["stderr_tail"]
    assert s["sanitizer_reports"] == 0, s["stderr_tail"]
    assert s["failures"] == 0 and s["examples"] == EXAMPLES, s.get("first_failure")
    assert "AddressSanitizer" in s["native"]
    # hostile native arguments: block sizes past int32, an inner stride of 0, an fp16 destination, through
    # the wrappers and straight into the library: refused, with no sanitizer report (the controls run)
    cases = s["native_cases"]
    assert len(cases) >= 10 and all(o.startswith("accepted" if n.startswith("control") else "refused: ")
                                    for n, o in cases.items()), cases

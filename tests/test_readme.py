"""The README is a user's document: its Python snippets run as pasted (on the embedded model), it stays short,
and it speaks about the software in the present tense (no dates, no issue numbers: ``history_helpers``).

A snippet whose first line starts with ``# needs a running server`` is shown, not run (the serving tests run
that path against real servers).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from history_helpers import history_hits

README = Path(__file__).resolve().parents[1] / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_is_short_and_has_no_history():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert not history_hits(text), f"history in the README: {history_hits(text)}"
    assert "bash scripts/demo.sh" in text and "bash scripts/test.sh" in text
    for link in re.findall(r"\]\(([^)#]+)\)", text):
        if not link.startswith("http"):
            assert (README.parent / link).exists(), link
    assert len(snippets()) >= 3


@pytest.mark.slow
def test_readme_snippets_run_as_pasted():
    ns: dict = {"__name__": "readme"}
    ran = 0
    for code in snippets():
        if code.startswith("# needs a running server"):
            continue
        exec(compile(code, f"README snippet {ran}", "exec"), ns)
        ran += 1
    assert ran >= 3
    # the quickstart's selective resume, checked against a full prefill of the edited context
    eng, res = ns["eng"], ns["res"]
    assert res.stats.fallback is None and 0 < res.stats.recompute_ratio <= 1
    exact = eng.resume(ns["ckpt"], eng.encode(ns["v1"]), strategy="exact", max_new_tokens=8)
    assert res.output_ids[:2] == exact.output_ids[:2]
    # the agent's last answer carries its resume stats; the graph's thread has a checkpoint with its KV handle
    assert ns["out"]["messages"][-1].response_metadata["patchkv"]["ttft_s"] > 0
    state = ns["app"].get_state({"configurable": {"thread_id": "t2"}})
    assert state.values["messages"][-1].type == "ai"

#!/usr/bin/env bash
# The main job: set up .venv, fetch the embedded SmolLM2-135M (once), run the LangGraph research agent
# whose controller edits its context between turns; it prints per-turn PatchKV resume stats next to
# what prefix recompute costs. Arguments go to examples/research_agent.py (--help lists them).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/python examples/research_agent.py "$@"

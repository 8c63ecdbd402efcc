"""The device run's plumbing (scripts/gpu_check.sh): random-weight model specs, a bare checkout's imports, and
the benchmark paths' imports on a machine without LangChain / LangGraph / gguf."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEVICE_MISSING = "langgraph,langchain,langchain_core,gguf,accelerate,xgrammar,pydantic,redis,hypothesis,langsmith"


def test_random_specs_parse_and_have_the_model_shapes():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from patchkv_agent.loading import RANDOM_MAX_POSITIONS, RANDOM_SHAPES, parse_random_spec

    assert parse_random_spec("random:smollm2-135m") == ("smollm2-135m", None)
    assert parse_random_spec("random:llama-1b@bf16") == ("llama-1b", torch.bfloat16)
    for bad in ("random:gpt5", "random:llama-1b@int3", "smollm2-135m"):
        with pytest.raises(ValueError):
            parse_random_spec(bad)
    sizes = {}
    for name, fields in RANDOM_SHAPES.items():
        with torch.device("meta"):
            m = AutoModelForCausalLM.from_config(LlamaConfig(**fields, max_position_embeddings=RANDOM_MAX_POSITIONS),
                                                 dtype=torch.bfloat16)
        sizes[name] = sum(p.numel() for p in m.parameters())
    assert sizes == {"smollm2-135m": 134_515_008, "llama-1b": 1_235_814_400}


def test_random_spec_on_the_command_line_is_checked_before_loading(capsys):
    from patchkv_agent.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench-host", "--model", "random:nope", "--lengths", "256"])
    assert e.value.code == 2
    assert "unknown random model shape" in capsys.readouterr().err


def test_random_model_loads_with_float32_rope_and_the_carried_tokenizer(tmp_path, monkeypatch):
    from patchkv_agent.loading import RANDOM_TOKENIZER_ENV, is_random, load_model

    monkeypatch.setenv(RANDOM_TOKENIZER_ENV, "none")
    model, tok = load_model("random:smollm2-135m@bf16")
    assert tok is None and is_random("random:smollm2-135m@bf16") and not is_random("smollm2-135m") and model.dtype == torch.bfloat16
    assert all(b.dtype == torch.float32 for _, b in model.named_buffers())  # inv_freq not rounded to bf16
    assert model.config.num_key_value_heads == 3 and model.config.max_position_embeddings == 131072


def test_checkout_run_imports_the_package_from_the_checkout_without_langchain(tmp_path):
    """scripts/checkout_run.py maps kernels/ and calibration/ into the package (no install), and the paths
    gpu_check.sh runs import none of the packages a device lacks (simulated missing)."""
    code = ("import sys, patchkv_agent.cli as c, patchkv_agent.engine, benchmarks.host_bench, "
            "patchkv_agent.runtime.threads, benchmarks.tiny, patchkv_agent.kernels.dispatch as d, "
            "patchkv_agent.calibration; c.build_parser(); "
            "import json; print(json.dumps({'kernels': d.__file__, "
            "'loaded': sorted({m.split('.')[0] for m in sys.modules if sys.modules[m] is not None})}))")
    script = tmp_path / "import_probe.py"
    script.write_text(code + "\n")
    env = dict(os.environ, PATCHKV_SIM_MISSING=DEVICE_MISSING)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "checkout_run.py"), str(script)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["kernels"]).resolve() == (ROOT / "kernels" / "dispatch.py").resolve()
    assert not set(got["loaded"]) & set(DEVICE_MISSING.split(","))


def test_gpu_check_summary_reads_a_partial_folder(tmp_path):
    """A stage that failed still gets a row and its log's last lines; missing files are skipped."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "kernels.log").write_text("Traceback\nRuntimeError: boom\n")
    (tmp_path / "stages.jsonl").write_text(json.dumps({"name": "env", "rc": 0, "wall_s": 1.0, "timeout_s": 90}) + "\n"
                                           + json.dumps({"name": "kernels", "rc": 1, "wall_s": 2.0, "timeout_s": 9})
                                           + "\n")
    (tmp_path / "resume_x.json").write_text(json.dumps({"model": "random:llama-1b@bf16", "label": "random weights, "
                                            "timing only", "rows": [
                                                {"context_tokens": 8192, "strategy": "prefix", "wall_ms": 10.0,
                                                 "ttft_ms": 9.0, "vs_prefix": 1.0},
                                                {"context_tokens": 8192, "strategy": "patchkv", "wall_ms": 5.0,
                                                 "ttft_ms": 4.0, "vs_prefix": 2.0}]}))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    md = (tmp_path / "summary.md").read_text()
    assert "RuntimeError: boom" in md and "random weights, timing only" in md and "2.00x" in md
    js = json.loads((tmp_path / "summary.json").read_text())
    assert js["ok"] is False
    assert js["resume"]["random:llama-1b@bf16"]["by_tokens"]["8192"]["patchkv"]["vs_prefix"] == 2.0

"""The first stage of scripts/gpu_check.sh: versions, the device, one Triton kernel, the imports of the benchmarks.

    python scripts/gpu_env_check.py --out DIR/env.json

Writes what the later stages depend on: python / torch / transformers / triton / numpy versions, CUDA and the
GPU, whether a trivial Triton kernel compiles and runs on the device (``triton_ok``; the stages after it run
with ``PATCHKV_KERNELS=torch`` when not), the native CPU kernels' status (they degrade to torch when no C
compiler builds them), the tokenizer of the ``random:`` models, and which optional packages are importable
and which of them the benchmark paths imported (none of langgraph / langchain is needed). Exits 1 only when
``patchkv_agent`` itself cannot be imported.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's benchmarks/ beside the package

OPTIONAL = ("langgraph", "langchain", "langchain_core", "gguf", "accelerate", "xgrammar", "pydantic", "redis",
            "xxhash", "matplotlib", "safetensors", "tokenizers", "tqdm", "numpy")


def _triton_smoke(torch) -> dict:
    """A vector add compiled and run on the device, checked against torch."""
    t = time.perf_counter()
    try:
        import triton
        import triton.language as tl

        @triton.jit
        def add(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
            i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            m = i < n
            tl.store(o_ptr + i, tl.load(x_ptr + i, mask=m) + tl.load(y_ptr + i, mask=m), mask=m)

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        x = torch.arange(1000, dtype=torch.float32, device=dev)
        o = torch.empty_like(x)
        add[(triton.cdiv(1000, 256),)](x, x, o, 1000, BLOCK=256)
        ok = bool(torch.equal(o, 2 * x))
        return {"triton_ok": ok, "triton_smoke_s": time.perf_counter() - t, "triton_device": dev}
    except Exception as e:  # noqa: BLE001
        return {"triton_ok": False, "triton_error": f"{type(e).__name__}: {e}"[:800],
                "triton_smoke_s": time.perf_counter() - t}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import numpy
    import torch
    import transformers

    env: dict = {"python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
                 "torch_cuda": torch.version.cuda, "transformers": transformers.__version__,
                 "numpy": numpy.__version__, "cuda": torch.cuda.is_available(),
                 "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                 "gpu_mem_gib": (torch.cuda.get_device_properties(0).total_memory / 2**30
                                 if torch.cuda.is_available() else None),
                 "cpus": __import__("os").cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        env["triton"] = f"unavailable ({type(e).__name__}: {e})"[:300]
    env.update(_triton_smoke(torch))
    env["installed"] = {m: importlib.util.find_spec(m) is not None for m in OPTIONAL}
    code = 0
    try:
        before = set(sys.modules)
        import patchkv_agent.cli as cli
        import patchkv_agent.engine  # noqa: F401
        import benchmarks.host_bench  # noqa: F401
        import benchmarks.tiny  # noqa: F401
        import patchkv_agent.runtime.threads  # noqa: F401
        from patchkv_agent.kernels import dispatch, native

        cli.build_parser()
        loaded = {m.split(".")[0] for m in set(sys.modules) - before}
        env["bench_imports_optional"] = sorted(m for m in OPTIONAL[:8] if m in loaded)
        env["patchkv_agent"] = str(Path(patchkv_agent.engine.__file__).parent)
        env["kernels_module"] = dispatch.__file__
        env["kernel_backend"] = dispatch.get_backend()
        t = time.perf_counter()
        env["native_available"] = native.available()
        env["native_status"] = native.status()
        env["native_build_s"] = time.perf_counter() - t
    except Exception:  # noqa: BLE001
        env["import_error"] = traceback.format_exc()[-3000:]
        code = 1
    try:
        from patchkv_agent.loading import load_tokenizer_dir, random_tokenizer_dir

        d = random_tokenizer_dir()
        env["random_tokenizer_dir"] = str(d) if d else None
        if d is not None:
            tok = load_tokenizer_dir(d)
            ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                          add_generation_prompt=True)
            env["random_tokenizer"] = {"class": type(tok).__name__, "vocab": len(tok),
                                       "chat_template_ok": isinstance(ids, str) and "hello" in ids}
    except Exception as e:  # noqa: BLE001
        env["random_tokenizer_error"] = f"{type(e).__name__}: {e}"[:800]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(env, indent=2, default=str) + "\n")
    print(json.dumps(env, indent=2, default=str))
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Triton kernels against their torch references, and their speed against device memcpy (scripts/gpu_check.sh).

    python scripts/gpu_kernel_check.py --out DIR [--small]

For every transport format (FP16, K8V8, K8V4, K4V4): ``quantize_gather`` of the Triton kernel against
``reference_quantize_gather`` (codes, scales and zeros bit for bit) and ``dequantize_scatter`` (with a RoPE
shift) against ``reference_dequantize_scatter`` (to tolerance; into float32 and into bfloat16 destinations), at
production sizes (SmolLM2's 3 KV heads and Llama-3.2-1B's 8, 64 channels, 32k rows; ``--small``: 1 head, 64 rows,
32 channels, for CI under ``TRITON_INTERPRET=1``). Then the median time of each against the torch reference on the
same device and against a device ``copy_`` of the same destination bytes. Writes ``DIR/kernels.json`` (rewritten
after each shape); exits 1 when a kernel disagrees with its reference. Knows the kernels only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def _time(fn, device, repeats: int) -> float:
    ts = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts[1:])


def _check_shape(h: int, n: int, d: int, device, repeats: int, small: bool) -> tuple[dict, bool]:
    """Every format at one (heads, rows, head_dim): agreement with the references, then the times."""
    from patchkv_agent.kernels import formats as KF, reference as KR
    from patchkv_agent.kernels.triton_dequantize_scatter import dequantize_scatter_triton
    from patchkv_agent.kernels.triton_quantize_gather import quantize_gather_triton

    g = torch.Generator().manual_seed(0)
    k = (torch.randn(h, n, d, generator=g) * torch.rand(1, 1, d, generator=g) * 4).to(device)
    v = torch.randn(h, n, d, generator=g).to(device)
    rows = torch.arange(0, n, dtype=torch.int64, device=device)
    dst_rows = torch.arange(n, dtype=torch.int64, device=device) + 17
    delta = torch.full((n,), 17, dtype=torch.int64, device=device)
    inv_freq = (1.0 / (1e4 ** (torch.arange(0, d, 2).float() / d))).to(device)
    report = {"heads": h, "rows": n, "head_dim": d, "formats": {}}
    ok = True
    for tag in KF.FORMATS:
        got = quantize_gather_triton(k, v, rows, tag, 32, 32)
        want = KR.reference_quantize_gather(k, v, rows, tag, 32, 32)
        # the definition is the reference on the CPU: torch's own CUDA kernels round a few codes differently
        # (~1e-5 of them, by one; scripts/gpu_quantize_diff.py), the Triton kernel does not
        defn = KR.reference_quantize_gather(k.cpu(), v.cpu(), rows.cpu(), tag, 32, 32).tensors()
        q_equal = all(torch.equal(got.tensors()[name].cpu(), t) for name, t in defn.items())
        ref_device_diff = sum(int((want.tensors()[name].cpu() != t).sum()) for name, t in defn.items())
        outs = []
        for fn in (KR.reference_dequantize_scatter, dequantize_scatter_triton):
            dk = torch.zeros(h, n + 17, d, device=device)
            dv = torch.zeros(h, n + 17, d, device=device)
            fn(want, dk, dv, dst_rows, delta, inv_freq)
            outs.append((dk, dv))
        err = max(float((a - b).abs().max()) for a, b in zip(outs[0], outs[1]))
        s_equal = err <= 1e-4
        ok &= q_equal and s_equal
        row = {"quantize_bit_exact": q_equal, "torch_reference_on_device_codes_differing": ref_device_diff, "scatter_max_abs_err": err, "scatter_ok": s_equal,
               "payload_bytes": int(want.nbytes)}
        # a bf16 destination (a bf16 model's cache): both round the same float32 values, so at most an ulp apart
        try:
            bf = []
            for fn in (KR.reference_dequantize_scatter, dequantize_scatter_triton):
                dk = torch.zeros(h, n + 17, d, device=device, dtype=torch.bfloat16)
                dv = torch.zeros(h, n + 17, d, device=device, dtype=torch.bfloat16)
                fn(want, dk, dv, dst_rows, delta, inv_freq)
                bf.append((dk, dv))
            scale = max(float(t.float().abs().max()) for t in bf[0]) or 1.0
            rel = max(float((a.float() - b.float()).abs().max()) for a, b in zip(bf[0], bf[1])) / scale
            row.update(bf16_scatter_max_rel_err=rel, bf16_scatter_ok=rel <= 2 ** -7)
            ok &= rel <= 2 ** -7
        except Exception as e:  # noqa: BLE001 - reported; the interpreter may not take bf16
            row.update(bf16_scatter_error=f"{type(e).__name__}: {e}"[:300], bf16_scatter_ok=None)
            ok &= small  # on a GPU a bf16 destination must work
        dk, dv = outs[1]
        out_bytes = 2 * dk.numel() * dk.element_size()
        buf = torch.empty(out_bytes // 4, device=device)
        src = torch.ones_like(buf)
        mem = _time(lambda: buf.copy_(src), device, repeats)
        q_s = _time(lambda: quantize_gather_triton(k, v, rows, tag, 32, 32), device, repeats)
        r_s = _time(lambda: dequantize_scatter_triton(want, dk, dv, dst_rows, delta, inv_freq), device, repeats)
        rq_s = _time(lambda: KR.reference_quantize_gather(k, v, rows, tag, 32, 32), device, repeats)
        rr_s = _time(lambda: KR.reference_dequantize_scatter(want, dk, dv, dst_rows, delta, inv_freq), device, repeats)
        row.update(quantize_ms=q_s * 1e3, restore_ms=r_s * 1e3, memcpy_ms=mem * 1e3,
                   ref_quantize_ms=rq_s * 1e3, ref_restore_ms=rr_s * 1e3,
                   quantize_speedup_vs_ref=rq_s / max(q_s, 1e-12), restore_speedup_vs_ref=rr_s / max(r_s, 1e-12),
                   restore_vs_memcpy=mem / max(r_s, 1e-12), quantize_vs_memcpy=mem / max(q_s, 1e-12))
        report["formats"][tag] = row
        print(f"[{h}x{n}x{d}] {tag:5s} quantize bit-exact={q_equal} scatter max|err|={err:.2e} "
              f"bf16 rel={row.get('bf16_scatter_max_rel_err', float('nan')):.1e}  quantize {q_s * 1e3:.3f} ms "
              f"(ref {rq_s * 1e3:.3f})  restore {r_s * 1e3:.3f} ms (ref {rr_s * 1e3:.3f})  memcpy {mem * 1e3:.3f} ms "
              f"(restore at {mem / max(r_s, 1e-12):.0%} of memcpy)")
    return report, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", action="store_true", help="CI sizes (runs under TRITON_INTERPRET=1 on CPU)")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # SmolLM2-135M's KV heads, then Llama-3.2-1B's, at 32k rows
    shapes = [(1, 64, 32)] if args.small else [(3, 32768, 64), (8, 32768, 64)]
    repeats = 1 if args.small else args.repeats
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": str(device), "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
              "small": args.small, "shapes": []}
    ok = True
    for h, n, d in shapes:
        got, shape_ok = _check_shape(h, n, d, device, repeats, args.small)
        ok &= shape_ok
        report["shapes"].append(got)
        if len(report["shapes"]) == 1:  # the first shape's fields at the top, as before
            report.update(heads=h, rows=n, head_dim=d, formats=got["formats"])
        report["ok"] = ok
        (out / "kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"kernels: {'OK' if ok else 'MISMATCH'} -> {out / 'kernels.json'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

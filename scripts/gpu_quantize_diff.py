"""Where the Triton quantizer's payload differs from the torch reference's on a GPU: per tensor, how many elements
differ and by how much (the kernel check reports only whether they are equal). Random inputs as in
scripts/gpu_kernel_check.py.

    python3 scripts/checkout_run.py scripts/gpu_quantize_diff.py
"""

import torch

from patchkv_agent.kernels import formats as KF, reference as KR
from patchkv_agent.kernels.triton_quantize_gather import quantize_gather_triton

dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
for h in (3, 8):
    n, d = 32768, 64
    k = (torch.randn(h, n, d, generator=g) * torch.rand(1, 1, d, generator=g) * 4).to(dev)
    v = torch.randn(h, n, d, generator=g).to(dev)
    rows = torch.arange(n, device=dev)
    for tag in KF.FORMATS:
        got = quantize_gather_triton(k, v, rows, tag, 32, 32).tensors()
        want = KR.reference_quantize_gather(k, v, rows, tag, 32, 32).tensors()
        # the same reference on the CPU: does torch agree with itself across devices?
        cpu = KR.reference_quantize_gather(k.cpu(), v.cpu(), rows.cpu(), tag, 32, 32).tensors()
        parts = []
        for name, t in want.items():
            a, b, c = got[name], t, cpu[name].to(t.device)
            ne = int((a != b).sum())
            diff = float((a.float() - b.float()).abs().max()) if ne else 0.0
            parts.append(f"{name}: {ne}/{b.numel()} differ (max {diff:.3g}); ref cpu!=gpu {int((c != b).sum())}")
        print(f"{h}x{n}x{d} {tag}: " + "; ".join(parts))

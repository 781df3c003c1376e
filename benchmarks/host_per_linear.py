"""Host us per qt.nn.Linear forward + backward, one line per run: `name=us ...` (for A/B calls).

    python3 benchmarks/host_per_linear.py [LAYER ...]   # default: nn.Linear fp8 fp8-delayed mxfp8 fp8-block nvfp4

Standalone on purpose (no quant_fsdp import): benchmarks/ab_trees.sh runs it against older source
trees, whose `benchmarks/linear_host.py` may time differently. Like that benchmark: bf16 256^3 on
CUDA (the GPU idles, so a step costs its host time), a new input object each step (as in
training: the same one would hit qt.nn's sibling cache and skip the input's quantize), eager;
the median of 7 rounds of 200 steps. On a CPU-only machine: 128^3 on the CPU.
"""

from __future__ import annotations

import sys
import time

import torch

import quant_tensors as qt


def host_us(name: str, device: str, size: int) -> float:
    layer = torch.nn.Linear(size, size, device=device, dtype=torch.bfloat16)
    if name != "nn.Linear":
        layer = qt.convert(torch.nn.Sequential(layer), qt.recipe_from_name(name))[0]
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    dy = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def step() -> None:
        layer(x.detach().requires_grad_(True)).backward(dy)

    for _ in range(20):
        step()
    samples = []
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            step()
        samples.append((time.perf_counter() - start) / 200 * 1e6)
    if device == "cuda":
        torch.cuda.synchronize()
    return sorted(samples)[3]


if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = sys.argv[1:] or ["nn.Linear", "fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"]
    print(" ".join(f"{name}={host_us(name, device, 256 if device == 'cuda' else 128):.0f}" for name in names))

"""How the benchmarks' runs compile: `compiled` is `torch.compile` with the run's backend; `fused`
is the same with quant-core's compiled kernels "inductor" while it traces (per-tensor and
blockwise FP8's quantizes, MXFP8's quantizes and dequantizes, as torch ops that Inductor fuses with their neighbours:
[Note: kernels Inductor fuses] in quant_core._library). Only our recipes have fused runs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import quant_core

COMPILED_MODES = ("compiled", "fused")


def compile_backend(backend: str, mode: str) -> str | Callable[..., Any]:
    """torch.compile's backend for a run of `mode` (one of COMPILED_MODES) and backend name."""
    if mode == "compiled":
        return backend
    if mode != "fused":
        raise ValueError(f"mode {mode!r} does not compile; compiled modes are {', '.join(COMPILED_MODES)}")
    inner = torch._dynamo.lookup_backend(backend)

    def fused(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        # AOTAutograd traces forward and backward in here, so the whole step uses the fused kernels.
        with quant_core.use_compiled_kernels("inductor"):
            return inner(graph, example_inputs)

    return fused

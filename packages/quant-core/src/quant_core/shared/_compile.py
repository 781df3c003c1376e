"""Whether torch.compile is tracing the calling code into a graph."""

from __future__ import annotations

import torch
import torch._guards


def compiling() -> bool:
    """True while torch.compile traces the caller into a graph: Dynamo tracing it, or AOTAutograd
    tracing a tensor subclass's __torch_dispatch__ under Dynamo's compile (where a quantized
    tensor's GEMM quantizes its other operand). `torch.compiler.is_compiling()` covers the second
    case only from torch 2.13 on; the tracing context, which Dynamo holds for its whole compile,
    covers it in every supported release. False in eager code."""
    # is_compiling first: Dynamo folds it to True and never reaches the thread-local read
    return torch.compiler.is_compiling() or torch._guards.TracingContext.try_get() is not None

"""bf16 GEMMs on the CPU computed the fp32 way, for the demo's bf16 run and the tests' bf16 baselines."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# [Note: bf16 GEMMs on CPUs without bf16 instructions] torch's CPU GEMM of bf16 operands runs
# ~30x slower than its fp32 GEMM on x86 CPUs without AVX-512 bf16 (bf16 256^3: 26 ms against
# 0.8 ms for both operands upcast, the fp32 GEMM and one rounding, on an AVX2 host), and takes 95%
# of a bf16 TinyTransformer training step there. Both sum fp32 products of the same bf16 values
# and round once to bf16, as GPU tensor cores do; only the order of the sums differs (results
# within a bf16 ulp or so). Baselines trained in bf16 run their GEMMs the fp32 way under
# `bf16_gemms_in_fp32`, and so does every run they are compared with.
_GEMMS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
}


# Plain tensors only (a Linear's bias reaches addmm as the Parameter itself); a tensor subclass
# (a quantized weight) runs its own GEMM.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class _Bf16GemmsInFp32(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func in _GEMMS and all(
            type(a) in _PLAIN and a.dtype == torch.bfloat16 and a.device.type == "cpu"
            for a in args
            if isinstance(a, torch.Tensor)
        ):
            upcast = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*upcast, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)


@contextmanager
def bf16_gemms_in_fp32() -> Iterator[None]:
    """Within it, CPU GEMMs (mm, addmm, bmm, baddbmm) of plain bf16 tensors run as fp32 GEMMs of
    the upcast operands, rounded to bf16 once ([Note: bf16 GEMMs on CPUs without bf16
    instructions]); every other op runs as it would."""
    with _Bf16GemmsInFp32():
        yield

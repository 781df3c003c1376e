"""The Triton amax_many kernel equals the CPU reference bit for bit: many tensors of mixed dtypes
in one launch, sizes across chunk boundaries, non-contiguous inputs. On machines without a GPU,
Triton's CPU interpreter checks the kernel's indexing (fp32 inputs are exact there: no FP8 cast).
"""

from __future__ import annotations

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

triton_module = pytest.importorskip("quant_core.fp8._triton_amax_many")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")

CUDA = torch.device("cuda")
CHUNK = triton_module.CHUNK
# Sizes around one and two chunks of a program, and a long tensor of many chunks.
CHUNK_EDGE_SIZES = [1, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1, 2 * CHUNK + 1, 1_000_003]


def bits(t: torch.Tensor) -> list[int]:
    return t.cpu().view(torch.int32).tolist()


def chunk_edge_tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    """For each size, tensors whose largest finite |x| sits at the last element of a chunk, at the
    first of the next one, or at the very end, the rest Gaussian with non-finite values around it."""
    tensors = []
    for n in CHUNK_EDGE_SIZES:
        for where in {CHUNK - 1, CHUNK, n - 1}:
            if where < n:
                x = torch.randn(n, generator=torch.Generator().manual_seed(n + where))
                x[where] = -1000.0
                neighbour = where + 1 if where + 1 < n else where - 1
                if neighbour >= 0:
                    x[neighbour] = float("inf") if where % 2 else float("nan")
                tensors.append(x.to(dtype))
    return tensors


# Run in a fresh process (~3 s of it importing torch): TRITON_INTERPRET is read when kernels are
# defined. fp32 only: the interpreter flushes bf16 subnormals to zero when converting them to fp32
# (NOTES.md). Seven programs (~30 ms each interpreted): the edges of one and two chunks, a strided
# view, empty tensors between others.
_INTERPRETED = """
import torch
from quant_core.fp8 import _triton_amax_many as _triton
from quant_core.fp8._amax_many import AmaxManyArgs, amax_many_reference
from quant_core.testing import adversarial

C = _triton.CHUNK
tensors = [adversarial((n,), torch.float32, seed=n) for n in (0, 1, 7)]
edge = torch.zeros(2 * C)
edge[C] = -3.0  # first element of the second chunk
tensors += [edge, torch.zeros(C).index_fill_(0, torch.tensor([C - 1]), 2.5), torch.empty(0, 3)]
tensors += [adversarial((40, 30), torch.float32, seed=3).t(), torch.tensor([float("nan"), 1e-45, -0.0])]
got = _triton._amax_many(AmaxManyArgs(tensors))
want = amax_many_reference(tensors)
assert got.view(torch.int32).tolist() == want.view(torch.int32).tolist(), (got, want)
"""


@pytest.mark.triton_interpreter(_INTERPRETED)
def test_kernel_equals_the_reference_in_the_triton_interpreter(triton_interpreter):
    triton_interpreter.check()


@pytest.mark.cuda
@needs_cuda
def test_triton_runs_amax_many():
    assert quant_core.selected_backend("amax_many", CUDA) == "triton"


@pytest.mark.cuda
@needs_cuda
def test_many_tensors_of_mixed_dtypes_and_layouts_equal_reference():
    generator = torch.Generator().manual_seed(0)
    sizes = torch.randint(0, 5000, (300,), generator=generator).tolist()
    tensors = [adversarial((n,), FLOAT_DTYPES[t % 3], seed=t) for t, n in enumerate(sizes)]
    for d, dtype in enumerate(FLOAT_DTYPES):
        base = adversarial((96, 160), dtype, seed=d)
        tensors += [base.t(), base[::3, 5::2], base.expand(2, 96, 160), base.reshape(8, 12, 160)[:, 0], base[0, 0]]
        tensors += [torch.empty(0, 4, dtype=dtype), adversarial((33, 65), dtype, seed=d)]
    got = quant_core.amax_many([t.to(CUDA) for t in tensors])
    assert (got.dtype, got.shape, got.device.type) == (torch.float32, (len(tensors),), "cuda")
    assert bits(got) == bits(quant_core.amax_many_reference(tensors))


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_sizes_across_chunk_boundaries_equal_reference(dtype):
    tensors = chunk_edge_tensors(dtype)
    got = quant_core.amax_many([t.to(CUDA) for t in tensors])
    assert bits(got) == bits(quant_core.amax_many_reference(tensors))
    assert set(got.tolist()) == {1000.0}


@pytest.mark.cuda
@needs_cuda
def test_adversarial_amaxes_equal_reference():
    # Zero, subnormal and non-finite-only tensors of each dtype, the fp32 max, one after another
    # in one launch.
    nan, inf = float("nan"), float("inf")
    values = [[0.0, -0.0], [1e-45, -1e-44, nan], [9.2e-41, -nan], [-6e-8, inf], [nan, -inf], [-3.4e38, 1.0], [65504.0]]
    tensors = [torch.tensor(v).to(dtype) for dtype in FLOAT_DTYPES for v in values]
    got = quant_core.amax_many([t.to(CUDA) for t in tensors])
    assert bits(got) == bits(quant_core.amax_many_reference(tensors))
    assert bits(quant_core.amax_many([torch.empty(0, device=CUDA)])) == [0]


@pytest.mark.cuda
@needs_cuda
def test_tensors_on_two_devices_raise_with_fix():
    with pytest.raises(ValueError, match=r"tensors\[1\] is on cuda.*tensors\[0\] is on cpu.*once per device"):
        quant_core.amax_many([torch.ones(3), torch.ones(3, device=CUDA)])

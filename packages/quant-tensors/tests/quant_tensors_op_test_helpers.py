"""Shared helpers of the QuantizedTensor op tests (test_ops_*.py): recipes and roles, the cases they
parametrize over, quantized inputs and the value/aliasing assertions.

Each op test checks the result's type (the format's subclass, or a plain tensor where that is the
contract), shape, nominal dtype and values: `dequantize()` is exact and deterministic, so values are
compared bitwise, on the rowwise and on the columnwise data. Ops that are views (detach, alias,
view, split, slice) must share buffers with their source; copies (clone, deepcopy) must not.

Imported by name (`from quant_tensors_op_test_helpers import ...`): this folder's conftest.py puts it
on sys.path, as the repository runs pytest with --import-mode=importlib.
"""

from __future__ import annotations

import copy

import torch

import quant_tensors as qt

aten = torch.ops.aten

RECIPE_NAMES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CASES = [(name, role) for name in RECIPE_NAMES for role in qt.ROLES]
CASE_IDS = [f"{name}-{role}" for name, role in CASES]

# Class and dim-0 block boundary (rows of the (M, K) view) of each recipe's tensors. The recipes'
# quantizers produce both usages, so 1-D-blocked formats need their columnwise blocks (which run
# along M) whole too: 32 for MXFP8, 128 for blockwise 1x128 and 128x128, 16 for NVFP4 1x16 and 16x16.
EXPECTED_CLASS = {
    "fp8": qt.Float8Tensor,
    "fp8-delayed": qt.Float8Tensor,
    "mxfp8": qt.MXFP8Tensor,
    "fp8-block": qt.Float8BlockwiseTensor,
    "nvfp4": qt.NVFP4Tensor,
}
ROW_ALIGNMENT = {"fp8": 1, "fp8-delayed": 1, "mxfp8": 32, "fp8-block": 128, "nvfp4": 16}
BLOCK_CASES = [case for case in CASES if ROW_ALIGNMENT[case[0]] > 1]
BLOCK_CASE_IDS = [f"{name}-{role}" for name, role in BLOCK_CASES]
PER_TENSOR_CASES = [case for case in CASES if ROW_ALIGNMENT[case[0]] == 1]
PER_TENSOR_CASE_IDS = [f"{name}-{role}" for name, role in PER_TENSOR_CASES]
# Formats whose blocks are 1-D along K: without columnwise data their rows are independent.
ONE_D_CASES = [(name, role) for name, role in BLOCK_CASES if not (role == "weight" and name != "mxfp8")]
ONE_D_CASE_IDS = [f"{name}-{role}" for name, role in ONE_D_CASES]

SHAPE_2D = (256, 384)
SHAPE_3D = (2, 128, 256)


# ---- helpers ---------------------------------------------------------------------------------


def randn(shape: tuple[int, ...], seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def quantized(name: str, role: str, shape: tuple[int, ...] = SHAPE_2D, seed: int = 0):
    """(quantizer, quantized tensor of a seeded bf16 input) for a recipe and role."""
    quantizer = qt.recipe_from_name(name).quantizer(role)
    return quantizer, quantizer.quantize(randn(shape, seed))


def columnwise_values(t: qt.QuantizedTensor) -> torch.Tensor:
    """t's values as its columnwise data gives them (an alias of t with rowwise dropped)."""
    alias = aten.alias.default(t)
    alias.update_usage(rowwise=False)
    assert alias.usages == (False, True)
    return alias.dequantize()


def raw(buffer: torch.Tensor) -> torch.Tensor:
    """A buffer's bytes, for bitwise comparisons (works for 0-d and non-contiguous buffers)."""
    return buffer.reshape(-1).contiguous().view(torch.uint8)


def present_buffers(t: qt.QuantizedTensor) -> dict[str, torch.Tensor]:
    return {name: b for name, b in t.buffers().items() if b is not None}


def assert_same_values(result: qt.QuantizedTensor, expected_rowwise: torch.Tensor, expected_columnwise=None) -> None:
    assert torch.equal(result.dequantize(), expected_rowwise)
    if expected_columnwise is not None:
        assert torch.equal(columnwise_values(result), expected_columnwise)


def assert_shares_buffers(written: qt.QuantizedTensor, other: qt.QuantizedTensor) -> None:
    """Requantizes `written` in place from new values; `other` must see all of it (data and scales)."""
    source = randn(tuple(written.shape), seed=99)
    expected = copy.deepcopy(written.quantizer).quantize(source)  # same quantizer state (delayed, SR)
    written.copy_(source)
    assert torch.equal(other.dequantize(), expected.dequantize().reshape(other.shape))
    assert torch.equal(columnwise_values(other), columnwise_values(expected).reshape(other.shape))


def assert_independent(copy_: qt.QuantizedTensor, original: qt.QuantizedTensor) -> None:
    """No buffer of `copy_` is (part of) a buffer of `original`: zeroing the copy leaves it unchanged."""
    before_rowwise, before_columnwise = original.dequantize(), columnwise_values(original)
    original_storages = {b.untyped_storage().data_ptr() for b in present_buffers(original).values()}
    for name, buffer in present_buffers(copy_).items():
        assert buffer.untyped_storage().data_ptr() not in original_storages, name
    copy_.zero_()
    assert not copy_.dequantize().any()
    assert torch.equal(original.dequantize(), before_rowwise)
    assert torch.equal(columnwise_values(original), before_columnwise)

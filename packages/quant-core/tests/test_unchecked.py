"""quant_core.unchecked ([Note: unchecked entries]): each entry gives what the public function of
the same name gives, bit for bit (shapes and dtypes included), and takes its operator's arguments."""

from __future__ import annotations

import inspect

import pytest
import torch

import quant_core
from quant_core import unchecked
from quant_core._library import OPERATORS

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _x(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(torch.bfloat16)


X = _x((3, 48, 160))  # (M, K) = (144, 160): partial 32-, 128- and 16 x 16 edge blocks, N-D rowwise data
X_MK = X.reshape(-1, 160)
AMAX = quant_core.amax(X)


def _blocks(q: quant_core.BlockQuantized) -> tuple[torch.Tensor | None, ...]:
    return q.rowwise_data, q.rowwise_scale_inv, q.columnwise_data, q.columnwise_scale_inv


def _nvfp4(x, block_shape, rowwise, columnwise, stochastic):
    seed = torch.tensor(7, dtype=torch.int64)
    got = unchecked.quantize_nvfp4(
        x, block_shape[0], AMAX, stochastic, seed, AMAX, None, rowwise=rowwise, columnwise=columnwise
    )
    want = quant_core.quantize_nvfp4(
        x, block_shape, rowwise=rowwise, columnwise=columnwise, stochastic_rounding=stochastic, seed=7
    )
    return got, _blocks(want)


def _blockwise(x, block_shape, fp8_dtype, power_2_scales, rowwise, columnwise):
    got = unchecked.quantize_fp8_blockwise(
        x, block_shape[0], fp8_dtype, power_2_scales, rowwise=rowwise, columnwise=columnwise
    )
    want = quant_core.quantize_fp8_blockwise(
        x, block_shape, fp8_dtype, power_2_scales=power_2_scales, rowwise=rowwise, columnwise=columnwise
    )
    return got, _blocks(want)


def _fp8_quantize(x, delayed: bool):
    history = torch.tensor([3.0, 50.0, 0.0])
    if delayed:
        got = unchecked.quantize_fp8_delayed(
            x, None, history.clone(), E4M3, 1, True, "max", True, True, scale=torch.empty(())
        )
        want = quant_core.quantize_fp8_delayed(
            x, history.clone(), E4M3, margin=1, power_2_scales=True, rowwise=True, columnwise=True
        )
    else:
        got = unchecked.quantize_fp8(x, None, E5M2, False, True, True, scale=torch.empty(()))
        want = quant_core.quantize_fp8(x, E5M2, rowwise=True, columnwise=True)
    return got, (want.rowwise_data, want.columnwise_data, want.scale_inv, want.scale)


def _dequantize_cases():
    mx = quant_core.quantize_mxfp8(X, columnwise=True)
    block = quant_core.quantize_fp8_blockwise(X, (128, 128), columnwise=True)
    nv = quant_core.quantize_nvfp4(X_MK, (16, 16), columnwise=True)
    nv_rows = quant_core.quantize_nvfp4(X_MK, columnwise=True)
    fp8 = quant_core.quantize_fp8(X_MK, columnwise=True)
    product = torch.randn(144, 96)
    bias = torch.randn(96)
    return {
        "dequantize_fp8": (
            lambda: (unchecked.dequantize_fp8(fp8.columnwise_data, fp8.scale_inv, torch.bfloat16),),
            lambda: (quant_core.dequantize_fp8(fp8.columnwise_data, fp8.scale_inv, torch.bfloat16),),
        ),
        "dequantize_mxfp8": (
            lambda: (unchecked.dequantize_mxfp8(mx.columnwise_data, mx.columnwise_scale_inv, torch.float16),),
            lambda: (quant_core.dequantize_mxfp8(mx.columnwise_data, mx.columnwise_scale_inv, torch.float16),),
        ),
        "dequantize_mxfp8_pair": (
            lambda: unchecked.dequantize_mxfp8_pair(
                mx.rowwise_data.reshape(-1, 160), mx.rowwise_scale_inv, *_blocks(mx)[2:], torch.float32
            ),
            lambda: quant_core.dequantize_mxfp8_pair(
                mx.rowwise_data.reshape(-1, 160), mx.rowwise_scale_inv, *_blocks(mx)[2:], torch.float32
            ),
        ),
        "dequantize_fp8_blockwise": (
            lambda: (
                unchecked.dequantize_fp8_blockwise(
                    block.columnwise_data, block.columnwise_scale_inv, 128, torch.float32
                ),
            ),
            lambda: (
                quant_core.dequantize_fp8_blockwise(
                    block.columnwise_data, block.columnwise_scale_inv, (128, 128), torch.float32
                ),
            ),
        ),
        "dequantize_nvfp4": (
            lambda: (
                unchecked.dequantize_nvfp4(nv.columnwise_data, nv.columnwise_scale_inv, 16, nv.amax, torch.bfloat16),
                unchecked.dequantize_nvfp4(nv.rowwise_data, nv.rowwise_scale_inv, 16, None, torch.float32),
            ),
            lambda: (
                quant_core.dequantize_nvfp4(
                    nv.columnwise_data, nv.columnwise_scale_inv, nv.amax, (16, 16), torch.bfloat16
                ),
                quant_core.dequantize_nvfp4(nv.rowwise_data, nv.rowwise_scale_inv, None, (16, 16), torch.float32),
            ),
        ),
        "dequantize_nvfp4_pair": (
            lambda: unchecked.dequantize_nvfp4_pair(
                nv_rows.rowwise_data,
                nv_rows.rowwise_scale_inv,
                nv.columnwise_data,
                nv.columnwise_scale_inv,
                1,
                nv_rows.amax,
                16,
                None,
                torch.float32,
            ),
            lambda: quant_core.dequantize_nvfp4_pair(
                nv_rows.rowwise_data,
                nv_rows.rowwise_scale_inv,
                nv_rows.amax,
                nv.columnwise_data,
                nv.columnwise_scale_inv,
                None,
                a_block_shape=(1, 16),
                b_block_shape=(16, 16),
                dtype=torch.float32,
            ),
        ),
        "nvfp4_gemm_output": (
            lambda: (unchecked.nvfp4_gemm_output(product, nv.amax, nv_rows.amax, bias, torch.bfloat16),),
            lambda: (quant_core.nvfp4_gemm_output(product, nv.amax, nv_rows.amax, bias, torch.bfloat16),),
        ),
        "transpose_bytes": (
            lambda: (unchecked.transpose_bytes(fp8.rowwise_data),),
            lambda: (quant_core.transpose_fp8(fp8.rowwise_data),),
        ),
        "transpose_nvfp4": (
            lambda: unchecked.transpose_nvfp4(nv.rowwise_data, nv.rowwise_scale_inv),
            lambda: quant_core.transpose_nvfp4(nv.rowwise_data, nv.rowwise_scale_inv),
        ),
        "amax": (lambda: (unchecked.amax(X_MK),), lambda: (AMAX,)),
    }


CASES = {
    **_dequantize_cases(),
    "quantize_mxfp8": lambda x, usages: (
        unchecked.quantize_mxfp8(x, rowwise=usages[0], columnwise=usages[1]),
        _blocks(quant_core.quantize_mxfp8(x, rowwise=usages[0], columnwise=usages[1])),
    ),
    "quantize_fp8_blockwise": lambda x, usages: _blockwise(x, (1, 128), E4M3, True, *usages),
    "quantize_fp8_blockwise tiles": lambda x, usages: _blockwise(x, (128, 128), E5M2, False, *usages),
    "quantize_nvfp4": lambda x, usages: _nvfp4(x, (1, 16), *usages, stochastic=True),
    "quantize_nvfp4 tiles": lambda x, usages: _nvfp4(x, (16, 16), *usages, stochastic=False),
    "cast_to_fp8": lambda x, usages: (
        unchecked.cast_to_fp8(x, torch.tensor(0.75), E5M2, rowwise=usages[0], columnwise=usages[1]),
        quant_core.cast_to_fp8(x, torch.tensor(0.75), E5M2, rowwise=usages[0], columnwise=usages[1]),
    ),
    "quantize_fp8": lambda x, usages: _fp8_quantize(x, delayed=False),
    "quantize_fp8_delayed": lambda x, usages: _fp8_quantize(x, delayed=True),
}


def _assert_same(got, want) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None) == (w is None)
        if w is not None:
            assert (g.shape, g.dtype) == (w.shape, w.dtype)
            assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("x", [X, X_MK], ids=["3-D", "2-D"])
@pytest.mark.parametrize("usages", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not isinstance(case, tuple)])
def test_quantizing_entries_fill_what_the_public_functions_return(name, usages, x):
    got, want = CASES[name](x, usages)
    _assert_same(got, want)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if isinstance(case, tuple)])
def test_entries_return_what_the_public_functions_return(name):
    got, want = CASES[name]
    _assert_same(got(), want())


def test_every_entry_is_tested_and_takes_its_operators_arguments():
    tested = {name.split()[0] for name in CASES}
    assert tested == set(unchecked.__all__)
    for name in unchecked.__all__:
        fields = OPERATORS[name].arguments._fields
        parameters = list(inspect.signature(getattr(unchecked, name)).parameters)
        if OPERATORS[name].mutates_args and name not in ("quantize_fp8", "quantize_fp8_delayed"):
            # x and the other inputs, then the usages (the buffers are the entry's to allocate)
            assert parameters == [
                "x",
                *fields[1 : len(fields) - len(OPERATORS[name].mutates_args)],
                "rowwise",
                "columnwise",
            ]
        elif not OPERATORS[name].mutates_args:
            assert parameters == list(fields)

"""The Triton kernels of NVFP4 equal the reference bit for bit (CUDA): quantize (1 x 16 and
16 x 16, stochastic rounding), dequantize, the nibble transpose and the Hadamard transform, every
kernel variant (`nvfp4._triton_quantize`, `nvfp4._triton_dequantize`). On machines without a GPU,
Triton's CPU interpreter checks the indexing of the register-blocks quantize and the pairs
dequantize kernels.

References run on CPU copies of the inputs (see test_triton_fp8.py for why).
"""

from __future__ import annotations

import os

import pytest
import torch

import quant_core
from quant_core.testing import FLOAT_DTYPES, adversarial

pytest.importorskip("triton")
from quant_core.nvfp4 import _triton_dequantize, _triton_quantize  # after the skip: imports Triton
from quant_core.shared._triton_numerics import Tiles

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")

CUDA = torch.device("cuda")
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "amax", "columnwise_amax")
USAGES = [
    dict(rowwise=True, columnwise=False),
    dict(rowwise=False, columnwise=True),
    dict(rowwise=True, columnwise=True),
]
# (M, K) views with even dims (codes pack in pairs along both): partial edge blocks, 3-D, several tiles.
SHAPES = [(2, 16), (34, 50), (130, 258), (4, 6, 160), (256, 384)]


def views_of(x: torch.Tensor) -> list[torch.Tensor]:
    """x on the GPU and non-contiguous views of it there with an even last dim."""
    x = x.to(CUDA)
    if x.dim() != 2:
        return [x]
    return [x, x.t(), x[::2, ::2][:, : x.shape[1] // 4 * 2]]


def assert_bitwise(got: torch.Tensor | None, want: torch.Tensor | None, what: str) -> None:
    assert (got is None) == (want is None), what
    if got is not None:
        assert (got.dtype, got.shape) == (want.dtype, want.shape), what
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[got.element_size()]
        assert torch.equal(got.cpu().view(width), want.cpu().view(width)), what


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "op",
    [
        "quantize_nvfp4",
        "dequantize_nvfp4",
        "transpose_nvfp4",
        "hadamard_transform_16",
        "hadamard_inverse_16",
        "hadamard_amaxes",
        "nvfp4_gemm_output",
    ],
)
def test_triton_runs_every_nvfp4_op(op):
    assert quant_core.selected_backend(op, CUDA) == "triton"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("block_shape", [(1, 16), (16, 16)])
@pytest.mark.parametrize("stochastic_rounding", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_quantize_and_dequantize_equal_reference(block_shape, stochastic_rounding, dtype):
    kwargs = dict(block_shape=block_shape, stochastic_rounding=stochastic_rounding, seed=2**63 + 12345)
    for shape in SHAPES:
        x = adversarial(shape, dtype, seed=sum(shape))
        for i, view in enumerate(views_of(x)):
            M = view.numel() // view.shape[-1]
            for usage in USAGES if M % 2 == 0 else USAGES[:1]:
                got = quant_core.quantize_nvfp4(view, **kwargs, **usage)
                want = quant_core.quantize_nvfp4_reference(view.cpu(), **kwargs, **usage)
                for field in FIELDS:
                    assert_bitwise(getattr(got, field), getattr(want, field), f"{shape} view {i} {usage} {field}")
        want = quant_core.quantize_nvfp4_reference(x, **kwargs, rowwise=True, columnwise=True)
        for data, scale_inv in (
            (want.rowwise_data, want.rowwise_scale_inv),
            (want.columnwise_data, want.columnwise_scale_inv),
        ):
            for out_dtype in FLOAT_DTYPES:
                got = quant_core.dequantize_nvfp4(
                    data.to(CUDA), scale_inv.to(CUDA), want.amax.to(CUDA), block_shape, out_dtype
                )
                expected = quant_core.dequantize_nvfp4_reference(data, scale_inv, want.amax, block_shape, out_dtype)
                assert_bitwise(got, expected, f"{shape} {out_dtype}")


@pytest.mark.cuda
@needs_cuda
def test_stochastic_rounding_takes_the_seed_as_int_or_tensor():
    x = torch.randn(64, 128, device=CUDA)
    by_int = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=7)
    by_tensor = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=torch.tensor(7, device=CUDA))
    other = quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=8)
    assert torch.equal(by_int.rowwise_data, by_tensor.rowwise_data)
    assert not torch.equal(by_int.rowwise_data, other.rowwise_data)


@pytest.mark.cuda
@needs_cuda
def test_given_global_amax_is_used():
    x = adversarial((64, 96), torch.bfloat16, seed=9)
    global_amax = torch.tensor(1.0e6)
    got = quant_core.quantize_nvfp4(x.to(CUDA), global_amax=global_amax.to(CUDA), rowwise=True, columnwise=True)
    want = quant_core.quantize_nvfp4_reference(x, global_amax=global_amax, rowwise=True, columnwise=True)
    for field in FIELDS:
        assert_bitwise(getattr(got, field), getattr(want, field), field)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", [(2, 16), (34, 50), (130, 258), (256, 384)])
def test_transpose_equals_columnwise(shape):
    x = adversarial(shape, torch.bfloat16, seed=sum(shape)).to(CUDA)
    q = quant_core.quantize_nvfp4(x, (16, 16), rowwise=True, columnwise=True)
    data_t, scale_t = quant_core.transpose_nvfp4(q.rowwise_data, q.rowwise_scale_inv)
    assert_bitwise(data_t, q.columnwise_data, "data")
    assert_bitwise(scale_t, q.columnwise_scale_inv, "scale_inv")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_hadamard_equals_reference(dtype):
    inputs = [
        adversarial(shape, dtype, seed=sum(shape)).to(CUDA) for shape in [(1, 16), (3, 48), (130, 256), (2, 3, 160)]
    ]
    strided = adversarial((260, 256), dtype, seed=1).to(CUDA)
    inputs += [strided[::2], strided[:48].t()]  # row stride 2K; a transposed view (stride_k = 256)
    for x in inputs:
        for seed in (0, 77, -(2**62), 2**63 + 5):
            got = quant_core.hadamard_transform_16(x, seed=seed)
            want = quant_core.hadamard_transform_16_reference(x.cpu(), seed=seed)
            assert_bitwise(got, want, f"{tuple(x.shape)} {x.stride()} seed {seed}")
            got = quant_core.hadamard_inverse_16(x, seed=seed)
            want = quant_core.hadamard_inverse_16_reference(x.cpu(), seed=seed)
            assert_bitwise(got, want, f"inverse {tuple(x.shape)} {x.stride()} seed {seed}")


# ---- kernel variants ([Note: NVFP4 register blocks]) ------------------------------------------------

SEED = 2**63 + 12345
HADAMARD_SEED = 2**63 + 5
COLUMNWISE_AMAX = 700.0  # the transformed columnwise usage's tensor scale: 2688 / 700, not a power of two
TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.0, 0.0, -5.0, 4.0, 1e-30, -2.5, 3.0]


def quantize_with(
    variant: str,
    tiles: object,
    x_MK: torch.Tensor,
    block_rows: int,
    stochastic: bool,
    columnwise: bool,
    hadamard_seed: int | None = None,
) -> tuple[torch.Tensor | None, ...]:
    """Runs one quantize kernel variant (rowwise, and columnwise if asked) on fresh buffers, with
    global amax 2688 (tensor scale 1, so the E2M1 ties planted by `with_ties` stay ties) and, for
    a Hadamard-transformed columnwise usage, columnwise amax COLUMNWISE_AMAX."""
    M, K = x_MK.shape
    Mb, Kb = -(-M // 16), -(-K // 16)
    device = x_MK.device
    out = (
        torch.zeros(M, K // 2, dtype=torch.uint8, device=device),
        torch.zeros(-(-M // block_rows), Kb, dtype=torch.uint8, device=device),
        torch.zeros(K, M // 2, dtype=torch.uint8, device=device) if columnwise else None,
        torch.zeros(Kb if block_rows > 1 else K, Mb, dtype=torch.uint8, device=device) if columnwise else None,
    )
    amax = torch.tensor(2688.0, device=device)
    columnwise_amax = torch.tensor(COLUMNWISE_AMAX, device=device)
    signed_seed = None if hadamard_seed is None else (hadamard_seed + 2**63) % 2**64 - 2**63  # int64 range
    _triton_quantize.launch_quantize(
        x_MK, block_rows, amax, stochastic, SEED, out, variant, tiles, columnwise_amax, signed_seed
    )  # fmt: skip
    return out


def reference_of(
    x_MK: torch.Tensor, block_rows: int, stochastic: bool, columnwise: bool, hadamard_seed: int | None = None
) -> tuple[torch.Tensor | None, ...]:
    """`quantize_with`'s bytes from the reference."""
    want = quant_core.quantize_nvfp4_reference(
        x_MK.cpu(),
        (block_rows, 16),
        global_amax=torch.tensor(2688.0),
        columnwise=columnwise,
        stochastic_rounding=stochastic,
        seed=SEED,
        hadamard_seed=hadamard_seed,
        columnwise_amax=None if hadamard_seed is None else torch.tensor(COLUMNWISE_AMAX),
    )
    fields = (want.rowwise_data, want.rowwise_scale_inv, want.columnwise_data, want.columnwise_scale_inv)
    return tuple(None if f is None else f.view(torch.uint8) for f in fields)


def with_ties(x: torch.Tensor) -> torch.Tensor:
    """x with a 1 x 16 and a 16 x 1 block of exact E2M1 ties (block amax 6: s = 1, enc = 1)."""
    x = x.clone()
    x[1, 16:32] = torch.tensor(TIES, dtype=x.dtype)
    x[:16, 40] = torch.tensor(TIES, dtype=x.dtype)
    return x


# Run in a fresh process: TRITON_INTERPRET is read when kernels are defined. The interpreter checks
# indexing (fp32 inputs: it flushes bf16 subnormals), in 2 x 2 programs with partial tiles.
_INTERPRETED = """
import sys
import torch
sys.path.insert(0, {tests!r})
from test_triton_nvfp4 import quantize_with, reference_of, with_ties
import quant_core
from quant_core.nvfp4 import _dequantize, _triton_dequantize, _triton_quantize
from quant_core.shared._triton_numerics import Tiles
from quant_core.testing import adversarial

x = with_ties(adversarial((34, 50), torch.float32, seed=1))
views = [x, x.t()[:, :34], x[::2, 1::2][:, :24]]  # transposed (stride_k 50), strided with odd M
cases = [(1, False), (1, True), (16, False), (16, True)]
runs = [(view, case, _triton_quantize.BlockTiles(32, 32, 2, 8)) for view in views for case in cases]
runs += [(x, case, _triton_quantize.BlockTiles(16, 16, 1, 2)) for case in cases[1:3]]  # T = 2: H = 8
for view, (block_rows, stochastic), tiles in runs:
    columnwise = view.shape[0] % 2 == 0
    got = quantize_with("register_blocks", tiles, view, block_rows, stochastic, columnwise)
    want = reference_of(view, block_rows, stochastic, columnwise)
    for g, w in zip(got, want):
        assert g is None or torch.equal(g, w.reshape(g.shape)), (tuple(view.shape), block_rows, stochastic, tiles)
amax = torch.tensor(3.0e3)
for block_rows, dtype in [(1, torch.float32), (16, torch.bfloat16), (1, torch.float16)]:
    q = quant_core.quantize_nvfp4_reference(x, (block_rows, 16), global_amax=amax)
    q.rowwise_scale_inv.view(torch.uint8)[0, 1] = 0x7F  # a NaN scale
    want = quant_core.dequantize_nvfp4_reference(q.rowwise_data, q.rowwise_scale_inv, amax, (block_rows, 16), dtype)
    got = torch.empty(want.shape, dtype=dtype)
    _triton_dequantize.launch_dequantize(q.rowwise_data, q.rowwise_scale_inv, block_rows, amax, got, "pairs", Tiles(16, 32, 2))
    width = {{4: torch.int32, 2: torch.int16}}[got.element_size()]
    assert torch.equal(got.view(width), want.view(width)), (block_rows, dtype)
    want = quant_core.dequantize_nvfp4_reference(q.rowwise_data, q.rowwise_scale_inv, None, (block_rows, 16), dtype)
    _triton_dequantize.launch_dequantize(q.rowwise_data, q.rowwise_scale_inv, block_rows, None, got, "pairs", Tiles(16, 32, 2))
    assert torch.equal(got.view(width), want.view(width)), (block_rows, dtype, "without the tensor scale")
# Two operands in one launch: A's programs, then B's (partial tiles both sides, an empty A).
_triton_dequantize.DEQUANTIZE_PAIRS_TILES = Tiles(16, 32, 2)
tiled = quant_core.quantize_nvfp4_reference(x, (16, 16), global_amax=amax)
blocks = quant_core.quantize_nvfp4_reference(x, (1, 16), global_amax=amax)
empty = quant_core.quantize_nvfp4_reference(torch.empty(0, 32))
operands = [(tiled.rowwise_data, tiled.rowwise_scale_inv, 16, amax), (blocks.rowwise_data, blocks.rowwise_scale_inv, 1, None), (empty.rowwise_data, empty.rowwise_scale_inv, 1, None)]
for a, b in [(operands[0], operands[1]), (operands[1], operands[0]), (operands[2], operands[0])]:
    outs = [torch.empty(op[0].shape[0], 2 * op[0].shape[1]) for op in (a, b)]
    pair = _dequantize.DequantizeNvfp4PairArgs(a[0], a[1], b[0], b[1], a[2], a[3], b[2], b[3], torch.float32)
    _triton_dequantize._dequantize_nvfp4_pair(pair, *outs)
    for (data, scale, rows, global_amax), out in zip((a, b), outs):
        want = quant_core.dequantize_nvfp4_reference(data, scale, global_amax, (rows, 16), torch.float32)
        assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (data.shape, rows, global_amax)
_triton_dequantize.GEMM_OUTPUT_TILES = Tiles(1, 64, 2)  # 34 x 50 = 1700 elements: 27 programs, the last partial
product = adversarial((34, 50), torch.float32, seed=5)
bias = adversarial((50,), torch.bfloat16, seed=6)
for a_amax, b_amax, with_bias, dtype in [(3.0e3, 1.0e-3, True, torch.bfloat16), (0.0, 7.5, False, torch.float16)]:
    a_amax, b_amax = torch.tensor(a_amax), torch.tensor(b_amax)
    b = bias if with_bias else None
    want = quant_core.nvfp4_gemm_output_reference(product, a_amax, b_amax, b, dtype)
    got = torch.empty(want.shape, dtype=dtype)
    _triton_dequantize._nvfp4_gemm_output(_dequantize.Nvfp4GemmOutputArgs(product, a_amax, b_amax, b, dtype), got)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (a_amax, b_amax, with_bias, dtype)
"""


@pytest.mark.triton_interpreter(_INTERPRETED.format(tests=os.path.dirname(__file__)))
def test_new_kernels_index_like_the_reference_in_the_triton_interpreter(triton_interpreter):
    triton_interpreter.check()


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    ("variant", "tiles"),
    [
        ("original", _triton_quantize.QUANTIZE_TILES),
        ("register_blocks", _triton_quantize.BlockTiles(32, 32, 2, 8)),
        ("register_blocks", _triton_quantize.BlockTiles(64, 64, 4, 4)),
        ("register_blocks", _triton_quantize.BlockTiles(128, 128, 8, 8)),
    ],
)
@pytest.mark.parametrize("block_rows", [1, 16])
@pytest.mark.parametrize("stochastic", [False, True])
def test_every_quantize_variant_equals_reference(variant, tiles, block_rows, stochastic):
    for shape in [(34, 50), (130, 258)]:
        for dtype in FLOAT_DTYPES:
            x = with_ties(adversarial(shape, dtype, seed=sum(shape)))
            for i, view in enumerate(views_of(x)):
                columnwise = view.shape[0] % 2 == 0
                got = quantize_with(variant, tiles, view, block_rows, stochastic, columnwise)
                want = reference_of(view, block_rows, stochastic, columnwise)
                for field, g, w in zip(FIELDS, got, want, strict=False):
                    assert_bitwise(g, None if w is None else w.reshape(g.shape), f"{shape} {dtype} view {i} {field}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    ("variant", "tiles"), [("elementwise", _triton_dequantize.DEQUANTIZE_TILES), ("pairs", Tiles(16, 32, 2))]
)
def test_every_dequantize_variant_equals_reference(variant, tiles):
    amax = torch.tensor(3.0e3)
    for shape, block_rows in [((34, 50), 1), ((130, 258), 16), ((1, 2), 1)]:
        q = quant_core.quantize_nvfp4_reference(adversarial(shape, seed=2), (block_rows, 16), global_amax=amax)
        q.rowwise_scale_inv.view(torch.uint8)[0, 0] = 0x7F  # a NaN scale
        for dtype in FLOAT_DTYPES:
            want = quant_core.dequantize_nvfp4_reference(
                q.rowwise_data, q.rowwise_scale_inv, amax, (block_rows, 16), dtype
            )
            got = torch.empty(want.shape, dtype=dtype, device=CUDA)
            data, scale = q.rowwise_data.to(CUDA), q.rowwise_scale_inv.to(CUDA)
            _triton_dequantize.launch_dequantize(data, scale, block_rows, amax.to(CUDA), got, variant, tiles)
            assert_bitwise(got, want, f"{shape} {dtype}")
            want = quant_core.dequantize_nvfp4_reference(
                q.rowwise_data, q.rowwise_scale_inv, None, (block_rows, 16), dtype
            )
            _triton_dequantize.launch_dequantize(data, scale, block_rows, None, got, variant, tiles)
            assert_bitwise(got, want, f"{shape} {dtype} without the tensor scale")


# (a_global_amax, b_global_amax): S = 1, S from ordinary amaxes, 0 (S = 1), S clamped (tiny amax).
GEMM_OUTPUT_AMAXES = [(2688.0, 2688.0), (3.0e3, 1.7e-2), (0.0, 41.0), (1.0e-38, 6.0e4)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", [(34, 50), (130, 258), (1, 4097), (2048, 1024)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_output_equals_reference(shape, with_bias):
    product = adversarial(shape, torch.float32, seed=sum(shape))
    bias = adversarial(shape[1:], torch.bfloat16, seed=7) if with_bias else None
    for a_amax, b_amax in GEMM_OUTPUT_AMAXES:
        a_amax, b_amax = torch.tensor(a_amax), torch.tensor(b_amax)
        for dtype in FLOAT_DTYPES:
            got = quant_core.nvfp4_gemm_output(
                product.to(CUDA), a_amax.to(CUDA), b_amax.to(CUDA), None if bias is None else bias.to(CUDA), dtype
            )
            want = quant_core.nvfp4_gemm_output_reference(product, a_amax, b_amax, bias, dtype)
            assert_bitwise(got, want, f"{shape} amaxes {a_amax.item()}, {b_amax.item()} {dtype}")


# ---- the Hadamard-transformed columnwise usage ([Note: NVFP4 random Hadamard transform]) ------------

# (M, K) views with M a multiple of 16 (whole runs): partial blocks and tiles along K, 3-D, many tiles.
HADAMARD_SHAPES = [(16, 16), (32, 50), (160, 258), (4, 8, 160), (256, 384)]


def whole_run_views_of(x: torch.Tensor) -> list[torch.Tensor]:
    """`views_of(x)` whose (M, K) view has M a multiple of 16 and K even."""
    return [v for v in views_of(x) if (v.numel() // v.shape[-1]) % 16 == 0 and v.shape[-1] % 2 == 0]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("stochastic_rounding", [False, True])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_hadamard_quantize_equals_reference(stochastic_rounding, dtype):
    kwargs = dict(stochastic_rounding=stochastic_rounding, seed=2**63 + 12345)
    for shape in HADAMARD_SHAPES:
        x = adversarial(shape, dtype, seed=sum(shape))
        for i, view in enumerate(whole_run_views_of(x)):
            for hadamard_seed in (0, -(2**62) + 3):
                for usage in USAGES:
                    got = quant_core.quantize_nvfp4(view, hadamard_seed=hadamard_seed, **kwargs, **usage)
                    want = quant_core.quantize_nvfp4_reference(
                        view.cpu(), hadamard_seed=hadamard_seed, **kwargs, **usage
                    )
                    for field in FIELDS:
                        what = f"{shape} view {i} seed {hadamard_seed} {usage} {field}"
                        assert_bitwise(getattr(got, field), getattr(want, field), what)


@pytest.mark.cuda
@needs_cuda
def test_hadamard_quantize_with_given_amaxes_equals_reference():
    x = adversarial((64, 96), torch.bfloat16, seed=9)
    amaxes = dict(global_amax=torch.tensor(1.0e6), columnwise_amax=torch.tensor(3.0e5))
    got = quant_core.quantize_nvfp4(
        x.to(CUDA), columnwise=True, hadamard_seed=5, **{k: v.to(CUDA) for k, v in amaxes.items()}
    )
    want = quant_core.quantize_nvfp4_reference(x, columnwise=True, hadamard_seed=5, **amaxes)
    for field in FIELDS:
        assert_bitwise(getattr(got, field), getattr(want, field), field)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_hadamard_amaxes_equal_reference(dtype):
    # Any M: partial last runs are zero-padded; several programs (atomics) for the larger shapes.
    for shape in [(1, 16), (7, 3), (34, 50), (130, 258), (4, 6, 40), (1000, 640)]:
        x = adversarial(shape, dtype, seed=sum(shape)).to(CUDA)
        views = [x] if x.dim() != 2 else [x, x.t(), x[::2, ::3]]
        for view in views:
            for seed in (0, 2**63 + 1):
                got = quant_core.hadamard_amaxes(view, seed)
                want = quant_core.hadamard_amaxes_reference(view.cpu(), seed)
                assert_bitwise(got, want, f"{shape} {view.stride()} seed {seed}")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "tiles",
    [
        _triton_quantize.BlockTiles(32, 32, 2, 8),
        _triton_quantize.BlockTiles(64, 64, 4, 4),
        _triton_quantize.BlockTiles(64, 64, 4, 16),
        _triton_quantize.BlockTiles(128, 128, 8, 8),
    ],
)
@pytest.mark.parametrize("stochastic", [False, True])
def test_every_hadamard_quantize_tile_equals_reference(tiles, stochastic):
    for shape in [(48, 50), (160, 258)]:
        for dtype in FLOAT_DTYPES:
            x = adversarial(shape, dtype, seed=sum(shape))
            for i, view in enumerate(whole_run_views_of(x)):
                got = quantize_with("register_blocks", tiles, view, 1, stochastic, True, hadamard_seed=HADAMARD_SEED)
                want = reference_of(view, 1, stochastic, True, hadamard_seed=HADAMARD_SEED)
                for field, g, w in zip(FIELDS, got, want, strict=False):
                    assert_bitwise(g, w.reshape(g.shape), f"{shape} {dtype} view {i} {field}")


_INTERPRETED_HADAMARD = """
import sys
import torch
sys.path.insert(0, {tests!r})
from test_triton_nvfp4 import HADAMARD_SEED, quantize_with, reference_of, with_ties
import quant_core
from quant_core.nvfp4 import _hadamard, _triton_hadamard, _triton_quantize
from quant_core.shared._triton_numerics import Tiles
from quant_core.testing import adversarial

x = with_ties(adversarial((48, 50), torch.float32, seed=1))
views = [x, x[:, :34], adversarial((50, 32), seed=2).t()[:, :48]]  # partial tiles; transposed (stride_k 50)
runs = [(view, stochastic, _triton_quantize.BlockTiles(32, 32, 2, 8)) for view in views for stochastic in (False, True)]
runs += [(x, False, _triton_quantize.BlockTiles(16, 16, 1, 2)), (x, True, _triton_quantize.BlockTiles(32, 16, 1, 16))]  # H = 8, T = 16
for view, stochastic, tiles in runs:
    got = quantize_with("register_blocks", tiles, view, 1, stochastic, True, hadamard_seed=HADAMARD_SEED)
    want = reference_of(view, 1, stochastic, True, hadamard_seed=HADAMARD_SEED)
    for g, w in zip(got, want):
        assert torch.equal(g, w.reshape(g.shape)), (tuple(view.shape), stochastic, tiles)
_triton_hadamard.HADAMARD_AMAXES_TILES = Tiles(32, 16, 1)  # several programs: their atomics
for shape in [(34, 50), (16, 16), (7, 3)]:
    y = adversarial(shape, seed=3)
    for view in (y, y.t()):
        got = torch.zeros(2)
        _triton_hadamard._hadamard_amaxes(_hadamard.HadamardArgs(view, -5), got)
        assert torch.equal(got, quant_core.hadamard_amaxes_reference(view, -5)), shape
"""


@pytest.mark.triton_interpreter(_INTERPRETED_HADAMARD.format(tests=os.path.dirname(__file__)))
def test_hadamard_kernels_index_like_the_reference_in_the_triton_interpreter(triton_interpreter):
    triton_interpreter.check()


@pytest.mark.parametrize("seed", [0, 1, -1, 2**31, -(2**31) - 1, 2**63 - 1, -(2**63), -(2**63) + 5, -3])
def test_a_seed_travels_as_two_int32_halves(seed):
    from quant_core.shared._triton_numerics import int32_halves

    high, low = int32_halves(seed)
    assert all(-(2**31) <= half < 2**31 for half in (high, low))
    assert (high << 32) | (low & 0xFFFFFFFF) == seed

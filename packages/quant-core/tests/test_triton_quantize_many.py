"""The Triton multi-tensor block quantize ([Note: multi-tensor block quantize]) writes, for every
tensor of a list, the bytes of the single-tensor Triton kernel, bit for bit.

Without a GPU: Triton's CPU interpreter runs both kernels on the same lists (it mis-rounds FP8
casts, identically in both, so equality still checks the many-kernel's indexing: tables, tiles,
pointers, strides), and the launcher's host code runs with the launch stubbed (groups, tables,
their caching). The `cuda` tests compare the two kernels on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch

import quant_core
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._mxfp8 import QuantizeMxfp8Args
from quant_core.testing import FLOAT_DTYPES, adversarial, quantize_many_inputs

tbm = pytest.importorskip("quant_core.blocks._triton_many")  # CI machines have no Triton
tb = pytest.importorskip("quant_core.blocks._triton_quantize")

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)")

CUDA = torch.device("cuda")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")

# Run in a fresh process: TRITON_INTERPRET is read when kernels are defined. Each configuration:
# the single-tensor kernel on each tensor, the multi-tensor kernel on the list (non-empty tensors:
# the operator drops empty ones before any kernel), into buffers of a sentinel byte.
_INTERPRETED = """
import torch
import quant_core
from quant_core.blocks import _triton_quantize as tb
from quant_core.blocks import _triton_many as tbm
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._mxfp8 import QuantizeMxfp8Args
from quant_core.shared._checks import as_2d
from quant_core.testing import quantize_many_inputs

FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def sentinel_buffers(q):
    buffers = [getattr(q, f) for f in FIELDS]
    if buffers[0] is not None:
        buffers[0] = buffers[0].reshape(-1, buffers[0].shape[-1])
    return [None if b is None else torch.full_like(b.view(torch.uint8), 0xA5).view(b.dtype) for b in buffers]


def check(name, args_type, single, many, quantize, format_args, dtype, seed):
    pairs = [(x, usage) for x, usage in quantize_many_inputs(dtype, seed) if x.numel() > 0]
    x_MKs = [as_2d(x) for x, _ in pairs]
    shapes = [quantize(x.float(), **usage) for x, usage in pairs]
    singles = [sentinel_buffers(q) for q in shapes]
    manys = [sentinel_buffers(q) for q in shapes]
    for x_MK, buffers in zip(x_MKs, singles):
        single(args_type(x_MK, *format_args, *buffers))
    many([args_type(x_MK, *format_args, *buffers) for x_MK, buffers in zip(x_MKs, manys)])
    for (x, usage), want, got in zip(pairs, singles, manys):
        for field, a, b in zip(FIELDS, want, got):
            assert (a is None) == (b is None)
            if a is not None:
                same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                assert same, (name, dtype, tuple(x.shape), x.stride(), usage, field)


def blockwise(block_rows, fp8_dtype, power_2_scales):
    def quantize(x, **usage):
        return quant_core.quantize_fp8_blockwise(x, (block_rows, 128), fp8_dtype, power_2_scales=power_2_scales, **usage)

    single, many = tb._quantize_fp8_blockwise, tbm._quantize_fp8_blockwise_many
    return QuantizeFp8BlockwiseArgs, single, many, quantize, (block_rows, fp8_dtype, power_2_scales)


mxfp8 = (QuantizeMxfp8Args, tb._quantize_mxfp8, tbm._quantize_mxfp8_many, quant_core.quantize_mxfp8, ())
# With a columnwise output fp32 takes the one-pass kernel for MXFP8 and the two-pass one for
# 1 x 128, bf16 the two-pass kernel for both ([Note: two-pass block quantize], `_tiles_for`).
for name, config, dtype in [
    ("mxfp8", mxfp8, torch.float32),
    ("mxfp8", mxfp8, torch.bfloat16),
    ("1x128 pow2 e4m3", blockwise(1, E4M3, True), torch.float32),
    ("1x128 e5m2", blockwise(1, E5M2, False), torch.float32),
    ("128x128 pow2 e4m3", blockwise(128, E4M3, True), torch.float32),
    ("128x128 e5m2", blockwise(128, E5M2, False), torch.bfloat16),
]:
    check(name, *config, dtype, seed=len(name))
"""


@pytest.mark.triton_interpreter(_INTERPRETED)
def test_many_kernel_equals_the_single_kernel_in_the_triton_interpreter(triton_interpreter):
    triton_interpreter.check()


class Launch(NamedTuple):
    grid: tuple[int, ...]
    pointers: torch.Tensor
    num_tensors: int
    programs: torch.Tensor
    constexprs: dict[str, object]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[Launch]:
    """The launches of the multi-tensor kernels, recorded instead of run (host code only)."""
    recorded: list[Launch] = []

    def record(kernel: Callable, grid: tuple[int, ...], pointers, num_tensors, programs, *likes, **kwargs) -> None:
        recorded.append(Launch(grid, pointers, num_tensors, programs, kwargs))

    monkeypatch.setattr(tbm, "launch", record)
    return recorded


def _buffers(quantize: Callable, xs: list[torch.Tensor], **usage: bool) -> list[list[torch.Tensor | None]]:
    """Four lists of per-tensor buffers (None where a usage is not wanted)."""
    results = [quantize(x, **usage) for x in xs]
    lists = [[getattr(q, f) for q in results] for f in FIELDS]
    lists[0] = [None if d is None else d.reshape(-1, d.shape[-1]) for d in lists[0]]
    return lists


def _mxfp8_args(xs: list[torch.Tensor], lists: list[list[torch.Tensor | None]]) -> list[QuantizeMxfp8Args]:
    """The kernel's argument: each tensor's arguments of the single-tensor quantize."""
    return [QuantizeMxfp8Args(x, *buffers) for x, *buffers in zip(xs, *lists, strict=True)]


def _blockwise_args(xs: list[torch.Tensor], lists: list[list[torch.Tensor | None]]) -> list[QuantizeFp8BlockwiseArgs]:
    """The kernel's argument for 1 x 128 blocks, E4M3, power-of-two scales."""
    return [QuantizeFp8BlockwiseArgs(x, 1, E4M3, True, *buffers) for x, *buffers in zip(xs, *lists, strict=True)]


def test_weights_of_one_dtype_and_usage_take_one_launch_with_their_tables(launches):
    # Ten fp32 masters whose dims are multiples of 16: one ALIGNED launch, one program per tile.
    xs = [torch.randn(64 * (1 + i % 3), 128) for i in range(10)]
    tbm._quantize_mxfp8_many(_mxfp8_args(xs, _buffers(quant_core.quantize_mxfp8, xs, rowwise=True, columnwise=True)))
    (launch,) = launches
    tile_m, tile_k = tbm._tile_shape(tbm._tiles_for("mxfp8", True, torch.float32), 32)
    counts = [-(-x.shape[0] // tile_m) * -(-x.shape[1] // tile_k) for x in xs]
    assert launch.grid == (sum(counts),)
    assert launch.num_tensors == 10
    assert launch.constexprs["ALIGNED"]
    assert launch.constexprs["ROWWISE"]
    assert launch.constexprs["COLUMNWISE"]
    assert launch.programs.tolist() == [[t, i] for t, n in enumerate(counts) for i in range(n)]
    table = launch.pointers
    assert table[0].tolist() == [x.data_ptr() for x in xs]
    assert table[5:].tolist() == [[x.shape[0] for x in xs], [128] * 10, [128] * 10, [1] * 10]  # M, K, strides


def test_tensors_are_grouped_by_what_the_single_launch_specializes_on(launches, monkeypatch):
    # The tiles of the single launches (1 x 128 blocks): two-pass with a columnwise output, 128 x 128
    # per program; rowwise only, 4 x 128 tiles.
    for name in ("BLOCKWISE_TILES", "BLOCKWISE_FP32_TILES"):
        monkeypatch.setattr(tb, name, tb.TwoPassTiles(tile_k=128, chunk_m=32, store_m=64, num_warps=8))
    monkeypatch.setattr(tb, "BLOCKWISE_ROWWISE_FP32_TILES", tb.Tiles(4, 128, 2))
    xs = [
        torch.randn(256, 256),
        torch.randn(256, 256, dtype=torch.bfloat16),  # another dtype
        torch.randn(160, 96).t(),  # a transposed view (96, 160): not ALIGNED, partial tiles (MASKED)
        torch.randn(128, 128),  # with the first
        torch.randn(3, 33),  # with the view
    ]
    quantize = quant_core.quantize_fp8_blockwise
    lists = _buffers(quantize, xs, rowwise=True, columnwise=True)
    rowwise_only = torch.randn(64, 128)  # another usage set
    for buffers, extra in zip(lists, _buffers(quantize, [rowwise_only], rowwise=True, columnwise=False), strict=True):
        buffers.append(extra[0])
    tbm._quantize_fp8_blockwise_many(_blockwise_args([*xs, rowwise_only], lists))
    groups = [
        (
            launch.num_tensors,
            launch.constexprs["ALIGNED"],
            launch.constexprs["COLUMNWISE"],
            launch.constexprs.get("MASKED"),
        )
        for launch in launches
    ]
    assert groups == [(2, True, True, False), (1, True, True, False), (2, False, True, True), (1, True, False, None)]
    assert launches[2].pointers[0].tolist() == [xs[2].data_ptr(), xs[4].data_ptr()]
    assert launches[2].pointers[5:].tolist() == [[96, 3], [160, 33], [1, 33], [96, 1]]  # M, K, strides


def test_large_mxfp8_tensors_take_their_own_single_launch(launches, monkeypatch):
    # MXFP8 tensors from MXFP8_SINGLE_LAUNCH_NUMEL elements on launch the single-tensor kernel
    # (its speed at 1e9 parameters); the rest share one launch. Blockwise FP8 keeps every size.
    singles = []
    monkeypatch.setattr(tbm, "_launch_quantize", lambda x, buffers, **kwargs: singles.append(x))
    monkeypatch.setattr(tbm, "MXFP8_SINGLE_LAUNCH_NUMEL", 128 * 128)
    xs = [torch.randn(64, 128), torch.randn(128, 128), torch.randn(32, 64), torch.randn(256, 128)]
    tbm._quantize_mxfp8_many(_mxfp8_args(xs, _buffers(quant_core.quantize_mxfp8, xs, rowwise=True, columnwise=True)))
    assert [x.data_ptr() for x in singles] == [xs[1].data_ptr(), xs[3].data_ptr()]
    (launch,) = launches
    assert launch.pointers[0].tolist() == [xs[0].data_ptr(), xs[2].data_ptr()]
    singles.clear()
    launches.clear()
    tbm._quantize_fp8_blockwise_many(_blockwise_args(xs, _buffers(quant_core.quantize_fp8_blockwise, xs)))
    assert singles == []
    assert sum(launch.num_tensors for launch in launches) == 4


def test_repeated_calls_reuse_their_tables(launches):
    # [Note: pointer tables]: the same storages copy nothing; new storages only a new pointer table.
    xs = [torch.randn(64, 128), torch.randn(32, 64)]
    lists = _buffers(quant_core.quantize_mxfp8, xs, rowwise=True, columnwise=True)
    for _ in range(2):
        tbm._quantize_mxfp8_many(_mxfp8_args(xs, lists))
    first, second = launches
    assert second.pointers is first.pointers
    assert second.programs is first.programs
    moved = [x.clone() for x in xs]
    tbm._quantize_mxfp8_many(_mxfp8_args(moved, lists))
    assert launches[2].pointers is not first.pointers
    assert launches[2].programs is first.programs


# ---- on the GPU --------------------------------------------------------------------------------


def _config(name: str) -> tuple[Callable[..., quant_core.BlockQuantized], Callable[..., None]]:
    """(single-tensor quantize, multi-tensor quantize) of a configuration."""
    if name == "mxfp8":
        return quant_core.quantize_mxfp8, quant_core.quantize_mxfp8_many
    block_rows, fp8_dtype, power_2_scales = {
        "1x128-pow2-e4m3": (1, E4M3, True),
        "1x128-e5m2": (1, E5M2, False),
        "128x128-pow2-e4m3": (128, E4M3, True),
        "128x128-e5m2": (128, E5M2, False),
    }[name]
    kwargs = dict(block_shape=(block_rows, 128), fp8_dtype=fp8_dtype, power_2_scales=power_2_scales)
    return (
        lambda x, **usage: quant_core.quantize_fp8_blockwise(x, **kwargs, **usage),
        lambda xs, outs: quant_core.quantize_fp8_blockwise_many(xs, outs, **kwargs),
    )


CONFIGS = ["mxfp8", "1x128-pow2-e4m3", "1x128-e5m2", "128x128-pow2-e4m3", "128x128-e5m2"]


def _fresh(q: quant_core.BlockQuantized) -> quant_core.BlockQuantized:
    """Buffers like q's filled with a sentinel byte (unwritten bytes show)."""
    buffers = [getattr(q, f) for f in FIELDS]
    return quant_core.BlockQuantized(
        *(None if t is None else torch.full_like(t.view(torch.uint8), 0xA5).view(t.dtype) for t in buffers)
    )


def _assert_many_equals_single(config: str, pairs: list[tuple[torch.Tensor, dict[str, bool]]]) -> None:
    single, many = _config(config)
    wants = [single(x, **usage) for x, usage in pairs]
    outs = [_fresh(q) for q in wants]
    many([x for x, _ in pairs], outs)
    for (x, usage), got, want in zip(pairs, outs, wants, strict=True):
        for field in FIELDS:
            a, b = getattr(got, field), getattr(want, field)
            assert (a is None) == (b is None), field
            if a is not None:
                same = torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())
                assert same, (config, x.dtype, tuple(x.shape), x.stride(), usage, field)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("op", ["quantize_mxfp8_many", "quantize_fp8_blockwise_many"])
def test_triton_runs_the_many_ops(op):
    assert quant_core.selected_backend(op, CUDA) == "triton"


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_many_equals_the_single_kernel_on_the_gpu(config, dtype):
    pairs = [(x.to(CUDA), usage) for x, usage in quantize_many_inputs(dtype, seed=len(config))]
    _assert_many_equals_single(config, pairs)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("config", CONFIGS)
def test_many_small_tensors_in_one_call(config):
    # 200 tensors, most smaller than one tile, some empty, fp32 and bf16, each usage.
    generator = torch.Generator().manual_seed(len(config))
    pairs = []
    for t in range(200):
        shape = tuple(torch.randint(0, 300, (2,), generator=generator).tolist())
        usage = [{"rowwise": True, "columnwise": False}, {"rowwise": False, "columnwise": True}, {}][t % 3]
        usage = usage or {"rowwise": True, "columnwise": True}
        pairs.append((adversarial(shape, FLOAT_DTYPES[t % 2], seed=t).to(CUDA), usage))
    _assert_many_equals_single(config, pairs)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("config", ["mxfp8", "128x128-pow2-e4m3"])
def test_a_captured_call_replays_with_new_values(config):
    # The tables are cached by content: after one eager launch a CUDA graph captures the launch
    # without a host-to-device copy, and its replays quantize what the inputs hold then.
    single, many = _config(config)
    xs = [torch.randn(256, 512, device=CUDA), torch.randn(128, 384, device=CUDA), torch.randn(7, 40, device=CUDA)]
    outs = [single(x, columnwise=True) for x in xs]
    many(xs, outs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        many(xs, outs)
    torch.cuda.current_stream().wait_stream(stream)
    for step in range(2):
        for x in xs:
            x.copy_(adversarial(tuple(x.shape), seed=step).to(CUDA))
        graph.replay()
        for x, got in zip(xs, outs, strict=True):
            want = single(x, columnwise=True)
            for field in FIELDS:
                assert torch.equal(getattr(got, field).view(torch.uint8), getattr(want, field).view(torch.uint8)), field


@pytest.mark.cuda
@needs_cuda
def test_tensors_on_two_devices_raise_with_fix():
    x = torch.ones(4, 32)
    outs = [quant_core.quantize_mxfp8(x), quant_core.quantize_mxfp8(x)]
    with pytest.raises(ValueError, match=r"xs\[1\] is on cuda:0 but xs\[0\] is on cpu; .* once per device"):
        quant_core.quantize_mxfp8_many([x, x.to(CUDA)], outs)

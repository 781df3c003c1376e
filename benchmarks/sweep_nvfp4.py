"""Times every NVFP4 quantize/dequantize kernel variant and tile of `quant_core.nvfp4` (`_triton_quantize`,
`_triton_dequantize`, `_triton_hadamard`) on the GPU machine, checks their bytes, and names the fastest per
case (meant to take < 3 min on an H100).

    python3 benchmarks/sweep_nvfp4.py [CASE ...]   # cases: 1x16-both 1x16-both-sr 1x16-rowwise
                                                 #        16x16-rowwise 16x16-both 1x16-both-rht
                                                 #        hadamard-amaxes dequantize gemm-output

bf16 8192 x 8192 input, global amax precomputed, buffers preallocated: each timing is the kernel
launch alone (`triton.testing.do_bench`, median). GB/s counts the least traffic (input read once,
packed codes and E4M3 scales written once; dequantize: codes and scales read, bf16 written) and
% copy compares it with a device-to-device copy timed in the same run. Checks: every variant and
tile equals the CPU reference bytewise on a 1008 x 1520 input (partial tiles) with ties, specials
and subnormals (dequantize: fp32/bf16/fp16 outputs, 1 x 16 and 16 x 16 scales, a NaN scale), and
equals the original kernel bytewise at full size. The winners go into the module constants.
`gemm-output` times `nvfp4_gemm_output` on an fp32 8192 x 8192 product with a bias into bf16 (traffic:
the product read, the output written), with the torch pass it replaced (`torch.mul` by a precomputed
factor into bf16, no bias) as a last row for comparison.
With the random Hadamard transform (`1x16-both-rht`, `hadamard-amaxes`), which the original kernel
lacks, "original" is the register-blocks kernel with the current module constant.
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
from triton.testing import do_bench

import quant_core
from quant_core.nvfp4 import _triton_dequantize, _triton_hadamard, _triton_quantize
from quant_core.nvfp4._dequantize import Nvfp4GemmOutputArgs
from quant_core.nvfp4._hadamard import HadamardArgs
from quant_core.shared._triton_numerics import Tiles
from quant_core.testing import adversarial

BlockTiles = _triton_quantize.BlockTiles
CUDA = torch.device("cuda")
SIZE = (8192, 8192)
# Partial tiles both ways; multiples of 16 like SIZE, so no kernel compiles twice (partial blocks:
# tests/test_triton_nvfp4.py).
CHECK_SIZE = (1008, 1520)
SEED = 2**63 + 12345
CHECK_AMAX = 2688.0  # tensor scale 448 * 6 / 2688 = 1: tie rows stay ties
# Tiles of the register-blocks kernel: TILE_K / 8 * (16 / T) * (TILE_M / 16) >= 32 * warps keeps
# each thread's T rows in registers (bf16, 16-byte vectors); all compile without spills on sm_90.
BLOCK_TILES = [
    BlockTiles(128, 64, 4, 8),
    BlockTiles(64, 128, 4, 8),
    BlockTiles(128, 128, 8, 8),
    BlockTiles(256, 64, 8, 8),
    BlockTiles(64, 64, 2, 8),
    BlockTiles(64, 64, 4, 4),
    BlockTiles(128, 64, 8, 4),
]
STOCHASTIC_TILES = [BlockTiles(64, 64, 4, 4), BlockTiles(128, 64, 8, 4), BlockTiles(32, 64, 2, 4)]
# The transformed columnwise runs hold more live values (179 registers per thread at 64 x 64 on
# sm_90, 12% occupancy under ncu): smaller tiles too.
HADAMARD_TILES = [
    BlockTiles(64, 64, 4, 4),
    BlockTiles(32, 64, 2, 4),
    BlockTiles(32, 64, 4, 4),
    BlockTiles(16, 64, 1, 4),
    BlockTiles(16, 128, 2, 4),
    BlockTiles(32, 32, 2, 4),
    BlockTiles(64, 32, 4, 4),
    BlockTiles(32, 128, 4, 4),
]
HADAMARD_AMAXES_TILES = [Tiles(64, 64, 4), Tiles(32, 64, 2), Tiles(32, 128, 4), Tiles(64, 128, 8), Tiles(16, 256, 4)]
HADAMARD_SEED = 12345
DEQUANTIZE_TILES = [Tiles(16, 256, 4), Tiles(8, 512, 4), Tiles(32, 256, 8), Tiles(16, 512, 8), Tiles(32, 128, 4)]


@dataclass(frozen=True)
class Case:
    name: str
    block_rows: int
    rowwise: bool
    columnwise: bool
    stochastic: bool
    tiles: list[BlockTiles]
    hadamard: bool = False
    """The columnwise usage is T(x^T) ([Note: NVFP4 random Hadamard transform])."""


CASES = [
    Case("1x16-both", 1, True, True, False, BLOCK_TILES),
    Case("1x16-both-sr", 1, True, True, True, STOCHASTIC_TILES),
    Case("1x16-rowwise", 1, True, False, False, BLOCK_TILES),
    Case("16x16-rowwise", 16, True, False, False, BLOCK_TILES),
    Case("16x16-both", 16, True, True, False, BLOCK_TILES),
    Case("1x16-both-rht", 1, True, True, False, HADAMARD_TILES, hadamard=True),
]


def check_input(dtype: torch.dtype) -> torch.Tensor:
    """Adversarial values plus 1 x 16 blocks of exact E2M1 ties (with CHECK_AMAX, a block amax of 6
    gives s = 1 and enc = 1) and of bf16 subnormals."""
    x = adversarial(CHECK_SIZE, torch.float32, seed=7)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.0, 0.0, -5.0, 4.0, 1e-30, -2.5, 3.0]
    x[0, :32] = torch.tensor(ties + [-t for t in ties])
    x[:16, 32] = torch.tensor(ties)  # a 16 x 1 block of ties
    x[1, :16] = torch.tensor([6.0 * 2.0**-126] + [2.0**-133 * k for k in range(1, 16)])
    return x.to(dtype)


def buffers(shape: tuple[int, int], case: Case) -> tuple[torch.Tensor | None, ...]:
    M, K = shape
    Mb, Kb = -(-M // 16), -(-K // 16)
    e4m3 = torch.float8_e4m3fn

    def zeros(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(rows, cols, dtype=dtype, device=CUDA)

    two_d = case.block_rows > 1
    return (
        zeros(M, K // 2, torch.uint8) if case.rowwise else None,
        zeros(Mb if two_d else M, Kb, e4m3) if case.rowwise else None,
        zeros(K, M // 2, torch.uint8) if case.columnwise else None,
        zeros(Kb if two_d else K, Mb, e4m3) if case.columnwise else None,
    )


def run_quantize(case: Case, x: torch.Tensor, amaxes: torch.Tensor, variant: str, tiles: object) -> tuple[object, ...]:
    """x quantized by one variant and tile; amaxes: (2,) fp32, amax(x) and the transformed usage's."""
    out = buffers(tuple(x.shape), case)
    launch_quantize(case, x, amaxes, SEED, out, variant, tiles)
    return out


def launch_quantize(
    case: Case, x: torch.Tensor, amaxes: torch.Tensor, seed: object, out: tuple, variant: str, tiles: object
) -> None:
    hadamard_seed = HADAMARD_SEED if case.hadamard else None
    _triton_quantize.launch_quantize(
        x, case.block_rows, amaxes[0], case.stochastic, seed, out, variant, tiles, amaxes[1], hadamard_seed
    )


def same_bytes(got: tuple[torch.Tensor | None, ...], want: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether every buffer holds the same bytes (compared on got's device)."""
    return all(
        g is None or torch.equal(g.view(torch.uint8), w.reshape(g.shape).view(torch.uint8).to(g.device))
        for g, w in zip(got, want, strict=True)
    )


def bench(fn: Callable[[], object]) -> float:
    """Median time of fn in us."""
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def sweep_quantize(case: Case, x: torch.Tensor, x_small: torch.Tensor) -> list[tuple]:
    amaxes = quant_core.hadamard_amaxes(x, HADAMARD_SEED)  # [amax(x), amax(T(x^T))]
    check_amaxes = torch.tensor([CHECK_AMAX, 4 * CHECK_AMAX])
    want_small = quant_core.quantize_nvfp4_reference(
        x_small,
        (case.block_rows, 16),
        global_amax=check_amaxes[0],
        rowwise=case.rowwise,
        columnwise=case.columnwise,
        stochastic_rounding=case.stochastic,
        seed=SEED,
        hadamard_seed=HADAMARD_SEED if case.hadamard else None,
        columnwise_amax=check_amaxes[1] if case.hadamard else None,
    )
    want_small = (
        want_small.rowwise_data,
        want_small.rowwise_scale_inv,
        want_small.columnwise_data,
        want_small.columnwise_scale_inv,
    )
    baseline = (
        ("register_blocks", _triton_quantize.QUANTIZE_1X16_TILES)
        if case.hadamard
        else ("original", _triton_quantize.QUANTIZE_TILES)
    )
    original = run_quantize(case, x, amaxes, *baseline)
    N = x.numel()
    usages = int(case.rowwise) + int(case.columnwise)
    scale_bytes = N // (16 * case.block_rows) * usages
    traffic = 2 * N + usages * N // 2 + scale_bytes
    seed = torch.tensor(SEED - 2**64, dtype=torch.int64, device=CUDA)  # the uint64 bits: no copy per launch
    rows = []
    for variant, tiles in [baseline] + [("register_blocks", t) for t in case.tiles]:
        small = run_quantize(case, x_small.to(CUDA), check_amaxes.to(CUDA), variant, tiles)
        checks = "ok" if same_bytes(small, want_small) else "REFERENCE MISMATCH"
        out = buffers(tuple(x.shape), case)

        def launch(out: tuple = out, variant: str = variant, tiles: object = tiles) -> None:
            launch_quantize(case, x, amaxes, seed, out, variant, tiles)

        us = bench(launch)
        if (variant, tiles) != baseline and not same_bytes(out, original):
            checks += ", ORIGINAL MISMATCH"
        rows.append((case.name, variant, tiles, us, traffic / us / 1e3, checks))
        torch.cuda.empty_cache()
    return rows


def sweep_hadamard_amaxes(x: torch.Tensor, x_small: torch.Tensor) -> list[tuple]:
    """`hadamard_amaxes` with each tile (the module constant set for the call); timed on the kernel
    alone (the maxima land in a preallocated pair, as the operator's zeroed output): bf16 read once."""
    want_small = quant_core.hadamard_amaxes_reference(x_small, HADAMARD_SEED)
    current = _triton_hadamard.HADAMARD_AMAXES_TILES
    want = quant_core.hadamard_amaxes(x, HADAMARD_SEED)
    maxima = torch.zeros(2, device=CUDA)
    rows = []
    try:
        for tiles in HADAMARD_AMAXES_TILES:
            _triton_hadamard.HADAMARD_AMAXES_TILES = tiles
            small = quant_core.hadamard_amaxes(x_small.to(CUDA), HADAMARD_SEED)
            checks = "ok" if torch.equal(small.cpu(), want_small) else "REFERENCE MISMATCH"
            if not torch.equal(quant_core.hadamard_amaxes(x, HADAMARD_SEED), want):
                checks += ", ORIGINAL MISMATCH"
            us = bench(lambda: _triton_hadamard._hadamard_amaxes(HadamardArgs(x, HADAMARD_SEED), maxima))
            variant = "original" if tiles == current else "tiles"
            rows.append(("hadamard-amaxes", variant, tiles, us, 2 * x.numel() / us / 1e3, checks))
    finally:
        _triton_hadamard.HADAMARD_AMAXES_TILES = current
    return rows


def sweep_dequantize(x: torch.Tensor, x_small: torch.Tensor) -> list[tuple]:
    """Dequantize of 1 x 16 rowwise data to bf16 (timed); checks over dtypes and block shapes."""
    global_amax = quant_core.amax(x)
    q = quant_core.quantize_nvfp4(x, global_amax=global_amax)
    data, scale = q.rowwise_data, q.rowwise_scale_inv
    small_cases = []
    check_amax = torch.tensor(3.0e3)
    for block_rows in (1, 16):
        ref = quant_core.quantize_nvfp4_reference(x_small, (block_rows, 16), global_amax=check_amax)
        small_scale = ref.rowwise_scale_inv.clone()
        small_scale.view(torch.uint8)[0, 0] = 0x7F  # a NaN scale: canonical NaN outputs
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            want = quant_core.dequantize_nvfp4_reference(
                ref.rowwise_data, small_scale, check_amax, (block_rows, 16), dtype
            )
            small_cases.append((block_rows, ref.rowwise_data, small_scale, dtype, want))
    reference_out = torch.empty(x.shape, dtype=torch.bfloat16, device=CUDA)
    _triton_dequantize.launch_dequantize(
        data, scale, 1, global_amax, reference_out, "elementwise", _triton_dequantize.DEQUANTIZE_TILES
    )
    N = x.numel()
    traffic = N // 2 + N // 16 + 2 * N
    rows = []
    candidates = [("elementwise", _triton_dequantize.DEQUANTIZE_TILES)] + [("pairs", t) for t in DEQUANTIZE_TILES]
    for variant, tiles in candidates:
        checks = "ok"
        for block_rows, small_data, small_scale, dtype, want in small_cases:
            got = torch.empty(want.shape, dtype=dtype, device=CUDA)
            _triton_dequantize.launch_dequantize(
                small_data.to(CUDA), small_scale.to(CUDA), block_rows, check_amax.to(CUDA), got, variant, tiles
            )
            width = {4: torch.int32, 2: torch.int16}[want.element_size()]
            if not torch.equal(got.cpu().view(width), want.view(width)):
                checks = f"REFERENCE MISMATCH ({dtype}, {block_rows} x 16)"
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=CUDA)

        def launch(out: torch.Tensor = out, variant: str = variant, tiles: Tiles = tiles) -> None:
            _triton_dequantize.launch_dequantize(data, scale, 1, global_amax, out, variant, tiles)

        us = bench(launch)
        if not torch.equal(out.view(torch.int16), reference_out.view(torch.int16)):
            checks += ", ORIGINAL MISMATCH"
        rows.append(("dequantize", variant, tiles, us, traffic / us / 1e3, checks))
    return rows


GEMM_OUTPUT_TILES = [Tiles(1, block, warps) for block in (1024, 2048, 4096, 8192) for warps in (4, 8)]


def sweep_gemm_output(x: torch.Tensor) -> list[tuple]:
    """nvfp4_gemm_output on an fp32 product of x's shape with a bias, to bf16 (timed); checked
    bytewise against the reference on an adversarial product."""
    amaxes = torch.tensor(3.0e3, device=CUDA), torch.tensor(1.7e-2, device=CUDA)
    small = adversarial(CHECK_SIZE, torch.float32, seed=3)
    small_bias = adversarial(CHECK_SIZE[1:], torch.bfloat16, seed=4)
    want = quant_core.nvfp4_gemm_output_reference(small, *(a.cpu() for a in amaxes), small_bias, torch.bfloat16)
    product = x.float()
    bias = torch.randn(x.shape[1], device=CUDA, dtype=torch.bfloat16)
    traffic = 6 * product.numel()
    rows = []
    original = _triton_dequantize.GEMM_OUTPUT_TILES
    for tiles in [original, *(t for t in GEMM_OUTPUT_TILES if t != original)]:
        _triton_dequantize.GEMM_OUTPUT_TILES = tiles
        got = torch.empty(CHECK_SIZE, dtype=torch.bfloat16, device=CUDA)
        small_args = Nvfp4GemmOutputArgs(small.to(CUDA), *amaxes, small_bias.to(CUDA), torch.bfloat16)
        _triton_dequantize._nvfp4_gemm_output(small_args, got)
        checks = "ok" if torch.equal(got.cpu().view(torch.int16), want.view(torch.int16)) else "REFERENCE MISMATCH"
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=CUDA)
        args = Nvfp4GemmOutputArgs(product, *amaxes, bias, torch.bfloat16)
        us = bench(lambda out=out, args=args: _triton_dequantize._nvfp4_gemm_output(args, out))
        rows.append(("gemm-output", "triton", tiles, us, traffic / us / 1e3, checks))
    _triton_dequantize.GEMM_OUTPUT_TILES = original
    factor = torch.reciprocal(quant_core.nvfp4_tensor_scale(amaxes[0])) * torch.reciprocal(
        quant_core.nvfp4_tensor_scale(amaxes[1])
    )
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=CUDA)
    us = bench(lambda: torch.mul(product, factor, out=out))
    rows.append(("gemm-output", "torch.mul", Tiles(0, 0, 0), us, traffic / us / 1e3, "the replaced pass (no bias)"))
    return rows


def describe(tiles: object) -> str:
    if isinstance(tiles, BlockTiles):
        return f"{tiles.tile_m}x{tiles.tile_k} w{tiles.num_warps} T{tiles.rows_per_thread}"
    return f"{tiles.tile_m}x{tiles.tile_k} w{tiles.num_warps}"


def main(names: list[str]) -> None:
    known = [case.name for case in CASES] + ["hadamard-amaxes", "dequantize", "gemm-output"]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"unknown cases {unknown}; choose from {known}")
    names = names or known
    torch.manual_seed(0)
    x = torch.randn(SIZE, device=CUDA, dtype=torch.bfloat16)
    x_small = check_input(torch.bfloat16)
    copy_out = torch.empty_like(x)
    copy_us = bench(lambda: copy_out.copy_(x))
    copy_gbs = 2 * x.numel() * x.element_size() / copy_us / 1e3
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
        f"{datetime.date.today()}; bf16 {SIZE[0]}x{SIZE[1]}; device-to-device copy {copy_us:.1f} us = "
        f"{copy_gbs:.0f} GB/s"
    )
    rows = []
    for case in CASES:
        if case.name in names:
            rows += sweep_quantize(case, x, x_small)
    if "hadamard-amaxes" in names:
        rows += sweep_hadamard_amaxes(x, x_small)
    if "dequantize" in names:
        rows += sweep_dequantize(x, x_small)
    if "gemm-output" in names:
        rows += sweep_gemm_output(x)
    print(f"\n{'case':<14} {'variant':<16} {'tile':<18} {'us':>8} {'GB/s':>7} {'% copy':>7}  check")
    for name, variant, tiles, us, gbs, checks in rows:
        print(
            f"{name:<14} {variant:<16} {describe(tiles):<18} {us:8.1f} {gbs:7.0f} {100 * gbs / copy_gbs:6.1f}%  {checks}"
        )
    print("\nwinner per case (fastest with every check ok):")
    for name in dict.fromkeys(row[0] for row in rows):
        ok = [row for row in rows if row[0] == name and row[5] == "ok" and row[1] != "torch.mul"]
        original = rows[next(i for i, row in enumerate(rows) if row[0] == name)]  # each case's first row
        if not ok:
            print(f"  {name}: none passed")
            continue
        best = min(ok, key=lambda row: row[3])
        print(
            f"  {name}: {best[1]} {describe(best[2])}: {best[3]:.1f} us, {100 * best[4] / copy_gbs:.1f}% of copy "
            f"({original[3] / best[3]:.2f}x the original's {original[3]:.1f} us)"
        )
    failed = [row for row in rows if row[5] != "ok" and row[1] != "torch.mul"]
    if failed:
        print(f"\n{len(failed)} variant(s) failed a check")
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])

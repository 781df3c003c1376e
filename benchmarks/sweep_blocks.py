"""Sweep of the block quantize kernels' launch choices on the GPU (run on the GPU machine).

    python3 benchmarks/sweep_blocks.py                       # ~1-2 min on one H100
    python3 benchmarks/sweep_blocks.py --dtype float32 --jobs 16
    python3 benchmarks/sweep_blocks.py --jobs 0 --json sweep_blocks.json

Cases, input of `--dtype` (bf16, or fp32 as FusedAdam's master weights): MXFP8 both usages,
blockwise FP8 1 x 128 both usages, 1 x 128 rowwise, 128 x 128 both usages (E4M3, power-of-two
scales), at 8192 x 8192 and 2048 x 8192. Each case times values (`Tiles` for
`_quantize_blocks_kernel`, `TwoPassTiles` for `_quantize_two_pass_kernel`) of the module constant
of `quant_core.blocks._triton_quantize` that the kernel reads for inputs of that dtype (`_tiles_for`:
MXFP8_TILES for bf16, MXFP8_FP32_TILES for fp32, ...), the current value first and for fp32 the
bf16 one next, with `triton.testing.do_bench` (the registered kernel on preallocated buffers, L2
flushed before each run, median), and reports GB/s of the least traffic (input read once at its
element size, codes written once; scales not counted, as in docs/benchmarks.md) and its share of
the copy baseline: a device-to-device copy of the same input (`out.copy_(x)`, x and out of the
input's dtype and shape, read + write) timed in the same run. Checks, bytewise, all on inputs of
the dtype: every candidate against the current kernel on the 8192^2 input (NaN of both signs,
+-Inf, zeros and subnormals planted) and against the CPU reference on a 1024 x 1536 adversarial
input; each case's winner also on an odd shape and a transposed view (partial tiles, masks,
strides). A candidate whose bytes differ cannot win. Kernels are compiled first in `--jobs` worker processes (Triton's disk cache).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import multiprocessing
import sys
import time
from dataclasses import dataclass

import torch
import triton

import quant_core
from quant_core.blocks import _triton_quantize as tb
from quant_core.blocks._blockwise import QuantizeFp8BlockwiseArgs
from quant_core.blocks._mxfp8 import QuantizeMxfp8Args
from quant_core.blocks._triton_two_pass import TwoPassTiles
from quant_core.shared._triton_numerics import Tiles
from quant_core.testing import adversarial

E4M3 = torch.float8_e4m3fn
FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
# Same Triton specialization as the timed shapes (dims and strides divisible by 16, no partial
# tile for any candidate), so the workers' compiles are the ones the timed runs load.
_COMPILE_SHAPE = (256, 1536)
_CHECK_SHAPE = (1024, 1536)
_EDGE_SHAPE = (1000, 1480)


def _two_pass(*shapes: tuple[int, int, int, int], **options: object) -> tuple[TwoPassTiles, ...]:
    """TwoPassTiles of each (tile_k, chunk_m, store_m, num_warps), with the same options."""
    return tuple(TwoPassTiles(tile_k=k, chunk_m=c, store_m=s, num_warps=w, **options) for k, c, s, w in shapes)


@dataclass(frozen=True)
class Case:
    """One quantize configuration and the launch choices to time for it."""

    name: str
    format: str
    """'mxfp8' or 'blockwise'."""
    block_rows: int
    """Blockwise: 1 (1 x 128) or 128 (128 x 128)."""
    rowwise: bool
    columnwise: bool
    constant: str
    """The `blocks._triton_quantize` constant the candidates replace (the one `_tiles_for` reads for the dtype)."""
    candidates: tuple[Tiles | TwoPassTiles, ...]
    """The current value first."""

    def allocate(self, x: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """Empty output buffers of the kernel for x (2-D): the layouts of [Note: block layouts]."""
        M, K = x.shape
        block = 32 if self.format == "mxfp8" else 128
        scale_dtype = torch.uint8 if self.format == "mxfp8" else torch.float32
        rows_per_scale = self.block_rows if self.format == "blockwise" else 1
        buffers: list[torch.Tensor | None] = [None] * 4
        if self.rowwise:
            buffers[0] = torch.empty((M, K), dtype=E4M3, device=x.device)
            buffers[1] = torch.empty((-(-M // rows_per_scale), -(-K // block)), dtype=scale_dtype, device=x.device)
        if self.columnwise:
            buffers[2] = torch.empty((K, M), dtype=E4M3, device=x.device)
            buffers[3] = torch.empty((-(-K // rows_per_scale), -(-M // block)), dtype=scale_dtype, device=x.device)
        return tuple(buffers)

    def reference(self, x: torch.Tensor) -> quant_core.BlockQuantized:
        usage = dict(rowwise=self.rowwise, columnwise=self.columnwise)
        if self.format == "mxfp8":
            return quant_core.quantize_mxfp8_reference(x, **usage)
        return quant_core.quantize_fp8_blockwise_reference(x, block_shape=(self.block_rows, 128), **usage)

    def run(self, candidate: Tiles | TwoPassTiles, x: torch.Tensor, buffers: tuple[torch.Tensor | None, ...]) -> None:
        """The registered Triton kernel with `candidate` as the launch choice."""
        setattr(tb, self.constant, candidate)
        if self.format == "mxfp8":
            tb._quantize_mxfp8(QuantizeMxfp8Args(x, *buffers))
        else:
            tb._quantize_fp8_blockwise(QuantizeFp8BlockwiseArgs(x, self.block_rows, E4M3, True, *buffers))

    def selected(self, dtype: torch.dtype) -> Tiles | TwoPassTiles:
        """The launch choice the kernel reads for an input of `dtype`."""
        return tb._tiles_for("mxfp8" if self.format == "mxfp8" else f"{self.block_rows}x128", self.columnwise, dtype)

    def least_bytes(self, x: torch.Tensor) -> int:
        """Input read once at its element size, one byte per code written."""
        return x.numel() * (x.element_size() + int(self.rowwise) + int(self.columnwise))


def _first_current(*candidates: Tiles | TwoPassTiles) -> tuple[Tiles | TwoPassTiles, ...]:
    """The candidates in order, each once (the fp32 constants start equal to the bf16 ones)."""
    return tuple(dict.fromkeys(candidates))


# bf16: the current constant first.
_MXFP8 = (
    tb.MXFP8_TILES,
    Tiles(32, 128, 4),
    Tiles(32, 256, 8),
    *_two_pass((256, 4, 32, 4), (256, 2, 32, 2), (128, 4, 32, 2), (128, 8, 32, 4), (256, 8, 32, 8), (512, 4, 32, 8)),
    *_two_pass((256, 4, 32, 4), (512, 8, 32, 8), early_nan=True),
    *_two_pass((256, 4, 32, 4), blocks_m=2),
    *_two_pass((256, 4, 32, 4), unroll=False),
)
_BLOCKWISE = (
    tb.BLOCKWISE_TILES,
    *_two_pass((128, 16, 32, 4), (128, 8, 32, 4), (128, 4, 32, 2), (128, 16, 64, 8), (128, 32, 128, 8)),
    *_two_pass((256, 4, 32, 4), (256, 8, 32, 8)),
    *_two_pass((128, 16, 32, 4), (256, 8, 32, 8), early_nan=True),
    *_two_pass((128, 8, 32, 4), unroll=False),
)
_BLOCKWISE_ROWWISE = (
    tb.BLOCKWISE_ROWWISE_TILES,
    Tiles(32, 128, 4),
    Tiles(16, 256, 8),
    Tiles(8, 512, 4),
    *_two_pass((128, 16, 128, 4), (256, 8, 128, 8), (512, 4, 128, 8)),
    *_two_pass((256, 8, 128, 8), early_nan=True),
)
_TWO_D = (tb.TWO_D_TILES, Tiles(128, 128, 4), Tiles(128, 128, 16))
# fp32: the current constant, the bf16 one, then tiles of about the bf16 winners' bytes (fewer rows
# per chunk or columns per program: an fp32 tile holds twice the bytes) and their variants.
_MXFP8_FP32 = _first_current(
    tb.MXFP8_FP32_TILES,
    tb.MXFP8_TILES,
    Tiles(32, 128, 4),  # one 2-D tile: the winner of the first fp32 sweep, and its neighbours
    Tiles(32, 128, 8),
    Tiles(32, 64, 2),
    Tiles(32, 64, 4),
    Tiles(64, 64, 4),
    Tiles(64, 128, 8),
    Tiles(32, 256, 8),
    *_two_pass((128, 2, 32, 2), (64, 4, 32, 2), (128, 4, 32, 4), (128, 4, 16, 2), (128, 8, 32, 4), (256, 2, 32, 4)),
    *_two_pass((128, 4, 32, 2), (128, 2, 32, 2), early_nan=True),
    *_two_pass((128, 4, 32, 2), blocks_m=2),
    *_two_pass((128, 4, 32, 2), unroll=False),
)
_BLOCKWISE_FP32 = _first_current(
    tb.BLOCKWISE_FP32_TILES,
    tb.BLOCKWISE_TILES,
    *_two_pass((128, 16, 128, 8), (128, 16, 64, 8), (128, 8, 64, 4), (128, 16, 32, 4), (128, 8, 32, 4)),
    *_two_pass((256, 8, 64, 8), (256, 4, 32, 4)),
    *_two_pass((128, 32, 128, 8), (128, 16, 64, 8), (128, 32, 64, 8), (128, 16, 128, 8), early_nan=True),
    *_two_pass((128, 16, 64, 8), unroll=False),
    *_two_pass((128, 32, 128, 8), early_nan=True, unroll=False),
)
_BLOCKWISE_ROWWISE_FP32 = _first_current(
    tb.BLOCKWISE_ROWWISE_FP32_TILES,
    tb.BLOCKWISE_ROWWISE_TILES,
    Tiles(8, 128, 4),
    Tiles(4, 128, 2),
    Tiles(16, 128, 8),
    Tiles(8, 256, 8),
    *_two_pass((128, 8, 128, 4), (128, 16, 128, 4)),
    *_two_pass((128, 8, 128, 4), early_nan=True),
)
_TWO_D_FP32 = _first_current(tb.TWO_D_FP32_TILES, tb.TWO_D_TILES, *_TWO_D[1:])
CASES = {
    torch.bfloat16: (
        Case("mxfp8 both", "mxfp8", 1, True, True, "MXFP8_TILES", _MXFP8),
        Case("1x128 both", "blockwise", 1, True, True, "BLOCKWISE_TILES", _BLOCKWISE),
        Case("1x128 rowwise", "blockwise", 1, True, False, "BLOCKWISE_ROWWISE_TILES", _BLOCKWISE_ROWWISE),
        Case("128x128 both", "blockwise", 128, True, True, "TWO_D_TILES", _TWO_D),
    ),
    torch.float32: (
        Case("mxfp8 both", "mxfp8", 1, True, True, "MXFP8_FP32_TILES", _MXFP8_FP32),
        Case("1x128 both", "blockwise", 1, True, True, "BLOCKWISE_FP32_TILES", _BLOCKWISE_FP32),
        Case("1x128 rowwise", "blockwise", 1, True, False, "BLOCKWISE_ROWWISE_FP32_TILES", _BLOCKWISE_ROWWISE_FP32),
        Case("128x128 both", "blockwise", 128, True, True, "TWO_D_FP32_TILES", _TWO_D_FP32),
    ),
}
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def describe(candidate: Tiles | TwoPassTiles) -> str:
    if isinstance(candidate, Tiles):
        return f"tile {candidate.tile_m}x{candidate.tile_k} w{candidate.num_warps}"
    extras = [f"bm{candidate.blocks_m}"] if candidate.blocks_m > 1 else []
    extras += [] if candidate.unroll else ["rolled"]
    extras += ["early-nan"] if candidate.early_nan else []
    shape = f"k{candidate.tile_k} c{candidate.chunk_m} s{candidate.store_m} w{candidate.num_warps}"
    return " ".join(["2pass", shape, *extras])


def buffers_of(q: quant_core.BlockQuantized) -> tuple[torch.Tensor | None, ...]:
    return tuple(getattr(q, field) for field in FIELDS)


def same_bytes(got: tuple[torch.Tensor | None, ...], want: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether every buffer has the same shape and bytes (None where the other is None)."""
    for g, w in zip(got, want, strict=True):
        if (g is None) != (w is None):
            return False
        if g is not None and not (
            g.shape == w.shape
            and torch.equal(g.reshape(-1).view(torch.uint8).to(w.device), w.reshape(-1).view(torch.uint8))
        ):
            return False
    return True


def matches_reference(
    case: Case, candidate: Tiles | TwoPassTiles, x_cpu: torch.Tensor, want: tuple[torch.Tensor | None, ...]
) -> bool:
    """Whether the candidate's bytes on x_cpu's GPU copy equal `want` (the CPU reference's)."""
    x = x_cpu.cuda()
    buffers = case.allocate(x)
    case.run(candidate, x, buffers)
    torch.cuda.synchronize()
    return same_bytes(buffers, want)


def planted_input(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`dtype` on the GPU: Gaussians times magnitudes over ~12 decades, specials at random places."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=generator)
    x = x * torch.exp(torch.randn(shape, device="cuda", generator=generator) * 4)
    specials = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -3e-39])
    flat = x.view(-1)
    positions = torch.randint(0, flat.numel(), (4096,), device="cuda", generator=generator)
    flat[positions] = specials.cuda().repeat(512)
    # Zero and subnormal rows and columns: all-zero and subnormal-amax blocks in both directions.
    x[7], x[:, 5] = 0.0, 0.0
    x[9], x[:, 11] = 1e-39, 1e-39
    return x.to(dtype)


def _compile(task: tuple[str, int, int]) -> tuple[int, int, float, str]:
    """Worker: compiles one candidate by running it once on a small input of the dtype."""
    dtype_name, case_index, candidate_index = task
    dtype = DTYPES[dtype_name]
    case = CASES[dtype][case_index]
    start = time.perf_counter()
    try:
        x = torch.randn(_COMPILE_SHAPE, device="cuda", dtype=dtype)
        case.run(case.candidates[candidate_index], x, case.allocate(x))
        torch.cuda.synchronize()
        error = ""
    except Exception as e:  # reported, and the main process compiles (and fails) again
        error = f"{type(e).__name__}: {e}"[:300]
    return case_index, candidate_index, time.perf_counter() - start, error


def precompile(jobs: int, dtype_name: str) -> None:
    cases = CASES[DTYPES[dtype_name]]
    tasks = [(dtype_name, c, k) for c, case in enumerate(cases) for k in range(len(case.candidates))]
    start, slowest = time.perf_counter(), 0.0
    context = multiprocessing.get_context("spawn")
    try:
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=context) as pool:
            for c, k, seconds, error in pool.map(_compile, tasks):
                slowest = max(slowest, seconds)
                if error:
                    print(f"  compile failed: {cases[c].name} / {describe(cases[c].candidates[k])}: {error}")
    except Exception as e:  # a pool that cannot start: compile on first use instead
        print(f"  parallel compile skipped ({type(e).__name__}: {e})")
    elapsed = time.perf_counter() - start
    print(f"compiled {len(tasks)} kernels in {elapsed:.1f} s ({jobs} workers, slowest {slowest:.1f} s)", flush=True)


def bench_ms(fn: object) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def sweep_case(case: Case, dtype: torch.dtype, sizes: list[tuple[int, int]], copy_gbps: dict, rows: list[dict]) -> None:
    check_input = adversarial(_CHECK_SHAPE, dtype, seed=11)
    want = buffers_of(case.reference(check_input))
    reference_ok = {}
    for k, candidate in enumerate(case.candidates):
        try:
            reference_ok[k] = matches_reference(case, candidate, check_input, want)
        except Exception as e:
            print(f"  {case.name} / {describe(candidate)} failed: {type(e).__name__}: {str(e)[:200]}")
            reference_ok[k] = None
        assert case.selected(dtype) is candidate, f"{dtype} inputs do not read {case.constant}"
    for shape in sizes:
        x = planted_input(shape, dtype, seed=shape[0])
        current = case.allocate(x)
        case.run(case.candidates[0], x, current)
        bytes_moved = case.least_bytes(x)
        for k, candidate in enumerate(case.candidates):
            if reference_ok[k] is None:
                continue
            buffers = case.allocate(x)
            try:
                case.run(candidate, x, buffers)
                torch.cuda.synchronize()
                equal_current = same_bytes(buffers, current)
                ms = bench_ms(lambda c=candidate, x=x, b=buffers: case.run(c, x, b))
            except Exception as e:
                print(f"  {case.name} / {describe(candidate)} at {shape}: {type(e).__name__}: {str(e)[:200]}")
                continue
            gbps = bytes_moved / ms / 1e6
            rows.append(
                dict(
                    case=case.name,
                    shape=f"{shape[0]}x{shape[1]}",
                    candidate=describe(candidate),
                    value=repr(candidate),
                    index=k,
                    us=ms * 1e3,
                    gbps=gbps,
                    percent_copy=100 * gbps / copy_gbps[shape],
                    equals_current=equal_current,
                    equals_reference=reference_ok[k],
                )
            )
        del x, current
        torch.cuda.empty_cache()
    setattr(tb, case.constant, case.candidates[0])


def edge_check(case: Case, candidate: Tiles | TwoPassTiles, dtype: torch.dtype) -> bool:
    """Partial tiles (masks) and a transposed view against the CPU reference."""
    x = adversarial(_EDGE_SHAPE, dtype, seed=3)
    try:
        ok = all(matches_reference(case, candidate, v, buffers_of(case.reference(v))) for v in (x, x.t()))
    except Exception as e:
        print(f"  {case.name} / {describe(candidate)} on the edge inputs: {type(e).__name__}: {str(e)[:200]}")
        ok = False
    finally:
        setattr(tb, case.constant, case.candidates[0])
    return ok


def print_table(rows: list[dict]) -> None:
    header = f"{'case':14} {'shape':10} {'candidate':40} {'us':>8} {'GB/s':>6} {'%copy':>6}  =cur =ref"
    print(header)
    print("-" * len(header))
    for r in rows:
        flags = f"{'yes' if r['equals_current'] else 'NO':>4} {'yes' if r['equals_reference'] else 'NO':>4}"
        print(
            f"{r['case']:14} {r['shape']:10} {r['candidate']:40} {r['us']:8.1f} {r['gbps']:6.0f} "
            f"{r['percent_copy']:6.1f}  {flags}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="8192x8192,2048x8192", help="comma-separated MxK")
    parser.add_argument("--jobs", type=int, default=8, help="compile workers (0: compile on first use)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="input dtype of every case and check")
    parser.add_argument("--json", default="", help="also write the rows and winners to this file")
    args = parser.parse_args()
    start = time.perf_counter()
    sizes = [tuple(int(d) for d in s.split("x")) for s in args.sizes.split(",")]
    dtype, cases = DTYPES[args.dtype], CASES[DTYPES[args.dtype]]
    torch.cuda.init()
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
        f"{datetime.date.today()}; {args.dtype} input; bytes = input at {dtype.itemsize} B + codes at 1 B "
        "(scales not counted); copy = out.copy_(x) of the same input",
        flush=True,
    )
    if args.jobs > 0:
        precompile(args.jobs, args.dtype)
    copy_gbps = {}
    for shape in sizes:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        out = torch.empty_like(x)
        copy_gbps[shape] = 2 * x.numel() * x.element_size() / bench_ms(lambda x=x, out=out: out.copy_(x)) / 1e6
        print(f"copy {shape[0]}x{shape[1]}: {copy_gbps[shape]:.0f} GB/s (read + write)", flush=True)
    rows: list[dict] = []
    for case in cases:
        sweep_case(case, dtype, sizes, copy_gbps, rows)
        print(f"{case.name}: {len(case.candidates)} candidates done at {time.perf_counter() - start:.0f} s", flush=True)
    print()
    print_table(rows)
    print()
    winners = []
    for case in cases:
        for shape in sizes:
            name = f"{shape[0]}x{shape[1]}"
            mine = [r for r in rows if r["case"] == case.name and r["shape"] == name]
            valid = [r for r in mine if r["equals_current"] and r["equals_reference"]]
            if not valid:
                print(f"{case.name} {name}: no candidate matched the current kernel and the reference")
                continue
            best, current = min(valid, key=lambda r: r["us"]), min(mine, key=lambda r: r["index"])
            edge = edge_check(case, case.candidates[best["index"]], dtype)
            winners.append(dict(best, edge_ok=edge))
            print(
                f"winner {case.name} {name}: {best['candidate']} {best['us']:.1f} us, {best['percent_copy']:.1f}% of "
                f"copy (current {current['us']:.1f} us, {current['percent_copy']:.1f}%); partial tiles and "
                f"transposed view {'equal' if edge else 'DIFFER from'} the reference\n"
                f"    {case.constant} = {best['value']}"
            )
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            copies = {f"{m}x{k}": v for (m, k), v in copy_gbps.items()}
            json.dump(dict(dtype=args.dtype, copy_gbps=copies, rows=rows, winners=winners), f)
    differs = any(not (r["equals_current"] and r["equals_reference"]) for r in rows)
    return 1 if differs or not all(w["edge_ok"] for w in winners) else 0


if __name__ == "__main__":
    sys.exit(main())

"""`python benchmarks/kernel_speed.py`: every kernel against its plain-torch reference, side by side in one run.

docs/benchmarks.md reports the ratios; absolute numbers depend on the
machine, so each result records the device, torch version and thread count it ran with.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import pathlib
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.utils.benchmark as benchmark
from _arguments import Parser, kernel_size, positive_seconds
from rich.console import Console
from rich.table import Table

import quant_core


@dataclass(frozen=True)
class Result:
    """One case measured on one backend."""

    case: str
    backend: str
    median_ms: float
    gb_per_s: float
    speedup_vs_reference: float
    shape: str = ""
    """(M, K) of the bf16 input, on CUDA (the CPU runs one square size)."""
    percent_of_copy: float = 0.0
    """GB/s over the device-to-device copy bandwidth measured in the same run (CUDA)."""
    device_ms: float = 0.0
    """CUDA: GPU time of the call's kernels (profiler), without the host time between launches;
    gb_per_s and percent_of_copy are computed from it. 0 where not measured."""
    speedup_vs_compiled_reference: float = 0.0
    """Time of torch.compile(reference) over this time; 0 where not measured."""


@dataclass(frozen=True)
class _Case:
    """One kernel benchmark: the public call, its plain-torch reference and the ops it runs."""

    name: str
    ops: tuple[str, ...]
    """quant_core ops the call dispatches; a backend is timed only if it has a kernel for each."""
    num_bytes: float
    call: Callable[[], object]
    reference: Callable[[], object]
    """The same result from the `*_reference` functions (timed eager and under torch.compile)."""


def _median_seconds(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm up (allocator, lazy init)
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def _cuda_median_seconds(fn: Callable[[], object], budget: float) -> float:
    """Median time per call from CUDA events over ~`budget` seconds (5 samples of back-to-back calls)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, min(500, int(budget / 5 / max(start.elapsed_time(end) * 1e-3, 1e-6))))
    samples = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / reps)
    return statistics.median(samples)


def _tensors(result: object) -> tuple[object, ...]:
    """The fields of a result dataclass as a tuple (what a compiled reference returns)."""
    if dataclasses.is_dataclass(result):
        return tuple(getattr(result, f.name) for f in dataclasses.fields(result))
    return result if isinstance(result, tuple) else (result,)


def _kernel_cases(shape: tuple[int, int], device: torch.device) -> list[_Case]:
    """The kernel benchmarks on a bf16 input of `shape` (M, K).

    Bytes are the least traffic the op needs (read the input once, write each output once), the
    convention of the bandwidth targets in docs/benchmarks.md: 4 B/element for quantize with transpose.
    Scales are left out of the count (at most 1/16 of the data), except in the reduce-scatter rows,
    whose bytes they are part of.
    """
    x = torch.randn(*shape, device=device).to(torch.bfloat16)
    n = x.numel()
    e4m3 = torch.float8_e4m3fn
    scale = torch.ones((), device=device)
    rowwise_out = torch.empty(shape, dtype=e4m3, device=device)
    columnwise_out = torch.empty(shape[::-1], dtype=e4m3, device=device)
    fp8 = quant_core.quantize_fp8(x, columnwise=True)
    mxfp8 = quant_core.quantize_mxfp8(x)
    blockwise = quant_core.quantize_fp8_blockwise(x, (128, 128))
    nvfp4 = quant_core.quantize_nvfp4(x, (16, 16))
    bf16 = torch.bfloat16
    # FusedAdam's requantize and sync_amax_'s shards: many tensors cast with a scale each.
    pieces = list(x.split(shape[0] // 8))
    piece_outs = [torch.empty(p.shape, dtype=e4m3, device=device) for p in pieces]
    piece_scales = torch.ones(len(pieces), device=device)
    # The FP8 reduce-scatter's kernels on an fp32 gradient of x's elements (256 MiB at 8192^2) over
    # 8 ranks: one rank's rows (codes + a 4-byte scale per 128), and the rows a rank receives.
    ranks, gradient = 8, x.float()
    rows = quant_core.quantize_fp8_chunks(gradient, ranks)
    summed = torch.empty(n // ranks, device=device)
    row_bytes = rows.numel()
    cases = [
        _Case(
            "fp8 reduce-scatter rows of fp32, 8 ranks",
            ("quantize_fp8_chunks",),
            4 * n + row_bytes,
            lambda: quant_core.quantize_fp8_chunks(gradient, ranks, out=rows),
            lambda: quant_core.quantize_fp8_chunks_reference(gradient, ranks),
        ),
        _Case(
            "fp8 reduce-scatter dequantize-sum of 8 rows to fp32",
            ("dequantize_sum_fp8_chunks",),
            row_bytes + 4 * n // ranks,
            lambda: quant_core.dequantize_sum_fp8_chunks(rows, n // ranks, out=summed),
            lambda: quant_core.dequantize_sum_fp8_chunks_reference(rows, n // ranks),
        ),
        _Case("amax", ("amax",), 2 * n, lambda: quant_core.amax(x), lambda: quant_core.amax_reference(x)),
        _Case(
            "fp8 quantize rowwise",
            ("amax", "cast_to_fp8"),
            3 * n,
            lambda: quant_core.quantize_fp8(x),
            lambda: _tensors(quant_core.quantize_fp8_reference(x)),
        ),
        _Case(
            "fp8 quantize rowwise+columnwise",
            ("amax", "cast_to_fp8"),
            4 * n,
            lambda: quant_core.quantize_fp8(x, columnwise=True),
            lambda: _tensors(quant_core.quantize_fp8_reference(x, columnwise=True)),
        ),
        _Case(
            "fp8 cast of 8 tensors, one call",
            ("cast_to_fp8_many",),
            3 * n,
            lambda: quant_core.cast_to_fp8_many(pieces, piece_scales, e4m3, piece_outs),
            lambda: [quant_core.cast_to_fp8_reference(p, piece_scales[0], e4m3)[0] for p in pieces],
        ),
        _Case(
            "fp8 cast of 8 tensors, a call each",
            ("cast_to_fp8",),
            3 * n,
            lambda: [
                quant_core.cast_to_fp8(p, piece_scales[i], e4m3, rowwise_out=o)
                for i, (p, o) in enumerate(zip(pieces, piece_outs, strict=True))
            ],
            lambda: [quant_core.cast_to_fp8_reference(p, piece_scales[0], e4m3)[0] for p in pieces],
        ),
        # The out= path of FSDP2's all-gather reuse (delayed scaling: the scale is known): one read.
        _Case(
            "fp8 cast rowwise+columnwise into out=",
            ("cast_to_fp8",),
            4 * n,
            lambda: quant_core.cast_to_fp8(
                x, scale, e4m3, columnwise=True, rowwise_out=rowwise_out, columnwise_out=columnwise_out
            ),
            lambda: quant_core.cast_to_fp8_reference(x, scale, e4m3, columnwise=True),
        ),
        _Case(
            "fp8 dequantize to bf16",
            ("dequantize_fp8",),
            3 * n,
            lambda: quant_core.dequantize_fp8(fp8.rowwise_data, fp8.scale_inv, bf16),
            lambda: quant_core.dequantize_fp8_reference(fp8.rowwise_data, fp8.scale_inv, bf16),
        ),
        _Case(
            "fp8 transpose",
            ("transpose_bytes",),
            2 * n,
            lambda: quant_core.transpose_fp8(fp8.rowwise_data),
            lambda: fp8.rowwise_data.t().contiguous(),
        ),
        _Case(
            "mxfp8 quantize rowwise+columnwise",
            ("quantize_mxfp8",),
            4 * n,
            lambda: quant_core.quantize_mxfp8(x, columnwise=True),
            lambda: _tensors(quant_core.quantize_mxfp8_reference(x, columnwise=True)),
        ),
        _Case(
            "mxfp8 dequantize to bf16",
            ("dequantize_mxfp8",),
            3 * n,
            lambda: quant_core.dequantize_mxfp8(mxfp8.rowwise_data, mxfp8.rowwise_scale_inv, bf16),
            lambda: quant_core.dequantize_mxfp8_reference(mxfp8.rowwise_data, mxfp8.rowwise_scale_inv, bf16),
        ),
        _Case(
            "blockwise 1x128 quantize rowwise+columnwise",
            ("quantize_fp8_blockwise",),
            4 * n,
            lambda: quant_core.quantize_fp8_blockwise(x, (1, 128), columnwise=True),
            lambda: _tensors(quant_core.quantize_fp8_blockwise_reference(x, (1, 128), columnwise=True)),
        ),
        _Case(
            "blockwise 128x128 quantize rowwise",
            ("quantize_fp8_blockwise",),
            3 * n,
            lambda: quant_core.quantize_fp8_blockwise(x, (128, 128)),
            lambda: _tensors(quant_core.quantize_fp8_blockwise_reference(x, (128, 128))),
        ),
        _Case(
            "blockwise 128x128 quantize rowwise+columnwise",
            ("quantize_fp8_blockwise",),
            4 * n,
            lambda: quant_core.quantize_fp8_blockwise(x, (128, 128), columnwise=True),
            lambda: _tensors(quant_core.quantize_fp8_blockwise_reference(x, (128, 128), columnwise=True)),
        ),
        _Case(
            "blockwise 128x128 transpose",
            ("transpose_bytes",),
            2 * n,
            lambda: quant_core.transpose_fp8_blockwise(blockwise.rowwise_data, blockwise.rowwise_scale_inv),
            lambda: (blockwise.rowwise_data.t().contiguous(), blockwise.rowwise_scale_inv.t().contiguous()),
        ),
        _Case(
            "blockwise 128x128 dequantize to bf16",
            ("dequantize_fp8_blockwise",),
            3 * n,
            lambda: quant_core.dequantize_fp8_blockwise(
                blockwise.rowwise_data, blockwise.rowwise_scale_inv, (128, 128), bf16
            ),
            lambda: quant_core.dequantize_fp8_blockwise_reference(
                blockwise.rowwise_data, blockwise.rowwise_scale_inv, (128, 128), bf16
            ),
        ),
        _Case(
            "nvfp4 1x16 quantize rowwise+columnwise",
            ("amax", "quantize_nvfp4"),
            3 * n,
            lambda: quant_core.quantize_nvfp4(x, columnwise=True),
            lambda: _tensors(quant_core.quantize_nvfp4_reference(x, columnwise=True)),
        ),
        # The random Hadamard transform on the columnwise (wgrad) usage: both amaxes in one read,
        # then one read for both usages (quant_core [Note: NVFP4 random Hadamard transform]).
        _Case(
            "nvfp4 1x16 quantize rowwise+columnwise with RHT",
            ("hadamard_amaxes", "quantize_nvfp4"),
            3 * n,
            lambda: quant_core.quantize_nvfp4(x, columnwise=True, hadamard_seed=1),
            lambda: _tensors(quant_core.quantize_nvfp4_reference(x, columnwise=True, hadamard_seed=1)),
        ),
        _Case(
            "nvfp4 amax and RHT amax",
            ("hadamard_amaxes",),
            2 * n,
            lambda: quant_core.hadamard_amaxes(x, seed=1),
            lambda: quant_core.hadamard_amaxes_reference(x, seed=1),
        ),
        _Case(
            "nvfp4 1x16 quantize, stochastic rounding",
            ("amax", "quantize_nvfp4"),
            2.5 * n,
            lambda: quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=1),
            lambda: _tensors(quant_core.quantize_nvfp4_reference(x, stochastic_rounding=True, seed=1)),
        ),
        _Case(
            "nvfp4 16x16 quantize rowwise",
            ("amax", "quantize_nvfp4"),
            2.5 * n,
            lambda: quant_core.quantize_nvfp4(x, (16, 16)),
            lambda: _tensors(quant_core.quantize_nvfp4_reference(x, (16, 16))),
        ),
        _Case(
            "nvfp4 16x16 transpose",
            ("transpose_nvfp4",),
            n,
            lambda: quant_core.transpose_nvfp4(nvfp4.rowwise_data, nvfp4.rowwise_scale_inv),
            lambda: _nibble_transpose_reference(nvfp4.rowwise_data),
        ),
        _Case(
            "nvfp4 dequantize to bf16",
            ("dequantize_nvfp4",),
            2.5 * n,
            lambda: quant_core.dequantize_nvfp4(
                nvfp4.rowwise_data, nvfp4.rowwise_scale_inv, nvfp4.amax, (16, 16), torch.bfloat16
            ),
            lambda: quant_core.dequantize_nvfp4_reference(
                nvfp4.rowwise_data, nvfp4.rowwise_scale_inv, nvfp4.amax, (16, 16), torch.bfloat16
            ),
        ),
        _Case(
            "hadamard 16x16 transform",
            ("hadamard_transform_16",),
            4 * n,
            lambda: quant_core.hadamard_transform_16(x, seed=1),
            lambda: quant_core.hadamard_transform_16_reference(x, seed=1),
        ),
    ]
    return [case for case in cases if not CASES or any(part in case.name for part in CASES)]


def _nibble_transpose_reference(packed: torch.Tensor) -> torch.Tensor:
    """Plain-torch NVFP4 transpose: unpack (M, K/2) bytes to codes, transpose, pack along M."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).t()
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _backends_with_kernels(case: _Case, backends: tuple[str, ...], device: torch.device) -> list[str]:
    """The backends that have a kernel for every op of `case` on `device`: a forced backend that
    lacks one would raise, so it is left out rather than forced."""
    usable = []
    for backend in backends:
        with quant_core.use_backend(backend):
            try:
                for op in case.ops:
                    quant_core.selected_backend(op, device)
            except (NotImplementedError, RuntimeError, ValueError):
                continue
        usable.append(backend)
    return usable


def benchmark_kernels(size: int, min_run_time: float, device: torch.device) -> list[Result]:
    """Times every kernel case on `device` for each backend that has its kernels, and the reference.

    CPU: one square `size`. CUDA: bf16 8192^2, 4096^2 and 2048x8192, each case also
    against the eager `*_reference` functions, and at 8192^2 against torch.compile of them; bandwidth
    as a percentage of a device-to-device copy measured in the same run.
    """
    if device.type != "cuda":
        return _benchmark_cpu(size, min_run_time, device)
    budget = min(min_run_time, 0.25)
    copy_gb_per_s = _copy_gb_per_s(device, budget)
    backends = quant_core.available_backends(device)
    results = []
    compile_left = COMPILE_BUDGET_S if COMPILE_REFERENCES else 0.0
    for shape in _CUDA_SHAPES:
        for case in _kernel_cases(shape, device):
            print(f"{shape[0]}x{shape[1]} {case.name}", flush=True)  # progress in the logs
            try:
                started = time.monotonic()
                compiled_s = _compiled_seconds(case, budget) if shape == _CUDA_SHAPES[0] and compile_left > 0 else 0.0
                compile_left -= time.monotonic() - started
                results += _time_cuda_case(case, shape, backends, device, budget, copy_gb_per_s, compiled_s)
            except Exception as error:  # report every case, then fail the run
                print(f"  FAILED: {type(error).__name__}: {error}"[:400], flush=True)
                results.append(Result(case.name, "FAILED", 0.0, 0.0, 0.0, shape=f"{shape[0]}x{shape[1]}"))
        torch.cuda.empty_cache()
    results.append(Result("device-to-device copy (bf16 8192^2)", "torch", 0.0, copy_gb_per_s, 0.0, percent_of_copy=100))
    return results


_CUDA_SHAPES = ((8192, 8192), (4096, 4096), (2048, 8192))
# Whether the CUDA run times torch.compile of each reference (at the first shape), and the seconds
# it may spend on that (compiling takes most of the run's time); cases past the budget show "-".
COMPILE_REFERENCES = True
COMPILE_BUDGET_S = 300.0
# Substrings of the case names to run (`--cases`); empty: every case.
CASES: tuple[str, ...] = ()


def _time_cuda_case(
    case: _Case,
    shape: tuple[int, int],
    backends: tuple[str, ...],
    device: torch.device,
    budget: float,
    copy_gb_per_s: float,
    compiled_s: float,
) -> list[Result]:
    reference_s = _cuda_median_seconds(case.reference, budget)
    results = []
    for backend in _backends_with_kernels(case, backends, device):
        with quant_core.use_backend(backend):
            s = _cuda_median_seconds(case.call, budget)
            device_s = _kernel_seconds(case.call) if backend != "reference" else s
        gb_per_s = case.num_bytes / device_s / 1e9
        results.append(
            Result(
                case.name,
                backend,
                s * 1e3,
                gb_per_s,
                reference_s / s,
                shape=f"{shape[0]}x{shape[1]}",
                percent_of_copy=100 * gb_per_s / copy_gb_per_s,
                speedup_vs_compiled_reference=compiled_s / s,
                device_ms=device_s * 1e3,
            )
        )
    return results


def _kernel_seconds(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU time per call summed over its kernels, memsets and copies (torch.profiler, CUDA activity only)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(event.self_device_time_total for event in profile.key_averages()) * 1e-6 / calls


def _copy_gb_per_s(device: torch.device, budget: float) -> float:
    """Bandwidth of a bf16 8192^2 device-to-device copy, counting bytes read plus bytes written."""
    source = torch.randn(8192, 8192, device=device).to(torch.bfloat16)
    target = torch.empty_like(source)
    seconds = _cuda_median_seconds(lambda: target.copy_(source), budget)
    return 2 * source.numel() * source.element_size() / seconds / 1e9


def _compiled_seconds(case: _Case, budget: float) -> float:
    """Time of torch.compile(case.reference) (0 when it does not compile, with the reason printed)."""
    try:
        compiled = torch.compile(case.reference, dynamic=False)
        return _cuda_median_seconds(compiled, budget)
    except Exception as error:  # a benchmark column, not a test
        print(f"torch.compile of the {case.name!r} reference failed: {type(error).__name__}: {error}"[:300])
        return 0.0


def _benchmark_cpu(size: int, min_run_time: float, device: torch.device) -> list[Result]:
    backends = quant_core.available_backends(device)
    results = []
    for case in _kernel_cases((size, size), device):
        seconds = {}
        for backend in _backends_with_kernels(case, backends, device):
            with quant_core.use_backend(backend):
                seconds[backend] = _median_seconds(case.call, min_run_time)
        for backend, s in seconds.items():
            results.append(Result(case.name, backend, s * 1e3, case.num_bytes / s / 1e9, seconds["reference"] / s))
    return results


def benchmark_hooks(min_run_time: float, device: torch.device, size: int = 1024, world_size: int = 2) -> list[Result]:
    """CPU time of one pre- plus post-all-gather hook call (the `out=` refill FSDP2 makes every
    unshard) per parameter, for a size x size fp32 weight sharded `world_size` ways, per recipe and mode.

    The collective itself is replaced by concatenating the shards' inputs beforehand. Mode 2 is timed
    with an unchanged shard (its quantized shard is reused: the backward gather, or a second forward);
    quantizing a changed shard is kernel time, measured by `benchmark_kernels`.
    """
    import quant_tensors as qt
    from quant_fsdp import QuantizeOnGatherTensor
    from quant_tensors.testing import FakeMesh

    mesh = FakeMesh(world_size)
    results = []
    for name in ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"):
        value = torch.randn(size, size, device=device)
        quantizer = qt.recipe_from_name(name).quantizer("weight")
        full = quantizer.quantize(value)
        for mode, shards in (
            ("quantized weights", [s.clone() for s in full.chunk(world_size)]),
            ("quantize on gather", [QuantizeOnGatherTensor(c.clone(), quantizer) for c in value.chunk(world_size)]),
        ):
            payloads = [s.fsdp_pre_all_gather(mesh, value.shape, value.stride(), None, None) for s in shards]
            outputs = tuple(torch.cat([p[0][k] for p in payloads]) for k in range(len(payloads[0][0])))
            unsharded, _ = shards[0].fsdp_post_all_gather(outputs, payloads[0][1], value.dtype)

            def hooks(shard=shards[0], value=value, outputs=outputs, unsharded=unsharded) -> None:
                _, metadata = shard.fsdp_pre_all_gather(mesh, value.shape, value.stride(), None, None)
                shard.fsdp_post_all_gather(outputs, metadata, value.dtype, out=unsharded)

            seconds = _median_seconds(hooks, min_run_time)
            results.append(Result(f"{name}: {mode}", "hooks", seconds * 1e3, 0.0, 0.0))
    return results


def _cpu_table(name: str, size: int, results: list[Result]) -> Table:
    table = Table(title=f"quant-core kernels vs plain-torch reference ({size}x{size} bf16 input)")
    for column in ("device", "case", "backend", "median ms", "GB/s", "x reference"):
        table.add_column(column, justify="left" if column in ("device", "case", "backend") else "right")
    for r in results:
        table.add_row(
            name, r.case, r.backend, f"{r.median_ms:.3f}", f"{r.gb_per_s:.1f}", f"{r.speedup_vs_reference:.2f}"
        )
    return table


def _cuda_table(name: str, results: list[Result]) -> Table:
    copy = results[-1].gb_per_s
    table = Table(
        title=f"quant-core kernels on {name}, bf16 input (copy: {copy:.0f} GB/s, read + write). us: per call, "
        "host included; GPU us: its kernels alone (GB/s and % copy from these)"
    )
    columns = ("shape", "case", "backend", "us", "GPU us", "GB/s", "% copy", "x eager ref", "x compiled ref")
    for column in columns:
        table.add_column(column, justify="left" if column in ("shape", "case", "backend") else "right")
    for r in results[:-1]:
        compiled = f"{r.speedup_vs_compiled_reference:.2f}" if r.speedup_vs_compiled_reference else "-"
        table.add_row(
            r.shape,
            r.case,
            r.backend,
            f"{r.median_ms * 1e3:.1f}",
            f"{r.device_ms * 1e3:.1f}",
            f"{r.gb_per_s:.0f}",
            f"{r.percent_of_copy:.0f}",
            f"{r.speedup_vs_reference:.2f}",
            compiled,
        )
    return table


def _version_of(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def run_bench(out: pathlib.Path, *, size: int, min_run_time: float, device: str = "all") -> int:
    """Runs the suite on the CPU and/or CUDA (`device`), prints a table, writes bench.json."""
    console = Console(width=None if sys.stdout.isatty() else 120)  # logs: no wrapped tables
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("kernel_speed.py --device cuda: no CUDA device is visible")
    devices = [torch.device(d) for d in ("cpu", "cuda") if device in (d, "all")]
    devices = [d for d in devices if d.type == "cpu" or torch.cuda.is_available()]
    records = []
    tables = []
    for device in devices:
        with console.status(f"benchmarking kernels on {device.type}"):
            results = benchmark_kernels(size, min_run_time, device)
        name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} cpu"
        tables.append(_cuda_table(name, results) if device.type == "cuda" else _cpu_table(name, size, results))
        records.append({"device": name, "results": [asdict(r) for r in results]})
    for table in tables:
        console.print(table)
    hooks = benchmark_hooks(min_run_time, torch.device("cpu"))
    hook_table = Table(title="FSDP2 all-gather hooks: CPU time per parameter per unshard (pre + post, out= refill)")
    for column in ("case", "median us"):
        hook_table.add_column(column, justify="left" if column == "case" else "right")
    for r in hooks:
        hook_table.add_row(r.case, f"{r.median_ms * 1e3:.1f}")
    console.print(hook_table)
    records.append({"device": "hooks (cpu, 1024x1024 fp32, 2 shards)", "results": [asdict(r) for r in hooks]})
    out.mkdir(parents=True, exist_ok=True)
    report = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "triton": _version_of("triton"),
        "quant_core": quant_core.__version__,
        "threads": torch.get_num_threads(),
        "size": size,
        "devices": records,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    failed = [r.case for record in records for r in record["results"] if r["backend"] == "FAILED"]
    if failed:
        console.print(f"cases that failed: {', '.join(failed)}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="kernel_speed.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for bench.json")
    parser.add_argument(
        "--size", type=kernel_size, default=4096, help="square input size of the kernel benchmarks (a multiple of 128)"
    )
    parser.add_argument("--min-run-time", type=positive_seconds, default=1.0, help="seconds measured per case")
    parser.add_argument(
        "--device", choices=("all", "cpu", "cuda"), default="all", help="all (default): the CPU, and CUDA if present"
    )
    parser.add_argument(
        "--cases", default="", help="comma-separated parts of case names: only the cases whose name holds one"
    )
    args = parser.parse_args(argv)
    global CASES
    CASES = tuple(part for part in args.cases.split(",") if part)
    return run_bench(args.out, size=args.size, min_run_time=args.min_run_time, device=args.device)


if __name__ == "__main__":
    sys.exit(main())

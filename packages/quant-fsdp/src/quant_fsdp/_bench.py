"""`quant-fsdp bench`: every kernel against its plain-torch reference, side by side in one run.

Ratios are what the targets of DESIGN section 9 are stated in; absolute numbers depend on the
machine, so each result records the device, torch version and thread count it ran with.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.utils.benchmark as benchmark
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


def _median_seconds(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm up (allocator, lazy init)
    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=min_run_time).median


def _kernel_cases(size: int, device: torch.device) -> list[tuple[str, int, Callable[[], object]]]:
    """(case name, bytes, call) for each kernel benchmark on a bf16 size x size input.

    Bytes are the least traffic the op needs (read the input once, write each output once), the
    convention of DESIGN section 9's bandwidth targets: 4 B/element for quantize with transpose.
    Scales are left out of the count (at most 1/16 of the data).
    """
    x = torch.randn(size, size, device=device).to(torch.bfloat16)
    n = x.numel()
    e4m3 = torch.float8_e4m3fn
    scale = torch.ones((), device=device)
    rowwise_out = torch.empty(size, size, dtype=e4m3, device=device)
    columnwise_out = torch.empty(size, size, dtype=e4m3, device=device)
    fp8 = quant_core.quantize_fp8(x, columnwise=True)
    mxfp8 = quant_core.quantize_mxfp8(x)
    blockwise = quant_core.quantize_fp8_blockwise(x, (128, 128))
    nvfp4 = quant_core.quantize_nvfp4(x, (16, 16))
    return [
        ("amax", 2 * n, lambda: quant_core.amax(x)),
        ("fp8 quantize rowwise", 3 * n, lambda: quant_core.quantize_fp8(x)),
        ("fp8 quantize rowwise+columnwise", 4 * n, lambda: quant_core.quantize_fp8(x, columnwise=True)),
        # The out= path of FSDP2's all-gather reuse: no fresh output pages to fault in.
        (
            "fp8 cast rowwise+columnwise into out=",
            4 * n,
            lambda: quant_core.cast_to_fp8(
                x, scale, e4m3, columnwise=True, rowwise_out=rowwise_out, columnwise_out=columnwise_out
            ),
        ),
        (
            "fp8 dequantize to bf16",
            3 * n,
            lambda: quant_core.dequantize_fp8(fp8.rowwise_data, fp8.scale_inv, torch.bfloat16),
        ),
        ("fp8 transpose", 2 * n, lambda: quant_core.transpose_fp8(fp8.rowwise_data)),
        ("mxfp8 quantize rowwise+columnwise", 4 * n, lambda: quant_core.quantize_mxfp8(x, columnwise=True)),
        (
            "mxfp8 dequantize to bf16",
            3 * n,
            lambda: quant_core.dequantize_mxfp8(mxfp8.rowwise_data, mxfp8.rowwise_scale_inv, torch.bfloat16),
        ),
        (
            "blockwise 1x128 quantize rowwise+columnwise",
            4 * n,
            lambda: quant_core.quantize_fp8_blockwise(x, (1, 128), columnwise=True),
        ),
        ("blockwise 128x128 quantize rowwise", 3 * n, lambda: quant_core.quantize_fp8_blockwise(x, (128, 128))),
        (
            "blockwise 128x128 transpose",
            2 * n,
            lambda: quant_core.transpose_fp8_blockwise(blockwise.rowwise_data, blockwise.rowwise_scale_inv),
        ),
        (
            "blockwise 128x128 dequantize to bf16",
            3 * n,
            lambda: quant_core.dequantize_fp8_blockwise(
                blockwise.rowwise_data, blockwise.rowwise_scale_inv, (128, 128), torch.bfloat16
            ),
        ),
        ("nvfp4 1x16 quantize rowwise+columnwise", 3 * n, lambda: quant_core.quantize_nvfp4(x, columnwise=True)),
        (
            "nvfp4 1x16 quantize, stochastic rounding",
            2.5 * n,
            lambda: quant_core.quantize_nvfp4(x, stochastic_rounding=True, seed=1),
        ),
        ("nvfp4 16x16 quantize rowwise", 2.5 * n, lambda: quant_core.quantize_nvfp4(x, (16, 16))),
        ("nvfp4 16x16 transpose", n, lambda: quant_core.transpose_nvfp4(nvfp4.rowwise_data, nvfp4.rowwise_scale_inv)),
        (
            "nvfp4 dequantize to bf16",
            2.5 * n,
            lambda: quant_core.dequantize_nvfp4(
                nvfp4.rowwise_data, nvfp4.rowwise_scale_inv, nvfp4.amax, (16, 16), torch.bfloat16
            ),
        ),
        ("hadamard 16x16 transform", 4 * n, lambda: quant_core.hadamard_transform_16(x, seed=1)),
    ]


def benchmark_kernels(size: int, min_run_time: float, device: torch.device) -> list[Result]:
    """Times every kernel case on each backend that runs on `device`, and on the reference."""
    backends = quant_core.available_backends(device)
    results = []
    for case, num_bytes, call in _kernel_cases(size, device):
        seconds = {}
        for backend in backends:
            with quant_core.use_backend(backend):
                seconds[backend] = _median_seconds(call, min_run_time)
        for backend, s in seconds.items():
            results.append(Result(case, backend, s * 1e3, num_bytes / s / 1e9, seconds["reference"] / s))
    return results


class _OneRankMesh:
    """The part of a DeviceMesh the all-gather hooks read, for timing them without processes."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size

    def get_group(self) -> None:
        return None


def benchmark_hooks(min_run_time: float, device: torch.device, size: int = 1024, world: int = 2) -> list[Result]:
    """CPU time of one pre- plus post-all-gather hook call (the `out=` refill FSDP2 makes every
    unshard) per parameter, for a size x size fp32 weight sharded `world` ways, per recipe and mode.

    The collective itself is replaced by concatenating the shards' inputs beforehand. Mode 2 is timed
    with an unchanged shard (its quantized shard is reused: the backward gather, or a second forward);
    quantizing a changed shard is kernel time, measured by `benchmark_kernels`.
    """
    import quant_fsdp  # noqa: F401  (installs the hooks)
    import quant_tensors as qt
    from quant_fsdp import QuantizeOnGatherTensor

    mesh = _OneRankMesh(world)
    results = []
    for name in ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"):
        value = torch.randn(size, size, device=device)
        quantizer = qt.recipe_from_name(name).quantizer("weight")
        full = quantizer.quantize(value)
        for mode, shards in (
            ("quantized weights", [s.clone() for s in full.chunk(world)]),
            ("quantize on gather", [QuantizeOnGatherTensor(c.clone(), quantizer) for c in value.chunk(world)]),
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


def run_bench(out: pathlib.Path, *, size: int, min_run_time: float, device: str = "all") -> int:
    """Runs the suite on the CPU and/or CUDA (`device`), prints a table, writes bench.json."""
    console = Console(width=None if sys.stdout.isatty() else 120)  # logs: no wrapped tables
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("quant-fsdp bench --device cuda: no CUDA device is visible")
    devices = [torch.device(d) for d in ("cpu", "cuda") if device in (d, "all")]
    devices = [d for d in devices if d.type == "cpu" or torch.cuda.is_available()]
    table = Table(title=f"quant-core kernels vs plain-torch reference ({size}x{size} bf16 input)")
    for column in ("device", "case", "backend", "median ms", "GB/s", "x reference"):
        table.add_column(column, justify="left" if column in ("device", "case", "backend") else "right")
    records = []
    for device in devices:
        with console.status(f"benchmarking kernels on {device.type}"):
            results = benchmark_kernels(size, min_run_time, device)
        name = torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} cpu"
        for r in results:
            table.add_row(
                name, r.case, r.backend, f"{r.median_ms:.3f}", f"{r.gb_per_s:.1f}", f"{r.speedup_vs_reference:.2f}"
            )
        records.append({"device": name, "results": [asdict(r) for r in results]})
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
        "quant_core": quant_core.__version__,
        "threads": torch.get_num_threads(),
        "size": size,
        "devices": records,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {out / 'bench.json'}")
    return 0

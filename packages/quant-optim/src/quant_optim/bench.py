"""`python -m quant_optim.bench`: FusedAdam against torch's fastest AdamW, side by side in one run.

Cases, each over `--tensors` parameters of `--numel` elements (default 10 x 1e6 = 1e7):
- fp32 parameters: FusedAdam on the fastest quant_core backend and on the reference (checking gradients for NaN/Inf itself,
  and given `found_inf` as under GradScaler) vs torch.optim.AdamW(fused=True), which checks nothing;
- quantized parameters (per-tensor FP8, MXFP8): FusedAdam (update + amax in one pass, then the
  requantize) vs torch.optim.AdamW(fused=True) on the fp32 masters followed by a separate
  requantize of each parameter (what a user without FusedAdam would run).
Prints a table and writes `<out>/bench_optim.json` (device, torch version, threads, date).
`nox -s bench` runs it after `quant-fsdp bench`.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import platform
from collections.abc import Callable

import torch
import torch.utils.benchmark as benchmark

import quant_core
import quant_tensors as qt
from quant_optim import FusedAdam


def _median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    fn()  # warm up: states are created, pages faulted in
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn})
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device) * 1e-3
    return params


def _fp32_params(tensors: int, numel: int, device: torch.device) -> list[torch.Tensor]:
    return _with_grads([torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)])


def fp32_cases(tensors: int, numel: int, device: torch.device, min_run_time: float) -> dict[str, float]:
    """Median ms per step of each optimizer over fp32 parameters."""
    times = {}
    no_inf = torch.zeros((), device=device)
    fastest = quant_core.selected_backend("adam_step", device)
    for backend in dict.fromkeys((fastest, "reference")):
        optimizer = FusedAdam(_fp32_params(tensors, numel, device), lr=1e-3, weight_decay=0.01)
        # The fastest backend per op (what users get), or every op on the reference.
        with contextlib.nullcontext() if backend == fastest else quant_core.use_backend("reference"):
            times[f"FusedAdam ({backend})"] = _median_ms(optimizer.step, min_run_time)
            # With a GradScaler-style verdict the gradients are not read a second time.
            times[f"FusedAdam ({backend}), found_inf given"] = _median_ms(
                lambda optimizer=optimizer: optimizer.step(found_inf=no_inf), min_run_time
            )
    torch_adamw = torch.optim.AdamW(_fp32_params(tensors, numel, device), lr=1e-3, weight_decay=0.01, fused=True)
    times["torch AdamW(fused=True)"] = _median_ms(torch_adamw.step, min_run_time)
    return times


def requantize_cases(
    recipe_name: str, tensors: int, numel: int, device: torch.device, min_run_time: float
) -> dict[str, float]:
    """Median ms per step with quantized parameters (rows of 1024): FusedAdam vs AdamW + requantize."""
    shape = (numel // 1024, 1024)
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    params = _with_grads(
        [qt.nn.quantized_parameter(torch.randn(shape, device=device), quantizer) for _ in range(tensors)]
    )
    fused = FusedAdam(params, lr=1e-3, weight_decay=0.01)
    times = {"FusedAdam (update + requantize)": _median_ms(fused.step, min_run_time)}

    masters = _with_grads([torch.nn.Parameter(p.dequantize(torch.float32)) for p in params])
    adamw = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True)

    def adamw_then_requantize() -> None:
        adamw.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.quantizer.quantize_(master, p)

    times["torch AdamW(fused=True) + requantize"] = _median_ms(adamw_then_requantize, min_run_time)
    return times


def memory_floor_ms(params: int, device: torch.device, min_run_time: float) -> float:
    """The least time an fp32 Adam step can take here: 28 B per parameter (read gradient; read and
    write parameter and both moments) at the in-place streaming bandwidth measured now."""
    x = torch.ones(params, device=device)
    seconds = _median_ms(lambda: x.mul_(1.0), min_run_time) / 1e3
    bandwidth = 8 * params / seconds  # an in-place pass reads and writes 4 B per element
    return 28 * params / bandwidth * 1e3


def run(out: pathlib.Path, *, tensors: int, numel: int, min_run_time: float, device: torch.device) -> dict:
    params = tensors * numel
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} cpu",
        "params": params,
        "tensors": tensors,
        "cases": {"fp32": fp32_cases(tensors, numel, device, min_run_time)},
    }
    report["cases"]["fp32"]["memory floor (28 B/param, in-place stream)"] = memory_floor_ms(
        params, device, min_run_time
    )
    for recipe_name in ("fp8", "mxfp8"):
        report["cases"][recipe_name] = requantize_cases(recipe_name, tensors, numel, device, min_run_time)

    print(f"FusedAdam vs torch AdamW: {params:.0e} params in {tensors} tensors, {report['device']}, "
          f"torch {torch.__version__}, {report['threads']} threads")  # fmt: skip
    print(f"{'params':<8} {'optimizer':<40} {'ms/step':>9} {'x torch':>8}")
    for kind, times in report["cases"].items():
        baseline = times[next(name for name in times if name.startswith("torch"))]
        for name, ms in times.items():
            print(f"{kind:<8} {name:<40} {ms:9.2f} {baseline / ms:8.2f}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_optim.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'bench_optim.json'}")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quant_optim.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--tensors", type=int, default=10)
    parser.add_argument("--numel", type=int, default=1_048_576, help="elements per tensor (a multiple of 1024)")
    parser.add_argument("--min-run-time", type=float, default=1.0, help="seconds of timing per case")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    run(
        args.out,
        tensors=args.tensors,
        numel=args.numel,
        min_run_time=args.min_run_time,
        device=torch.device(args.device),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python benchmarks/linear_host.py`: host (CPU) time of one Linear forward + backward, per recipe.

At a size where the GPU idles (bf16 256 x 256 x 256 by default) a layer's step costs what the
host spends dispatching it: Python, torch's dispatcher, kernel launches. Measured side by side in
one run: torch's nn.Linear, qt.nn.Linear under every recipe (eager and torch.compile), and
torchao's Float8Linear (tensorwise; eager and compiled) where torchao imports (results:
docs/benchmarks.md, 'Host time per Linear').

Host time per step = wall time of N steps issued back to back, before the closing synchronize,
over N: the GPU finishes each step before the host has issued the next, so the host never waits.
Rounds interleave the layers (each round times every layer once): the ratios hold while the
host's speed drifts.
"""

from __future__ import annotations

import copy
import json
import pathlib
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from _arguments import Parser, positive
from rich.console import Console
from rich.table import Table

import quant_tensors as qt

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")


@dataclass(frozen=True)
class LinearHostResult:
    """One layer kind, eager or compiled."""

    layer: str
    compiled: bool
    host_us: float
    """Host time per forward + backward, microseconds (median of repeats)."""
    vs_nn_linear: float
    """This host time over nn.Linear's (eager)."""
    error: str = ""


def _layers(size: int, device: torch.device) -> dict[str, Callable[[], torch.nn.Module]]:
    """Builders of every layer kind measured, by name."""

    def plain() -> torch.nn.Module:
        return torch.nn.Linear(size, size, device=device, dtype=torch.bfloat16)

    builders: dict[str, Callable[[], torch.nn.Module]] = {"nn.Linear": plain}
    for name in RECIPES:
        builders[f"qt {name}"] = lambda name=name: qt.convert(torch.nn.Sequential(plain()), qt.recipe_from_name(name))[
            0
        ]
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return builders

    def torchao_tensorwise() -> torch.nn.Module:
        config = Float8LinearConfig.from_recipe_name("tensorwise")
        return convert_to_float8_training(torch.nn.Sequential(plain()), config=config)[0]

    builders["torchao tensorwise"] = torchao_tensorwise
    return builders


def _time_us(step: Callable[[], None], device: torch.device, iterations: int) -> float:
    """Host microseconds per step over `iterations` steps back to back."""
    start = time.perf_counter()
    for _ in range(iterations):
        step()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / iterations * 1e6


def benchmark_linear_host(
    device: torch.device,
    *,
    size: int = 256,
    iterations: int = 50,
    repeats: int = 5,
    compile: bool = True,
    layers: tuple[str, ...] = (),
) -> list[LinearHostResult]:
    """Host time per fwd + bwd of every layer kind on `device` (eager, and compiled if asked), or
    of the kinds named in `layers` (nn.Linear, the baseline, always).

    Every layer is built, compiled and warmed up first; then each of `repeats` rounds times every
    layer once, so a drift of the host's speed during the run (up to ~2x on the GPU VMs) reaches
    every layer alike, and a layer's host time is the median of its rounds."""
    builders = _layers(size, device)
    unknown = sorted(set(layers) - set(builders))
    if unknown:
        raise ValueError(f"unknown layer kinds {unknown}: choose from {sorted(builders)}")
    x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    dy = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    steps: dict[tuple[str, bool], Callable[[], None]] = {}
    errors: dict[tuple[str, bool], str] = {}
    torch._dynamo.reset()
    for name, build in builders.items():
        if layers and name not in layers and name != "nn.Linear":
            continue
        for compiled in (False, True) if compile else (False,):
            try:
                layer = copy.deepcopy(build())
                forward = torch.compile(layer) if compiled else layer

                def step(forward=forward) -> None:
                    # A new input object each step, as in training: the same one would find its
                    # quantization in qt.nn's sibling cache ([Note: sibling layers share one
                    # quantized input]) and skip the input's quantize.
                    forward(x.detach().requires_grad_(True)).backward(dy)

                for _ in range(3):  # warm-up: allocator, lazy init, compilation
                    step()
                steps[name, compiled] = step
            except Exception as error:  # one failing layer kind must not hide the others
                errors[name, compiled] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    rounds: dict[tuple[str, bool], list[float]] = {key: [] for key in steps}
    for _ in range(repeats):
        for key, step in steps.items():
            rounds[key].append(_time_us(step, device, iterations))
    host_us = {key: sorted(samples)[len(samples) // 2] for key, samples in rounds.items()}
    baseline = host_us["nn.Linear", False]
    order = [(name, compiled) for name in builders for compiled in (False, True)]
    results = []
    for key in sorted({*steps, *errors}, key=order.index):
        us = host_us.get(key, float("nan"))
        results.append(LinearHostResult(*key, us, us / baseline, errors.get(key, "")))
    return results


def run_linear_host_bench(
    out: pathlib.Path, device: str = "all", *, size: int = 256, layers: tuple[str, ...] = (), repeats: int = 5
) -> int:
    """Measures every layer kind (or those named) on CUDA (the CPU when no GPU is present or
    asked for), prints the table and writes linear_host.json; 1 if a layer kind failed."""
    target = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    results = benchmark_linear_host(target, size=size, layers=layers, repeats=repeats)
    name = torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu"
    table = Table(title=f"Host time per Linear forward + backward, bf16 {size}^3, {name}, torch {torch.__version__}")
    for column in ("layer", "mode", "host us", "vs nn.Linear", "error"):
        table.add_column(column, justify="right" if column in ("host us", "vs nn.Linear") else "left")
    for r in results:
        mode = "compiled" if r.compiled else "eager"
        table.add_row(r.layer, mode, f"{r.host_us:.0f}", f"{r.vs_nn_linear:.2f}x", r.error)
    Console(width=160).print(table)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "torch": torch.__version__, "size": size, "results": [asdict(r) for r in results]}
    (out / "linear_host.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if any(r.error for r in results) else 0


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="linear_host.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="folder for linear_host.json")
    parser.add_argument(
        "--device", choices=("all", "cpu", "cuda"), default="all", help="cuda, cpu; all (default): CUDA if present"
    )
    parser.add_argument(
        "--layers",
        type=lambda text: tuple(text.split(",")),
        default=(),
        help='comma-separated layer kinds, e.g. "qt fp8,torchao tensorwise" (default: all; nn.Linear always)',
    )
    parser.add_argument("--repeats", type=positive, default=5, help="rounds; each times every layer (default 5)")
    args = parser.parse_args(argv)
    try:
        return run_linear_host_bench(args.out, args.device, layers=args.layers, repeats=args.repeats)
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())

"""`python -m quant_optim.bench`: FusedAdam against torch's fastest AdamW, side by side in one run.

Cases, each over `--tensors` parameters of `--numel` elements (default 10 x 1e6 = 1e7):
- fp32 parameters: FusedAdam on the fastest quant_core backend and on the reference (checking gradients for NaN/Inf itself,
  and given `found_inf` as under GradScaler) vs torch.optim.AdamW(fused=True), which checks nothing;
- quantized parameters (per-tensor FP8, MXFP8): FusedAdam (update + amax in one pass, then the
  requantize) vs torch.optim.AdamW(fused=True) on the fp32 masters followed by a separate
  requantize of each parameter (what a user without FusedAdam would run).
`--preset 1e9` runs instead the DESIGN section 9 case (`mix_cases`): ~1e9 parameters in the weight
shapes of 4 Llama-3-8B-like layers plus an embedding, once all fp32 and once per quantized format
(per-tensor FP8, MXFP8, blockwise FP8, NVFP4: the Linear weights quantized with fp32 masters, the
embedding and norms fp32), each against torch AdamW(fused=True) + a separate requantize of every
weight with quant-core's Triton kernels, with its memory floor (`floor_bytes`). About 20 GB of
GPU memory per case, ~1 minute on an H100.
On CUDA, also `graph_cases` for fp32, per-tensor FP8 and MXFP8: one step captured in a CUDA graph
(after an eager warm-up step) and replayed, FusedAdam(capturable=True) vs torch
AdamW(fused=True, capturable=True) (+ a requantize of each weight): the step without its host
side. Each graph row first checks that one replay equals one eager step bit for bit (on a twin
built alike) and prints an error instead of a time when it does not.
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


def _twin_params(kind: str, tensors: int, numel: int, device: torch.device, seed: int = 0) -> list[torch.Tensor]:
    """Parameters (fp32, or quantized with rows of 1024) and gradients drawn from `seed`: equal bits on every call."""
    generator = torch.Generator(device=device).manual_seed(seed)
    quantizer = None if kind == "fp32" else qt.recipe_from_name(kind).quantizer("weight")
    params = []
    for _ in range(tensors):
        value = torch.randn((numel // 1024, 1024), device=device, generator=generator)
        params.append(torch.nn.Parameter(value) if quantizer is None else qt.nn.quantized_parameter(value, quantizer))
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=generator) * 1e-3
    return params


def _captured(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`step` captured in a CUDA graph after one eager warm-up call on a side stream (torch.cuda.graphs'
    recipe; FusedAdam(capturable=True) needs that eager step: [Note: FusedAdam tensor-driven step])."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _state_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every byte a step may write (parameters, quantized buffers, optimizer states), as uint8 copies."""
    tensors = []
    for p in params:
        tensors += [b for b in p.buffers().values() if b is not None] if isinstance(p, qt.QuantizedTensor) else [p]
        tensors += [v for _, v in sorted(optimizer.state[p].items()) if isinstance(v, torch.Tensor)]
    return [t.detach().reshape(-1).view(torch.uint8).clone() for t in tensors]


def _graph_row(
    make: Callable[[], tuple[list[torch.Tensor], torch.optim.Optimizer, Callable[[], object]]], min_run_time: float
) -> float | str:
    """ms per replay of a captured step, or an error (a string) when capture fails or one replay
    does not equal one eager step bit for bit (checked once, before timing, on a twin built alike)."""
    try:
        params, optimizer, step = make()
        graph = _captured(step)
        twin_params, twin, twin_step = make()
        twin_step()  # the twin's warm-up, eager
        graph.replay()
        twin_step()
        torch.cuda.synchronize()
        replayed, eager = _state_bytes(params, optimizer), _state_bytes(twin_params, twin)
    except Exception as error:
        return f"error: {type(error).__name__}: {str(error).splitlines()[0][:100]}"
    differing = sum(not torch.equal(a, b) for a, b in zip(replayed, eager, strict=True))
    checked = len(replayed)
    del twin_params, twin, twin_step, replayed, eager
    if differing:
        return f"error: one replay != one eager step in {differing} of {checked} tensors"
    return _median_ms(graph.replay, min_run_time)


def graph_cases(
    kind: str, tensors: int, numel: int, device: torch.device, min_run_time: float
) -> dict[str, float | str]:
    """ms per CUDA-graph replay of one step: FusedAdam(capturable=True), without and with a caller's
    found_inf, vs torch AdamW(fused=True, capturable=True) (+ a requantize of each weight with its
    quantizer for quantized `kind`), each captured after one eager warm-up step on the same
    parameters and gradients."""

    def fused(found_inf: bool) -> Callable[[], tuple[list[torch.Tensor], torch.optim.Optimizer, Callable[[], object]]]:
        def make() -> tuple[list[torch.Tensor], torch.optim.Optimizer, Callable[[], object]]:
            params = _twin_params(kind, tensors, numel, device)
            optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01, capturable=True)
            no_inf = torch.zeros((), device=device) if found_inf else None
            return params, optimizer, lambda: optimizer.step(found_inf=no_inf)

        return make

    def adamw() -> tuple[list[torch.Tensor], torch.optim.Optimizer, Callable[[], object]]:
        params = _twin_params(kind, tensors, numel, device)
        if kind == "fp32":
            optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True, capturable=True)
            return params, optimizer, optimizer.step
        masters = [torch.nn.Parameter(p.dequantize(torch.float32)) for p in params]
        for p, master in zip(params, masters, strict=True):
            master.grad = p.grad
        optimizer = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True, capturable=True)

        def step() -> None:
            optimizer.step()
            with torch.no_grad():
                for p, master in zip(params, masters, strict=True):
                    p.quantizer.quantize_(master, p)

        return params + masters, optimizer, step

    requantize = "" if kind == "fp32" else " + requantize"
    return {
        "FusedAdam(capturable), graph replay": _graph_row(fused(False), min_run_time),
        "FusedAdam(capturable), found_inf, graph replay": _graph_row(fused(True), min_run_time),
        f"torch AdamW(fused, capturable){requantize}, graph replay": _graph_row(adamw, min_run_time),
    }


# (out_features, in_features) of one Llama-3-8B-like decoder layer: q, k, v (grouped, 8 of 32
# heads), o, gate, up, down; hidden 4096, intermediate 14336: 218.1M parameters.
_LAYER_SHAPES = ((4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096), (14336, 4096), (4096, 14336))
_EMBEDDING = (32000, 4096)
_FLOOR_BYTES = {"fp32": 28, "quantized": 32}
"""Least bytes per parameter per step (besides the quantized bytes written): fp32 Adam reads the
gradient (4) and reads and writes the parameter and both moments (24); a quantized weight's fp32
master is read once more to requantize it after the update's amax is known (4)."""


def mix_shapes(num_layers: int = 4) -> list[tuple[tuple[int, ...], bool]]:
    """(shape, quantizable) of ~1e9 parameters: an embedding, `num_layers` layers, two norms per layer."""
    shapes = [(_EMBEDDING, False)]
    for _ in range(num_layers):
        shapes += [(shape, True) for shape in _LAYER_SHAPES] + [((4096,), False), ((4096,), False)]
    return shapes


def floor_bytes(params: list[torch.Tensor]) -> int:
    """The least traffic of one step over `params` ([see _FLOOR_BYTES]): per element 28 B (fp32) or
    32 B plus the bytes of its quantized buffers (quantized weights)."""
    total = 0
    for p in params:
        if isinstance(p, qt.QuantizedTensor):
            total += _FLOOR_BYTES["quantized"] * p.numel() + sum(
                b.nbytes for b in p.buffers().values() if b is not None
            )
        else:
            total += _FLOOR_BYTES["fp32"] * p.numel()
    return total


def mix_cases(device: torch.device, min_run_time: float) -> dict[str, dict[str, float]]:
    """ms per step over `mix_shapes()` for fp32 and each quantized format: FusedAdam vs torch
    AdamW(fused=True) (+ a separate requantize of each quantized weight), and the memory floor."""
    bandwidth = stream_bandwidth(device, min_run_time)
    cases: dict[str, dict[str, float]] = {}
    for kind in ("fp32", "fp8", "mxfp8", "fp8-block", "nvfp4"):
        quantizer = None if kind == "fp32" else qt.recipe_from_name(kind).quantizer("weight")
        params = []
        for shape, quantizable in mix_shapes():
            value = torch.randn(shape, device=device)
            # No high-precision init value kept (it would hold a second fp32 copy): masters start dequantized.
            weight = quantizer.quantize(value) if quantizer is not None and quantizable else value
            params.append(torch.nn.Parameter(weight))
            del value
        _with_grads(params)
        times = {"memory floor": floor_bytes(params) / bandwidth * 1e3}
        fused = FusedAdam(params, lr=1e-3, weight_decay=0.01)
        times["FusedAdam"] = _median_ms(fused.step, min_run_time)
        no_inf = torch.zeros((), device=device)
        times["FusedAdam, found_inf given"] = _median_ms(
            lambda fused=fused, no_inf=no_inf: fused.step(found_inf=no_inf), min_run_time
        )
        # The baseline steps the masters FusedAdam made (its moments freed first), then requantizes.
        masters = [fused.state[p].get("master", p) for p in params]
        del fused
        plain = [torch.nn.Parameter(m.detach()) for m in masters]
        _with_grads(plain)
        adamw = torch.optim.AdamW(plain, lr=1e-3, weight_decay=0.01, fused=True)

        def adamw_then_requantize(adamw=adamw, params=params, plain=plain) -> None:
            adamw.step()
            with torch.no_grad():
                for p, master in zip(params, plain, strict=True):
                    if isinstance(p, qt.QuantizedTensor):
                        p.quantizer.quantize_(master, p)

        name = "torch AdamW(fused=True)" + ("" if kind == "fp32" else " + requantize")
        times[name] = _median_ms(adamw_then_requantize, min_run_time)
        cases[kind] = {
            "params": sum(p.numel() for p in params),
            "bytes per param": floor_bytes(params) / sum(p.numel() for p in params),
            **times,
        }
        del adamw, plain, masters, params
        torch.cuda.empty_cache()
    cases["bandwidth GB/s"] = {"in-place stream": bandwidth / 1e9}
    return cases


def stream_bandwidth(device: torch.device, min_run_time: float, numel: int = 1 << 28) -> float:
    """Bytes per second of an in-place fp32 pass (read and write 4 B per element), measured now."""
    x = torch.ones(numel, device=device)
    seconds = _median_ms(lambda: x.mul_(1.0), min_run_time) / 1e3
    return 8 * numel / seconds


def print_mix(report: dict) -> None:
    print(f"FusedAdam at ~1e9 parameters (mix_shapes), {report['device']}, torch {torch.__version__}; floor = least "
          f"bytes per step at {report['cases']['bandwidth GB/s']['in-place stream']:.0f} GB/s (in-place stream)")  # fmt: skip
    print(f"{'kind':<10} {'B/param':>8} {'optimizer':<42} {'ms/step':>9} {'% floor':>8} {'x baseline':>10}")
    for kind, times in report["cases"].items():
        if kind == "bandwidth GB/s":
            continue
        baseline = times[next(name for name in times if name.startswith("torch"))]
        for name, ms in times.items():
            if name in ("params", "bytes per param"):
                continue
            print(f"{kind:<10} {times['bytes per param']:8.2f} {name:<42} {ms:9.2f} "
                  f"{100 * times['memory floor'] / ms:7.0f}% {baseline / ms:10.2f}")  # fmt: skip


def memory_floor_ms(params: int, device: torch.device, min_run_time: float) -> float:
    """The least time an fp32 Adam step can take here: 28 B per parameter (read gradient; read and
    write parameter and both moments) at the in-place streaming bandwidth measured now."""
    x = torch.ones(params, device=device)
    seconds = _median_ms(lambda: x.mul_(1.0), min_run_time) / 1e3
    bandwidth = 8 * params / seconds  # an in-place pass reads and writes 4 B per element
    return 28 * params / bandwidth * 1e3


def run(
    out: pathlib.Path, *, tensors: int, numel: int, min_run_time: float, device: torch.device, preset: str | None = None
) -> dict:
    if preset == "1e9":
        report = {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} cpu",
            "preset": preset,
            "cases": mix_cases(device, min_run_time),
        }
        print_mix(report)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_optim_1e9.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out / 'bench_optim_1e9.json'}")
        return report
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
    if device.type == "cuda":  # CUDA graphs: the step without its host side
        for kind in ("fp32", "fp8", "mxfp8"):
            report["cases"][f"{kind} graph"] = graph_cases(kind, tensors, numel, device, min_run_time)
            torch.cuda.empty_cache()

    print(f"FusedAdam vs torch AdamW: {params:.0e} params in {tensors} tensors, {report['device']}, "
          f"torch {torch.__version__}, {report['threads']} threads")  # fmt: skip
    print(f"{'params':<12} {'optimizer':<56} {'ms/step':>9} {'x torch':>8}")
    for kind, times in report["cases"].items():
        baseline = times[next(name for name in times if name.startswith("torch"))]
        for name, ms in times.items():
            if isinstance(ms, str):  # a graph row that failed its check
                print(f"{kind:<12} {name:<56} {ms}")
                continue
            ratio = f"{baseline / ms:8.2f}" if isinstance(baseline, float) else f"{'-':>8}"
            print(f"{kind:<12} {name:<56} {ms:9.2f} {ratio}")
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
    parser.add_argument("--preset", choices=["1e9"], help="1e9: the DESIGN section 9 case (mix_cases) instead")
    args = parser.parse_args(argv)
    run(
        args.out,
        tensors=args.tensors,
        numel=args.numel,
        min_run_time=args.min_run_time,
        device=torch.device(args.device),
        preset=args.preset,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`python benchmarks/optim.py`: FusedAdam against torch's fastest AdamW, side by side in one run.

Cases, each over `--tensors` parameters of `--numel` elements (default 10 x 1e6 = 1e7):
- fp32 parameters: FusedAdam on the fastest quant_core backend and on the reference (checking gradients for NaN/Inf itself,
  and given `found_inf` as under GradScaler) vs torch.optim.AdamW(fused=True), which checks nothing;
- quantized parameters (per-tensor FP8, MXFP8): FusedAdam (update + amax in one pass, then the
  requantize) vs torch.optim.AdamW(fused=True) on the fp32 masters followed by a separate
  requantize of each parameter (what a user without FusedAdam would run).
These eager rows are timed in `--rounds` interleaved rounds ([Note: interleaved rounds]): each row's
ms/step is its median over rounds, and `x torch` is the median over rounds of the per-round ratio
with its min-max spread, "1.16 (0.98-1.31)".
`--preset 1e9` runs instead the ~1e9-parameter case of docs/benchmarks.md (`mix_cases`): ~1e9 parameters in the weight
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
Prints a table and writes `<out>/bench_optim.json` (device, torch version, threads, date; the eager
rows' ms of every round under "ms per round", to recompute from).
`nox -s bench` runs it after benchmarks/kernel_speed.py.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import pathlib
import platform
import statistics
import time
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


# [Note: interleaved rounds]
# At 1e7 parameters a step takes ~0.1-2 ms, mostly host (Python) time, and on the shared GPU VM the
# host's speed drifts between and within calls: fp8 FusedAdam vs AdamW + requantize, three calls on
# one H100 with no code change, 1.24 vs 1.17, 1.54 vs 1.91, 2.22 vs 1.39 ms. Timed one after the
# other, each optimizer gets its own stretch of that drift and the ratio measures the drift. So the
# eager rows of a case are timed in rounds: each round times every optimizer once in turn, in the
# reverse order of the round before (every pair swaps who goes first, so a trend favours neither),
# and a ratio is taken within a round, where both sides saw about the same host; the table gives
# the median over rounds and the min-max spread, and the JSON every round's ms.
# A round times blocks of a fixed number of steps, set once per optimizer after its warm-up step so
# that a block lasts ~1/10 of the optimizer's time in a round (min_run_time / rounds): every round
# then times the same work and spends nothing re-estimating (blocked_autorange would, each call: up
# to 1 + 10 + 100 steps at ~1 ms), and the median of a round's ~10 blocks drops one a host hiccup
# hit. time.perf_counter reads each block, fenced on CUDA by torch.cuda.synchronize(): the steps
# are queued asynchronously, so the fence charges a block with its device work and keeps the
# previous optimizer's queued work out of it; a block lasts ~20 ms at the defaults (1 s over 5
# rounds), so the fences (~10 us each) cost ~0.1%.


def _block_seconds(step: Callable[[], object], number: int, device: torch.device) -> float:
    """Seconds for `number` calls of `step`, fenced by a synchronize on CUDA ([Note: interleaved rounds])."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(number):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def interleaved_ms(
    steps: dict[str, Callable[[], object]], *, rounds: int, min_run_time: float, device: torch.device
) -> dict[str, list[float]]:
    """ms per step of each of `steps` in each round, the steps timed in turn: [Note: interleaved rounds].

    Args:
        steps: the optimizer steps of one case by row name; each is called once first as a warm-up.
        rounds: how many rounds; round r times the steps in their order (r even) or reversed (r odd).
        min_run_time: seconds of timing per step over all rounds (at least one block per round).
    Returns:
        Per row name, one ms per round (the median over that round's blocks), in round order.
    """
    share = min_run_time / rounds
    numbers = {}
    for name, step in steps.items():
        step()  # warm up: states are created, pages faulted in
        once = _block_seconds(step, 1, device)
        numbers[name] = max(1, int(share / 10 / max(once, 1e-9)))
    ms: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for _ in range(rounds):
        for name in order:
            blocks, spent = [], 0.0
            while not blocks or spent < share:
                seconds = _block_seconds(steps[name], numbers[name], device)
                blocks.append(seconds / numbers[name])
                spent += seconds
            ms[name].append(statistics.median(blocks) * 1e3)
        order.reverse()
    return ms


def ratio_spread(baseline_ms: list[float], ms: list[float]) -> dict[str, float]:
    """Median, min and max over rounds of `baseline_ms / ms` within each round (> 1: faster than the baseline)."""
    ratios = [baseline / mine for baseline, mine in zip(baseline_ms, ms, strict=True)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def _fused_step(optimizer: FusedAdam, found_inf: torch.Tensor | None, forced_backend: str | None) -> Callable[[], None]:
    """`optimizer.step(found_inf=found_inf)`, with every quant_core op on `forced_backend` when one is given."""

    def step() -> None:
        with contextlib.nullcontext() if forced_backend is None else quant_core.use_backend(forced_backend):
            optimizer.step(found_inf=found_inf)

    return step


def _with_grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    for p in params:
        p.grad = torch.randn(p.shape, device=p.device) * 1e-3
    return params


def _fp32_params(tensors: int, numel: int, device: torch.device) -> list[torch.Tensor]:
    return _with_grads([torch.nn.Parameter(torch.randn(numel, device=device)) for _ in range(tensors)])


def fp32_cases(
    tensors: int, numel: int, device: torch.device, min_run_time: float, rounds: int
) -> dict[str, list[float]]:
    """ms per step of each optimizer over fp32 parameters in each round ([Note: interleaved rounds])."""
    steps = {}
    no_inf = torch.zeros((), device=device)
    # FusedAdam steps every tensor with adam_step (Triton on CUDA, C++ on CPU).
    fastest = quant_core.selected_backend("adam_step", device)
    for backend in dict.fromkeys((fastest, "reference")):
        optimizer = FusedAdam(_fp32_params(tensors, numel, device), lr=1e-3, weight_decay=0.01)
        # The fastest backend per op (what users get), or every op on the reference; with a
        # GradScaler-style verdict (found_inf given) the gradients are not read a second time.
        forced_backend = None if backend == fastest else backend
        steps[f"FusedAdam ({backend})"] = _fused_step(optimizer, None, forced_backend)
        steps[f"FusedAdam ({backend}), found_inf given"] = _fused_step(optimizer, no_inf, forced_backend)
    torch_adamw = torch.optim.AdamW(_fp32_params(tensors, numel, device), lr=1e-3, weight_decay=0.01, fused=True)
    steps["torch AdamW(fused=True)"] = torch_adamw.step
    return interleaved_ms(steps, rounds=rounds, min_run_time=min_run_time, device=device)


def requantize_cases(
    recipe_name: str, tensors: int, numel: int, device: torch.device, min_run_time: float, rounds: int
) -> dict[str, list[float]]:
    """ms per step with quantized parameters (rows of 1024) in each round ([Note: interleaved
    rounds]): FusedAdam vs AdamW + requantize."""
    steps = requantize_steps(recipe_name, tensors, numel, device)
    return interleaved_ms(steps, rounds=rounds, min_run_time=min_run_time, device=device)


def requantize_steps(recipe_name: str, tensors: int, numel: int, device: torch.device) -> dict[str, Callable[[], None]]:
    """The two steps `requantize_cases` compares, by row name: FusedAdam over `tensors` quantized
    parameters of `numel` elements (rows of 1024), and AdamW(fused) over fp32 masters + a requantize."""
    shape = (numel // 1024, 1024)
    quantizer = qt.recipe_from_name(recipe_name).quantizer("weight")
    params = _with_grads(
        [qt.nn.quantized_parameter(torch.randn(shape, device=device), quantizer) for _ in range(tensors)]
    )
    fused = FusedAdam(params, lr=1e-3, weight_decay=0.01)

    masters = _with_grads([torch.nn.Parameter(p.dequantize(torch.float32)) for p in params])
    adamw = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, fused=True)

    def adamw_then_requantize() -> None:
        adamw.step()
        with torch.no_grad():
            for p, master in zip(params, masters, strict=True):
                p.quantizer.quantize_(master, p)

    return {
        "FusedAdam (update + requantize)": fused.step,
        "torch AdamW(fused=True) + requantize": adamw_then_requantize,
    }


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


def mix_params(kind: str, device: torch.device) -> list[torch.nn.Parameter]:
    """Parameters of `mix_shapes()` with gradients: fp32, or with the quantizable ones quantized by
    recipe `kind`'s weight quantizer."""
    quantizer = None if kind == "fp32" else qt.recipe_from_name(kind).quantizer("weight")
    params = []
    for shape, quantizable in mix_shapes():
        value = torch.randn(shape, device=device)
        # No high-precision init value kept (it would hold a second fp32 copy): masters start dequantized.
        weight = quantizer.quantize(value) if quantizer is not None and quantizable else value
        params.append(torch.nn.Parameter(weight))
        del value
    return _with_grads(params)


def mix_cases(device: torch.device, min_run_time: float) -> dict[str, dict[str, float]]:
    """ms per step over `mix_shapes()` for fp32 and each quantized format: FusedAdam vs torch
    AdamW(fused=True) (+ a separate requantize of each quantized weight), and the memory floor."""
    bandwidth = stream_bandwidth(device, min_run_time)
    cases: dict[str, dict[str, float]] = {}
    for kind in ("fp32", "fp8", "mxfp8", "fp8-block", "nvfp4"):
        params = mix_params(kind, device)
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
    return 28 * params / stream_bandwidth(device, min_run_time, numel=params) * 1e3


def run(
    out: pathlib.Path,
    *,
    tensors: int,
    numel: int,
    min_run_time: float,
    device: torch.device,
    preset: str | None = None,
    rounds: int = 5,
) -> dict:
    """Times the cases, prints the table and writes `<out>/bench_optim.json` (`_1e9` for that preset).

    Args:
        min_run_time: seconds of timing per row; an eager row's are split over its `rounds`.
        rounds: interleaved rounds of the eager rows ([Note: interleaved rounds]); not used by the 1e9 preset.
    """
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
    if rounds < 1:
        raise ValueError(f"--rounds must be at least 1 (each round times every optimizer once); got {rounds}")
    params = tensors * numel
    ms_per_round = {"fp32": fp32_cases(tensors, numel, device, min_run_time, rounds)}
    for recipe_name in ("fp8", "mxfp8"):
        ms_per_round[recipe_name] = requantize_cases(recipe_name, tensors, numel, device, min_run_time, rounds)
    report: dict = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"{platform.machine()} cpu",
        "params": params,
        "tensors": tensors,
        "rounds": rounds,
        # Eager rows: the median over rounds; graph rows: blocked_autorange's median.
        "cases": {
            kind: {name: statistics.median(ms) for name, ms in rows.items()} for kind, rows in ms_per_round.items()
        },
        "x torch": {kind: _x_torch(rows) for kind, rows in ms_per_round.items()},
        "ms per round": ms_per_round,
    }
    report["cases"]["fp32"]["memory floor (28 B/param, in-place stream)"] = memory_floor_ms(
        params, device, min_run_time
    )
    if device.type == "cuda":  # CUDA graphs: the step without its host side
        for kind in ("fp32", "fp8", "mxfp8"):
            report["cases"][f"{kind} graph"] = graph_cases(kind, tensors, numel, device, min_run_time)
            torch.cuda.empty_cache()

    print(f"FusedAdam vs torch AdamW: {params:.0e} params in {tensors} tensors, {report['device']}, "
          f"torch {torch.__version__}, {report['threads']} threads; eager rows: median of {rounds} "
          f"interleaved rounds, x torch (min-max over rounds)")  # fmt: skip
    print(f"{'params':<12} {'optimizer':<56} {'ms/step':>9} {'x torch':>8}")
    for kind, times in report["cases"].items():
        baseline = times[next(name for name in times if name.startswith("torch"))]
        spreads = report["x torch"].get(kind, {})
        for name, ms in times.items():
            if isinstance(ms, str):  # a graph row that failed its check
                print(f"{kind:<12} {name:<56} {ms}")
                continue
            if name in spreads:
                spread = spreads[name]
                ratio = f"{spread['median']:8.2f} ({spread['min']:.2f}-{spread['max']:.2f})"
            else:  # the baseline itself, the memory floor, a graph row
                ratio = f"{baseline / ms:8.2f}" if isinstance(baseline, float) else f"{'-':>8}"
            print(f"{kind:<12} {name:<56} {ms:9.2f} {ratio}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_optim.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out / 'bench_optim.json'}")
    return report


def _x_torch(ms_per_round: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """`ratio_spread` of every row of a case against its torch row (the first named "torch ...")."""
    baseline = next(name for name in ms_per_round if name.startswith("torch"))
    return {name: ratio_spread(ms_per_round[baseline], ms) for name, ms in ms_per_round.items() if name != baseline}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="optim.py", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    parser.add_argument("--tensors", type=int, default=10)
    parser.add_argument("--numel", type=int, default=1_048_576, help="elements per tensor (a multiple of 1024)")
    parser.add_argument(
        "--min-run-time", type=float, default=1.0, help="seconds of timing per row (eager rows: over all rounds)"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds of the eager rows (ratios per round; not --preset)"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--preset", choices=["1e9"], help="1e9: the docs/benchmarks.md case (mix_cases) instead")
    args = parser.parse_args(argv)
    run(
        args.out,
        tensors=args.tensors,
        numel=args.numel,
        min_run_time=args.min_run_time,
        device=torch.device(args.device),
        preset=args.preset,
        rounds=args.rounds,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

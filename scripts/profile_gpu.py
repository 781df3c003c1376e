"""Profiles for the GPU machine (run from scripts/gpu-suite.sh's environment).

    python3 scripts/profile_gpu.py host [LAYER ...]    # cProfile of a Linear fwd+bwd, bf16 256^3
    python3 scripts/profile_gpu.py ops [LAYER ...]     # torch.profiler: ops and launches per fwd+bwd
    python3 scripts/profile_gpu.py parts               # host us of each piece of an fp8 fwd+bwd, timed alone
    python3 scripts/profile_gpu.py accumulation        # fp8 forward GEMMs with and without fast accumulation
    python3 scripts/profile_gpu.py weight-cache [RECIPE ...]  # host us per 4-micro-batch step, with and without qt.nn.weight_cache
    python3 scripts/profile_gpu.py decode [RECIPE ...]  # ms per generated token, with and without qt.nn.weight_cache
    python3 scripts/profile_gpu.py kernels [CASE ...]  # each quantize twice at bf16 8192^2 (under ncu)
    python3 scripts/profile_gpu.py e2e [--config NAME] [RUN ...]  # GPU time per e2e training step, by kernel (PROFILE_HOST=1: and host ops; MICRO_BATCHES=N [WEIGHT_CACHE=1])
    python3 scripts/profile_gpu.py memory [--config NAME] [RUN ...]  # peak memory per phase of an e2e step
    python3 scripts/profile_gpu.py optim [KIND ...]    # GPU time per FusedAdam step at ~1e9 params, by kernel
    python3 scripts/profile_gpu.py optim-1e7 [KIND ...]  # host time of FusedAdam vs AdamW + requantize at 1e7

A LAYER is nn.Linear, a recipe name or torchao (Float8Linear, tensorwise), NAME:compiled under
torch.compile. `host` prints where the host time of one forward + backward goes (the functions
with the most own time, and the count of calls per step); `e2e` trains benchmarks/e2e.py's default model with each run (default: bf16:eager,
fp8:hp:compiled, torchao-tensorwise:compiled) and prints, per step, the GPU time of the kernels
grouped (GEMMs, attention, quantize/cast, optimizer, other elementwise) and the top kernels;
`kernels` launches each quantize kernel twice (a warm-up,
then the one ncu should profile: `ncu --launch-skip` per kernel name, see gpu-suite.sh).
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import os
import pathlib
import pstats
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))  # its modules, by name

import torch

import quant_core
import quant_tensors as qt

SIZE = 256


def _layer(name: str) -> torch.nn.Module:
    """A Linear by name: nn.Linear, a recipe's qt.nn.Linear, or torchao (Float8Linear,
    tensorwise); NAME:compiled is it under torch.compile."""
    kind, _, mode = name.partition(":")
    layer: torch.nn.Module = torch.nn.Linear(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    if kind == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name("tensorwise")
        layer = convert_to_float8_training(torch.nn.Sequential(layer), config=config)[0]
    elif kind != "nn.Linear":
        layer = qt.convert(torch.nn.Sequential(layer), qt.recipe_from_name(kind))[0]
    return torch.compile(layer) if mode == "compiled" else layer


def _warm_layers(recipes: list[str]) -> Iterator[tuple[str, Callable[[], None]]]:
    """(name, step) per recipe, each layer warmed up: step() runs one fwd+bwd at SIZE^3."""
    x = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    for name in recipes:
        layer = _layer(name)

        def step(layer=layer) -> None:
            # A new input object each step, as in training (the same one would hit qt.nn's
            # sibling cache and skip the input's quantize).
            layer(x.detach().requires_grad_(True)).backward(dy)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        yield name, step


def host(recipes: list[str]) -> None:
    steps = 200
    for name, step in _warm_layers(recipes):
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profiler)
        calls = sum(entry[1] for entry in stats.stats.values()) / steps  # type: ignore[attr-defined]
        print(f"\n=== {name}: {stats.total_tt / steps * 1e6:.0f} us/step under cProfile, {calls:.0f} calls/step")  # type: ignore[attr-defined]
        print(
            "own time by where the code lives (us/step): "
            + ", ".join(f"{k} {v / steps * 1e6:.0f}" for k, v in _by_package(stats))
        )
        stats.sort_stats("tottime").print_stats(28)


def _by_package(stats: pstats.Stats) -> list[tuple[str, float]]:
    """Own (tottime) seconds summed by where the function lives, largest first: our three
    packages, Triton, torch's Python, C functions (torch ops, launches: "C"), the rest."""
    totals: dict[str, float] = {}
    for (path, _, _), (_, _, own, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = next((p for p in ("quant_core", "quant_tensors", "quant_fsdp", "triton", "torch") if p in path), None)
        key = where or ("C" if path == "~" else "other")
        totals[key] = totals.get(key, 0.0) + own
    return sorted(totals.items(), key=lambda item: -item[1])


def ops(recipes: list[str]) -> None:
    """Per fwd+bwd: each op's calls and host (self CPU) time, and the CUDA kernels launched."""
    steps = 20
    for name, step in _warm_layers(recipes):
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as profile:
            for _ in range(steps):
                step()
            torch.cuda.synchronize()
        events = profile.key_averages()
        launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx"))
        print(f"\n=== {name}: {launches / steps:.0f} kernel launches per fwd+bwd")
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
        for e in rows:
            print(f"{e.key[:60]:60s} {e.count / steps:6.1f} calls {e.self_cpu_time_total / steps:8.1f} us self")


def parts() -> None:
    """Host time of each piece of a per-tensor FP8 forward + backward, each timed alone in a loop."""
    x = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    q = quant_core.quantize_fp8(x, rowwise=True, columnwise=True)
    quantizer = qt.recipe_from_name("fp8").quantizer("input")
    qx = quantizer.quantize(x, rowwise=True, columnwise=True)
    one = torch.ones((), device="cuda")
    xg = x.clone().requires_grad_(True)
    plain, fp8 = _layer("nn.Linear"), _layer("fp8")
    pieces = {
        "torch.empty(())": lambda: torch.empty((), device="cuda"),
        "torch.empty(256, 256)": lambda: torch.empty(SIZE, SIZE, device="cuda", dtype=torch.float8_e4m3fn),
        "x.abs() (one aten kernel)": lambda: x.abs(),
        "torch._scaled_mm": lambda: torch._scaled_mm(
            q.rowwise_data, q.columnwise_data.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
        ),
        "quant_core.amax": lambda: quant_core.amax(x),
        "quant_core.quantize_fp8 rowwise": lambda: quant_core.quantize_fp8(x),
        "quant_core.quantize_fp8 both": lambda: quant_core.quantize_fp8(x, rowwise=True, columnwise=True),
        "quantizer.quantize both": lambda: quantizer.quantize(x, rowwise=True, columnwise=True),
        "qt.ops.scaled_mm": lambda: qt.ops.scaled_mm(qx, qx, torch.bfloat16),
        "nn.Linear fwd+bwd": lambda: plain(xg).backward(x),
        "qt.nn.Linear fp8 fwd": lambda: fp8(xg),
        "qt.nn.Linear fp8 fwd+bwd": lambda: fp8(xg).backward(x),
    }
    for name, piece in pieces.items():
        for _ in range(20):
            piece()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                piece()
            samples.append((time.perf_counter() - start) / 200 * 1e6)
            torch.cuda.synchronize()
        print(f"{name:40s} {sorted(samples)[2]:8.1f} us host")


def kernels(names: list[str]) -> None:
    """Each quantize named (default: all) twice at bf16 8192^2."""
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    amax = quant_core.amax(x)
    amaxes = quant_core.hadamard_amaxes(x, seed=1)
    tiled = quant_core.quantize_nvfp4(x, (16, 16), global_amax=amax)
    rowwise = quant_core.quantize_nvfp4(x, global_amax=amax)
    cases = {
        "mxfp8 both": lambda: quant_core.quantize_mxfp8(x, rowwise=True, columnwise=True),
        "fp8-block 1x128 both": lambda: quant_core.quantize_fp8_blockwise(x, rowwise=True, columnwise=True),
        "fp8-block 1x128 rowwise": lambda: quant_core.quantize_fp8_blockwise(x),
        "nvfp4 1x16 both": lambda: quant_core.quantize_nvfp4(x, global_amax=amax, rowwise=True, columnwise=True),
        "nvfp4 1x16 both sr": lambda: quant_core.quantize_nvfp4(
            x, global_amax=amax, rowwise=True, columnwise=True, stochastic_rounding=True
        ),
        "nvfp4 16x16": lambda: quant_core.quantize_nvfp4(x, (16, 16), global_amax=amax, rowwise=True, columnwise=True),
        "nvfp4 1x16 both rht": lambda: quant_core.quantize_nvfp4(
            x, global_amax=amaxes[0], columnwise_amax=amaxes[1], columnwise=True, hadamard_seed=1
        ),
        "hadamard amaxes": lambda: quant_core.hadamard_amaxes(x, seed=1),
        "nvfp4 16x16 rowwise": lambda: quant_core.quantize_nvfp4(x, (16, 16), global_amax=amax),
        "nvfp4 16x16 transpose": lambda: quant_core.transpose_nvfp4(tiled.rowwise_data, tiled.rowwise_scale_inv),
        "nvfp4 dequantize": lambda: quant_core.dequantize_nvfp4(
            rowwise.rowwise_data, rowwise.rowwise_scale_inv, amax, dtype=torch.bfloat16
        ),
    }
    unknown = set(names) - set(cases)
    if unknown:
        raise SystemExit(f"unknown kernel cases {sorted(unknown)}; choose from {sorted(cases)}")
    for name, case in cases.items():
        if names and name not in names:
            continue
        for _ in range(2):
            case()
        torch.cuda.synchronize()
        print("ran", name)


def _kernel_group(name: str) -> str:
    # aten's strided elementwise kernels are named "gpu_kernel_impl_nocast": not a cast
    lowered = name.lower().replace("impl_nocast", "impl")
    if any(k in lowered for k in ("gemm", "sm90_xmma", "cutlass", "nvjet", "matmul", "_scaled_mm")):
        return "GEMM"
    if "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if "adam" in lowered or "multi_tensor" in lowered:
        return "optimizer"
    if any(k in lowered for k in ("fp8", "float8", "quantize", "amax", "cast", "scale", "transpose")):
        return "quantize/cast"
    return "other"


def e2e(runs: list[str], config: str = "default") -> None:
    """GPU time of one training step of the e2e model (`config`: a benchmarks/e2e.py
    `--config` name), by kernel group and top kernels, per run."""
    from _e2e import E2EOptions, build_run, free_memory, markov_batches, select_runs
    from _e2e_model import resolve_model_source

    # MICRO_BATCHES=N [WEIGHT_CACHE=1]: the bench's --micro-batches N [--weight-cache]
    micro_batches, weight_cache = int(os.environ.get("MICRO_BATCHES", "1")), bool(os.environ.get("WEIGHT_CACHE"))
    options = E2EOptions(device="cuda", config=config, micro_batches=micro_batches, weight_cache=weight_cache)
    batches = markov_batches(options.decoder, 8).cuda()
    for spec in select_runs(",".join(runs)):
        _, _, step = build_run(spec, options, torch.device("cuda"), resolve_model_source("auto"))
        for i in range(4):
            step(batches[i, :, :-1], batches[i, :, 1:])
        torch.cuda.synchronize()
        steps = 3
        activities = [torch.profiler.ProfilerActivity.CUDA]
        if os.environ.get("PROFILE_HOST"):
            activities.append(torch.profiler.ProfilerActivity.CPU)
        wall = time.perf_counter()
        with torch.profiler.profile(activities=activities) as profile:
            for i in range(4, 4 + steps):
                step(batches[i, :, :-1], batches[i, :, 1:])
            torch.cuda.synchronize()
        wall = (time.perf_counter() - wall) / steps
        events = profile.key_averages()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        groups: dict[str, float] = {}
        for e in kernels:
            groups[_kernel_group(e.key)] = groups.get(_kernel_group(e.key), 0.0) + e.self_device_time_total / steps
        total = sum(groups.values())
        print(
            f"\n=== {spec.name}: {total / 1e3:.1f} ms of kernels per step, "
            f"{sum(e.count for e in kernels) / steps:.0f} kernels"
        )
        for group, us in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"  {group:14s} {us / 1e3:8.2f} ms {us / total:6.1%}")
        ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)
        for e in ranked[:25]:
            print(f"  {e.count / steps:5.0f}x {e.self_device_time_total / steps / 1e3:7.2f} ms  {e.key[:110]}")
        if os.environ.get("PROFILE_HOST"):
            _host_ops(events, steps, wall)
        if os.environ.get("OUT"):  # every kernel, for diffing two runs offline
            path = os.path.join(os.environ["OUT"], f"kernels_{spec.name.replace(':', '_')}.tsv")
            with open(path, "w") as out:
                for e in ranked:
                    group = _kernel_group(e.key)
                    out.write(f"{e.count / steps:.0f}\t{e.self_device_time_total / steps:.1f}\t{group}\t{e.key}\n")
        del step
        free_memory(torch.device("cuda"))


def _host_ops(events: Any, steps: int, wall: float) -> None:
    """PROFILE_HOST=1: the step's host side, per step: wall time under the profiler, the CPU ops'
    count and self time (cudaLaunchKernel, allocator calls and syncs show up by name), top 30."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    calls = sum(e.count for e in cpu) / steps
    print(f"  host: {wall * 1e3:.1f} ms wall per step under the profiler, {calls:.0f} CPU op calls per step")
    for e in sorted(cpu, key=lambda e: -e.self_cpu_time_total)[:30]:
        print(f"  {e.count / steps:7.0f}x {e.self_cpu_time_total / steps / 1e3:7.2f} ms self  {e.key[:90]}")


def weight_cache(recipes: list[str]) -> None:
    """Host us per step of MICRO micro-batches through one Linear (fwd+bwd each, bf16 SIZE^3: the
    GPU idles, so a step costs its host time), with and without `qt.nn.weight_cache` around them;
    the two alternate round by round (the VM's host speed drifts), medians of 7 rounds of 100 steps."""
    micro = 4
    x = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(SIZE, SIZE, device="cuda", dtype=torch.bfloat16)
    for name in recipes:
        layer = _layer(name)

        def step(cached: bool, layer=layer) -> None:
            with qt.nn.weight_cache(layer) if cached else contextlib.nullcontext():
                for _ in range(micro):
                    layer(x.detach().requires_grad_(True)).backward(dy)
            with torch.no_grad():
                layer.weight.add_(0.0)  # the optimizer step: a new weight version

        samples: dict[bool, list[float]] = {False: [], True: []}
        for cached in (False, True):
            for _ in range(5):
                step(cached)
        for _ in range(7):
            for cached in (False, True):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(100):
                    step(cached)
                samples[cached].append((time.perf_counter() - start) / 100 * 1e6)
        torch.cuda.synchronize()
        plain, cached_us = (sorted(samples[c])[3] for c in (False, True))
        print(
            f"{name}: {micro} micro-batches per step, host us per step {plain:.0f} -> {cached_us:.0f} with "
            f"weight_cache ({cached_us / plain:.2f}x); per micro-batch {plain / micro:.0f} -> {cached_us / micro:.0f}"
        )


def decode(recipes: list[str]) -> None:
    """Greedy decoding with the e2e default model (transformers' LlamaForCausalLM, key/value cache
    on, batch 1, a 128-token prompt, 64 new tokens): ms per new token for bf16 and each recipe with
    high-precision weights, without and with `qt.nn.weight_cache` around `generate` (alternating,
    median of 3 rounds). Each decoding step is host-bound: every Linear quantizes its weight again
    unless the block holds it."""
    from _e2e import recipe_of
    from _e2e_model import CONFIGS, build_decoder

    device = torch.device("cuda")
    prompt = torch.randint(0, CONFIGS["default"].vocab_size, (1, 128), device=device)
    new_tokens = 64
    for name in ["bf16", *recipes]:
        torch.manual_seed(0)
        model = build_decoder(CONFIGS["default"], device, "transformers").eval()
        model.config.use_cache = True
        if name != "bf16":
            qt.convert(model, recipe_of(name), module_filter_fn=lambda _, fqn: fqn != "lm_head")

        def generate(cached: bool, model=model) -> float:
            with qt.nn.weight_cache(model) if cached else contextlib.nullcontext(), torch.no_grad():
                torch.cuda.synchronize()
                start = time.perf_counter()
                model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
                torch.cuda.synchronize()
            return (time.perf_counter() - start) / new_tokens * 1e3

        generate(False), generate(True)  # warm-up
        samples: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(3):
            for cached in (False, True):
                samples[cached].append(generate(cached))
        plain, cached_ms = (sorted(samples[c])[1] for c in (False, True))
        print(
            f"{name}: {plain:.2f} ms per token, with weight_cache {cached_ms:.2f} ({cached_ms / plain:.2f}x)",
            flush=True,
        )
        del model
        torch.cuda.empty_cache()


def accumulation() -> None:
    """The forward GEMMs of the e2e models (tokens 8192) with and without fast accumulation ([Note:
    fast accumulation] in quant_tensors.ops): CUDA-event time of each and the relative L2 error
    against the fp32 product of the same FP8 operands (fp32 outputs for the error, bf16 for the time)."""
    recipe = qt.Float8CurrentScaling()
    generator = torch.Generator(device="cuda").manual_seed(0)
    print(
        f"{'M x N x K':>20s} {'promoted us':>12s} {'fast us':>9s} {'fast/promoted':>14s} {'error promoted':>15s} {'error fast':>11s}"
    )
    for n, k in ((2048, 2048), (8192, 2048), (2048, 8192), (4096, 4096), (14336, 4096), (4096, 14336)):
        x = recipe.quantizer("input").quantize(torch.randn(8192, k, device="cuda", generator=generator).bfloat16())
        w = recipe.quantizer("weight").quantize(
            (torch.randn(n, k, device="cuda", generator=generator) * 0.02).bfloat16()
        )
        exact = torch.matmul(qt.ops.operand_values(x, "rowwise"), qt.ops.operand_values(w, "rowwise").t())
        row = []
        for fast in (False, True):
            product = qt.ops.scaled_mm(x, w, torch.float32, fast_accumulation=fast)  # no bf16 rounding in the error
            error = float((product - exact).norm() / exact.norm())
            gemm = functools.partial(qt.ops.scaled_mm, x, w, torch.bfloat16, fast_accumulation=fast)
            for _ in range(3):
                gemm()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                gemm()
            end.record()
            end.synchronize()
            row.append((start.elapsed_time(end) / 50 * 1e3, error))
        (slow_us, slow_error), (fast_us, fast_error) = row
        print(
            f"{f'8192 x {n} x {k}':>20s} {slow_us:12.1f} {fast_us:9.1f} {fast_us / slow_us:14.3f} {slow_error:15.2e} {fast_error:11.2e}"
        )


def _saved_bytes(t: torch.Tensor) -> tuple[str, int]:
    """(kind, bytes) of a tensor autograd saves: QuantizedTensors by their buffers."""
    if isinstance(t, qt.QuantizedTensor):
        inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]
        return type(t).__name__, sum(b.numel() * b.element_size() for b in inner)
    return str(t.dtype), t.untyped_storage().nbytes() if t.numel() else 0


def _counting(saved: dict[str, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """A pack hook that adds each saved tensor's bytes to saved[kind], each storage once (a
    QuantizedTensor's storage is its first data buffer's: the columnwise-only wrappers that sibling
    layers save of one shared input count once)."""
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            kind, size = _saved_bytes(t)
            saved[kind] = saved.get(kind, 0) + size
        return t

    return pack


def memory(runs: list[str], config: str = "default") -> None:
    """Per run (hp weights or bf16): GiB allocated before the step, peak in the forward, backward and
    optimizer step, and what the forward saves for backward by kind (storages counted once)."""
    from _e2e import E2EOptions, build_run, free_memory, markov_batches, select_runs
    from _e2e_model import resolve_model_source

    options = E2EOptions(device="cuda", config=config)
    batches = markov_batches(options.decoder, 4).cuda()
    gib = 2.0**30
    for spec in select_runs(",".join(runs)):
        model, optimizer, step = build_run(spec, options, torch.device("cuda"), resolve_model_source("auto"))
        for i in range(3):
            step(batches[i, :, :-1], batches[i, :, 1:])
        torch.cuda.synchronize()
        inputs, targets = batches[3, :, :-1], batches[3, :, 1:]
        saved: dict[str, int] = {}
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autograd.graph.saved_tensors_hooks(_counting(saved), lambda t: t):
            logits = model(inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        forward_peak, after_forward = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        del logits, loss
        backward_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        optimizer.step()
        optimizer_peak = torch.cuda.max_memory_allocated()
        optimizer.zero_grad(set_to_none=True)
        print(
            f"\n=== {spec.name} ({config}): start {start / gib:.2f} GiB, forward peak {forward_peak / gib:.2f} "
            f"(after {after_forward / gib:.2f}), backward peak {backward_peak / gib:.2f}, optimizer peak "
            f"{optimizer_peak / gib:.2f}"
        )
        for kind, size in sorted(saved.items(), key=lambda kv: -kv[1]):
            print(f"  saved for backward: {kind:22s} {size / gib:6.2f} GiB")
        del model, optimizer, step
        free_memory(torch.device("cuda"))


def optim(kinds: list[str]) -> None:
    """GPU time of one FusedAdam step over `mix_shapes()` of benchmarks/optim.py (~1e9 parameters), by kernel."""
    from optim import floor_bytes, mix_params, stream_bandwidth

    from quant_optim import FusedAdam

    bandwidth = stream_bandwidth(torch.device("cuda"), 0.5)
    for kind in kinds:
        params = mix_params(kind, torch.device("cuda"))
        optimizer = FusedAdam(params, lr=1e-3, weight_decay=0.01)
        for _ in range(3):
            optimizer.step()
        torch.cuda.synchronize()
        steps = 3
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            for _ in range(steps):
                optimizer.step()
            torch.cuda.synchronize()
        kernels = [e for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(e.self_device_time_total for e in kernels) / steps
        floor_us = floor_bytes(params) / bandwidth * 1e6
        wall, host = [], []
        for _ in range(5):
            start = time.perf_counter()
            optimizer.step()
            host.append(time.perf_counter() - start)  # the step returns once its work is queued
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - start)
        print(
            f"\n=== {kind}: {total / 1e3:.2f} ms of kernels per step, wall {min(wall) * 1e3:.2f} ms, host "
            f"{min(host) * 1e3:.2f} ms (floor {floor_us / 1e3:.2f} ms at {bandwidth / 1e9:.0f} GB/s)"
        )
        profiler = cProfile.Profile()
        profiler.enable()
        optimizer.step()
        profiler.disable()
        torch.cuda.synchronize()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(14)
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
            print(f"  {e.count / steps:5.0f}x {e.self_device_time_total / steps / 1e3:7.2f} ms  {e.key[:110]}")
        del optimizer, params
        torch.cuda.empty_cache()


def optim_1e7(kinds: list[str]) -> None:
    """Host and wall time per step at 1e7 parameters (10 weights of 1024 x 1024, `python -m
    benchmarks/optim.py`'s case), FusedAdam and AdamW(fused) + requantize alternately, then where
    each one's host time goes (cProfile of 20 steps)."""
    from optim import requantize_steps

    for kind in kinds:
        steps = requantize_steps(kind, 10, 1 << 20, torch.device("cuda"))
        for step in steps.values():
            for _ in range(5):
                step()
        torch.cuda.synchronize()
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
        for round_ in range(10):
            for name in list(steps)[:: 1 if round_ % 2 == 0 else -1]:
                start = time.perf_counter()
                for _ in range(10):
                    steps[name]()
                host = time.perf_counter() - start
                torch.cuda.synchronize()
                times[name].append((host / 10, (time.perf_counter() - start) / 10))
        for name, pairs in times.items():
            host = sorted(h for h, _ in pairs)[len(pairs) // 2]
            wall = sorted(w for _, w in pairs)[len(pairs) // 2]
            print(
                f"\n=== {kind} {name}: median host {host * 1e3:.3f} ms, wall {wall * 1e3:.3f} ms per step (10 rounds of 10)"
            )
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(20):
                steps[name]()
            profiler.disable()
            torch.cuda.synchronize()
            stats = pstats.Stats(profiler)
            calls = sum(entry[1] for entry in stats.stats.values()) / 20  # type: ignore[attr-defined]
            print(f"{calls:.0f} Python calls per step")
            stats.sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    recipes = sys.argv[2:] or ["nn.Linear", "fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"]
    if sys.argv[1] == "host":
        host(recipes)
    elif sys.argv[1] == "ops":
        ops(recipes)
    elif sys.argv[1] == "parts":
        parts()
    elif sys.argv[1] == "accumulation":
        accumulation()
    elif sys.argv[1] == "decode":
        decode(sys.argv[2:] or ["fp8", "mxfp8", "fp8-block", "nvfp4"])
    elif sys.argv[1] == "weight-cache":
        weight_cache(sys.argv[2:] or ["fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"])
    elif sys.argv[1] == "optim-1e7":
        optim_1e7(sys.argv[2:] or ["fp8", "mxfp8", "nvfp4"])
    elif sys.argv[1] == "optim":
        optim(sys.argv[2:] or ["fp32", "fp8", "mxfp8", "fp8-block", "nvfp4"])
    elif sys.argv[1] in ("e2e", "memory"):
        config = sys.argv[3] if sys.argv[2:3] == ["--config"] else "default"
        runs = sys.argv[4:] if sys.argv[2:3] == ["--config"] else sys.argv[2:]
        if sys.argv[1] == "e2e":
            e2e(runs or ["bf16:eager", "fp8:hp:compiled", "torchao-tensorwise:compiled"], config)
        else:
            memory(runs or ["bf16:eager", "fp8:hp:eager"], config)
    else:
        kernels(sys.argv[2:])

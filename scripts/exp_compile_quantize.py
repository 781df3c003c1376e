"""Experiment (issue #16): how a compiled current-scaling FP8 quantize should reach Inductor.

python3 scripts/exp_compile_quantize.py check      # bitwise: compiled (each mode) vs eager
python3 scripts/exp_compile_quantize.py micro      # us of silu(g)*u -> quantize, compiled
python3 scripts/exp_compile_quantize.py e2e MODE.. # e2e fp8:hp:compiled per mode
"""

from __future__ import annotations

import sys
import time

import torch
from torch._inductor.utils import run_and_get_code

import quant_core
from quant_core import _triton_fp8

MODES = ("kernels", "amax", "full")
torch._dynamo.config.recompile_limit = 64
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


def _inputs(dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(shape, device="cuda", generator=g) * 3
    flat = x.view(-1)
    n = flat.numel()
    idx = torch.randperm(n, device="cuda", generator=g)[:64]
    flat[idx[:8]] = float("nan")
    flat[idx[8:16]] = -float("nan")
    flat[idx[16:24]] = float("inf")
    flat[idx[24:32]] = -float("inf")
    flat[idx[32:40]] = 1e-40
    flat[idx[40:48]] = 6e4
    flat[idx[48:56]] = 0.0
    flat[idx[56:64]] = -1e-30
    return x.to(dtype)


def _quantize(x: torch.Tensor, fp8_dtype: torch.dtype, amax: torch.Tensor | None = None):
    q = quant_core.quantize_fp8(x, fp8_dtype, rowwise=True, columnwise=True, amax=amax)
    return q.rowwise_data, q.columnwise_data, q.scale_inv, q.amax


def _bits_equal(a, b) -> bool:
    return all(
        torch.equal(
            u.view(torch.uint8) if u.element_size() == 1 else u.view(torch.int32),
            v.view(torch.uint8) if v.element_size() == 1 else v.view(torch.int32),
        )
        for u, v in zip(a, b, strict=True)
    )


def check() -> None:
    for mode in ("amax", "full"):
        _triton_fp8.COMPILED_CURRENT_SCALING = mode
        torch._dynamo.reset()
        bad = 0
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                for shape in ((4096, 2048), (1000, 333)):
                    torch._dynamo.reset()
                    x = _inputs(dtype, shape)
                    eager = _quantize(x, fp8_dtype)
                    compiled = torch.compile(_quantize, fullgraph=True)(x, fp8_dtype)
                    given = torch.full((1,), 17.5, device="cuda")
                    eager_given = _quantize(x, fp8_dtype, given)
                    compiled_given = torch.compile(_quantize, fullgraph=True)(x, fp8_dtype, given)
                    ok = _bits_equal(eager, compiled) and _bits_equal(eager_given[:3], compiled_given[:3])
                    zero = torch.zeros(shape, device="cuda", dtype=dtype)
                    ok = ok and _bits_equal(_quantize(zero, fp8_dtype), torch.compile(_quantize)(zero, fp8_dtype))
                    if not ok:
                        bad += 1
                        print(f"  MISMATCH {mode} {dtype} {fp8_dtype} {shape}")
        # with a producer: silu(g) * u
        g, u = (torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(2))

        def produced(g, u):
            return _quantize(torch.nn.functional.silu(g) * u, torch.float8_e4m3fn)

        eager = produced(g, u)
        for emulate in (False, True):
            torch._dynamo.reset()
            torch._inductor.config.emulate_precision_casts = emulate
            compiled = torch.compile(produced)(g, u)
            diff = (eager[0].view(torch.uint8) != compiled[0].view(torch.uint8)).sum().item()
            print(
                f"  {mode}: producer silu*u, emulate_precision_casts={emulate}: {diff} rowwise codes differ, amax equal {torch.equal(eager[3], compiled[3])}"
            )
        torch._inductor.config.emulate_precision_casts = False
        print(f"{mode}: {bad} mismatching cases on graph inputs")


def _time(fn, *args, reps: int = 50) -> float:
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def micro() -> None:
    for shape in ((8192, 8192), (8192, 8192 // 4), (8192, 2048)):
        g, u = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        line = [f"{shape}"]
        for mode in MODES:
            _triton_fp8.COMPILED_CURRENT_SCALING = mode
            torch._dynamo.reset()

            def produced(g, u):
                h = torch.nn.functional.silu(g) * u
                return _quantize(h, torch.float8_e4m3fn)[:3]

            def produced_keep(g, u):
                h = torch.nn.functional.silu(g) * u
                return (h, *_quantize(h, torch.float8_e4m3fn)[:3])

            _, code = run_and_get_code(torch.compile(produced), g, u)
            kernels = sum(c.count("async_compile.triton(") for c in code)
            ours = sum(c.count("_amax_kernel") + c.count("_cast_kernel") for c in code)
            line.append(
                f"{mode}: {_time(torch.compile(produced), g, u):.0f} / keep"
                f" {_time(torch.compile(produced_keep), g, u):.0f} us ({kernels} inductor kernels, {ours} refs to ours)"
            )
        torch._dynamo.reset()
        line.append(
            f"bf16 silu*u alone {_time(torch.compile(lambda g, u: torch.nn.functional.silu(g) * u), g, u):.0f} us"
        )
        print("  ".join(line))


def e2e(modes: list[str]) -> None:
    from quant_fsdp import _bench_e2e as b

    options = b.E2EOptions(device="cuda", num_steps=8, num_warmup=3)
    device = options.torch_device()
    source = b.resolve_model_source(options.model_source)
    batches = b.markov_batches(options.decoder, options.num_warmup + options.num_steps).to(device)
    runs = [("torchao", b.RunSpec("torchao-tensorwise", compiled=True))]
    runs += [(mode, b.RunSpec("fp8", compiled=True)) for mode in modes]
    runs += [("torchao", b.RunSpec("torchao-tensorwise", compiled=True))]
    for mode, spec in runs:
        _triton_fp8.COMPILED_CURRENT_SCALING = mode if mode in MODES else "kernels"
        t0 = time.time()
        row = b.measure_run(spec, batches, options, device, source)
        b.free_memory(device)
        print(
            f"{spec.name:32} mode={mode:8} {row.tokens_per_s or 0:10.0f} tokens/s peak {row.peak_memory_gib or 0:.2f} GiB host {row.host_ms_per_step or 0:.1f} ms loss {row.loss} ({time.time() - t0:.0f} s) {row.error or ''}",
            flush=True,
        )


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "check":
        check()
    elif what == "micro":
        micro()
    else:
        e2e(sys.argv[2:] or list(MODES))

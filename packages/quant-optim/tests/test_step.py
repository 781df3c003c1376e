"""FusedAdam's step executor ([Note: FusedAdam step]) on its two verdict routes, both run on the
CPU through the C++ kernel of adam_step: the verdict left on the device ([Note: FusedAdam
tensor-driven step]; capturable=True, the kernel reads it) against the verdict read on the host
bit for bit: the same parameters, masters, moments, step counts and quantized bytes after steps,
skipped steps and steps with a caller's found_inf. On CUDA the device route runs the Triton kernel
(test_fused_adam_cuda.py). Also: the plan is built once and rebuilt when the parameters change."""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch

import quant_optim._plan
import quant_optim._step
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_optim import FusedAdam
from quant_optim.testing import SKIP_SCHEDULE, force_device_route, same_bits, state_bits, step_through

STATELESS = ("fp8", "mxfp8", "fp8-block", "nvfp4")


def model(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    return [
        torch.nn.Parameter(values(96, 64)),
        torch.nn.Parameter(values(300).to(torch.bfloat16)),
        torch.nn.Parameter(values(0, 16)),
        torch.nn.Parameter(values(40).to(torch.bfloat16)),  # the group without masters
        *(qt.nn.quantized_parameter(values(128, 256), qt.recipe_from_name(r).quantizer("weight")) for r in STATELESS),
    ]


def optimizer_for(
    params: list[torch.nn.Parameter],
    capturable: bool,
    lr: float | torch.Tensor = 1e-2,
    moments: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
) -> FusedAdam:
    """Three groups; `moments` are the first and third groups' (exp_avg, exp_avg_sq) dtypes."""
    kept = {"exp_avg_dtype": moments[0], "exp_avg_sq_dtype": moments[1]}
    return FusedAdam(
        [
            {"params": params[:3], "weight_decay": 0.1, **kept},
            {"params": params[3:4], "master_weights": False, "exp_avg_dtype": torch.bfloat16},
            {"params": params[4:], "lr": 3e-3, **kept},
        ],
        lr=lr,
        weight_decay=0.01,
        capturable=capturable,
    )


def set_grads(params: list[torch.nn.Parameter], step: int, nan: bool = False) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    if nan:
        params[-1].grad[3, 5] = float("nan")


@pytest.mark.parametrize(
    "moments",
    [(torch.float32, torch.float32), (torch.float8_e4m3fn, torch.bfloat16), (torch.float8_e5m2, torch.float8_e4m3fn)],
)
def test_the_device_verdict_route_equals_the_host_verdict_route_bitwise(moments):
    runs = {}
    for capturable in (False, True):
        params = model()
        optimizer = optimizer_for(params, capturable, lr=torch.tensor(1e-2), moments=moments)
        verdicts = step_through(params, optimizer, set_grads)  # skipped steps change nothing
        runs[capturable] = (state_bits(params, optimizer), verdicts, optimizer.skipped_steps)
    assert runs[False][1:] == ([False, True, False, True, False, False], 2)
    assert runs[True][1:] == runs[False][1:]
    assert same_bits(runs[False][0], runs[True][0])


def test_a_skipped_step_leaves_everything_as_it_was():
    params = model()
    optimizer = optimizer_for(params, capturable=True)
    before = state_bits(params, optimizer)  # the quantized bytes are not yet the masters' quantization
    set_grads(params, 0, nan=True)
    optimizer.step()
    assert optimizer.last_step_skipped
    assert same_bits(state_bits(params, optimizer), before)
    set_grads(params, 1)
    optimizer.step()
    stepped = state_bits(params, optimizer)
    set_grads(params, 2, nan=True)
    optimizer.step()  # requantizes from the unchanged masters: the same bytes
    assert same_bits(state_bits(params, optimizer), stepped)
    assert [float(optimizer.state[p]["step"]) for p in params] == [1.0] * len(params)


def test_bytes_written_since_the_last_step_are_kept_by_a_skipped_step():
    params = model()
    optimizer = optimizer_for(params, capturable=True)
    set_grads(params, 0)
    optimizer.step()
    weight = params[-1]  # NVFP4: requantizing its master would overwrite what is written below
    weight.quantizer.quantize_(torch.full(weight.shape, 0.5), weight)
    written = [raw_bits(b.reshape(-1)).clone() for b in weight.buffers().values() if b is not None]
    set_grads(params, 1, nan=True)
    optimizer.step()
    assert optimizer.last_step_skipped
    assert all(
        torch.equal(raw_bits(b.reshape(-1)), w)
        for b, w in zip([b for b in weight.buffers().values() if b is not None], written, strict=True)
    )


def test_a_loaded_optimizer_continues_bitwise():
    runs = {}
    for capturable in (False, True):
        params = model()
        optimizer = optimizer_for(params, capturable)
        set_grads(params, 0)
        optimizer.step()
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        set_grads(params, 1)
        optimizer.step()  # undone by the load below (moments, steps; the weights are not restored here)
        buffer.seek(0)
        optimizer.load_state_dict(torch.load(buffer, weights_only=True))
        for step in (2, 3):
            set_grads(params, step, nan=step == 3)
            optimizer.step()
        runs[capturable] = state_bits(params, optimizer)
    assert same_bits(runs[False], runs[True])


def test_parameters_at_different_step_counts_step_alike_on_both_routes():
    # Two parameters of each bucket miss a gradient once: their buckets then hold two step counts
    # (the kernel reads each count on both routes).
    runs = {}
    for capturable in (False, True):
        params = model()
        optimizer = optimizer_for(params, capturable)
        for step in range(4):
            set_grads(params, step)
            if step == 1:
                params[0].grad = params[4].grad = None
            optimizer.step()
        runs[capturable] = state_bits(params, optimizer)
        counts = [float(optimizer.state[p]["step"]) for p in params]
        assert counts == [3.0, 4.0, 4.0, 4.0, 3.0, 4.0, 4.0, 4.0], capturable
    assert same_bits(runs[False], runs[True])


# step -> (a NaN in some gradient, the caller's found_inf); the first step skipped
HOST_GATED_SCHEDULE = {0: (True, None), 1: (False, None), 2: (True, None), 3: (False, 1.0), 4: (False, 0.0)}


@pytest.mark.parametrize("moment_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_the_device_route_reads_the_verdict_on_the_host_for_what_a_skip_would_change(moment_dtype, monkeypatch):
    # fp8 moments, delayed scaling and bytes not yet written by the optimizer (the first step) on
    # the device route, forced on the CPU without capturable=True (which refuses delayed scaling),
    # as CUDA tensors take it: bitwise the host route, histories included.
    runs = {}
    for route in ("host", "device"):
        if route == "device":
            force_device_route(monkeypatch)
        generator = torch.Generator().manual_seed(3)
        params = [
            torch.nn.Parameter(torch.randn(96, 64, generator=generator)),
            torch.nn.Parameter(torch.randn(300, generator=generator).to(torch.bfloat16)),
            *(
                qt.nn.quantized_parameter(
                    torch.randn(128, 256, generator=generator), qt.recipe_from_name(r).quantizer("weight")
                )
                for r in ("fp8", "mxfp8", "fp8-delayed")
            ),
        ]
        optimizer = FusedAdam(
            params, lr=1e-2, weight_decay=0.1, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype
        )
        verdicts = step_through(params, optimizer, set_grads, HOST_GATED_SCHEDULE)  # histories included
        runs[route] = (state_bits(params, optimizer), verdicts, optimizer.skipped_steps)
    assert runs["host"][1:] == ([True, False, True, True, False], 3)
    assert runs["device"][1:] == runs["host"][1:]
    assert same_bits(runs["host"][0], runs["device"][0])


def test_fp8_moments_leave_the_verdict_on_the_device_and_a_skip_keeps_them(monkeypatch):
    # Stateless weights and fp8 moments of both formats: the device route agrees the moments'
    # amaxes every step, skipped or not, with the verdict left on the device ([Note: fp8 moments on
    # a skipped step]); bitwise the host route, a skipped step changing nothing.
    agree, current = quant_optim._step.agree_moment_amaxes, [0]
    agreed: list[int] = []  # the step of each agreement

    def recorded(buckets: Any, local: Any) -> Any:
        agreed.append(current[0])
        return agree(buckets, local)

    def grads_of_step(params: list[torch.nn.Parameter], step: int, nan: bool) -> None:
        current[0] = step
        set_grads(params, step, nan)

    monkeypatch.setattr(quant_optim._step, "agree_moment_amaxes", recorded)
    runs = {}
    for route in ("host", "device"):
        if route == "device":
            force_device_route(monkeypatch)
        params = [p for p in model(seed=4) if p.numel()]
        optimizer = FusedAdam(
            params, lr=1e-2, weight_decay=0.1, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e5m2
        )
        agreed.clear()
        verdicts = step_through(params, optimizer, grads_of_step)  # skipped steps change nothing
        runs[route] = (state_bits(params, optimizer), verdicts)
        if route == "host":  # skipped steps return before the pre-pass
            assert agreed == [step for step, skipped in enumerate(verdicts) if not skipped]
        else:  # every step agrees, skipped ones too
            assert agreed == list(SKIP_SCHEDULE)
    assert runs["host"][1] == runs["device"][1] == [False, True, False, True, False, False]
    assert same_bits(runs["host"][0], runs["device"][0])


@pytest.mark.parametrize("route", ["host", "device"])
def test_fp8_moments_take_one_pre_pass_per_bucket_and_one_agreement_per_step(route, monkeypatch):
    # [Note: FusedAdam fp8 moments]: every bucket holding fp8 moments (here two groups, so two) gets
    # one adam_moment_amaxes call, then one agreement carries all their amaxes; the Adam kernels
    # read the codes, no fp32 moment values are made (no dequantize_fp8).
    if route == "device":
        force_device_route(monkeypatch)
    calls: list[str] = []
    for name in ("adam_moment_amaxes", "dequantize_fp8"):
        original = getattr(torch.ops.quant_core, name)

        def counted(*args: Any, name: str = name, original: Any = original) -> Any:
            calls.append(name)
            return original(*args)

        monkeypatch.setattr(torch.ops.quant_core, name, counted)
    agree, agreements = quant_optim._step.agree_moment_amaxes, []

    def recorded(buckets: Any, local: Any) -> Any:
        agreements.append([tuple(a.shape) for a in local])
        return agree(buckets, local)

    monkeypatch.setattr(quant_optim._step, "agree_moment_amaxes", recorded)
    params = [p for p in model(seed=5) if p.numel()]
    optimizer = FusedAdam(
        [{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.1}],
        lr=1e-2,
        exp_avg_dtype=torch.float8_e4m3fn,
        exp_avg_sq_dtype=torch.bfloat16,
    )
    set_grads(params, 0)
    optimizer.step()
    fp8_buckets = [b for b in optimizer._plan[1].buckets if b.moment_scale_invs]
    assert len(fp8_buckets) == len(optimizer._plan[1].buckets) >= 2
    assert calls == ["adam_moment_amaxes"] * len(fp8_buckets)
    assert agreements == [[(1, len(b.params)) for b in fp8_buckets]]  # one row: exp_avg is fp8, exp_avg_sq bf16


def test_fp8_moments_hold_no_fp32_values_between_steps():
    # The fp32 values exist during a step only: between steps (the forward and backward) a moment
    # holds its codes, 1 byte per element, also after a step that raised.
    params = [p for p in model() if p.numel()]
    optimizer = FusedAdam(params, lr=1e-2, exp_avg_dtype=torch.float8_e4m3fn, exp_avg_sq_dtype=torch.float8_e5m2)

    def held() -> set[torch.dtype]:
        buckets = optimizer._plan[1].buckets
        return {m.dtype for b in buckets for m in (*b.exp_avgs, *b.exp_avg_sqs)}

    set_grads(params, 0)
    optimizer.step()
    assert held() == {torch.float8_e4m3fn, torch.float8_e5m2}

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("broken")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(quant_optim._step, "write_back", broken)
        with pytest.raises(RuntimeError, match="broken"):
            optimizer.step()
    assert held() == {torch.float8_e4m3fn, torch.float8_e5m2}


def test_the_plan_is_built_once_and_again_after_add_param_group_or_load_state_dict(monkeypatch):
    build, built = quant_optim._plan.build_plan, []

    def counted(*args: Any) -> quant_optim._plan.Plan:
        built.append(len(args[0]))
        return build(*args)

    monkeypatch.setattr(quant_optim._plan, "build_plan", counted)
    params = model()
    optimizer = optimizer_for(params, capturable=False)
    for step in range(3):
        set_grads(params, step)
        optimizer.step()
    assert built == [8]
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(8))]})  # no gradient: not stepped
    set_grads(params, 3)
    optimizer.step()
    assert built == [8, 8]
    optimizer.load_state_dict(optimizer.state_dict())
    set_grads(params, 4)
    optimizer.step()
    set_grads(params, 5)
    params[0].grad = None
    optimizer.step()
    assert built == [8, 8, 8, 7]


def test_capturable_refuses_what_reads_the_verdict_on_the_host():
    p = qt.nn.quantized_parameter(torch.randn(32, 32), qt.recipe_from_name("fp8-delayed").quantizer("weight"))
    with pytest.raises(ValueError, match="capturable=True cannot step a Float8DelayedQuantizer weight .* stateless"):
        FusedAdam([p], capturable=True)
    fp8 = qt.nn.quantized_parameter(torch.randn(32, 32), qt.recipe_from_name("fp8").quantizer("weight"))
    FusedAdam([fp8], capturable=True, exp_avg_dtype=torch.float8_e4m3fn)  # fp8 moments need no host verdict


def alike_model(device: str) -> list[torch.nn.Parameter]:
    """Block-format weights in three configurations (MXFP8, blockwise 128 x 128, blockwise 1 x 128),
    two of them twice, and per-tensor FP8 weights in two (E4M3 twice, E5M2), shapes not multiples
    of every block, between fp32 and bf16 parameters."""
    generator = torch.Generator().manual_seed(7)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device)

    mxfp8 = qt.MXFP8BlockScaling().quantizer("weight")
    tiled, rows = qt.Float8BlockScaling().quantizer("weight"), qt.Float8BlockScaling().quantizer("input")
    e4m3, e5m2 = qt.Float8CurrentScaling().quantizer("weight"), qt.Float8CurrentScaling().quantizer("grad_output")
    return [
        qt.nn.quantized_parameter(values(96, 160), mxfp8),
        torch.nn.Parameter(values(50)),
        qt.nn.quantized_parameter(values(130, 256), tiled),
        qt.nn.quantized_parameter(values(64, 200), rows),
        qt.nn.quantized_parameter(values(48, 32), e4m3),
        qt.nn.quantized_parameter(values(33, 64), copy.deepcopy(mxfp8)),  # an equal quantizer, another object
        qt.nn.quantized_parameter(values(16, 80), e5m2),
        torch.nn.Parameter(values(40, 8).to(torch.bfloat16)),
        qt.nn.quantized_parameter(values(128, 128), tiled),
        qt.nn.quantized_parameter(values(64, 48), copy.deepcopy(e4m3)),
    ]


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
def test_weights_of_one_configuration_requantize_in_one_call_as_a_loop_would(device, monkeypatch):
    # Bitwise what requantizing weight by weight gives (quantize_ per weight, with the Adam pass's
    # amax for per-tensor FP8), over four steps with a skipped third one; one call per configuration.
    def loop(quantizer: qt.Quantizer, srcs: list[torch.Tensor], outs: list[qt.QuantizedTensor], amaxes=None) -> None:
        for i, (src, out) in enumerate(zip(srcs, outs, strict=True)):
            quantizer.quantize_(src, out, amax=None if amaxes is None else amaxes[i])

    batched, sizes = qt.Quantizer.quantize_many_, []

    def counted(quantizer: qt.Quantizer, srcs: list[torch.Tensor], outs: list[qt.QuantizedTensor], amaxes=None) -> None:
        sizes.append(len(srcs))
        batched(quantizer, srcs, outs, amaxes=amaxes)

    runs = {}
    for name, requantize in (("loop", loop), ("many", counted)):
        monkeypatch.setattr(qt.Quantizer, "quantize_many_", requantize)
        params = alike_model(device)
        optimizer = FusedAdam(params, lr=1e-2, weight_decay=0.01, capturable=device == "cpu")
        for step in range(4):
            generator = torch.Generator().manual_seed(100 + step)
            for p in params:
                p.grad = torch.randn(p.shape, generator=generator).to(device=device, dtype=p.dtype)
            if step == 2:
                params[-1].grad[3, 5] = float("nan")
            optimizer.step()
            assert optimizer.last_step_skipped == (step == 2)
        runs[name] = state_bits(params, optimizer)
    assert same_bits(runs["loop"], runs["many"])
    # MXFP8, 128 x 128, 1 x 128 in the parameters' order, then E4M3 and E5M2
    assert sizes == [2, 2, 1, 2, 1] * 4

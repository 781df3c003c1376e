"""FusedAdam with master_weight_dtype=torch.bfloat16 ([Note: FusedAdam bf16 masters] in
quant_optim._plan): bit for bit quant_core's reference Adam step with stochastic rounding over
several steps, counters advanced by updating steps only and started apart, the host and device
verdict routes equal, state_dict round trips continuing bitwise, and the dtype-mismatch errors."""

from __future__ import annotations

import io

import pytest
import torch

import quant_core
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_optim import FusedAdam
from quant_optim._plan import MASTER_ROUNDING_SEED
from quant_optim.testing import force_device_route, same_bits, state_bits, step_through

COUNTER = "master_rounding_counter"
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.999), 1e-8, 0.1


def model(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    return [
        torch.nn.Parameter(values(96, 64)),  # fp32: its own fp32 master, no counter
        torch.nn.Parameter(values(300).to(torch.bfloat16)),  # its own bf16 master
        qt.nn.quantized_parameter(values(128, 256), qt.recipe_from_name("fp8").quantizer("weight")),
        qt.nn.quantized_parameter(values(64, 128), qt.recipe_from_name("mxfp8").quantizer("weight")),
    ]


def optimizer_for(params: list[torch.nn.Parameter], **kwargs: object) -> FusedAdam:
    return FusedAdam(
        params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, master_weight_dtype=torch.bfloat16, **kwargs
    )


def set_grads(params: list[torch.nn.Parameter], step: int, nan: bool = False) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(p.dtype)
    if nan:
        params[1].grad[7] = float("nan")


def test_masters_are_bf16_with_counters_started_apart():
    params = model()
    optimizer = optimizer_for(params)
    states = [optimizer.state[p] for p in params]
    assert "master" not in states[0]
    assert COUNTER not in states[0]
    assert "master" not in states[1]  # a bf16 parameter is its own master
    assert [s["master"].dtype for s in states[2:]] == [torch.bfloat16] * 2
    assert [(s[COUNTER].dtype, s[COUNTER].dim(), int(s[COUNTER])) for s in states[1:]] == [
        (torch.int64, 0, index << 32) for index in (1, 2, 3)
    ]


@pytest.mark.parametrize("capturable", [False, True])
def test_steps_equal_the_reference_kernel_bitwise(capturable):
    params = model()
    optimizer = optimizer_for(params, capturable=capturable)
    # The reference state: fp32 parameter, bf16 masters, moments, counters, as the optimizer made them.
    masters = [params[0].detach().clone(), params[1].detach().clone()]
    masters += [optimizer.state[p]["master"].clone() for p in params[2:]]
    moments = [(torch.zeros(m.shape), torch.zeros(m.shape)) for m in masters]
    counters = [optimizer.state[p][COUNTER].clone() for p in params[1:]]
    for step in range(1, 5):
        set_grads(params, step)
        optimizer.step()
        hyper = {"lr": LR, "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS, "weight_decay": WEIGHT_DECAY}
        with quant_core.use_backend("reference"):
            for index, (p, master, (exp_avg, exp_avg_sq)) in enumerate(zip(params, masters, moments, strict=True)):
                rounding = {} if index == 0 else {"stochastic_rounding_counters": [counters[index - 1]]}
                quant_core.adam_step_(
                    [master], [p.grad], [exp_avg], [exp_avg_sq], [torch.tensor(step - 1.0)], **hyper,
                    adam_w_mode=True, seed=MASTER_ROUNDING_SEED, **rounding,
                )  # fmt: skip
            expected_bytes = [p.quantizer.quantize(m) for p, m in zip(params[2:], masters[2:], strict=True)]
        assert torch.equal(raw_bits(params[0].detach()), raw_bits(masters[0])), step
        assert torch.equal(raw_bits(params[1].detach()), raw_bits(masters[1])), step
        for p, master, expected in zip(params[2:], masters[2:], expected_bytes, strict=True):
            assert torch.equal(raw_bits(optimizer.state[p]["master"]), raw_bits(master)), step
            for name, buffer in p.buffers().items():
                if buffer is not None:
                    assert torch.equal(raw_bits(buffer.reshape(-1)), raw_bits(expected.buffers()[name].reshape(-1))), (
                        step,
                        name,
                    )
        for p, (exp_avg, exp_avg_sq) in zip(params, moments, strict=True):
            assert torch.equal(optimizer.state[p]["exp_avg"], exp_avg)
            assert torch.equal(optimizer.state[p]["exp_avg_sq"], exp_avg_sq)
        assert [int(optimizer.state[p][COUNTER]) for p in params[1:]] == [(i << 32) + step for i in (1, 2, 3)]


@pytest.mark.parametrize("capturable", [False, True])
def test_a_skipped_step_changes_no_counter(capturable):
    params = model()
    optimizer = optimizer_for(params, capturable=capturable)
    set_grads(params, 0)
    optimizer.step()
    before = state_bits(params, optimizer)
    set_grads(params, 1, nan=True)
    optimizer.step()
    assert optimizer.last_step_skipped
    assert same_bits(state_bits(params, optimizer), before)
    optimizer.step(found_inf=torch.tensor([1.0]))
    assert same_bits(state_bits(params, optimizer), before)
    assert [int(optimizer.state[p][COUNTER]) for p in params[1:]] == [(i << 32) + 1 for i in (1, 2, 3)]


# step -> (a NaN in some gradient, the caller's found_inf)
def test_the_device_route_equals_the_host_route_bitwise(monkeypatch):
    runs = {}
    for route in ("host", "device"):
        if route == "device":  # forced on the CPU, as CUDA tensors take it
            force_device_route(monkeypatch)
        params = model()
        optimizer = optimizer_for(params, exp_avg_dtype=torch.bfloat16)
        verdicts = step_through(params, optimizer, set_grads)
        runs[route] = (state_bits(params, optimizer), verdicts)
    assert runs["host"][1] == runs["device"][1] == [False, True, False, True, False, False]
    assert same_bits(runs["host"][0], runs["device"][0])


@pytest.mark.parametrize("capturable", [False, True])
def test_a_resumed_run_continues_bitwise(capturable):
    params = model()
    optimizer = optimizer_for(params, capturable=capturable)
    for step in range(3):
        set_grads(params, step)
        optimizer.step()
    buffer = io.BytesIO()
    torch.save(({n: p.detach() for n, p in enumerate(params)}, optimizer.state_dict()), buffer)
    for step in range(3, 6):
        set_grads(params, step, nan=step == 4)
        optimizer.step()
    uninterrupted = state_bits(params, optimizer)

    buffer.seek(0)
    weights, state_dict = torch.load(buffer, weights_only=False)
    resumed = model(seed=1)  # other values: everything comes from the checkpoint
    with torch.no_grad():
        for p, saved in zip(resumed, weights.values(), strict=True):
            if isinstance(p, qt.QuantizedTensor):
                for name, b in p.buffers().items():
                    if b is not None:
                        b.copy_(saved.buffers()[name])
            else:
                p.copy_(saved)
    optimizer = optimizer_for(resumed, capturable=capturable)
    optimizer.load_state_dict(state_dict)
    assert [int(optimizer.state[p][COUNTER]) for p in resumed[1:]] == [(i << 32) + 3 for i in (1, 2, 3)]
    for step in range(3, 6):
        set_grads(resumed, step, nan=step == 4)
        optimizer.step()
    assert same_bits(state_bits(resumed, optimizer), uninterrupted)


@pytest.mark.parametrize(("saved", "loaded"), [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_a_checkpoint_of_another_master_dtype_is_refused_and_changes_nothing(saved, loaded):
    params = model()
    source = FusedAdam(params, lr=LR, master_weight_dtype=saved)
    set_grads(params, 0)
    source.step()
    target = FusedAdam(params, lr=LR, master_weight_dtype=loaded)
    before = state_bits(params, target)
    with pytest.raises(ValueError, match=rf"holds masters as {saved} .* load with master_weight_dtype={saved}"):
        target.load_state_dict(source.state_dict())
    assert same_bits(state_bits(params, target), before)


def test_bad_master_settings_are_refused():
    with pytest.raises(ValueError, match="master_weight_dtype must be torch.float32 or torch.bfloat16"):
        FusedAdam([torch.nn.Parameter(torch.zeros(4))], master_weight_dtype=torch.float16)
    with pytest.raises(ValueError, match="float16 parameter .* master_weight_dtype=torch.float32"):
        FusedAdam([torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))], master_weight_dtype=torch.bfloat16)

"""FusedAdam on CUDA tensors (the verdict on the device, [Note: FusedAdam tensor-driven step]) equals the
C++ CPU step bit for bit ([Note: Adam numerics] uses only correctly rounded fp32 operations),
with fp32 or bf16 masters (stochastic rounding draws the same bits), skipped steps included; after its first step it makes no host sync; with capturable=True a
CUDA graph of one step replays as eager steps do, fp8 moments included."""

from __future__ import annotations

import pytest
import torch

import quant_tensors as qt
from quant_core.testing import no_host_syncs
from quant_optim import FusedAdam
from quant_optim.testing import assert_same_bits, state_bits

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu-suite.sh)"),
]


def params_on(device: str) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)  # values drawn on the CPU: CUDA's generator differs

    def values(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device)

    return [
        torch.nn.Parameter(values(512, 384)),
        torch.nn.Parameter(values(1000).to(torch.bfloat16)),
        *(
            qt.nn.quantized_parameter(values(256, 512), qt.recipe_from_name(r).quantizer("weight"))
            for r in ("fp8", "mxfp8", "fp8-block", "nvfp4", "fp8-delayed")
        ),
    ]


def set_grads(params: list[torch.nn.Parameter], step: int, device: str, nan: bool = False) -> None:
    generator = torch.Generator().manual_seed(step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator).to(device=device, dtype=p.dtype)
    if nan:
        params[-2].grad[7, 9] = float("nan")


# step -> (a NaN in a gradient, the caller's found_inf)
SCHEDULE = {0: (True, None), 1: (False, None), 2: (False, None), 3: (True, None), 4: (False, 1.0), 5: (False, 0.0)}


@pytest.mark.parametrize("master_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("moment_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cuda_step_equals_cpu_step_bitwise(moment_dtype, master_dtype):
    results = {}
    for device in ("cpu", "cuda"):
        params = params_on(device)
        optimizer = FusedAdam(
            params,
            lr=1e-2,
            weight_decay=0.1,
            master_weight_dtype=master_dtype,
            exp_avg_dtype=moment_dtype,
            exp_avg_sq_dtype=moment_dtype,
        )
        verdicts = []
        for step, (nan, found) in SCHEDULE.items():
            set_grads(params, step, device, nan)
            before = state_bits(params, optimizer)
            optimizer.step(found_inf=None if found is None else torch.tensor([found], device=device))
            verdicts.append(optimizer.last_step_skipped)
            if verdicts[-1]:  # a skipped step (the first one too) writes nothing, histories included
                assert_same_bits(state_bits(params, optimizer), before)
        results[device] = (state_bits(params, optimizer), verdicts, optimizer.skipped_steps)
    assert results["cuda"][1:] == results["cpu"][1:] == ([True, False, False, True, True, False], 3)
    assert_same_bits(results["cpu"][0], results["cuda"][0])


def stateless_params(device: str = "cuda") -> list[torch.nn.Parameter]:
    return params_on(device)[:-1]  # fp8-delayed left out: it reads the verdict on the host (and capturable refuses it)


@pytest.mark.parametrize("moments", [(torch.bfloat16, torch.float32), (torch.float8_e4m3fn, torch.float8_e5m2)])
def test_cuda_steps_after_the_first_make_no_host_sync(moments):
    params = stateless_params()
    lr = torch.tensor(1e-2, device="cuda")
    optimizer = FusedAdam(params, lr=lr, weight_decay=0.1, exp_avg_dtype=moments[0], exp_avg_sq_dtype=moments[1])
    grads = []
    for step in range(4):
        set_grads(params, step, "cuda")
        grads.append([p.grad for p in params])
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    optimizer.step()  # the first: builds the plan and tables, writes the quantized bytes from the masters
    torch.cuda.synchronize()
    with no_host_syncs():
        for step, found in ((1, None), (2, torch.zeros(1, device="cuda")), (3, torch.ones(1, device="cuda"))):
            for p, g in zip(params, grads[step], strict=True):
                p.grad = g  # other memory than the first step's: one pinned, non-blocking table copy
            lr.mul_(0.5)
            optimizer.step(found_inf=found)
    assert optimizer.skipped_steps == 1
    assert all(float(optimizer.state[p]["step"]) == 3.0 for p in params)


@pytest.mark.parametrize("moments", [(torch.float32, torch.float32), (torch.float8_e4m3fn, torch.bfloat16)])
def test_capturable_step_replays_in_a_cuda_graph_as_eager_steps(moments):
    lr = {"graph": torch.tensor(1e-2, device="cuda"), "eager": torch.tensor(1e-2, device="cuda")}
    found = {"graph": torch.zeros(1, device="cuda"), "eager": torch.zeros(1, device="cuda")}
    runs = {}
    for run in ("graph", "eager"):
        params = stateless_params()
        optimizer = FusedAdam(
            params, lr=lr[run], weight_decay=0.1, capturable=True, exp_avg_dtype=moments[0], exp_avg_sq_dtype=moments[1]
        )
        set_grads(params, 0, "cuda")  # static gradients: each step below writes new values into them
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            optimizer.step(found_inf=found[run])  # the warm-up step
        torch.cuda.current_stream().wait_stream(stream)
        if run == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                optimizer.step(found_inf=found[run])
        for step in range(1, 6):
            generator = torch.Generator().manual_seed(step)
            for p in params:
                p.grad.copy_(torch.randn(p.shape, generator=generator).to(dtype=p.dtype))
            lr[run].fill_(1e-2 / step)
            found[run].fill_(1.0 if step == 3 else 0.0)
            graph.replay() if run == "graph" else optimizer.step(found_inf=found[run])
        torch.cuda.synchronize()
        runs[run] = (state_bits(params, optimizer), optimizer.skipped_steps)
    assert runs["graph"][1] == runs["eager"][1] == 1
    assert_same_bits(runs["eager"][0], runs["graph"][0])

"""Helpers for FusedAdam's tests: every byte a step may write, compared bit for bit, and the
step's verdict route forced onto the device on the CPU."""

from __future__ import annotations

from collections.abc import Callable

import torch

import quant_tensors as qt
from quant_optim import _step

SKIP_SCHEDULE = {
    0: (False, None),
    1: (True, None),
    2: (False, None),
    3: (False, 1.0),
    4: (False, 0.0),
    5: (False, None),
}
"""step -> (a NaN in some gradient, the caller's found_inf): two skipped steps, one by found_inf."""


def state_bits(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
    """Every byte a step may write, per parameter, as raw bits on the CPU: the parameter (each
    buffer of a quantized one), its quantizer's state (delayed scaling's amax history), and its
    optimizer states in the order of their names."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.detach().reshape(-1).view(torch.uint8).cpu().clone()  # bytes: NaN codes compare too

    out = []
    for p in params:
        if isinstance(p, qt.QuantizedTensor):
            tensors = [b for b in p.buffers().values() if b is not None]
            tensors += [] if p.quantizer.state is None else [p.quantizer.state]
        else:
            tensors = [p]
        out.append([bits(t) for t in tensors] + [bits(v) for _, v in sorted(optimizer.state[p].items())])
    return out


def same_bits(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    """Whether two `state_bits` are equal."""
    return all(torch.equal(x, y) for ta, tb in zip(a, b, strict=True) for x, y in zip(ta, tb, strict=True))


def assert_same_bits(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    """`same_bits`, naming the first parameter and tensor that differ."""
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        for j, (u, v) in enumerate(zip(x, y, strict=True)):
            assert torch.equal(u, v), f"parameter {i}, tensor {j}: {(u != v).sum()} of {u.numel()} differ"


def force_device_route(monkeypatch: object) -> None:
    """Patches FusedAdam's step onto the device-verdict route for the rest of a test (as CUDA
    tensors take it), whatever the tensors' device."""
    run = _step.run

    def forced(*args: object, verdict_on_host: bool) -> torch.Tensor:
        return run(*args, verdict_on_host=False)

    monkeypatch.setattr(_step, "run", forced)  # type: ignore[attr-defined]


def step_through(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    set_grads: Callable[[list[torch.nn.Parameter], int, bool], None],
    schedule: dict[int, tuple[bool, float | None]] = SKIP_SCHEDULE,
) -> list[bool]:
    """Steps `optimizer` through `schedule` (`set_grads(params, step, nan)` before each step, the
    caller's found_inf passed when given), asserting that a skipped step leaves every byte of
    `state_bits` as it was and a step that ran does not; returns whether each step was skipped."""
    skipped = []
    for step, (nan, found) in schedule.items():
        set_grads(params, step, nan)
        before = state_bits(params, optimizer)
        optimizer.step(found_inf=None if found is None else torch.tensor([found]))
        skipped.append(optimizer.last_step_skipped)
        assert same_bits(state_bits(params, optimizer), before) == skipped[-1], (step, skipped[-1])
    return skipped

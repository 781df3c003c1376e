"""Delayed scaling under FSDP2 on 2 gloo ranks: every rank holds the same amax histories, the
maximum over ranks of what each measured ([Note: shared amax histories] in quant_fsdp._amax)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import quant_core
import quant_fsdp
import quant_tensors as qt
from quant_core.testing import run_ranks

STEPS = 3


def _inputs(rank: int, step: int) -> torch.Tensor:
    # Ranks see inputs of different magnitudes, so their local amaxes differ at every step.
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * rank + step)) * (rank + 1) * (step + 1)


def _histories_agree_and_hold_the_maximum(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = qt.convert(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
        qt.Float8DelayedScaling(amax_history_len=4),
        quantized_weights=False,
    )
    quant_fsdp.fully_shard(model[0])
    quant_fsdp.fully_shard(model)
    calls = []
    original = dist.all_reduce
    for step in range(STEPS):
        dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), original(t, *a, **k))[1]  # type: ignore[assignment]
        model(_inputs(rank, step)).sum().backward()
        dist.all_reduce = original
    # One all-reduce per step (the root's hook; the inner module's runs inside the root's forward), of
    # every history: 2 layers x (input, weight, grad_output) x amax_history_len values.
    assert calls == [6 * 4] * STEPS, calls
    assert quant_fsdp.sync_amax_histories_(model) == 6  # the last step's amaxes
    first_layer = model[0]
    expected = [max(quant_core.amax(_inputs(r, s)).item() for r in range(world_size)) for s in range(STEPS)]
    assert first_layer.input_quantizer_state.tolist() == [*reversed(expected), 0.0]
    gathered = [torch.empty(6, 4) for _ in range(world_size)]
    states = [state for name, state in model.named_buffers() if name.endswith("_quantizer_state")]
    dist.all_gather(gathered, torch.stack(states))
    assert all(torch.equal(g, gathered[0]) for g in gathered)
    assert (gathered[0][:, :STEPS] > 0).all()


def test_delayed_histories_are_reduced_over_the_data_parallel_group():
    run_ranks(_histories_agree_and_hold_the_maximum, 2)

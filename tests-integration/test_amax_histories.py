"""Delayed scaling under FSDP2 on 2 gloo ranks, and HSDP on a 2 x 2 mesh of 4: every rank holds the
same amax histories, the maximum over ranks of what each measured ([Note: shared amax histories] in
quant_fsdp._amax), in training and in the state dict, so a run saved with
torch.distributed.checkpoint resumes bitwise."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import quant_core
import quant_fsdp
import quant_tensors as qt
from quant_lab.testing import run_on_warm_ranks

STEPS = 3


def _inputs(rank: int, step: int) -> torch.Tensor:
    # Ranks see inputs of different magnitudes, so their local amaxes differ at every step.
    return torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * rank + step)) * (rank + 1) * (step + 1)


def _sharded_delayed_model(mesh: DeviceMesh | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = qt.convert(
        torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)),
        qt.Float8DelayedScaling(amax_history_len=4),
        quantized_weights=False,
    )
    quant_fsdp.fully_shard(model[0], mesh=mesh)
    quant_fsdp.fully_shard(model, mesh=mesh)
    return model


def _histories_agree_and_hold_the_maximum(rank: int, world_size: int) -> None:
    model = _sharded_delayed_model()
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
    run_on_warm_ranks(_histories_agree_and_hold_the_maximum, 2)


# ---- the state dict holds the synced histories -------------------------------------------------------


def _train_step(model: torch.nn.Module, rank: int, world_size: int, step: int) -> torch.Tensor:
    # Rank 1 measures the larger input amaxes, rank 0 the larger grad_output amaxes: whichever
    # rank's copy of a history a checkpoint keeps, it lacks the other rank's newest amaxes unless
    # the histories are synced before they are saved.
    out = model(_inputs(rank, step))
    (out.sum() * (world_size - rank)).backward()
    return out.detach()


def _histories(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b for name, b in model.named_buffers() if name.endswith("_quantizer_state")}


def _everyone(t: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    gathered = [torch.empty_like(t) for _ in range(world_size)]
    dist.all_gather(gathered, t.contiguous())
    return gathered


def _state_dict_holds_synced_histories(rank: int, world_size: int, directory: pathlib.Path) -> None:
    model = _sharded_delayed_model()
    for step in range(STEPS):
        _train_step(model, rank, world_size, step)
    # The newest input and grad_output amaxes are each rank's own until the next forward's sync.
    local = torch.stack(list(_histories(model).values())).clone()
    everyone = _everyone(local, world_size)
    assert not all(torch.equal(e, everyone[0]) for e in everyone)
    expected = torch.stack(everyone).amax(dim=0)

    calls = []
    original = dist.all_reduce
    dist.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), original(t, *a, **k))[1]  # type: ignore[assignment]
    try:
        state = get_model_state_dict(model)
    finally:
        dist.all_reduce = original
    # One all-reduce per sharded module, of the histories it holds outside the inner sharded one:
    # the root's of model[1], then model[0]'s (3 roles x amax_history_len values each).
    assert calls == [3 * 4, 3 * 4], calls
    saved = torch.stack([state[name] for name in _histories(model)])
    assert torch.equal(saved, expected)
    assert torch.equal(torch.stack(list(_histories(model).values())), expected)

    # Saved with DCP, loaded into a fresh model, the next step equals the uninterrupted one bitwise.
    dcp.save({"model": state}, checkpoint_id=directory)
    want_out = _train_step(model, rank, world_size, STEPS)
    want = torch.stack(list(_histories(model).values()))

    resumed = _sharded_delayed_model()
    loaded = {"model": get_model_state_dict(resumed)}
    dcp.load(loaded, checkpoint_id=directory)
    set_model_state_dict(resumed, loaded["model"])
    assert torch.equal(torch.stack(list(_histories(resumed).values())), expected)
    got_out = _train_step(resumed, rank, world_size, STEPS)
    assert torch.equal(got_out, want_out)
    assert torch.equal(torch.stack(list(_histories(resumed).values())), want)


def test_state_dict_holds_the_histories_synced_over_ranks_and_resumes_bitwise(tmp_path):
    run_on_warm_ranks(_state_dict_holds_synced_histories, 2, tmp_path / "checkpoint")


# ---- HSDP: histories reduced over both mesh dims -----------------------------------------------------


def _hsdp_histories_agree_and_hold_the_maximum(rank: int, world_size: int) -> None:
    # HSDP: ranks {0, 1} and {2, 3} each shard one replica ({0, 2} and {1, 3} replicate a shard).
    # Every rank measures other input and grad_output amaxes (_train_step), so histories agree across
    # all 4 ranks only if they are reduced over both mesh dims.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _sharded_delayed_model(mesh)
    seen, scales = [], []  # each layer's histories as its forward found them; each saved quantized input's scale
    for layer in model:
        layer.register_forward_pre_hook(
            lambda module, args: seen.append(torch.stack(list(_histories(module).values())))
        )

    def record_scale(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, qt.QuantizedTensor):
            scales.append(t.scale_inv.clone())
        return t

    expected = []
    for step in range(STEPS):
        # What the forward's sync must make of the histories: the maximum over all 4 ranks.
        local = torch.stack(list(_histories(model).values()))
        expected.append(torch.stack(_everyone(local, world_size)).amax(dim=0))
        with torch.autograd.graph.saved_tensors_hooks(record_scale, lambda t: t):
            _train_step(model, rank, world_size, step)
    seen = torch.cat(seen).reshape(STEPS, 6, 4)
    assert torch.equal(seen, torch.stack(expected))
    input_amaxes = [max(quant_core.amax(_inputs(r, s)).item() for r in range(world_size)) for s in range(STEPS)]
    assert seen[-1, 1].tolist() == [*reversed(input_amaxes[:-1]), 0.0, 0.0]  # the first layer's input history
    assert all(torch.equal(s, seen) for s in _everyone(seen, world_size))
    # Each layer saves its quantized input for the wgrad: scaled alike on every rank.
    scales = torch.stack(scales)
    assert scales.shape == (STEPS * 2,)
    assert all(torch.equal(s, scales) for s in _everyone(scales, world_size))

    # By hand (as with torch's own fully_shard), the mesh's groups given as a generator: the last
    # step's newest amaxes, each rank's own so far, are reduced over all 4 ranks as well.
    local = torch.stack(list(_histories(model).values()))
    everyone = _everyone(local, world_size)
    assert not all(torch.equal(e, local) for e in everyone)
    assert quant_fsdp.sync_amax_histories_(model, (mesh.get_group(d) for d in range(mesh.ndim))) == 6
    assert torch.equal(torch.stack(list(_histories(model).values())), torch.stack(everyone).amax(dim=0))


def test_hsdp_histories_are_reduced_over_both_mesh_dims():
    run_on_warm_ranks(_hsdp_histories_agree_and_hold_the_maximum, 4)


def test_sync_amax_histories_names_the_groups_it_takes():
    with pytest.raises(TypeError, match=r"groups= as None .* \[mesh.get_group\(d\) for d in range\(mesh.ndim\)\]"):
        quant_fsdp.sync_amax_histories_(torch.nn.Linear(4, 4), ["replicate", "shard"])

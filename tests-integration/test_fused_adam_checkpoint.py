"""torch.distributed.checkpoint with FusedAdam on FSDP2 (gloo, CPU), quantized primary weights, every recipe.

One 2-rank run per recipe trains 5 steps, saves model and optimizer with get_state_dict and
dcp.save, writes the full (gathered) tensors it saved, and trains on to step 10. Then:
- resumed on 2 ranks into a freshly built model and optimizer, 5 more steps give the
  uninterrupted run's parameters (raw bytes), masters, moments and step counts bit for bit;
- loaded on 1 and on 4 ranks, every parameter and optimizer state equals the saved one bit for bit
  (gathered back to full tensors), and training goes on with finite losses.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import raw_bits, run_ranks
from quant_fsdp.testing import local_state_bytes, quantized_transformer, train_with
from quant_optim import FusedAdam
from quant_tensors.testing import MarkovTask, TinyTransformer, TransformerConfig

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
BATCH = 8
SAVE_STEP, LAST_STEP = 5, 10

# A known gap outside quant-optim, written as a strict xfail so that fixing it shows up here.
LAYOUT_CHANGES = pytest.mark.xfail(
    strict=True,
    reason="blockwise FP8 weights change form with the world size: a shard that splits 128-row blocks stays fp32 "
    "(the alignment fallback, no master), an aligned one is quantized (with a master), so a weight of one form "
    "on 2 ranks loads into the other form on 1 or 4 ranks and is not the saved tensor",
)


def build(recipe_name: str) -> tuple[TinyTransformer, FusedAdam]:
    model = quantized_transformer(recipe_name, CONFIG, sharded=True)
    return model, FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)


def train(model: TinyTransformer, optimizer: FusedAdam, steps: range, rank: int, world: int) -> list[float]:
    return train_with(model, optimizer, MarkovTask(CONFIG.vocab), steps, batch_size=BATCH, rank=rank, world=world)


def save(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def load(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


# ---- what is compared -----------------------------------------------------------------------------


def gathered(tensors: torch.Tensor) -> list[torch.Tensor]:
    everyone: list[torch.Tensor | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tensors)
    return everyone  # type: ignore[return-value]


def full_snapshot(model: TinyTransformer, optimizer: FusedAdam) -> dict[str, torch.Tensor]:
    """Full tensors, equal on every rank whatever the world size: parameters dequantized (and the
    rowwise codes of quantized ones, shards concatenated along the rows, plus their per-tensor
    scales and amaxes), optimizer states with full_tensor()."""
    snapshot = {}
    for name, p in model.named_parameters():
        local = p._local_tensor
        if isinstance(local, qt.QuantizedTensor):
            snapshot[name] = qt.shard_like(p, local.dequantize(torch.float32)).full_tensor()
            if local.rowwise_data is not None:
                snapshot[f"{name}:rowwise_data"] = torch.cat(gathered(raw_bits(local.rowwise_data)))
            for key, buffer in local.buffers().items():
                if buffer is not None and buffer.numel() == 1:
                    values = gathered(buffer)
                    assert all(torch.equal(v, values[0]) for v in values), (name, key)
                    snapshot[f"{name}:{key}"] = values[0]
        elif isinstance(local, quant_fsdp.QuantizeOnGatherTensor):
            snapshot[name] = qt.shard_like(p, local._data).full_tensor()
        else:
            snapshot[name] = p.full_tensor()
        for key, value in optimizer.state[p].items():
            snapshot[f"{name}/{key}"] = value.full_tensor() if isinstance(value, DTensor) else value
    return snapshot


def assert_bitwise_equal(got: dict, want: dict, label: str) -> None:
    assert got.keys() == want.keys(), (label, sorted(got.keys() ^ want.keys()))
    for name in want:
        a, b = got[name], want[name]
        if isinstance(b, list):
            assert len(a) == len(b), (label, name)
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (label, name)
        else:
            assert a.dtype == b.dtype, (label, name, a.dtype, b.dtype)
            assert torch.equal(raw_bits(a.reshape(-1)), raw_bits(b.reshape(-1))), (label, name)


# ---- the 2-rank checkpoint ------------------------------------------------------------------------


def _save_and_train_on(rank: int, world_size: int, root: pathlib.Path) -> None:
    for recipe_name in RECIPES:
        directory = root / recipe_name
        model, optimizer = build(recipe_name)
        train(model, optimizer, range(SAVE_STEP), rank, world_size)
        save(model, optimizer, directory / "checkpoint")
        full = full_snapshot(model, optimizer)
        if rank == 0:
            torch.save(full, directory / "saved_full.pt")
        train(model, optimizer, range(SAVE_STEP, LAST_STEP), rank, world_size)
        torch.save(local_state_bytes(model, optimizer), directory / f"uninterrupted_rank{rank}.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("fused_adam_dcp")
    for recipe_name in RECIPES:
        (root / recipe_name).mkdir()
    run_ranks(_save_and_train_on, 2, root)
    return root


# ---- resume on 2 ranks: bitwise equal to the uninterrupted run -------------------------------------


def _resume(rank: int, world_size: int, directory: pathlib.Path, recipe_name: str) -> None:
    model, optimizer = build(recipe_name)
    load(model, optimizer, directory / "checkpoint")
    train(model, optimizer, range(SAVE_STEP, LAST_STEP), rank, world_size)
    expected = torch.load(directory / f"uninterrupted_rank{rank}.pt", weights_only=True)
    assert_bitwise_equal(local_state_bytes(model, optimizer), expected, f"{recipe_name} rank {rank}")
    assert all(float(optimizer.state[p]["step"]) == LAST_STEP for p in model.parameters())


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_resume_on_two_ranks_continues_bitwise(checkpoints, recipe_name):
    run_ranks(_resume, 2, checkpoints / recipe_name, recipe_name)


# ---- load on 1 and on 4 ranks: every tensor as saved, then training goes on ------------------------


def _reshard(rank: int, world_size: int, directory: pathlib.Path, recipe_name: str) -> None:
    model, optimizer = build(recipe_name)
    load(model, optimizer, directory / "checkpoint")
    expected = torch.load(directory / "saved_full.pt", weights_only=True)
    assert_bitwise_equal(full_snapshot(model, optimizer), expected, f"{recipe_name} world {world_size}")
    losses = train(model, optimizer, range(SAVE_STEP, SAVE_STEP + 2), rank, world_size)
    assert all(torch.isfinite(torch.tensor(losses))), losses


@pytest.mark.parametrize(
    ("recipe_name", "world_size"),
    [pytest.param(r, w, marks=LAYOUT_CHANGES if r == "fp8-block" else ()) for r in RECIPES for w in (1, 4)],
)
def test_two_rank_checkpoint_loads_bitwise_on_another_world_size(checkpoints, recipe_name, world_size):
    run_ranks(_reshard, world_size, checkpoints / recipe_name, recipe_name)

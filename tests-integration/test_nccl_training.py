"""Training on several GPUs over NCCL: the gloo scenarios of the training, tensor-parallel and
checkpoint tests, on CUDA ranks (every GPU kernel, NCCL's collectives and streams).

- FSDP2 (1-D mesh) and HSDP (2-D meshes 1 x N and N x 1) train every recipe in both weight modes
  to the losses of single-GPU data-parallel training on the same global batches
  (quant_lab.testing.train_replicas: one replica per rank slice, gradients averaged), within
  LOSS_TOLERANCE at every step: the order in which gradients are summed is the only difference.
- TP=N with sequence parallelism (quant_fsdp.parallel's styles) trains to a single GPU's losses.
- DCP with FusedAdam on quantized weights, every recipe and state configuration (fp32 or bf16
  masters, fp32 or FP8 + bf16 moments): saved on N GPUs, resumed there, loaded on 1 GPU, trained
  and saved again, loaded back on N; every load restores every optimizer state (masters, moments,
  steps) and every quantizer state bit for bit, and training continues to the uninterrupted run's
  losses.

Every scenario runs with backend "gloo" on CPU ranks too (`_device` picks the device), which is
how these workers are checked on a machine without GPUs; CI runs the gloo tests they mirror.
"""

from __future__ import annotations

import functools
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig, run_ranks, train
from quant_lab.testing import (
    TensorParallelModel,
    quantized_transformer,
    tensor_parallel_plan,
    train_data_parallel,
    train_replicas,
)
from quant_optim import FusedAdam

pytestmark = pytest.mark.cuda
RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
MODES = ("quantized-weights", "quantize-on-gather")
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
TASK = MarkovTask(CONFIG.vocab)
BATCH, STEPS = 16, 20
LR = 3e-4  # as the gloo parity tests: quantized training amplifies the order of summation
LOSS_TOLERANCE = 5e-3  # relative, at every step, as the gloo parity tests
SAVE_STEP, STEPS_AFTER_LOAD = 5, 3


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def _mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    return init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", shape, mesh_dim_names=names)


def _worst(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def _needs_gpus(count: int) -> None:
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA GPUs (scripts/gpu-suite.sh --multi on a {count}-GPU machine)")


# ---- FSDP2 and HSDP train as one GPU ----------------------------------------------------------------


def build(recipe_name: str, mode: str, device: torch.device) -> TinyTransformer:
    torch.manual_seed(0)
    with device:
        model = TinyTransformer(CONFIG)
    return qt.convert(model, qt.recipe_from_name(recipe_name), quantized_weights=mode == "quantized-weights")


def _trains_as_one_gpu(rank: int, world_size: int, layouts: dict[str, tuple[int, ...]]) -> None:
    """For every recipe: single-GPU data-parallel losses (both modes compute the same thing without
    FSDP), then each layout in each mode against them."""
    device = _device(rank)
    meshes = {
        label: _mesh(shape) if len(shape) == 1 else _mesh(shape, ("replicate", "shard"))
        for label, shape in layouts.items()
    }
    for recipe_name in RECIPES:
        replicas = [build(recipe_name, "quantize-on-gather", device) for _ in range(world_size)]
        want = train_replicas(replicas, TASK, steps=STEPS, batch_size=BATCH, lr=LR)
        for (label, mesh), mode in ((m, mode) for m in meshes.items() for mode in MODES):
            model = build(recipe_name, mode, device)
            for block in model.blocks:
                quant_fsdp.fully_shard(block, mesh=mesh, quantize_on_gather=mode == "quantize-on-gather")
            quant_fsdp.fully_shard(model, mesh=mesh, quantize_on_gather=mode == "quantize-on-gather")
            got = train_data_parallel(model, TASK, steps=STEPS, batch_size=BATCH, lr=LR)
            worst = _worst(got, want)
            if rank == 0:
                print(f"{recipe_name} {label} {mode}: max relative loss difference {worst:.2e}")
            assert worst <= LOSS_TOLERANCE, (recipe_name, label, mode, worst, got, want)


def test_fsdp2_and_hsdp_train_as_one_gpu():
    _needs_gpus(2)
    layouts = {"fsdp 2": (2,), "hsdp 1x2": (1, 2), "hsdp 2x1": (2, 1)}
    run_ranks(_trains_as_one_gpu, 2, layouts, backend="nccl")


# ---- tensor parallelism with sequence parallelism ---------------------------------------------------

TP_CONFIG = TransformerConfig(vocab=256, hidden=256, layers=2, heads=4, sequence=64)
TP_STEPS, TP_BATCH = 10, 8


def _tensor_parallel_model(recipe_name: str, device: torch.device) -> TensorParallelModel:
    torch.manual_seed(0)
    with device:
        return TensorParallelModel(TP_CONFIG, functools.partial(qt.nn.Linear, recipe=qt.recipe_from_name(recipe_name)))


def _tensor_parallel_trains_as_one_gpu(rank: int, world_size: int) -> None:
    device = _device(rank)
    mesh = _mesh((1, world_size), ("dp", "tp"))
    task = MarkovTask(TP_CONFIG.vocab)
    for recipe_name in RECIPES:
        want = train_replicas(
            [_tensor_parallel_model(recipe_name, device)], task, steps=TP_STEPS, batch_size=TP_BATCH, lr=LR
        )
        model = _tensor_parallel_model(recipe_name, device)
        parallelize_module(model, mesh["tp"], tensor_parallel_plan(model, sequence_parallel=True))
        group = mesh["dp"].get_group()  # of one rank: every rank trains the whole batch
        got = train_data_parallel(model, task, steps=TP_STEPS, batch_size=TP_BATCH, lr=LR, group=group)
        worst = _worst(got, want)
        if rank == 0:
            print(f"{recipe_name} tp={world_size} sp: max relative loss difference {worst:.2e}")
        assert worst <= LOSS_TOLERANCE, (recipe_name, worst, got, want)


def test_tensor_parallel_with_sequence_parallel_trains_as_one_gpu():
    _needs_gpus(2)
    run_ranks(_tensor_parallel_trains_as_one_gpu, 2, backend="nccl")


# ---- DCP across world sizes: N GPUs -> 1 GPU -> N GPUs ----------------------------------------------

# FusedAdam's state configurations (benchmarks/multi_gpu.py names them the same way).
STATES = {
    "fp32": {},
    "master-bf16": {"master_weight_dtype": torch.bfloat16},
    "m-fp8": {"exp_avg_dtype": torch.float8_e4m3fn, "exp_avg_sq_dtype": torch.bfloat16},
    "master-bf16-m-fp8": {
        "master_weight_dtype": torch.bfloat16,
        "exp_avg_dtype": torch.float8_e4m3fn,
        "exp_avg_sq_dtype": torch.bfloat16,
    },
}
CASES = tuple((recipe_name, states) for recipe_name in RECIPES for states in STATES)
# A resume on the layout it was saved on restores every state bit for bit; the losses after it may
# still differ in the last bits, since CUDA kernels (attention's backward) may sum in another order
# from one run to the next.
SAME_LAYOUT_TOLERANCE = 1e-6


def _built(recipe_name: str, states: str, device: torch.device) -> tuple[TinyTransformer, FusedAdam]:
    with device:
        model = quantized_transformer(recipe_name, CONFIG, sharded=True)
    return model, FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01, **STATES[states])


def _train(model, optimizer, steps: range, rank: int, world_size: int) -> list[float]:
    return train(model, TASK, steps=steps, batch_size=BATCH, optimizer=optimizer, batch_slice=(rank, world_size))


def _full_states(model: TinyTransformer, optimizer: FusedAdam) -> dict[str, torch.Tensor]:
    """Every optimizer state (masters in either weight form, moments, steps) and every module buffer
    (amax histories, stochastic-rounding counters) as full tensors' raw bits on the CPU: equal on
    every rank, whatever the world size."""
    _, optimizer_state = get_state_dict(model, optimizer)
    full = {}
    for fqn, state in optimizer_state["state"].items():
        for key, value in state.items():
            if isinstance(value, DTensor):  # gathered as bytes: gloo has no FP8 or int16 collectives
                shape = (*value.shape[:-1], value.shape[-1] * value.dtype.itemsize)
                value = DTensor.from_local(
                    raw_bits(value.to_local()),
                    value.device_mesh,
                    value.placements,
                    shape=shape,
                    stride=torch.empty(shape, device="meta").stride(),
                ).full_tensor()
            full[f"{fqn}/{key}"] = raw_bits(value.reshape(-1))
    full.update({name: raw_bits(b.reshape(-1)) for name, b in model.named_buffers()})
    return {k: v.to("cpu", copy=True) for k, v in full.items()}  # training goes on after it


def _save(model, optimizer, directory: pathlib.Path, rank: int, world_size: int, steps: range) -> None:
    """Saves `directory`/checkpoint, then trains `steps` on: the full states and these losses (the
    uninterrupted run) go to `directory`/saved.pt."""
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / "checkpoint")
    states = _full_states(model, optimizer)
    losses = _train(model, optimizer, steps, rank, world_size)
    if rank == 0:
        torch.save({"states": states, "losses": losses}, directory / "saved.pt")
    dist.barrier()


def _resumed(
    case: tuple[str, str], directory: pathlib.Path, rank: int, world_size: int, steps: range, tolerance: float
):
    """A fresh model and optimizer loaded from `directory`: every state bit for bit as saved, then
    `steps` trained to the uninterrupted run's losses within `tolerance` (relative)."""
    saved = torch.load(directory / "saved.pt", weights_only=True)
    model, optimizer = _built(*case, _device(rank))
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=directory / "checkpoint")
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    loaded = _full_states(model, optimizer)
    assert loaded.keys() == saved["states"].keys(), (case, sorted(loaded.keys() ^ saved["states"].keys()))
    different = [k for k, v in saved["states"].items() if not torch.equal(loaded[k], v)]
    assert not different, (case, directory.name, world_size, different)
    worst = _worst(_train(model, optimizer, steps, rank, world_size), saved["losses"])
    if rank == 0:
        print(f"{case} {directory.name} -> {world_size}: states bitwise, loss difference {worst:.2e}", flush=True)
    assert worst <= tolerance, (case, directory.name, world_size, worst)
    return model, optimizer


def _first_layout(rank: int, world_size: int, root: pathlib.Path) -> None:
    """Trains SAVE_STEP steps and saves root/<case>/first; then resumes from it on this layout."""
    after = range(SAVE_STEP, SAVE_STEP + STEPS_AFTER_LOAD)
    for case in CASES:
        directory = root / "-".join(case) / "first"
        directory.mkdir(parents=True, exist_ok=True)
        model, optimizer = _built(*case, _device(rank))
        _train(model, optimizer, range(SAVE_STEP), rank, world_size)
        _save(model, optimizer, directory, rank, world_size, after)
        _resumed(case, directory, rank, world_size, after, SAME_LAYOUT_TOLERANCE)


def _other_layout(rank: int, world_size: int, root: pathlib.Path) -> None:
    """Resumes root/<case>/first on this world size (states bitwise, losses within LOSS_TOLERANCE:
    another world size sums gradients in another order and quantizes per-tensor activations per
    slice), then saves root/<case>/second after those steps."""
    after = range(SAVE_STEP, SAVE_STEP + STEPS_AFTER_LOAD)
    for case in CASES:
        model, optimizer = _resumed(case, root / "-".join(case) / "first", rank, world_size, after, LOSS_TOLERANCE)
        directory = root / "-".join(case) / "second"
        directory.mkdir(parents=True, exist_ok=True)
        _save(model, optimizer, directory, rank, world_size, range(after.stop, after.stop + STEPS_AFTER_LOAD))


def _back_on_first_layout(rank: int, world_size: int, root: pathlib.Path) -> None:
    after = range(SAVE_STEP + STEPS_AFTER_LOAD, SAVE_STEP + 2 * STEPS_AFTER_LOAD)
    for case in CASES:
        _resumed(case, root / "-".join(case) / "second", rank, world_size, after, LOSS_TOLERANCE)


def test_checkpoints_resume_and_reshard_two_gpus_to_one_and_back(tmp_path):
    """Every recipe and FusedAdam state configuration: saved on 2 GPUs, resumed there; loaded on
    1 GPU, trained on and saved; loaded back on 2 GPUs."""
    _needs_gpus(2)
    run_ranks(_first_layout, 2, tmp_path, backend="nccl")
    run_ranks(_other_layout, 1, tmp_path, backend="nccl")
    run_ranks(_back_on_first_layout, 2, tmp_path, backend="nccl")

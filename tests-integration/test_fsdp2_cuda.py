"""FSDP2 with quantized weights on two GPUs over NCCL: the gathered weights equal the unsharded
quantization bit for bit, bytes on the wire, and a few training steps, for every recipe and mode;
memory allocated after each of 300 steps stays flat (every recipe, both weight modes, eager and
compiled). On one GPU: FusedAdam's steps on FSDP2-sharded quantized weights make no host sync."""

from __future__ import annotations

import contextlib
import copy
import itertools
import pathlib
import time

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import quant_fsdp
import quant_tensors as qt
from quant_core.testing import no_host_syncs, raw_bits
from quant_lab.demo import MarkovTask, MasterWeights, TinyTransformer, TransformerConfig, run_ranks
from quant_lab.demo._launch import load_by_path
from quant_lab.testing import count_all_gather_bytes, quantized_transformer
from quant_optim import FusedAdam

pytestmark = pytest.mark.cuda
RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
WIDTHS = (1024, 2048, 1024)


def _train_and_gather(rank: int, world_size: int, mode: str) -> None:
    device = torch.device("cuda", rank)
    mesh = init_device_mesh("cuda", (world_size,))
    for recipe_name in RECIPES:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *(torch.nn.Linear(a, b, bias=False, device=device) for a, b in itertools.pairwise(WIDTHS))
        )
        qt.convert(model, qt.recipe_from_name(recipe_name), quantized_weights=mode == "quantized-weights")
        for layer in model:
            quant_fsdp.fully_shard(layer, mesh=mesh, quantize_on_gather=mode == "quantize-on-gather")
        quant_fsdp.fully_shard(model, mesh=mesh, quantize_on_gather=mode == "quantize-on-gather")
        masters = MasterWeights(model)
        optimizer = torch.optim.AdamW(masters.parameters, lr=1e-2)
        torch.manual_seed(rank)
        x = torch.randn(256, WIDTHS[0], device=device)
        for _ in range(3):
            with count_all_gather_bytes() as counted:
                loss = model(x).float().pow(2).mean()
                loss.backward()
            # The quantizers before the next quantization of the weights (mode 1: the requantize
            # in masters.step; mode 2: the unshard below): delayed scaling's history sets the scale.
            quantizers = [copy.deepcopy(layer.weight._local_tensor.quantizer) for layer in model]
            masters.step(optimizer)
            optimizer.zero_grad()
        weights = sum(layer.weight.numel() for layer in model)
        ratio = counted.bytes / (2 * 2 * weights)  # bf16, gathered forward and backward
        assert ratio <= (0.30 if recipe_name == "nvfp4" else 0.52), (recipe_name, ratio)
        assert torch.isfinite(loss)
        for i, layer in enumerate(model):
            local = layer.weight._local_tensor
            hp = (
                local._data
                if isinstance(local, quant_fsdp.QuantizeOnGatherTensor)
                else dict(masters.pairs)[layer.weight]._local_tensor
            )
            full = DTensor.from_local(hp, mesh, layer.weight.placements, run_check=False).full_tensor()
            expected = quantizers[i].quantize(full, amax=full.abs().max() if quantizers[i].per_tensor_amax else None)
            layer.unshard()
            gathered = layer.weight
            # A forward unshard gathers rowwise; MXFP8's columnwise comes with the backward's, into
            # buffers the tensor holds already ([Note: refilled unsharded buffers]).
            assert gathered.usages[0]
            expected.update_usage(columnwise=False)
            for name, buffer in expected.buffers().items():
                if buffer is not None:
                    got = getattr(gathered, name)
                    assert torch.equal(raw_bits(got.reshape(-1)), raw_bits(buffer.reshape(-1))), (recipe_name, i, name)
            layer.reshard()
        if rank == 0:
            print(f"{recipe_name} {mode}: {ratio:.4f}x bf16 bytes, loss {loss.item():.4f}")


@pytest.mark.parametrize("mode", ["quantized-weights", "quantize-on-gather"])
def test_fsdp2_over_nccl(mode):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (scripts/gpu-suite.sh on a 2-GPU machine)")
    run_ranks(_train_and_gather, 2, mode, backend="nccl")


def _fused_adam_steps(rank: int, world_size: int) -> None:
    torch.cuda.set_device(rank)
    config = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
    task = MarkovTask(config.vocab)
    # fp8-delayed reads the skip verdict on the host by design (a requantize pushes its history).
    for recipe_name in ("fp8", "mxfp8", "fp8-block", "nvfp4"):
        with torch.device("cuda"):
            model = quantized_transformer(recipe_name, config, sharded=True)
        optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
        for step in range(4):
            inputs, targets = (t.cuda() for t in task.batch(step, 8, config.sequence))
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # FSDP2's fresh gradients: new memory every step
            # The first step writes the quantized bytes from the masters (the verdict on the host).
            with no_host_syncs() if step else contextlib.nullcontext():
                optimizer.step()
        assert torch.isfinite(loss), recipe_name
        assert all(float(optimizer.state[p]["step"]) == 4.0 for p in model.parameters()), recipe_name


def test_fused_adam_steps_on_fsdp2_sharded_weights_make_no_host_sync():
    """A hook that bumped the weight buffers' version counters, or an amax all-reduce read back,
    would bring a sync into every step ([Note: FusedAdam tensor-driven step])."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (scripts/gpu-suite.sh)")
    run_ranks(_fused_adam_steps, 1, backend="nccl")


# ---- the gloo fault scenarios of tests-integration, on 2 GPUs ---------------------------------------


def _gloo_scenario(file: str, name: str):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (scripts/gpu-suite.sh on a 2-GPU machine)")
    return getattr(load_by_path(str(pathlib.Path(__file__).with_name(file))), name)


def test_an_all_gather_that_does_not_complete_is_logged_with_its_weights_on_nccl():
    """NCCL's host does not wait in a gather: the watch follows its completion on the GPU."""
    run_ranks(_gloo_scenario("test_fsdp2_gather.py", "watch_names_a_stuck_gather"), 2, backend="nccl")


def test_ranks_that_disagree_on_the_weights_are_refused_at_fully_shard_on_nccl():
    run_ranks(_gloo_scenario("test_fsdp2_gather.py", "ranks_that_disagree_are_refused"), 2, backend="nccl")


def test_a_nan_gradient_on_one_rank_skips_the_step_on_every_rank_on_nccl():
    run_ranks(_gloo_scenario("test_fused_adam_parity.py", "nan_on_one_rank"), 2, backend="nccl")


# ---- leaks: memory after each step, 300 steps ------------------------------------------------------

LEAK_STEPS = 300
LEAK_WARMUP = 10  # steps before the memory after a step must stay flat (optimizer states, compiles)
LEAK_BOUND_PER_LAYER = 50 * 1024  # bytes: TransformerEngine's bound in its FSDP2 tests
# [Note: memory after a step on NCCL] ProcessGroupNCCL keeps a collective's tensors alive until it
# sees the collective completed (a `wait()` on its work, or its watchdog thread's polling; FSDP2
# waits on streams, not on the work), so the memory allocated after a step can include a layer's
# gather or reduce-scatter buffers, more often on a busy GPU: the likely cause of a 10 MB
# difference between two steps seen once on 2 H200s shared with other tests. A leak grows the
# memory that every step leaves; those buffers come and go. So the growth compared is between
# the least memory of the first and of the last LEAK_WINDOW steps.
LEAK_WINDOW = 50
LEAK_CONFIG = TransformerConfig(vocab=128, hidden=256, layers=2, heads=4, sequence=64)
MODES = ("quantized-weights", "quantize-on-gather")


def _memory_after_each_step(
    rank: int, world_size: int, steps: int, recipes: tuple[str, ...], compiled: bool, out: str
) -> None:
    """For each recipe and weight mode: the growth of the memory allocated after each step ([Note:
    memory after a step on NCCL]), the graphs compiled after step LEAK_WARMUP and the seconds
    taken; saved by rank 0 to `out`."""
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda", (world_size,))
    task = MarkovTask(LEAK_CONFIG.vocab)
    found = {}
    for recipe_name, mode in itertools.product(recipes, MODES):
        start = time.perf_counter()
        torch._dynamo.reset()
        torch.manual_seed(0)
        with torch.device(device):
            model = TinyTransformer(LEAK_CONFIG)
        qt.convert(model, qt.recipe_from_name(recipe_name), quantized_weights=mode == MODES[0])
        for block in model.blocks:
            if compiled:
                block.compile()
            quant_fsdp.fully_shard(block, mesh=mesh, quantize_on_gather=mode == MODES[1])
        quant_fsdp.fully_shard(model, mesh=mesh, quantize_on_gather=mode == MODES[1])
        optimizer = (
            FusedAdam(model.parameters(), lr=1e-3)
            if mode == MODES[0]
            else torch.optim.AdamW(model.parameters(), lr=1e-3)
        )
        counters = torch._dynamo.utils.counters
        counters.clear()
        after, graphs = [], 0
        for step in range(steps):
            if step == LEAK_WARMUP:
                graphs = -counters["stats"]["unique_graphs"]
            inputs, targets = (t.chunk(world_size)[rank].to(device) for t in task.batch(step, 8, LEAK_CONFIG.sequence))
            logits = model(inputs)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if mode == MODES[1]:
                quant_fsdp.sync_amax_(model.parameters())
            del logits, loss
            after.append(torch.cuda.memory_allocated(device))
        graphs += counters["stats"]["unique_graphs"]
        growth = min(after[-LEAK_WINDOW:]) - min(after[LEAK_WARMUP : LEAK_WARMUP + LEAK_WINDOW])
        found[(recipe_name, mode)] = (growth, graphs, time.perf_counter() - start)
        if rank == 0:  # as it goes: a run cut short by a time limit still tells what it saw
            moves = [(s, after[s] - after[s - 1]) for s in range(LEAK_WARMUP + 1, steps) if after[s] != after[s - 1]]
            print(
                f"{recipe_name} {mode}: growth {growth} B, spread {max(after[LEAK_WARMUP:]) - min(after[LEAK_WARMUP:])} B, "
                f"graphs {graphs}, {found[(recipe_name, mode)][2]:.0f} s"
                + (f"; moved at (step, bytes) {moves[:12]}{' ...' if len(moves) > 12 else ''}" if moves else ""),
                flush=True,
            )
        del model, optimizer
    if rank == 0:
        torch.save(found, out)


# Eager: every recipe in one process (13-19 s a configuration on 2 H200s). Compiled: a process per
# recipe, since each configuration compiles its layers with Inductor first (minutes each).
LEAK_CASES = [("eager", RECIPES), *((f"compiled-{r}", (r,)) for r in RECIPES)]


@pytest.mark.parametrize(("case", "recipes"), LEAK_CASES, ids=[case for case, _ in LEAK_CASES])
def test_memory_after_each_step_stays_flat_for_300_steps(tmp_path, case, recipes):
    """A cache that grows (gathered weights, quantized shards, compiled graphs, optimizer plans)
    shows in the memory allocated after each step: the least of steps 251-300 within 50 KiB per
    layer of the least of steps 11-60, and no graph compiled after step 10."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (scripts/gpu-suite.sh on a 2-GPU machine)")
    out = tmp_path / "memory.pt"
    run_ranks(_memory_after_each_step, 2, LEAK_STEPS, recipes, case != "eager", str(out), backend="nccl")
    found = torch.load(out)
    bound = LEAK_BOUND_PER_LAYER * LEAK_CONFIG.layers
    assert {key: v for key, v in found.items() if v[0] > bound or v[1] != 0} == {}
    assert len(found) == len(recipes) * len(MODES)

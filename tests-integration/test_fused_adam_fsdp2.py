"""FusedAdam on FSDP2-sharded quantized weights (gloo): world size 1 equals no FSDP bit for bit;
on 2 ranks one amax all-reduce per step (and one for all fp8 moments) makes every shard's scale
the unsharded one."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import quant_tensors as qt
from quant_core.testing import raw_bits
from quant_lab import demo
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig
from quant_lab.testing import local_bytes, quantized_transformer, run_on_warm_ranks
from quant_optim import FusedAdam

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)


def train(
    model: TinyTransformer, steps: int, rank: int = 0, world_size: int = 1, moment_dtype: torch.dtype = torch.float32
) -> tuple[list[float], FusedAdam]:
    optimizer = FusedAdam(
        model.parameters(), lr=1e-3, weight_decay=0.01, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype
    )
    task = MarkovTask(CONFIG.vocab)
    losses = demo.train(model, task, steps=steps, batch_size=8, optimizer=optimizer, batch_slice=(rank, world_size))
    return losses, optimizer


def _world_1(rank: int, world_size: int) -> None:
    for recipe_name, moment_dtype in [*((r, torch.float32) for r in RECIPES), ("fp8", torch.float8_e4m3fn)]:
        plain, sharded = (
            quantized_transformer(recipe_name, CONFIG, sharded=False),
            quantized_transformer(recipe_name, CONFIG, sharded=True),
        )
        expected, plain_optimizer = train(plain, 10, moment_dtype=moment_dtype)
        got, sharded_optimizer = train(sharded, 10, moment_dtype=moment_dtype)
        assert got == expected, recipe_name
        for (name, p), q in zip(sharded.named_parameters(), plain.parameters(), strict=True):
            assert all(torch.equal(a, b) for a, b in zip(local_bytes(p), local_bytes(q), strict=True)), name
            for key, value in plain_optimizer.state[q].items():
                state = sharded_optimizer.state[p][key]
                assert isinstance(state, DTensor) or key == "step" or key.endswith("_scale_inv"), (name, key)
                local = state._local_tensor if isinstance(state, DTensor) else state
                assert torch.equal(raw_bits(local.reshape(-1)), raw_bits(value.reshape(-1))), (name, key)


def test_world_size_1_equals_no_fsdp_bitwise():
    run_on_warm_ranks(_world_1, 1)


CASES = (
    ("fp8", torch.float32),
    ("nvfp4", torch.float32),
    ("mxfp8", torch.float8_e4m3fn),
    ("fp8", torch.float8_e4m3fn),
)


def _one_amax_all_reduce(rank: int, world_size: int) -> None:
    for recipe_name, moment_dtype in CASES:
        model = quantized_transformer(recipe_name, CONFIG, sharded=True)
        train(model, 2, rank, world_size)
        optimizer = FusedAdam(model.parameters(), lr=1e-3, exp_avg_dtype=moment_dtype, exp_avg_sq_dtype=moment_dtype)
        calls = []
        original = dist.all_reduce

        def counting(tensor, *args, calls=calls, original=original, **kwargs):
            calls.append(tuple(tensor.shape))
            return original(tensor, *args, **kwargs)

        inputs, targets = MarkovTask(CONFIG.vocab).batch(0, 8, CONFIG.sequence)
        logits = model(inputs.chunk(world_size)[rank])
        F.cross_entropy(logits.reshape(-1, CONFIG.vocab), targets.chunk(world_size)[rank].reshape(-1)).backward()
        dist.all_reduce = counting
        try:
            optimizer.step()
        finally:
            dist.all_reduce = original
        quantized = [p for p in model.parameters() if qt.local_quantized(p) is not None]
        per_tensor = [p for p in quantized if qt.local_quantized(p).quantizer.per_tensor_amax]
        fp8_moments = 2 * len(list(model.parameters())) if moment_dtype != torch.float32 else 0
        # One all-reduce agrees on skipping (non-finite gradients); the fp8 moments' amaxes travel
        # in one, before the update; then one carries every per-tensor weight's amax.
        weights = [(len(per_tensor),)] if per_tensor else []
        moments = calls[1 : len(calls) - len(weights)]
        assert calls[0] == (), (recipe_name, calls)
        assert calls[len(calls) - len(weights) :] == weights, (recipe_name, calls)
        assert sum(shape[0] for shape in moments) == fp8_moments, (recipe_name, calls)
        assert len(moments) == (1 if fp8_moments else 0), calls
        for p in per_tensor:  # every shard holds the scale (FP8) or global amax (NVFP4) of the whole
            local = p._local_tensor
            scalar = local.buffers()["scale_inv" if "scale_inv" in local.buffers() else "amax"]
            assert_equal_on_every_rank(scalar, world_size, recipe_name)
            full_amax = optimizer.state[p]["master"].full_tensor().abs().max()
            if recipe_name == "nvfp4":
                assert torch.equal(local.amax, full_amax)
        for p in model.parameters() if fp8_moments else ():
            state = optimizer.state[p]
            for key in ("exp_avg", "exp_avg_sq"):  # one scale for the whole moment, from its full amax
                assert_equal_on_every_rank(state[f"{key}_scale_inv"], world_size, key)
                # (gloo cannot move fp8 tensors, so no full_tensor(): the codes' largest magnitude
                # over all shards is the format's max, which only the full amax gives everywhere)
                codes = state[key]._local_tensor.float()
                largest = codes.abs().max() if codes.numel() else torch.zeros(())
                dist.all_reduce(largest, op=dist.ReduceOp.MAX)
                assert largest.item() == torch.finfo(moment_dtype).max, (key, largest)


def assert_equal_on_every_rank(scalar: torch.Tensor, world_size: int, what: str) -> None:
    everyone = [torch.empty_like(scalar) for _ in range(world_size)]
    dist.all_gather(everyone, scalar)
    assert all(torch.equal(s, scalar) for s in everyone), what


def test_one_amax_all_reduce_per_step_on_two_ranks():
    run_on_warm_ranks(_one_amax_all_reduce, 2)


def _torch_sharded(recipe_name: str) -> TinyTransformer:
    torch.manual_seed(0)
    model = qt.convert(TinyTransformer(CONFIG), qt.recipe_from_name(recipe_name), quantized_weights=True)
    for block in model.blocks:
        torch_fully_shard(block)
    torch_fully_shard(model)
    return model


def _load_before_any_gather(rank: int, world_size: int, folder: str) -> None:
    for recipe_name in ("fp8", "nvfp4"):
        saved, resumed = _torch_sharded(recipe_name), _torch_sharded(recipe_name)
        _, optimizer = train(saved, 2, rank, world_size)
        model_state, optimizer_state = get_state_dict(saved, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"{folder}/{recipe_name}")
        resumed_optimizer = FusedAdam(resumed.parameters(), lr=1e-3, weight_decay=0.01)
        model_state, optimizer_state = get_state_dict(resumed, resumed_optimizer)
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=f"{folder}/{recipe_name}")
        set_state_dict(resumed, resumed_optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        quantized = 0
        for (name, a), b in zip(saved.named_parameters(), resumed.parameters(), strict=True):
            quantized += qt.local_quantized(b) is not None
            assert all(torch.equal(x, y) for x, y in zip(local_bytes(a), local_bytes(b), strict=True)), (
                recipe_name,
                name,
            )
        assert quantized > 0


def test_load_under_torchs_fully_shard_before_any_gather_requantizes_with_the_whole_amax(tmp_path):
    """torch's fully_shard binds a per-tensor quantizer's amax group at its first gather; a
    checkpoint loaded before that (as torchtitan resumes) requantizes the weights from their
    shards of the masters with the whole tensor's amax all the same: bit for bit the saving run's
    bytes, on the rank whose shard holds the largest value and on the others."""
    run_on_warm_ranks(_load_before_any_gather, 2, str(tmp_path))

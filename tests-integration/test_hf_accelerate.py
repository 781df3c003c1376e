"""Hugging Face Accelerate's FSDP2 (`FullyShardedDataParallelPlugin(fsdp_version=2)`) over a
`qt.convert`-ed transformers `LlamaForCausalLM` (2 layers, hidden 64), on 2 gloo ranks.

`Accelerator(cpu=True)` picks the MULTI_CPU distributed type, under which `prepare` leaves the model
unsharded. The test sets its state's distributed type to FSDP after construction, so
`accelerator.prepare(model, optimizer)` runs Accelerate's own FSDP2 path (`_prepare_fsdp2`:
`fsdp2_prepare_model`, `fully_shard` per `LlamaDecoderLayer`, the embedding and the tail, the fp32
upcast under mixed precision, the optimizer's parameter swap), the code it runs on GPUs.
All scenarios share one warm world of 2 ranks.
"""

from __future__ import annotations

import math
import os
import tempfile

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import quant_fsdp
import quant_optim
import quant_tensors as qt
from quant_lab.testing import count_all_gather_bytes, run_on_warm_ranks

VOCAB = 256
SEQUENCE = 32
BATCH = 2
LAYERS = 2
STEPS = 3
# Relative loss gap to bf16 over 3 steps (loss ~5.5): measured ~1e-4 for FP8, ~3e-3 for NVFP4; the
# bounds catch a broken layer (a wrong scale or a lost optimizer mapping moves it by far more).
RTOL = {"fp8": 1e-2, "nvfp4": 3e-2}
RECIPES = {"fp8": qt.Float8CurrentScaling, "nvfp4": qt.NVFP4BlockScaling}


def _config():
    import transformers

    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
    )


def _accelerator(**plugin_options):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import MixedPrecisionPolicy

    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        **plugin_options,
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision="bf16")
    accelerator.state.distributed_type = DistributedType.FSDP  # see the module docstring
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def _build(recipe: str | None, **plugin_options):
    """The documented lines: convert, FusedAdam over the unsharded model, accelerator.prepare."""
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16)
    if recipe is not None:
        qt.convert(model, RECIPES[recipe](), quantized_weights=True)
    optimizer = quant_optim.FusedAdam(model.parameters(), lr=1e-3)
    accelerator = _accelerator(**plugin_options)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _train(accelerator, model, optimizer, rank: int, steps: int, first: int = 0) -> list[float]:
    losses = []
    for step in range(first, first + steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQUENCE), generator=torch.Generator().manual_seed(step * 8 + rank))
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total := loss.detach().float() / dist.get_world_size())
        losses.append(total.item())
    return losses


def _setup_env(rank: int, world_size: int) -> None:
    """Accelerate's state reads the launcher's variables; the process group already exists."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")


def _parity_and_gathered_bytes(rank: int, world_size: int) -> None:
    _setup_env(rank, world_size)
    losses, gathered = {}, {}
    quant_fsdp.reset_comm_stats()
    for recipe in (None, "fp8", "nvfp4"):
        accelerator, model, optimizer = _build(recipe)
        weights = [p for n, p in model.named_parameters() if "layers." in n and "proj" in n]
        if recipe is not None:
            assert all(isinstance(qt.local_shard(p), qt.QuantizedTensor) for p in weights)
            assert quant_fsdp.count_gathers(model) == len(weights) + 1  # the projections and the lm_head
            # Accelerate swapped FusedAdam's parameters for the sharded ones, one for one
            owned = [p for group in optimizer.param_groups for p in group["params"]]
            assert {id(p) for p in owned} == {id(p) for p in model.parameters()}
        with count_all_gather_bytes() as gathered[recipe]:
            losses[recipe] = _train(accelerator, model, optimizer, rank, STEPS)
    for recipe in ("fp8", "nvfp4"):
        for reference, got in zip(losses[None], losses[recipe], strict=True):
            assert math.isfinite(got), losses
            assert abs(got - reference) <= RTOL[recipe] * abs(reference), (losses, recipe)
        assert losses[recipe] != losses[None]
    stats = quant_fsdp.comm_stats()
    assert stats["per-tensor FP8"]["quantized"] > 0, stats
    assert stats["per-tensor FP8"]["fallback"] == 0, stats
    assert stats["NVFP4"]["quantized"] > 0, stats
    assert stats["NVFP4"]["fallback"] == 0, stats
    # Same FSDP units and gathers in the same order: those of the decoder layers (quantized
    # projections + two bf16 norm weights, forward and backward) and of the tail (final norm +
    # the quantized lm_head, gathered once: reshard_after_forward=False) shrink; the embedding's do not.
    bf16, fp8 = gathered[None].sizes, gathered["fp8"].sizes
    assert len(bf16) == len(fp8)
    blocks = [(a, b) for a, b in zip(bf16, fp8, strict=True) if a != b]
    assert len(blocks) == STEPS * (2 * LAYERS + 1), (bf16, fp8)
    ratio = sum(b for _, b in blocks) / sum(a for a, _ in blocks)
    assert ratio <= 0.52, ratio


def _checkpoint_resume(rank: int, world_size: int) -> None:
    """DCP of model + FusedAdam, as docs/checkpointing.md makes it, resumed on a model prepared again."""
    _setup_env(rank, world_size)
    accelerator, model, optimizer = _build("nvfp4")
    _train(accelerator, model, optimizer, rank, 2)
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    model_sd, optim_sd = get_state_dict(model, optimizer.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(folder[0], "dcp"))
    expected = _train(accelerator, model, optimizer, rank, 2, first=2)

    accelerator, resumed, resumed_optimizer = _build("nvfp4")
    model_sd, optim_sd = get_state_dict(resumed, resumed_optimizer.optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=os.path.join(folder[0], "dcp"))
    set_state_dict(
        resumed, resumed_optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    assert _train(accelerator, resumed, resumed_optimizer, rank, 2, first=2) == expected


def _save_pretrained_is_plain(rank: int, world_size: int) -> None:
    """export_state_dict (FusedAdam's fp32 masters as bf16, keyed like the unconverted model) +
    save_pretrained on rank 0: from_pretrained loads exactly the plain keys, bit for bit."""
    import safetensors.torch
    import transformers

    _setup_env(rank, world_size)
    accelerator, resumed, resumed_optimizer = _build("nvfp4")
    _train(accelerator, resumed, resumed_optimizer, rank, 2)
    assert any(key.endswith("_quantizer_state") for key in resumed.state_dict())  # the model has them
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    exported = quant_fsdp.export_state_dict(resumed, resumed_optimizer.optimizer, dtype=torch.bfloat16)
    if rank != 0:
        assert exported == {}
        return
    plain_keys = set(transformers.LlamaForCausalLM(_config()).state_dict())
    assert set(exported) == plain_keys
    expected_values = {key: value.clone() for key, value in exported.items()}
    resumed.save_pretrained(os.path.join(folder[0], "hf"), state_dict=exported)
    saved = safetensors.torch.load_file(os.path.join(folder[0], "hf", "model.safetensors"))
    assert set(saved) == plain_keys
    assert {value.dtype for value in saved.values()} == {torch.bfloat16}
    loaded = transformers.LlamaForCausalLM.from_pretrained(os.path.join(folder[0], "hf"), dtype=torch.bfloat16)
    assert set(loaded.state_dict()) == plain_keys
    for key, value in loaded.state_dict().items():
        assert value.dtype == torch.bfloat16, key
        assert torch.equal(value, expected_values[key]), key
    fresh = transformers.LlamaForCausalLM(_config()).to(torch.bfloat16)
    fresh.load_state_dict(saved, strict=True)


def test_fp8_and_nvfp4_train_like_bf16_and_gather_quantized_bytes() -> None:
    run_on_warm_ranks(_parity_and_gathered_bytes, 2)


def test_dcp_resume_is_bitwise() -> None:
    run_on_warm_ranks(_checkpoint_resume, 2)


def test_save_pretrained_is_plain() -> None:
    run_on_warm_ranks(_save_pretrained_is_plain, 2)

"""The Transformers `Trainer` with FSDP2 (`fsdp_config={"version": 2}`) over a `qt.convert`-ed
`LlamaForCausalLM` (2 layers, hidden 64) and FusedAdam (`optimizer_cls_and_kwargs`), on 2 gloo ranks.

On the CPU the Trainer builds an `Accelerator` whose distributed type is MULTI_CPU, under which
`prepare` leaves the model unsharded. `_FsdpOnCpu` sets the type to FSDP (with the plugin the
Trainer built from its arguments) right after the Trainer makes its Accelerator, as
test_hf_accelerate.py does, so the Trainer runs Accelerate's FSDP2 path: `fully_shard` per
`LlamaDecoderLayer` and of the root, the optimizer built on the sharded parameters, sharded
checkpoints (`state_dict_type: SHARDED_STATE_DICT`, DCP) and `resume_from_checkpoint`.
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

import quant_optim
import quant_tensors as qt
from quant_lab.testing import run_on_warm_ranks

VOCAB = 256
SEQUENCE = 32
STEPS = 4
SAVE_AT = 2


class _Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank for a given index (the Trainer's sampler
    gives each rank its own indices)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = torch.randint(0, VOCAB, (SEQUENCE,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": tokens, "labels": tokens}


def _trainer(output_dir: str, recipe: str | None, max_steps: int):
    import transformers
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    class _FsdpOnCpu(transformers.Trainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            self.accelerator.state.distributed_type = DistributedType.FSDP  # see the module docstring
            self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            self.is_fsdp_enabled = True

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQUENCE,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    # The documented lines: convert the model, hand the Trainer FusedAdam as its optimizer class.
    if recipe is not None:
        qt.convert(model, qt.recipe_from_name(recipe), quantized_weights=True)
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_steps=SAVE_AT,
        save_strategy="steps",
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        fsdp="full_shard",
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )
    return _FsdpOnCpu(
        model=model,
        args=args,
        train_dataset=_Tokens(),
        optimizer_cls_and_kwargs=(quant_optim.FusedAdam, {"lr": 1e-3}),
    )


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _train_save_resume(rank: int, world_size: int) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    losses = {}
    for recipe in (None, "fp8"):
        trainer = _trainer(os.path.join(folder[0], str(recipe)), recipe, STEPS)
        trainer.train()
        losses[recipe] = _losses(trainer)
        assert len(losses[recipe]) == STEPS, trainer.state.log_history
    model = trainer.model
    weights = [p for n, p in model.named_parameters() if "layers." in n and "proj" in n]
    assert weights
    assert all(isinstance(qt.local_shard(p), qt.QuantizedTensor) for p in weights)
    assert isinstance(trainer.optimizer.optimizer, quant_optim.FusedAdam)
    for reference, got in zip(losses[None], losses["fp8"], strict=True):
        assert math.isfinite(got), losses
        assert abs(got - reference) <= 1e-2 * abs(reference), losses
    assert losses["fp8"] != losses[None]
    # Resumed from the checkpoint of step SAVE_AT, the last steps repeat bit for bit.
    resumed = _trainer(os.path.join(folder[0], "fp8"), "fp8", STEPS)
    resumed.train(resume_from_checkpoint=os.path.join(folder[0], "fp8", f"checkpoint-{SAVE_AT}"))
    assert _losses(resumed)[-(STEPS - SAVE_AT) :] == losses["fp8"][SAVE_AT:], (_losses(resumed), losses)


def test_trainer_trains_fp8_like_bf16_and_resumes_bitwise() -> None:
    run_on_warm_ranks(_train_save_resume, 2)

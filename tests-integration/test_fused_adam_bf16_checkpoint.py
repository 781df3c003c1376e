"""torch.distributed.checkpoint with FusedAdam(master_weight_dtype=torch.bfloat16) on FSDP2 (gloo,
CPU, 2 ranks): a run resumed from a checkpoint continues bit for bit (weights, bf16 masters,
moments, stochastic-rounding counters), for a weight held quantized (mxfp8) and one held in high
precision by quant-fsdp's alignment fallback (blockwise FP8's 128-row blocks split over 2 ranks);
checkpoints of the other master dtype are refused: a bf16-master optimizer's load by DCP's planner
(the fp32 checkpoint lacks the counters) before anything changes, an fp32-master optimizer's by
FusedAdam naming the fix (after dcp.load wrote the checkpoint's values into the tensors that
get_state_dict handed out, as DCP does)."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from quant_core.testing import raw_bits
from quant_lab import demo
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig
from quant_lab.testing import local_state_bytes, quantized_transformer, run_on_warm_ranks
from quant_optim import FusedAdam

RECIPES = ("mxfp8", "fp8-block")
CONFIG = TransformerConfig(vocab=128, hidden=128, layers=1, heads=2, sequence=32)
BATCH = 8
SAVE_STEP, LAST_STEP = 3, 6
WORLD_SIZE = 2


def build(recipe_name: str, master_weight_dtype: torch.dtype = torch.bfloat16) -> tuple[TinyTransformer, FusedAdam]:
    model = quantized_transformer(recipe_name, CONFIG, sharded=True)
    return model, FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01, master_weight_dtype=master_weight_dtype)


def train(model: TinyTransformer, optimizer: FusedAdam, steps: range, rank: int) -> None:
    task = MarkovTask(CONFIG.vocab)
    demo.train(model, task, steps=steps, batch_size=BATCH, optimizer=optimizer, batch_slice=(rank, WORLD_SIZE))


def load(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def snapshot(model: TinyTransformer, optimizer: FusedAdam) -> dict[str, list[torch.Tensor]]:
    state = local_state_bytes(model, optimizer)
    state.update({name: [raw_bits(b.reshape(-1)).clone()] for name, b in model.named_buffers()})
    return state


def save(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> None:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)


def refusal(model: TinyTransformer, optimizer: FusedAdam, path: pathlib.Path) -> str:
    try:
        load(model, optimizer, path)
    except (Exception, CheckpointException) as error:  # DCP's exception is a BaseException
        return str(error)
    return ""


def _save_resume_and_refuse(rank: int, world_size: int, root: pathlib.Path) -> None:
    results = {}
    for recipe_name in RECIPES:
        path = root / recipe_name
        model, optimizer = build(recipe_name)
        train(model, optimizer, range(SAVE_STEP), rank)
        save(model, optimizer, path)
        train(model, optimizer, range(SAVE_STEP, LAST_STEP), rank)
        uninterrupted = snapshot(model, optimizer)
        counters = sorted(k for k in uninterrupted if k.endswith("/master_rounding_counter"))

        model, optimizer = build(recipe_name)
        load(model, optimizer, path)
        train(model, optimizer, range(SAVE_STEP, LAST_STEP), rank)
        resumed = snapshot(model, optimizer)

        model, optimizer = build(recipe_name, torch.float32)
        save(model, optimizer, root / f"{recipe_name}-fp32")
        refused_fp32 = refusal(model, optimizer, path)
        model, optimizer = build(recipe_name)
        before = snapshot(model, optimizer)
        results[recipe_name] = {
            "resumed_equal": resumed.keys() == uninterrupted.keys()
            and all(
                all(torch.equal(a, b) for a, b in zip(resumed[k], uninterrupted[k], strict=True)) for k in uninterrupted
            ),
            "counters": counters,
            "fp32 refusal": refused_fp32,
            "bf16 refusal": refusal(model, optimizer, root / f"{recipe_name}-fp32"),
            "refused_unchanged": all(
                all(torch.equal(a, b) for a, b in zip(v, before[k], strict=True))
                for k, v in snapshot(model, optimizer).items()
            ),
        }
    if rank == 0:
        torch.save(results, root / "results.pt")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fused_adam_bf16_dcp")
    run_on_warm_ranks(_save_resume_and_refuse, WORLD_SIZE, root)
    return torch.load(root / "results.pt", weights_only=True)


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_a_resumed_run_continues_bitwise(results, recipe_name):
    assert results[recipe_name]["counters"]  # the weights' bf16 masters and their counters were compared
    assert results[recipe_name]["resumed_equal"]


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_checkpoints_of_the_other_master_dtype_are_refused(results, recipe_name):
    assert re.search(
        r"holds masters as torch.bfloat16 .* load with master_weight_dtype=torch.bfloat16",
        results[recipe_name]["fp32 refusal"],
    )
    assert re.search(
        r"Missing key in checkpoint state_dict: optimizer\.state\..*\.master_rounding_counter",
        results[recipe_name]["bf16 refusal"],
    )
    assert results[recipe_name]["refused_unchanged"]

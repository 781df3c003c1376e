"""A rank killed in the middle of a DCP save leaves the last complete checkpoint loadable, and the
run resumes from it bitwise (docs/checkpointing.md, "Interrupted saves").

torch.distributed.checkpoint writes a checkpoint's `.metadata` last, from the coordinator (rank 0),
after every rank has reported its writes: a directory without it is incomplete, and `dcp.load`
refuses it. Here 2 gloo ranks train fp8 quantized weights with FusedAdam, save after step 3,
train steps 3 and 4 (their losses are the uninterrupted run's), and save again while rank 1 kills
itself (SIGKILL) right after writing its own files. Fresh ranks then find the second checkpoint
incomplete, fail to load it without changing anything, load the first and train steps 3 and 4
again: the same losses bit for bit.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from quant_lab.demo import MarkovTask, TransformerConfig, run_ranks, train
from quant_lab.testing import local_state_bytes, quantized_transformer
from quant_optim import FusedAdam

CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
BATCH = 8
SAVED_AT, LAST = 3, 5  # steps 0-2 before the complete checkpoint, 3-4 after it


def _build() -> tuple[torch.nn.Module, FusedAdam]:
    model = quantized_transformer("fp8", CONFIG, sharded=True)
    return model, FusedAdam(model.parameters(), lr=1e-3)


def _train(model: torch.nn.Module, optimizer: FusedAdam, steps: range) -> list[float]:
    task = MarkovTask(CONFIG.vocab)
    slices = (dist.get_rank(), dist.get_world_size())
    return train(model, task, steps=steps, batch_size=BATCH, optimizer=optimizer, batch_slice=slices)


def _states(model: torch.nn.Module, optimizer: FusedAdam) -> dict:
    model_state, optimizer_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def _train_save_and_die(rank: int, world_size: int, root: pathlib.Path) -> None:
    model, optimizer = _build()
    _train(model, optimizer, range(SAVED_AT))
    dcp.save(_states(model, optimizer), checkpoint_id=root / "complete")
    losses = _train(model, optimizer, range(SAVED_AT, LAST))
    if rank == 0:
        (root / "uninterrupted.json").write_text(json.dumps([loss.hex() for loss in losses]))
    dist.barrier()
    writer = dcp.FileSystemWriter(root / "interrupted")
    if rank == 1:
        write_data = writer.write_data

        def write_then_die(plan, planner):
            result = write_data(plan, planner)
            result.wait()
            os.kill(os.getpid(), signal.SIGKILL)

        writer.write_data = write_then_die
    dcp.save(_states(model, optimizer), storage_writer=writer)


def _resume(rank: int, world_size: int, root: pathlib.Path) -> None:
    model, optimizer = _build()
    _train(model, optimizer, range(1))  # optimizer states exist, so a failed load has something to keep
    before = local_state_bytes(model, optimizer)
    states = _states(model, optimizer)
    with pytest.raises(CheckpointException) as failed:  # every rank: no .metadata to read
        dcp.load(states, checkpoint_id=root / "interrupted")
    assert "interrupted/.metadata" in str(failed.value.failures)
    after = local_state_bytes(model, optimizer)  # the failed load changed nothing
    assert after.keys() == before.keys()
    for name, tensors in after.items():
        assert all(map(torch.equal, tensors, before[name])), name
    states = _states(model, optimizer)
    dcp.load(states, checkpoint_id=root / "complete")
    set_state_dict(model, optimizer, model_state_dict=states["model"], optim_state_dict=states["optimizer"])
    losses = _train(model, optimizer, range(SAVED_AT, LAST))
    assert [loss.hex() for loss in losses] == json.loads((root / "uninterrupted.json").read_text())


def test_a_rank_killed_mid_save_leaves_the_last_complete_checkpoint_to_resume_from(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="signal SIGKILL"):
        run_ranks(_train_save_and_die, 2, tmp_path)
    assert (tmp_path / "complete" / ".metadata").exists()
    assert any((tmp_path / "interrupted").iterdir())  # rank 1 wrote its files ...
    assert not (tmp_path / "interrupted" / ".metadata").exists()  # ... and the save never completed
    run_ranks(_resume, 2, tmp_path)

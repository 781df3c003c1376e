"""A long run killed in the middle resumes from its newest complete checkpoint to the losses of the
run that was never interrupted (docs/checkpointing.md, "Interrupted saves").

fp8 quantized weights with FusedAdam on 2 ranks, a DCP save every EVERY steps into a directory of
its own (`step-<n>`). The interrupted run, in processes of its own, loses rank 1 to SIGKILL between
two saves; the ranks of another process group load the newest directory holding a `.metadata` and
train to the end. On gloo (CI: 40 steps, a save every 10, the kill at step 25; the uninterrupted
and the resumed run on warm ranks, [Note: warm ranks] in quant_lab.testing) every loss after the
resume equals the uninterrupted run's bit for bit. On 2 GPUs over NCCL (the 2-GPU suite: 2000
steps, a save every 500, the kill at step 1250) the losses agree within NCCL_TOLERANCE: CUDA's
attention backward may sum in another order from one run to the next, so two uninterrupted runs
need not be bitwise equal either; the largest difference is printed.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from quant_lab.demo import MarkovTask, TransformerConfig, run_ranks, train
from quant_lab.testing import quantized_transformer, run_on_warm_ranks
from quant_optim import FusedAdam

CONFIG = TransformerConfig(vocab=128, hidden=128, layers=2, heads=2, sequence=32)
BATCH = 8
NCCL_TOLERANCE = 5e-3  # relative, every step after the resume: the NCCL tests' loss tolerance


def _run(rank: int, world_size: int, root: pathlib.Path, steps: int, every: int, dies_at: int | None) -> None:
    """Trains to `steps` from the newest complete checkpoint under `root` (or from scratch), saving
    every `every` steps; with `dies_at`, rank 1 kills itself before that step. Rank 0 writes each
    step's loss to root/losses-from-<first step>.json."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    with device:
        model = quantized_transformer("fp8", CONFIG, sharded=True)
    optimizer = FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    complete = sorted(int(d.name.removeprefix("step-")) for d in root.glob("step-*") if (d / ".metadata").exists())
    first = complete[-1] if complete else 0
    if first:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        states = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(states, checkpoint_id=root / f"step-{first}")
        set_state_dict(model, optimizer, model_state_dict=states["model"], optim_state_dict=states["optimizer"])

    def after_step(step: int, loss: float) -> None:
        if (step + 1) % every == 0:
            model_state, optimizer_state = get_state_dict(model, optimizer)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=root / f"step-{step + 1}")
        if rank == 1 and step + 1 == dies_at:
            os.kill(os.getpid(), signal.SIGKILL)

    losses = train(
        model,
        MarkovTask(CONFIG.vocab),
        steps=range(first, steps),
        batch_size=BATCH,
        optimizer=optimizer,
        batch_slice=(rank, world_size),
        on_step=after_step,
    )
    if rank == 0:
        (root / f"losses-from-{first}.json").write_text(json.dumps([loss.hex() for loss in losses]))


def _killed_and_resumed(root: pathlib.Path, steps: int, every: int, dies_at: int, backend: str) -> tuple[list, list]:
    """The uninterrupted run's losses from the resume point on, and the resumed run's. The killed
    run's ranks are processes of their own; on gloo, the other two runs take warm ranks."""
    launch = run_on_warm_ranks if backend == "gloo" else functools.partial(run_ranks, backend=backend)
    launch(_run, 2, root / "uninterrupted", steps, every, None)
    with pytest.raises(mp.ProcessExitedException, match="signal SIGKILL"):
        run_ranks(_run, 2, root / "interrupted", steps, every, dies_at, backend=backend)
    resumed_from = dies_at // every * every
    assert not (root / "interrupted" / f"step-{resumed_from + every}").exists()
    launch(_run, 2, root / "interrupted", steps, every, None)
    uninterrupted = json.loads((root / "uninterrupted" / "losses-from-0.json").read_text())
    resumed = json.loads((root / "interrupted" / f"losses-from-{resumed_from}.json").read_text())
    return [float.fromhex(h) for h in uninterrupted[resumed_from:]], [float.fromhex(h) for h in resumed]


@pytest.fixture
def long_run_root(tmp_path: pathlib.Path) -> pathlib.Path:
    for run in ("uninterrupted", "interrupted"):
        (tmp_path / run).mkdir()
    return tmp_path


def test_a_run_killed_between_saves_resumes_to_the_uninterrupted_losses(long_run_root):
    want, got = _killed_and_resumed(long_run_root, steps=40, every=10, dies_at=25, backend="gloo")
    assert len(got) == 20
    assert [loss.hex() for loss in got] == [loss.hex() for loss in want]


@pytest.mark.cuda
def test_a_2000_step_run_on_two_gpus_killed_between_saves_resumes_to_the_uninterrupted_losses(long_run_root):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (scripts/gpu-suite.sh --multi on a 2-GPU machine)")
    want, got = _killed_and_resumed(long_run_root, steps=2000, every=500, dies_at=1250, backend="nccl")
    assert len(got) == 1000
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    bitwise = sum(g == w for g, w in zip(got, want, strict=True))
    print(f"2000 steps, resumed at 1000: {bitwise} of 1000 losses bitwise equal, largest difference {worst:.2e}")
    assert worst <= NCCL_TOLERANCE, worst

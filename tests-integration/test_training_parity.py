"""Single-process training parity: every recipe trains TinyTransformer like bf16 does.

AdamW steps (4 sequences of 64 tokens each) on the synthetic Markov task, same seeds (initial
weights and batches) for every run, TinyTransformer with 2 blocks (every kind of quantized Linear
the 4-block default has, at half its cost; the bf16 loss reaches ~1.49 in 100 steps). bf16 and
NVFP4 train 100 steps, the FP8 recipes 50. A run's final loss (mean of its last 10 steps) must be
within 0.4% of the bf16 run's over the same steps for the FP8 recipes and within 2% for NVFP4,
either way, with high-precision weights and with quantized primary weights.

The runs are deterministic on one CPU but not from one CPU to another: torch's CPU GEMMs and
reductions round differently with the instruction set, and training carries the differences on.
Measured (torch 2.13; docs/benchmarks.md, "Training parity, single process, CPU"): after 100
steps, on three CPUs and on one of them with torch's kernels limited to SSE4.2, the FP8 recipes at
most 0.21% from bf16, a run's distance moving by up to 0.09 points between machines; NVFP4 at
most 1.39%, moving by up to 0.37 points. After 50 steps (AMD EPYC without AVX-512, with torch's
kernels as they are and limited to SSE4.2) the FP8 recipes at most 0.18%, moving by up to 0.04
points. Each bound is the largest distance plus about twice the largest move seen (0.18 + 0.18,
up to 0.4; 1.39 + 0.61). NVFP4 is 1.5-2.4% above bf16 between steps 30 and 70, so fewer steps would
not keep its margin. 50 steps tell a wrong FP8 format apart better than 100: E5M2 for every role
instead of E4M3 for weights and inputs ends +0.62% (high-precision weights) and +0.47% (quantized)
from bf16 after 50 steps, but +0.20% and -0.07% after 100, while the loss still falls twice as
fast at step 50 as at step 100.

The 11 runs are independent, so they share out over two worker processes of one thread each (the
CI machine's 2 cores), and each test asserts on its run's losses.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import traceback

import pytest
import torch

import quant_tensors as qt
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig, bf16_gemms_in_fp32, train
from quant_lab.testing import run_on_warm_ranks

# Steps each run trains: bf16 and NVFP4 100, the FP8 recipes 50 (their distance from bf16 is
# measured at either; NVFP4 needs the 100, see above).
STEPS = {None: 100, "fp8": 50, "fp8-delayed": 50, "mxfp8": 50, "fp8-block": 50, "nvfp4": 100}
# "It trained": the last step's loss below this fraction of the first. Measured on both settings
# above: at most 0.38 after 50 steps and 0.26 after 100.
TRAINED = {50: 1 / 2, 100: 1 / 3}
CONFIG = TransformerConfig(layers=2)
BATCH = 4  # sequences of 64 tokens per step
TOLERANCE = {"fp8": 0.004, "fp8-delayed": 0.004, "mxfp8": 0.004, "fp8-block": 0.004, "nvfp4": 0.02}
RUNS = [(None, False), *((recipe, weights) for recipe in TOLERANCE for weights in (False, True))]
WORKERS = 2


def final_loss(recipe: str | None, quantized_weights: bool) -> tuple[float, list[float]]:
    """The run's final loss (mean of its last 10 steps) and the loss of each of its STEPS[recipe] steps."""
    torch.manual_seed(0)
    model = TinyTransformer(CONFIG).to(torch.bfloat16)
    if recipe is not None:
        qt.convert(model, qt.recipe_from_name(recipe), quantized_weights=quantized_weights)
    # The quantized layers' GEMMs emulate in fp32 on the CPU; bf16's run its GEMMs so too ([Note:
    # bf16 GEMMs on CPUs without bf16 instructions] in quant_lab.demo._cpu_gemms).
    with bf16_gemms_in_fp32() if recipe is None else contextlib.nullcontext():
        losses = train(model, MarkovTask(seed=0), steps=STEPS[recipe], batch_size=BATCH)
    return sum(losses[-10:]) / 10, losses


def _train_runs(rank: int, world_size: int, folder: str) -> None:
    """Each worker takes the next run no other worker has claimed and writes its result (or its
    error) to run-<i>.json. Longest first, so that the workers end together: bf16, then NVFP4,
    ... FP8."""
    for i in (0, *reversed(range(1, len(RUNS)))):
        run = RUNS[i]
        try:
            os.close(os.open(os.path.join(folder, f"claim-{i}"), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        try:
            loss, losses = final_loss(*run)
            result = {"loss": loss, "losses": losses}
        except Exception:
            result = {"error": traceback.format_exc()}
        pathlib.Path(folder, f"run-{i}.json").write_text(json.dumps(result))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str | None, bool], tuple[float, list[float]]]:
    folder = tmp_path_factory.mktemp("training")
    run_on_warm_ranks(_train_runs, WORKERS, str(folder))
    outcomes = {}
    for i, run in enumerate(RUNS):
        result = json.loads((folder / f"run-{i}.json").read_text())
        outcomes[run] = result.get("error") or (result["loss"], result["losses"])
    return outcomes


def outcome(results: dict, recipe: str | None, quantized_weights: bool) -> tuple[float, list[float]]:
    """The run's (final loss, losses); fails the test with the worker's traceback if it raised."""
    result = results[(recipe, quantized_weights)]
    if isinstance(result, str):
        pytest.fail(f"training {recipe} (quantized_weights={quantized_weights}) raised:\n{result}")
    return result


@pytest.fixture(scope="module")
def bf16_losses(results) -> list[float]:
    loss, losses = outcome(results, None, False)
    assert losses[0] > 5.0  # starts near ln(256) = 5.55 ...
    assert loss < 1.6  # ... and learns most of the chain (its entropy is ~1.11)
    return losses


@pytest.mark.parametrize("quantized_weights", [False, True], ids=["hp-weights", "quantized-weights"])
@pytest.mark.parametrize("recipe", list(TOLERANCE))
def test_final_loss_matches_bf16(recipe, quantized_weights, bf16_losses, results):
    loss, losses = outcome(results, recipe, quantized_weights)
    steps = STEPS[recipe]
    assert len(losses) == steps
    bf16_loss = sum(bf16_losses[steps - 10 : steps]) / 10  # bf16's final loss at the same step
    relative = loss / bf16_loss - 1
    print(f"{recipe} quantized_weights={quantized_weights}: {relative:+.2%} from bf16 after {steps} steps")
    assert abs(relative) <= TOLERANCE[recipe], (
        f"{recipe}: final loss {loss:.4f} vs bf16 {bf16_loss:.4f} after {steps} steps ({relative:+.2%})"
    )
    assert losses[-1] < losses[0] * TRAINED[steps]  # it trained

"""Single-process training parity (issue #5): every recipe trains TinyTransformer like bf16 does.

200 AdamW steps (4 sequences of 64 tokens each) on the synthetic Markov task, same seeds (initial weights and batches) for every
run. The final loss (mean of the last 10 steps) must be within 3% of the bf16 run for the FP8
recipes and within 6% for NVFP4, with high-precision weights and with quantized primary weights.
"""

from __future__ import annotations

import pytest
import torch

import quant_tensors as qt
from quant_tensors.testing import MarkovTask, TinyTransformer, train

STEPS = 200
BATCH = 4  # sequences of 64 tokens per step; keeps the 11 runs within a few minutes of CI
TOLERANCE = {"fp8": 0.03, "fp8-delayed": 0.03, "mxfp8": 0.03, "fp8-block": 0.03, "nvfp4": 0.06}


def final_loss(recipe: str | None, quantized_weights: bool) -> tuple[float, list[float]]:
    torch.manual_seed(0)
    model = TinyTransformer().to(torch.bfloat16)
    if recipe is not None:
        qt.convert(model, qt.recipe_from_name(recipe), quantized_weights=quantized_weights)
    losses = train(model, MarkovTask(seed=0), steps=STEPS, batch_size=BATCH)
    return sum(losses[-10:]) / 10, losses


@pytest.fixture(scope="module")
def bf16_loss() -> float:
    loss, losses = final_loss(None, False)
    assert losses[0] > 5.0  # starts near ln(256) = 5.55 ...
    assert loss < 1.6  # ... and learns most of the chain (its entropy is ~1.11)
    return loss


@pytest.mark.parametrize("quantized_weights", [False, True], ids=["hp-weights", "quantized-weights"])
@pytest.mark.parametrize("recipe", list(TOLERANCE))
def test_final_loss_matches_bf16(recipe, quantized_weights, bf16_loss):
    loss, losses = final_loss(recipe, quantized_weights)
    relative = abs(loss - bf16_loss) / bf16_loss
    assert relative <= TOLERANCE[recipe], f"{recipe}: final loss {loss:.4f} vs bf16 {bf16_loss:.4f} ({relative:.2%})"
    assert losses[-1] < losses[0] / 3  # it trained

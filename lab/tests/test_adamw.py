"""quant_lab.demo.adamw: torch's AdamW with foreach ops where the parameters allow them. Parameters
that mix DTensors and plain tensors (foreach ops refuse them) train in test_scenarios.py's tensor-parallel rows."""

from __future__ import annotations

import torch

import quant_tensors as qt
from quant_lab.demo import MarkovTask, TinyTransformer, TransformerConfig, adamw, train


def trained(optimizer_of) -> list[float]:
    torch.manual_seed(0)
    model = TinyTransformer(TransformerConfig(layers=1)).to(torch.bfloat16)
    qt.convert(model, qt.recipe_from_name("fp8"))
    optimizer = optimizer_of(model)
    losses = train(model, MarkovTask(seed=0), steps=4, batch_size=2, optimizer=optimizer)
    return [*losses, *(p.detach().float().sum().item() for p in model.parameters())]


def test_foreach_steps_like_torchs_loop_over_parameters_bit_for_bit():
    foreach = trained(lambda model: adamw(model.parameters(), lr=1e-2, weight_decay=0.01))
    loop = trained(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01, foreach=False))
    assert foreach == loop

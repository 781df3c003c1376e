"""benchmarks/linear_host.py on the CPU: every layer kind measured (no numbers asserted)."""

from __future__ import annotations

import math

import pytest
import torch
from linear_host import RECIPES, benchmark_linear_host, main


def test_every_layer_kind_gets_a_host_time():
    results = benchmark_linear_host(torch.device("cpu"), size=128, iterations=2, repeats=1, compile=False)
    layers = {r.layer for r in results}
    assert {"nn.Linear", *(f"qt {name}" for name in RECIPES)} <= layers
    for r in results:
        assert not r.error, r
        assert math.isfinite(r.host_us)
        assert r.host_us > 0
    assert next(r for r in results if r.layer == "nn.Linear").vs_nn_linear == 1.0


def test_each_step_quantizes_a_new_input(monkeypatch):
    """As in training: a step whose input was quantized already (qt.nn's sibling cache) would skip
    the input's quantize and time less than a training step's layer costs."""
    import quant_tensors.nn as qt_nn

    seen: list[bool] = []
    quantize_input = qt_nn._quantize_input

    def recording(x, *args, **kwargs):
        seen.append(hasattr(x, qt_nn._QUANTIZED_INPUT))
        return quantize_input(x, *args, **kwargs)

    monkeypatch.setattr(qt_nn, "_quantize_input", recording)
    benchmark_linear_host(torch.device("cpu"), size=128, iterations=3, repeats=2, compile=False)
    assert seen
    assert not any(seen)


def test_layers_names_the_kinds_measured_beside_nn_linear():
    results = benchmark_linear_host(
        torch.device("cpu"), size=128, iterations=1, repeats=1, compile=False, layers=("qt fp8",)
    )
    assert [r.layer for r in results] == ["nn.Linear", "qt fp8"]


def test_an_unknown_layer_kind_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--device", "cpu", "--layers", "qt fp9"])
    assert exit.value.code == 2
    assert "unknown layer kinds ['qt fp9']: choose from" in capsys.readouterr().err

"""benchmarks/scaling_model.py: the bytes per step it counts for the 2.2B Llama are those
benchmarks/multi_gpu.py measured on 2 H200s (here) and those its collective counter measures
over gloo on the tiny model (test_multi_gpu.py)."""

from __future__ import annotations

import pathlib

import _multi_gpu_runs as runs
import scaling_model

# benchmarks/multi_gpu.py's collective counter on the 2.2B Llama, 2 x H200, per GPU and step:
# all-gather output and reduce-scatter input bytes, 2026-11-27 (multi_gpu.json); for MXFP8 and
# NVFP4 only the report's AG MiB/step is kept (invocation G of docs/benchmarks.md).
MEASURED_BYTES = {
    "bf16": {"all_gather": 8_309_186_560, "reduce_scatter": 8_833_482_752},
    "fp8": {"all_gather": 4_416_872_448, "reduce_scatter": 8_833_482_752},
}
MEASURED_ALL_GATHER_MIB = {"mxfp8": 4328, "nvfp4": 2371}


def test_the_counted_bytes_are_those_measured_on_two_gpus():
    assert set(scaling_model.FORMATS) == set(MEASURED_BYTES) | set(MEASURED_ALL_GATHER_MIB)
    config = runs.MODELS[scaling_model.MODEL]
    for recipe in scaling_model.FORMATS:
        counted = scaling_model.step_bytes(config, recipe, world_size=2)
        if recipe in MEASURED_BYTES:
            assert counted == MEASURED_BYTES[recipe], recipe
        else:
            assert round(counted["all_gather"] / 2**20) == MEASURED_ALL_GATHER_MIB[recipe], (recipe, counted)
            assert counted["reduce_scatter"] == MEASURED_BYTES["bf16"]["reduce_scatter"], recipe


def test_docs_scaling_shows_the_table_the_model_prints():
    """docs/scaling.md's prediction table is scaling_model.py's output at its default bandwidths."""
    config = runs.MODELS[scaling_model.MODEL]
    nbytes = {f: scaling_model.step_bytes(config, f, world_size=2) for f in scaling_model.FORMATS}
    printed = scaling_model.table(nbytes, intra_gb_s=265.0, inter_gb_s=40.0)
    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    assert printed in docs

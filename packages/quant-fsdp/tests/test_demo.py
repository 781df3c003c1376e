"""The demo's FSDP2 training part runs end to end (2 gloo ranks, a few steps)."""

from __future__ import annotations

import io
import json

from rich.console import Console

from quant_fsdp._demo_training import RECIPES, run_training


def test_demo_training_runs_fsdp2_and_reports_bytes(tmp_path):
    output = io.StringIO()
    assert run_training(Console(file=output, width=200), tmp_path, steps=2)
    rows = {row["run"]: row for row in json.loads((tmp_path / "demo.json").read_text())}
    assert list(rows) == ["bf16", *RECIPES]
    for recipe in RECIPES:
        assert len(rows[recipe]["losses"]) == 2
        # Linear weights travel quantized; norms, embeddings and biases stay bf16.
        assert rows[recipe]["gathered_mib_per_step"] < 0.6 * rows["bf16"]["gathered_mib_per_step"]
        assert rows[recipe]["fallbacks"] == 0
    assert "all-gathered MiB/step" in output.getvalue()

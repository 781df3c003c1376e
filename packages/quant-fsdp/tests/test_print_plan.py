"""`fully_shard(..., print_plan=True)` prints whole parameter names and reasons into logs and pipes,
with quant-fsdp's own dependencies only."""

from __future__ import annotations

import subprocess
import sys

import torch

from quant_fsdp._plan import GatherPlan, print_plan, record

NAME = "model.layers.17.mixture_of_experts.experts.63.down_projection.weight"
REASON = "shard rows (24) split the format's 16-row tiles on 4 ranks; give the weight 64, 128 or 256 rows"


def test_names_and_reasons_are_never_cut_when_stdout_is_not_a_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # what a narrow log or CI runner reports
    module = torch.nn.Module()
    record(module, (GatherPlan(NAME, "nvfp4 16x16", (1024, 4096), "quantized weights", REASON),))
    print_plan(module)
    printed = capsys.readouterr().out
    row = next(line for line in printed.splitlines() if "nvfp4" in line)
    assert NAME in row
    assert REASON in row


def test_quant_fsdp_imports_and_prints_its_plan_without_rich():
    # rich is no dependency of quant-fsdp: an environment without it imports the package and prints the plan.
    script = f"""
import sys
sys.modules["rich"] = None  # an import of rich or of any rich.* module raises ImportError
import torch
import quant_fsdp
from quant_fsdp._plan import GatherPlan, print_plan, record
module = torch.nn.Module()
record(module, (GatherPlan({NAME!r}, "nvfp4 16x16", (1024, 4096), "quantized weights", {REASON!r}),))
print_plan(module)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    row = next(line for line in done.stdout.splitlines() if "nvfp4" in line)
    assert NAME in row
    assert REASON in row

"""benchmarks/step_host.py on the CPU: the tiny decoder's compiled step under FSDP2 (world size 1,
aot_eager), bf16 and per-tensor FP8 with quantized weights; its table, its JSON and its refusals
(no numbers asserted beyond what counting itself implies)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import step_host

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1]
RUNS = ("bf16:compiled", "fp8:qw-bf16:compiled")


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("step_host")
    command = [
        sys.executable, str(BENCHMARKS / "step_host.py"), "--runs", ",".join(RUNS), "--warmup", "1", "--steps", "1",
        "--out", str(out),
    ]  # fmt: skip
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]
    return completed.stdout, json.loads((out / "step_host.json").read_text())


def test_the_table_has_a_row_per_run_and_a_column_per_package(measured):
    stdout, report = measured
    lines = stdout.splitlines()
    header = next(line for line in lines if line.startswith("| run |"))
    assert header == "| " + " | ".join(["run", *step_host.PACKAGES, "total", "host ms"]) + " |"
    rows = [line for line in lines if line.startswith("| ") and line.split(" | ")[0][2:] in RUNS]
    assert [row.split(" | ")[0][2:] for row in rows] == list(RUNS)
    for row, result in zip(rows, report["results"], strict=True):
        cells = row.strip("| ").split(" | ")
        assert len(cells) == len(step_host.PACKAGES) + 3
        assert [int(c) for c in cells[1:-1]] == [
            *(result["calls"][p] for p in step_host.PACKAGES),
            result["calls"]["total"],
        ]
        assert float(cells[-1]) > 0


def test_calls_are_counted_where_they_run(measured):
    _, report = measured
    bf16, fp8 = (r["calls"] for r in report["results"])
    for calls in (bf16, fp8):
        assert calls["total"] == sum(calls[p] for p in step_host.PACKAGES) > 0
        assert calls["fsdp2"] > 0
        assert calls["compiled"] > 0
    assert all(bf16[p] == 0 for p in step_host.QUANT_PACKAGES)  # torch's own fully_shard and AdamW
    assert all(fp8[p] > 0 for p in step_host.QUANT_PACKAGES)  # hooks, Linear, kernels, FusedAdam
    # FSDP2's all-gather extension path (the quantized weights' hooks) and the quantized Linear
    # cost Python calls that bf16's step does not make.
    assert bf16["total"] < fp8["total"]
    assert bf16["fsdp2"] < fp8["fsdp2"]


def test_an_unknown_run_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exit:
        step_host.main(["--runs", "fp8:qw-bf17:compiled"])
    assert exit.value.code == 2
    assert "unknown runs ['fp8:qw-bf17:compiled']; choose from bf16:eager" in capsys.readouterr().err

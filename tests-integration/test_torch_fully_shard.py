"""torch's own `fully_shard` trains quantized primary weights in processes that never import
quant_fsdp: QuantizedTensor carries FSDP2's all-gather hooks itself, and quant-tensors' default
gather policy gathers bit-exactly ([Note: gather policy] in quant_tensors._fsdp). The ranks run
torch_fully_shard_ranks.py as plain scripts (its docstring lists the checks), so nothing of
pytest's process or of quant_fsdp's launcher (quant_lab.testing imports quant_fsdp) reaches them;
every recipe runs in one gloo group of 2 ranks."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

RANKS = pathlib.Path(__file__).with_name("torch_fully_shard_ranks.py")
RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
TIMEOUT_S = 300


def test_torchs_fully_shard_trains_quantized_weights_without_quant_fsdp(tmp_path):
    world_size = 2
    logs = [tmp_path / f"rank-{rank}.log" for rank in range(world_size)]
    processes = []
    for rank, log in enumerate(logs):
        with log.open("w") as output:
            command = [sys.executable, str(RANKS), str(rank), str(world_size), str(tmp_path / "store")]
            processes.append(subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + TIMEOUT_S
    # A rank that fails leaves its peer waiting in a collective: stop the others then.
    while any(p.poll() is None for p in processes):
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in processes):
            for p in processes:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    outputs = [log.read_text() for log in logs]
    for rank, (process, output) in enumerate(zip(processes, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} exited with {process.returncode}:\n{output}"
        assert [line for line in output.splitlines() if line.startswith("checked ")] == [
            f"checked {name}" for name in RECIPES
        ], output

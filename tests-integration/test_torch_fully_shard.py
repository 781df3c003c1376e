"""torch's own `fully_shard` trains quantized primary weights in processes that never import
quant_fsdp: QuantizedTensor carries FSDP2's all-gather hooks itself, and the plain shard context
gathers bit-exactly ([Note: shard context] in quant_tensors._fsdp). Importing quant_fsdp changes
nothing of it: two gloo groups of 2 ranks, one whose processes import quant_fsdp first, run every
recipe side by side and must compute, send and gather the same bytes. The ranks run
torch_fully_shard_ranks.py as plain scripts (its docstring lists the checks), so nothing of
pytest's process or of the lab's launcher (quant_lab.testing imports quant_fsdp) reaches them."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time

RANKS = pathlib.Path(__file__).with_name("torch_fully_shard_ranks.py")
RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
TIMEOUT_S = 300


def test_torchs_fully_shard_trains_quantized_weights_alike_with_and_without_quant_fsdp(tmp_path):
    world_size = 2
    worlds = ((), ("--import-quant-fsdp",))
    logs = [tmp_path / f"world-{w}-rank-{rank}.log" for w in range(len(worlds)) for rank in range(world_size)]
    processes = []
    for i, log in enumerate(logs):
        world, rank = divmod(i, world_size)
        with log.open("w") as output:
            store = str(tmp_path / f"store-{world}")
            command = [sys.executable, str(RANKS), str(rank), str(world_size), store, *worlds[world]]
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
    checked = []
    for log, process, output in zip(logs, processes, outputs, strict=True):
        assert process.returncode == 0, f"{log.stem} exited with {process.returncode}:\n{output}"
        lines = [line.split() for line in output.splitlines() if line.startswith("checked ")]
        assert [line[1] for line in lines] == list(RECIPES), output
        checked.append([line[2] for line in lines])
    for rank in range(world_size):  # the same bytes with quant_fsdp imported as without
        assert checked[world_size + rank] == checked[rank], rank
    assert checked[0] != checked[1]  # the digests see each rank's own inputs

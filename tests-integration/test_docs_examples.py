"""Every ```python block of docs/*.md and README.md runs on the CPU, so a broken example fails CI.

A block is a whole program, as a user would paste it: nothing is prepended. Blocks that call
`dist.init_process_group(...)` run as 2 processes under torchrun's environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), exactly as `torchrun --nproc-per-node 2 example.py` would start them;
the others run in this process, each in a fresh namespace and a temporary working directory.
Code that is not meant to run uses another fence language (```text, ```bash).
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC_FILES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
NUM_RANKS = 2
RANK_TIMEOUT_S = 120
# Runs the block file as __main__, then leaves without interpreter teardown: process-group
# teardown at exit races with gloo's worker threads now and then (see quant_lab.demo._launch).
RANK_WRAPPER = (
    "import os, runpy, sys\n"
    "runpy.run_path(sys.argv[1], run_name='__main__')\n"
    "sys.stdout.flush(); sys.stderr.flush()\n"
    "os._exit(0)\n"
)


def _blocks() -> list[tuple[str, str]]:
    """(id, source) of every python block: id is `file:line`."""
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{path.relative_to(ROOT)}:{line}", match.group(1)))
    return found


BLOCKS = _blocks()


def _needs_ranks(source: str) -> bool:
    return "init_process_group(" in source


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(source: str, tmp_path: pathlib.Path) -> None:
    block, wrapper = tmp_path / "example.py", tmp_path / "_rank_wrapper.py"
    block.write_text(source)
    wrapper.write_text(RANK_WRAPPER)
    port = _free_port()
    processes = []
    for rank in range(NUM_RANKS):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(NUM_RANKS),
            "LOCAL_WORLD_SIZE": str(NUM_RANKS),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",  # the ranks share the machine's cores, as torchrun arranges
        }
        processes.append(
            subprocess.Popen(
                [sys.executable, str(wrapper), str(block)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    failures = []
    for rank, process in enumerate(processes):
        try:
            output, _ = process.communicate(timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in processes:
                p.kill()
            output, _ = process.communicate()
            failures.append(f"rank {rank} timed out after {RANK_TIMEOUT_S} s:\n{output}")
            continue
        if process.returncode != 0:
            failures.append(f"rank {rank} exited with {process.returncode}:\n{output}")
    assert not failures, "\n\n".join(failures)


def test_blocks_were_found() -> None:
    # The docs hold examples on several pages; an empty list means the fence pattern broke.
    assert len(BLOCKS) >= 10, [block_id for block_id, _ in BLOCKS]


@pytest.mark.parametrize(("block_id", "source"), BLOCKS, ids=[block_id for block_id, _ in BLOCKS])
def test_doc_example_runs(block_id: str, source: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if _needs_ranks(source):
        _run_ranks(source, tmp_path)
        return
    monkeypatch.chdir(tmp_path)
    code = compile(source, block_id, "exec")
    exec(code, {"__name__": "__main__"})

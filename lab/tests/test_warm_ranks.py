"""`run_on_warm_ranks` ([Note: warm ranks] in quant_lab.testing): ranks that stay up between calls
run each call like new processes would, and fail the way torch's spawn fails."""

from __future__ import annotations

import os
import pathlib
import signal
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from quant_lab import testing
from quant_lab.testing import run_on_warm_ranks

_calls_in_this_module = 0  # a call's module globals start new: every call sees 0 here


def _record(rank: int, world_size: int, folder: str) -> None:
    global _calls_in_this_module
    _calls_in_this_module += 1
    gathered = [None] * world_size
    dist.all_gather_object(gathered, [rank])
    pathlib.Path(folder, f"rank-{rank}").write_text(f"{os.getpid()} {_calls_in_this_module} {gathered}")


def _import_a_shadow(rank: int, world_size: int, folder: str) -> None:
    """Puts `folder` first on the path and imports from it a `hatchling` (an installed distribution's
    module, which no rank imports on its own) and a helper module."""
    sys.path.insert(0, folder)
    import hatchling
    import warm_ranks_helper

    assert hatchling.SHADOW
    assert warm_ranks_helper.HELPER


def _import_the_installed_module(rank: int, world_size: int, folder: str, caller_path: list[str]) -> None:
    assert sys.path == caller_path
    assert folder not in sys.path
    assert "warm_ranks_helper" not in sys.modules
    import hatchling

    assert not hasattr(hatchling, "SHADOW"), hatchling.__file__


def _raise_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()  # rank 0 waits for a peer that never comes: it is killed with the world


def _die_on_rank_0(rank: int, world_size: int) -> None:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def _use_threads(rank: int, world_size: int, threads: int, folder: str) -> None:
    """Records the intra-op threads the call starts with, then sets `threads` (as Accelerate's
    state does for MULTI_CPU ranks)."""
    pathlib.Path(folder, f"threads-{rank}").write_text(str(torch.get_num_threads()))
    torch.set_num_threads(threads)


def _record_environment(rank: int, world_size: int, folder: str) -> None:
    """Records TRITON_INTERPRET and what quant-core read from it when this rank imported it."""
    from quant_core.shared import _triton_launch

    variable = os.environ.get("TRITON_INTERPRET")
    pathlib.Path(folder, f"environment-{rank}").write_text(f"{variable} {_triton_launch._INTERPRETED}")


def _pids_and_counts(folder: pathlib.Path, world_size: int) -> list[tuple[int, int, str]]:
    out = []
    for rank in range(world_size):
        pid, count, gathered = folder.joinpath(f"rank-{rank}").read_text().split(" ", 2)
        out.append((int(pid), int(count), gathered))
    return out


def test_calls_reuse_the_ranks_and_load_the_file_afresh(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    run_on_warm_ranks(_record, 2, str(first))
    run_on_warm_ranks(_record, 2, str(second))
    before, after = _pids_and_counts(first, 2), _pids_and_counts(second, 2)
    assert [pid for pid, _, _ in before] == [pid for pid, _, _ in after]  # the same processes
    assert [count for _, count, _ in before + after] == [1, 1, 1, 1]  # module globals start new
    assert {gathered for _, _, gathered in before + after} == {"[[0], [1]]"}  # one process group


def test_a_call_imports_as_a_new_rank_would_whatever_an_earlier_call_put_on_the_path(tmp_path):
    tmp_path.joinpath("hatchling.py").write_text("SHADOW = True\n")
    tmp_path.joinpath("warm_ranks_helper.py").write_text("HELPER = True\n")
    run_on_warm_ranks(_import_a_shadow, 2, str(tmp_path))
    run_on_warm_ranks(_import_the_installed_module, 2, str(tmp_path), list(sys.path))


def test_a_rank_that_raises_fails_the_call_with_its_traceback_and_the_next_call_gets_new_ranks(tmp_path):
    run_on_warm_ranks(_record, 2, str(tmp_path))
    (old_pid, _, _), _ = _pids_and_counts(tmp_path, 2)
    with pytest.raises(mp.ProcessRaisedException, match="(?s)Process 1 terminated.*ValueError: rank 1 refuses"):
        run_on_warm_ranks(_raise_on_rank_1, 2)
    run_on_warm_ranks(_record, 2, str(tmp_path))
    (new_pid, count, gathered), _ = _pids_and_counts(tmp_path, 2)
    assert new_pid != old_pid
    assert (count, gathered) == (1, "[[0], [1]]")


def test_a_rank_that_dies_fails_the_call_with_its_signal(tmp_path):
    with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with signal SIGKILL"):
        run_on_warm_ranks(_die_on_rank_0, 2)
    run_on_warm_ranks(_record, 2, str(tmp_path))  # the next call runs on new ranks
    assert _pids_and_counts(tmp_path, 2)[1][1:] == (1, "[[0], [1]]")


def test_worlds_beyond_the_limit_close_the_least_recently_used(tmp_path, monkeypatch):
    testing._close_worlds()  # from no world up, whatever tests ran before in this process
    monkeypatch.setattr(testing, "_MAX_WORLDS", 1)
    run_on_warm_ranks(_record, 1, str(tmp_path))
    one = testing._worlds[1]
    run_on_warm_ranks(_record, 2, str(tmp_path))
    assert list(testing._worlds) == [2]
    assert all(process.exitcode == 0 for process in one.processes)  # closed, not killed


def test_every_call_starts_with_one_intra_op_thread(tmp_path):
    run_on_warm_ranks(_use_threads, 2, 2, str(tmp_path))
    run_on_warm_ranks(_use_threads, 2, 1, str(tmp_path))
    assert [tmp_path.joinpath(f"threads-{rank}").read_text() for rank in range(2)] == ["1", "1"]


def test_new_ranks_take_the_environment_of_the_process_that_starts_them(tmp_path, monkeypatch):
    """Ranks start from a fork server that imported torch before any of them; each takes the
    environment variables of its starting process when it starts, before it imports the quant-*
    packages (quant-core reads TRITON_INTERPRET when imported), as a spawned rank would."""
    run_on_warm_ranks(_record, 2, str(tmp_path))  # the fork server is up
    testing._close_worlds()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    try:
        run_on_warm_ranks(_record_environment, 2, str(tmp_path))
    finally:
        testing._close_worlds()  # no later call runs on ranks that hold the variable
    assert [tmp_path.joinpath(f"environment-{rank}").read_text() for rank in range(2)] == ["1 True"] * 2

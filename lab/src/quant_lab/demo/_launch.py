"""Run a function in several processes joined in a torch.distributed process group.

`quant-fsdp demo` trains on its ranks with it; multi-process tests and benchmarks run their scenarios
with it (quant_lab.demo.run_ranks).
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import pathlib
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_TERMINATE_GRACE_S = 10.0


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Runs fn(rank, world_size, *args) in `world_size` processes joined in a process group.

    `backend="nccl"` gives rank r the CUDA device r (it must exist).

    `fn` must be a module-level function. Each process loads fn's file by path rather than by
    module name, so this works for test files that pytest imported under a path-derived name
    (`--import-mode=importlib`). A failure in any rank re-raises here with that rank's traceback.
    The ranks ignore Ctrl-C (SIGINT): it interrupts this process, which ends them before it re-raises.
    """
    source = pathlib.Path(inspect.getfile(fn)).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(pathlib.Path(tmp) / "store")
        with _sigint_ignored():  # the ranks inherit the ignored SIGINT from their start on
            context = mp.spawn(
                _rank_entry,
                args=(world_size, str(source), fn.__name__, store, args, backend),
                nprocs=world_size,
                join=False,
            )
        try:
            while not context.join():
                pass
        except BaseException:  # Ctrl-C, a test's timeout, or a failed rank: no rank outlives the call
            for process in context.processes:
                process.terminate()
            for process in context.processes:
                process.join(_TERMINATE_GRACE_S)
                if process.is_alive():  # SIGTERM did not end it: SIGKILL does
                    process.kill()
                    process.join()
            raise


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Ignores SIGINT meanwhile, so that the processes started meanwhile ignore it from their start.
    Only the main thread may set signal handlers (and only it receives Ctrl-C): elsewhere it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _rank_entry(
    rank: int, world_size: int, source: str, name: str, store: str, args: tuple[Any, ...], backend: str
) -> None:
    # torch's spawn has a rank sent SIGINT when its parent dies; ranks ignore SIGINT, so SIGTERM it is.
    torch.multiprocessing._prctl_pr_set_pdeathsig(signal.SIGTERM)
    module = load_by_path(source)
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size)
    try:
        getattr(module, name)(rank, world_size, *args)
        dist.barrier()  # no rank leaves while another still uses the group
    except BaseException:
        dist.destroy_process_group()
        raise
    # Success: leave without tearing anything down. Process-group teardown and interpreter
    # finalization race with gloo's worker threads, which now and then abort a rank
    # ("terminate called without an active exception") after its work passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def load_by_path(source: str) -> ModuleType:
    """The module of file `source`, imported in a rank process under a name derived from its path
    (test files that pytest imported with `--import-mode=importlib` have no importable name)."""
    spec = importlib.util.spec_from_file_location(f"_quant_rank_{pathlib.Path(source).stem}", source)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {source} in a rank process")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module

"""Run a function in several processes joined in a torch.distributed process group.

`quant-fsdp demo` trains on its ranks with it; multi-process tests and benchmarks run their scenarios
with it (quant_fsdp.demo.run_ranks).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(fn: Callable[..., None], world_size: int, *args: Any, backend: str = "gloo") -> None:
    """Runs fn(rank, world_size, *args) in `world_size` processes joined in a process group.

    `backend="nccl"` gives rank r the CUDA device r (it must exist).

    `fn` must be a module-level function. Each process loads fn's file by path rather than by
    module name, so this works for test files that pytest imported under a path-derived name
    (`--import-mode=importlib`). A failure in any rank re-raises here with that rank's traceback.
    """
    source = pathlib.Path(inspect.getfile(fn)).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(pathlib.Path(tmp) / "store")
        mp.spawn(
            _rank_entry,
            args=(world_size, str(source), fn.__name__, store, args, backend),
            nprocs=world_size,
            join=True,
        )


def _rank_entry(
    rank: int, world_size: int, source: str, name: str, store: str, args: tuple[Any, ...], backend: str
) -> None:
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

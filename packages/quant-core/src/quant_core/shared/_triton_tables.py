"""The device tables of multi-tensor Triton launches: per-tensor addresses and sizes, and which
tensor and which part of it each program handles, both cached by content ([Note: pointer tables]).

Used by the Adam, non-finite and amax-of-many kernels (one program per chunk of a tensor:
`chunk_table`) and the multi-tensor block quantize (`blocks._triton_many`: one program per tile).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# [Note: pointer tables] A multi-tensor kernel reads the addresses of its tensors from an int64
# table on the device. Building it costs a host-to-device copy; a table depends only on its
# content (addresses and sizes), so tables are cached keyed by it: while the storages of a call's
# tensors stay the same (parameters, optimizer states; gradients that torch accumulates into the
# same memory), a call copies nothing and no CUDA graph replay depends on host memory. Tensors
# whose storage changes every call (FSDP2 hands fresh gradients per step) cost one
# non-blocking copy from pinned memory per call. The table is struct-of-arrays: row c is list c,
# so a row is contiguous. The program table of a launch (tensor index, part index per program)
# depends only on the number of parts of each tensor and is cached the same way.
_pointer_tables: dict[tuple[object, ...], torch.Tensor] = {}
_program_tables: dict[tuple[object, ...], torch.Tensor] = {}


def to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-made table on `device`: from pinned memory without waiting for the copy (the
    caching host allocator keeps the pinned block until the copy is done). Refused while a CUDA
    graph is being captured: the graph would replay a copy from a host buffer that is reused."""
    if device.type != "cuda":
        return table.to(device)
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "a quant_core multi-tensor kernel needs a new pointer table while a CUDA graph is being captured: the "
            "tensors' storages (or sizes) differ from every eager call. Run the same call once before capturing "
            "(a warm-up step) and keep its tensors, gradients included, in the memory the graph captured"
        )
    return table.pin_memory().to(device, non_blocking=True)


def pointer_table(*lists: Sequence[torch.Tensor], extra: Sequence[int] = ()) -> torch.Tensor:
    """int64 (rows, T) on the tensors' device, T = len(lists[0]) ([Note: pointer tables]): row c
    holds the data pointers of list c, then a row of numels (of lists[0]), then `extra`'s rows
    (one int per tensor each, flattened)."""
    columns = [t.data_ptr() for tensors in lists for t in tensors]
    columns += [t.numel() for t in lists[0]]
    columns += extra
    return int_table(columns, len(lists[0]), lists[0][0].device)


def int_table(values: Sequence[int], width: int, device: torch.device) -> torch.Tensor:
    """int64 (len(values) / width, width) on `device` holding `values` row after row, cached by
    content ([Note: pointer tables]): what `pointer_table` builds, for callers that have the ints."""
    key = (device, width, *values)
    table = _pointer_tables.get(key)
    if table is None:
        table = to_device(torch.tensor(values, dtype=torch.int64).reshape(-1, width), device)
        if len(_pointer_tables) >= 32:  # the oldest out: a model has few distinct calls per step
            del _pointer_tables[next(iter(_pointer_tables))]
        _pointer_tables[key] = table
    else:  # most recent last
        _pointer_tables[key] = _pointer_tables.pop(key)
    return table


def program_table(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 (sum(counts), 2) on `device` ([Note: pointer tables]): row p is (t, i), program p
    handles part i of tensor t, tensor t having counts[t] parts (chunks, tiles), in order."""
    key = (counts, device)
    table = _program_tables.get(key)
    if table is None:
        parts = torch.tensor(counts, dtype=torch.int64)
        tensor_index = torch.repeat_interleave(torch.arange(len(counts)), parts)
        first_program = torch.cumsum(parts, 0) - parts
        part_index = torch.arange(len(tensor_index)) - first_program[tensor_index]
        rows = torch.stack((tensor_index, part_index), dim=1).to(torch.int32)
        table = to_device(rows, device)
        if len(_program_tables) > 64:  # shapes of one model: a handful of keys; bound it anyway
            _program_tables.clear()
        _program_tables[key] = table
    return table


CHUNK = 16384  # elements per program of a chunked launch: CHUNK_BLOCK-sized steps over one chunk
CHUNK_BLOCK = 1024


def chunk_table(numels: tuple[int, ...], device: torch.device, *, at_least_one: bool = False) -> torch.Tensor:
    """(tensor index, chunk index) of every program of a multi-tensor launch, as int32 (n, 2);
    with `at_least_one`, an empty tensor gets one program too."""
    return program_table(tuple(max(-(-n // CHUNK), int(at_least_one)) for n in numels), device)

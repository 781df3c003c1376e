"""The device tables of multi-tensor Triton launches: per-tensor addresses and sizes, and which
tensor and which part of it each program handles, both cached by content ([Note: pointer tables]).

Used by the Adam, non-finite and amax-of-many kernels (one program per chunk of a tensor:
`chunk_table`) and the multi-tensor block quantize (`blocks._triton_many`: one program per tile).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

# [Note: pointer tables] A multi-tensor kernel reads the addresses of its tensors from an int64
# table on the device. Building it costs a host-to-device copy; a table depends only on its
# content (addresses and sizes), so tables are cached keyed by it: while the storages of a call's
# tensors stay the same (parameters, optimizer states; gradients that torch accumulates into the
# same memory), a call copies nothing. Tensors whose storage changes every call (FSDP2 hands fresh
# gradients per step) cost one non-blocking copy from pinned memory per call. The table is
# struct-of-arrays: row c is list c, so a row is contiguous. The program table of a launch (tensor
# index, part index per program) depends only on the number of parts of each tensor and is cached
# the same way.
#
# While a CUDA graph is captured, a table found in the cache is used as is (its copy was enqueued
# before the capture). A table that is not there (tensors first allocated in the capture, such as
# gradients after `zero_grad(set_to_none=True)`) is copied in the graph: every replay copies it
# again from its host memory, so that host memory and the device table are kept for the life of
# the process, and the table stays out of the cache (it holds nothing until the graph is replayed).
# A capture may copy only from pinned memory and should not allocate it, so its tables' host
# copies are cut from a pinned block set aside by eager calls (CAPTURE_HOST_BYTES, a new block
# when less than half is left).
_pointer_tables: dict[tuple[object, ...], torch.Tensor] = {}
_program_tables: dict[tuple[object, ...], torch.Tensor] = {}
_captured_tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host, device) copied in CUDA graphs
CAPTURE_HOST_BYTES = 1 << 20
_capture_host: list[torch.Tensor] = []  # [what is left of the pinned block capture copies are cut from]


def _capture_copy(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` on `device`, copied in the CUDA graph being captured ([Note: pointer tables])."""
    size = host.numel() * host.element_size()
    left = _capture_host[0] if _capture_host else None
    if left is None or left.numel() < size:
        raise RuntimeError(
            f"a quant_core multi-tensor kernel needs a new {size}-byte pointer table while a CUDA graph is being "
            "captured, and the pinned memory set aside for such tables is used up (or was never set aside: no "
            "eager call on CUDA came first). Run the captured step once eagerly first, and capture fewer graphs "
            "or keep the tensors (gradients included) in the memory of that eager step"
        )
    pinned = left[:size].view(host.dtype).view(host.shape)
    _capture_host[0] = left[-(-size // 16) * 16 :]  # 16-byte aligned starts
    pinned.copy_(host)
    table = pinned.to(device, non_blocking=True)
    _captured_tables.append((pinned, table))
    return table


def _device_table(
    cache: dict[tuple[object, ...], torch.Tensor],
    key: tuple[object, ...],
    build: Callable[[], torch.Tensor],
    device: torch.device,
    size: int,
) -> torch.Tensor:
    """The device copy of `build()` for `key`, from `cache` (at most `size` entries, least recently
    used out first) or made now ([Note: pointer tables])."""
    table = cache.pop(key, None)
    if table is not None:
        cache[key] = table  # most recent last
        return table
    host = build()
    if device.type != "cuda":
        table = host.to(device)
    elif torch.cuda.is_current_stream_capturing():
        return _capture_copy(host, device)
    else:  # pinned: the copy does not wait; the caching host allocator keeps the block until it is done
        table = host.pin_memory().to(device, non_blocking=True)
        if not _capture_host or _capture_host[0].numel() < CAPTURE_HOST_BYTES // 2:
            _capture_host[:] = [torch.empty(CAPTURE_HOST_BYTES, dtype=torch.uint8, pin_memory=True)]
    if len(cache) >= size:
        del cache[next(iter(cache))]
    cache[key] = table
    return table


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
    content ([Note: pointer tables]): what `pointer_table` builds, for callers that have the ints.
    A model makes few distinct calls per step: 32 tables are kept."""

    def build() -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).reshape(-1, width)

    return _device_table(_pointer_tables, (device, width, *values), build, device, 32)


def program_table(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 (sum(counts), 2) on `device` ([Note: pointer tables]): row p is (t, i), program p
    handles part i of tensor t, tensor t having counts[t] parts (chunks, tiles), in order. The
    tensor shapes of one model make a handful: 64 tables are kept."""

    def build() -> torch.Tensor:
        parts = torch.tensor(counts, dtype=torch.int64)
        tensor_index = torch.repeat_interleave(torch.arange(len(counts)), parts)
        first_program = torch.cumsum(parts, 0) - parts
        part_index = torch.arange(len(tensor_index)) - first_program[tensor_index]
        return torch.stack((tensor_index, part_index), dim=1).to(torch.int32)

    return _device_table(_program_tables, (counts, device), build, device, 64)


CHUNK = 16384  # elements per program of a chunked launch: CHUNK_BLOCK-sized steps over one chunk
CHUNK_BLOCK = 1024


def chunk_table(numels: tuple[int, ...], device: torch.device, *, at_least_one: bool = False) -> torch.Tensor:
    """(tensor index, chunk index) of every program of a multi-tensor launch, as int32 (n, 2);
    with `at_least_one`, an empty tensor gets one program too."""
    return program_table(tuple(max(-(-n // CHUNK), int(at_least_one)) for n in numels), device)

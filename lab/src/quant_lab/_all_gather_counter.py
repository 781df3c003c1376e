"""Count the bytes torch.distributed's all-gathers deliver (`quant-fsdp demo` and FSDP2 tests)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

__all__ = ["AllGatherBytes", "count_all_gather_bytes"]


class AllGatherBytes:
    """Bytes delivered by all-gather collectives (output sizes) while counting, in total and per call."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.sizes: list[int] = []


@contextlib.contextmanager
def count_all_gather_bytes() -> Iterator[AllGatherBytes]:
    """Counts what torch.distributed's all-gathers deliver, independently of quant-fsdp's hooks.

    FSDP2 calls `dist.all_gather_single` (torch 2.13) or `dist.all_gather_into_tensor` (older);
    both are wrapped for the duration of the block.
    """
    counter = AllGatherBytes()
    originals = {
        name: getattr(dist, name) for name in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, name)
    }

    def counting(original):
        def wrapper(output_tensor, *args, **kwargs):
            size = output_tensor.numel() * output_tensor.element_size()
            counter.bytes += size
            counter.calls += 1
            counter.sizes.append(size)
            return original(output_tensor, *args, **kwargs)

        return wrapper

    try:
        for name, original in originals.items():
            setattr(dist, name, counting(original))
        yield counter
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)

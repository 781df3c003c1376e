"""Bus bandwidth of FSDP2's two collectives on this host: all-gather and reduce-scatter.

    torchrun --nproc-per-node=2 benchmarks/collective_bandwidth.py [--sizes-mib 64,256,1024]

For each size S (MiB of the unsharded tensor, uint8 for the gather as quantized weights travel,
fp32 for the reduce-scatter as FSDP2 reduces gradients), the median time of 20 collectives after 5
warm-ups, on CUDA events. Bus bandwidth follows NCCL's convention: S * (N - 1) / N / time, the
bytes each GPU's link carries, so sizes and world sizes compare. docs/scaling.md models gather
and reduce-scatter time per step from these numbers and the bytes benchmarks/multi_gpu.py counts.
Rank 0 prints one JSON line per collective and size.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics

import torch
import torch.distributed as dist


def _time_ms(collective, repeats: int = 20, warmup: int = 5) -> float:
    for _ in range(warmup):
        collective()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        collective()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", default="64,256,1024", help="unsharded sizes, comma-separated")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off on shared hosts
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    for size_mib in (int(s) for s in args.sizes_mib.split(",")):
        nbytes = size_mib * 2**20 // world_size * world_size
        gathered = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        shard = torch.randint(0, 255, (nbytes // world_size,), dtype=torch.uint8, device="cuda")
        unsharded = torch.randn(nbytes // 4, device="cuda")
        reduced = torch.empty(nbytes // 4 // world_size, device="cuda")
        cases = {
            "all_gather": functools.partial(dist.all_gather_into_tensor, gathered, shard),
            "reduce_scatter": functools.partial(dist.reduce_scatter_tensor, reduced, unsharded),
        }
        for name, collective in cases.items():
            ms = _time_ms(collective)
            bus_gb_per_s = nbytes * (world_size - 1) / world_size / (ms * 1e-3) / 1e9
            if rank == 0:
                line = {"collective": name, "world_size": world_size, "mib": size_mib, "ms": round(ms, 3)}
                print(json.dumps({**line, "bus_gb_per_s": round(bus_gb_per_s, 1)}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

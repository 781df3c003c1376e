"""All-gather and reduce-scatter time per training step for 8 to 1024 GPUs, from measured bytes
and bandwidth (docs/scaling.md explains the model and its inputs).

    python benchmarks/scaling_model.py [--intra-gb-s 265] [--inter-gb-s 40]

Bytes per step come from benchmarks/multi_gpu.py (what FSDP2's collectives moved on each GPU
in one step); bandwidths are bus bandwidths (benchmarks/collective_bandwidth.py), so a collective
over N GPUs of a payload S (the unsharded bytes) takes S * (N - 1) / N / bandwidth. Layouts:
- FSDP over all N GPUs: a ring through every GPU runs at the slowest link's rate, NVLink inside
  one node (N <= 8), InfiniBand across nodes;
- HSDP (8-GPU shard groups, replicated across N / 8 nodes): the gathers and the gradient
  reduce-scatter stay on NVLink, then each GPU all-reduces its gradient shard across the
  replicas over InfiniBand (2 * (R - 1) / R of the shard's bytes).
Compute time does not enter: the model gives the communication a step must hide behind it.
"""

from __future__ import annotations

import argparse

GPUS_PER_NODE = 8
# Per GPU and step on the 2.2B Llama (batch 2 x 2048 per GPU), benchmarks/multi_gpu.py on
# 2 H200s, 2026-11-27: all-gather output bytes (the unsharded bytes gathered: decoder layers twice,
# the root once) and reduce-scatter input bytes (fp32 gradients).
MEASURED_BYTES = {
    "bf16": {"all_gather": 8_309_186_560, "reduce_scatter": 8_833_482_752},
    "fp8": {"all_gather": 4_416_872_448, "reduce_scatter": 8_833_482_752},
}


def collective_ms(payload_bytes: float, num_gpus: int, bus_gb_s: float) -> float:
    """A ring collective over `num_gpus` moving `payload_bytes` (unsharded) at `bus_gb_s` bus bandwidth."""
    if num_gpus <= 1:
        return 0.0
    return payload_bytes * (num_gpus - 1) / num_gpus / (bus_gb_s * 1e9) * 1e3


def step_comm_ms(
    nbytes: dict[str, float], num_gpus: int, layout: str, intra_gb_s: float, inter_gb_s: float
) -> tuple[float, float]:
    """(gather ms, gradient ms) per step: all-gathers, and reduce-scatter (+ HSDP's all-reduce)."""
    if layout == "fsdp":
        bandwidth = intra_gb_s if num_gpus <= GPUS_PER_NODE else inter_gb_s
        return (
            collective_ms(nbytes["all_gather"], num_gpus, bandwidth),
            collective_ms(nbytes["reduce_scatter"], num_gpus, bandwidth),
        )
    shard_gpus = min(num_gpus, GPUS_PER_NODE)
    replicas = num_gpus // shard_gpus
    gather = collective_ms(nbytes["all_gather"], shard_gpus, intra_gb_s)
    scatter = collective_ms(nbytes["reduce_scatter"], shard_gpus, intra_gb_s)
    shard_bytes = nbytes["reduce_scatter"] / 2 / shard_gpus  # the fp32 gradient shard (input is fp32 too)
    all_reduce = 2 * collective_ms(shard_bytes, replicas, inter_gb_s)
    return gather, scatter + all_reduce


def table(measured: dict[str, dict[str, float]], intra_gb_s: float, inter_gb_s: float) -> str:
    lines = [
        "| GPUs | layout | bf16 gather ms | fp8 gather ms | fp8 / bf16 | gradient ms (both) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for num_gpus in (2, 8, 16, 64, 256, 1024):
        for layout in ("fsdp", "hsdp") if num_gpus > GPUS_PER_NODE else ("fsdp",):
            bf16_gather, gradient = step_comm_ms(measured["bf16"], num_gpus, layout, intra_gb_s, inter_gb_s)
            fp8_gather, _ = step_comm_ms(measured["fp8"], num_gpus, layout, intra_gb_s, inter_gb_s)
            lines.append(
                f"| {num_gpus} | {layout} | {bf16_gather:.1f} | {fp8_gather:.1f} | {fp8_gather / bf16_gather:.2f}x "
                f"| {gradient:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intra-gb-s", type=float, default=265.0, help="NVLink bus bandwidth (GB/s)")
    parser.add_argument("--inter-gb-s", type=float, default=40.0, help="InfiniBand bus bandwidth per GPU (GB/s)")
    args = parser.parse_args()
    print(table(MEASURED_BYTES, args.intra_gb_s, args.inter_gb_s))


if __name__ == "__main__":
    main()

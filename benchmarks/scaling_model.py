"""All-gather and reduce-scatter time per training step for 8 to 1024 GPUs, from the bytes each
step moves and measured bandwidth (docs/scaling.md explains the model and its inputs).

    python benchmarks/scaling_model.py [--intra-gb-s 265] [--inter-gb-s 40]

Bytes per step are counted from the 2.2B Llama of benchmarks/multi_gpu.py (`step_bytes`): its
parameters' shapes on the meta device, each quantized weight's all-gather inputs as quant-tensors'
gather builds them. They are what multi_gpu.py's collective counter measures (benchmarks/tests
check them against its CPU runs and against its 2-GPU measurements). Bandwidths are bus
bandwidths (benchmarks/collective_bandwidth.py), so a collective over N GPUs of a payload S (the
unsharded bytes) takes S * (N - 1) / N / bandwidth. Layouts:
- FSDP over all N GPUs: a ring through every GPU runs at the slowest link's rate, NVLink inside
  one node (N <= 8), InfiniBand across nodes;
- HSDP (8-GPU shard groups, replicated across N / 8 nodes): the gathers and the gradient
  reduce-scatter stay on NVLink, then each GPU all-reduces its gradient shard across the
  replicas over InfiniBand (2 * (R - 1) / R of the shard's bytes).
Gradients are reduced in fp32 (the layout's `reduce_dtype`), in bf16, or by quant_fsdp's FP8
reduce-scatter (`reduce_scatter="fp8"`: one byte per element plus an fp32 scale per 128, exchanged
in one all-to-all, which sends and receives (N - 1) / N of the payload per GPU as a ring does; under
HSDP only the shard group's reduce-scatter is quantized, the all-reduce across replicas stays in the
reduce dtype, bf16 here). Compute time does not enter, nor the FP8 reduce-scatter's quantize and
dequantize-sum kernels: the model gives the communication a step must hide behind it.
"""

from __future__ import annotations

import argparse

import torch
from _e2e_model import DecoderConfig
from _multi_gpu_runs import MODELS, _not_lm_head, build_model, decoder_layers

GPUS_PER_NODE = 8
MODEL = "llama-2b"
FORMATS = ("bf16", "fp8", "mxfp8", "nvfp4")
# Bytes per gradient element on the wire, by how gradients are reduced: fp32, bf16, and the FP8
# reduce-scatter's codes plus one fp32 scale per 1 x 128 block (chunk padding ignored: < 0.01%).
GRADIENT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 1.0 + 4.0 / 128}


def step_bytes(config: DecoderConfig, recipe: str, world_size: int) -> dict[str, int]:
    """Bytes per GPU and step of benchmarks/multi_gpu.py's layout (each decoder layer and the root
    sharded over `world_size` GPUs, bf16 params, fp32 gradient reduction), for "bf16" or a
    recipe's quantized weights: all-gather output bytes (each decoder layer gathered in the
    forward and again in the backward, the root once) and reduce-scatter input bytes.

    A converted weight sends the all-gather inputs of its shard: rowwise data and block scales
    (per-tensor values stay local), in the backward columnwise instead for formats whose
    columnwise data is not derived from rowwise (MXFP8) ([Note: quantized all-gather] in
    quant_tensors._fsdp); every other parameter travels in bf16, every gradient in fp32."""
    import quant_tensors as qt

    model = build_model(config, torch.device("meta"), "builtin")
    if recipe != "bf16":
        qt.convert(model, qt.recipe_from_name(recipe), quantized_weights=True, module_filter_fn=_not_lm_head)
    in_layers = {id(param) for param in decoder_layers(model).parameters()}
    gathered = scattered = 0
    for param in model.parameters():
        gathers = 2 if id(param) in in_layers else 1
        scattered += param.numel() * torch.float32.itemsize
        if not isinstance(param, qt.QuantizedTensor):
            gathered += gathers * param.numel() * torch.bfloat16.itemsize
            continue
        shard = torch.chunk(param, world_size)[0]
        backward = (True, False) if param.quantizer.can_derive_columnwise else (False, True)
        for usages in ((True, False), backward)[:gathers]:
            inputs, _ = qt.fsdp.all_gather_inputs(shard, world_size, usages=usages)
            gathered += world_size * sum(t.nbytes for t in inputs)
    return {"all_gather": gathered, "reduce_scatter": scattered}


def collective_ms(payload_bytes: float, num_gpus: int, bus_gb_s: float) -> float:
    """A ring collective over `num_gpus` moving `payload_bytes` (unsharded) at `bus_gb_s` bus bandwidth."""
    if num_gpus <= 1:
        return 0.0
    return payload_bytes * (num_gpus - 1) / num_gpus / (bus_gb_s * 1e9) * 1e3


def step_comm_ms(
    nbytes: dict[str, float],
    num_gpus: int,
    layout: str,
    intra_gb_s: float,
    inter_gb_s: float,
    gradients: str = "fp32",
) -> tuple[float, float]:
    """(gather ms, gradient ms) per step: all-gathers, and the reduce-scatter of gradients reduced
    as `gradients` (a key of GRADIENT_BYTES), plus under HSDP the all-reduce of the shard in the
    reduce dtype (fp32 for "fp32"; bf16 for "bf16" and for the FP8 reduce-scatter)."""
    scattered = nbytes["reduce_scatter"] / GRADIENT_BYTES["fp32"] * GRADIENT_BYTES[gradients]
    if layout == "fsdp":
        bandwidth = intra_gb_s if num_gpus <= GPUS_PER_NODE else inter_gb_s
        return (
            collective_ms(nbytes["all_gather"], num_gpus, bandwidth),
            collective_ms(scattered, num_gpus, bandwidth),
        )
    shard_gpus = min(num_gpus, GPUS_PER_NODE)
    replicas = num_gpus // shard_gpus
    gather = collective_ms(nbytes["all_gather"], shard_gpus, intra_gb_s)
    scatter = collective_ms(scattered, shard_gpus, intra_gb_s)
    reduce_dtype = "fp32" if gradients == "fp32" else "bf16"
    shard_bytes = nbytes["reduce_scatter"] / GRADIENT_BYTES["fp32"] * GRADIENT_BYTES[reduce_dtype] / shard_gpus
    all_reduce = 2 * collective_ms(shard_bytes, replicas, inter_gb_s)
    return gather, scatter + all_reduce


def table(nbytes: dict[str, dict[str, float]], intra_gb_s: float, inter_gb_s: float) -> str:
    """Gather ms per step of each format in `nbytes` ("bf16" first; the others with their ratio to
    bf16's) and gradient ms (the same in every format) reduced in fp32, in bf16 and by the FP8
    reduce-scatter (with its ratio to bf16's)."""
    formats = list(nbytes)[1:]
    lines = [
        "| GPUs | layout | bf16 gather ms | "
        + " | ".join(f"{f} gather ms" for f in formats)
        + " | fp32 gradient ms | bf16 gradient ms | fp8 reduce-scatter gradient ms |",
        "| ---: | --- | ---: | " + "---: | " * len(formats) + "---: | ---: | ---: |",
    ]
    for num_gpus in (2, 8, 16, 64, 256, 1024):
        for layout in ("fsdp", "hsdp") if num_gpus > GPUS_PER_NODE else ("fsdp",):
            bf16_gather, _ = step_comm_ms(nbytes["bf16"], num_gpus, layout, intra_gb_s, inter_gb_s)
            cells = []
            for f in formats:
                gather, _ = step_comm_ms(nbytes[f], num_gpus, layout, intra_gb_s, inter_gb_s)
                cells.append(f"{gather:.1f} ({gather / bf16_gather:.2f}x)")
            fp32, bf16, fp8 = (
                step_comm_ms(nbytes["bf16"], num_gpus, layout, intra_gb_s, inter_gb_s, gradients)[1]
                for gradients in GRADIENT_BYTES
            )
            lines.append(
                f"| {num_gpus} | {layout} | {bf16_gather:.1f} | "
                + " | ".join(cells)
                + f" | {fp32:.1f} | {bf16:.1f} | {fp8:.1f} ({fp8 / bf16:.2f}x) |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intra-gb-s", type=float, default=265.0, help="NVLink bus bandwidth (GB/s)")
    parser.add_argument("--inter-gb-s", type=float, default=40.0, help="InfiniBand bus bandwidth per GPU (GB/s)")
    args = parser.parse_args()
    # The bytes per GPU do not depend on the number of GPUs (each receives (N - 1) / N of every
    # gathered layer); counted at the 2 GPUs they were measured on.
    nbytes = {f: step_bytes(MODELS[MODEL], f, world_size=2) for f in FORMATS}
    print(table(nbytes, args.intra_gb_s, args.inter_gb_s))


if __name__ == "__main__":
    main()

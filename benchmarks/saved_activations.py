"""What Inductor's partitioner saves for backward in one compiled decoder layer, per run.

Usage (one GPU; the CPU works for small configurations):
    python benchmarks/saved_activations.py --runs bf16,torchao,fp8:qw,fp8:hp --model llama-2b

Builds the model of `--model` with one decoder layer in bf16 on one device (no FSDP), converts it
as the run says (torchao: float8 tensorwise; `<recipe>:qw` quantized weights; `<recipe>:hp`
high-precision weights), compiles the layer with Inductor, runs a forward and a backward, and
prints the tensors the partitioned forward graph hands to the backward (the layer's saved
activations and its parameters), counted by shape and dtype, largest first.
"""

from __future__ import annotations

import argparse
import collections

import _e2e_model
import torch
import torch._inductor.compile_fx as compile_fx
from _multi_gpu_runs import MODELS

_partition = compile_fx.min_cut_rematerialization_partition
_saved: list[list[tuple[tuple[int, ...], torch.dtype]]] = []


def _recording_partition(joint, inputs, **kwargs):
    forward, backward = _partition(joint, inputs, **kwargs)
    outputs = next(n for n in forward.graph.nodes if n.op == "output").args[0]
    values = (o.meta.get("val") for o in outputs if hasattr(o, "meta"))
    _saved.append([(tuple(v.shape), v.dtype) for v in values if isinstance(v, torch.Tensor)])
    return forward, backward


def saved_by_layer(run: str, config: _e2e_model.DecoderConfig, device: torch.device) -> list[tuple]:
    """(shape, dtype) of every tensor the compiled layer's forward saves for its backward."""
    torch.manual_seed(0)
    model = _e2e_model.build_decoder(config, device, "transformers", dtype=torch.bfloat16)
    not_head = lambda module, name: name != "lm_head"  # noqa: E731
    if run == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(), module_filter_fn=not_head)
    elif run != "bf16":
        import quant_tensors as qt

        recipe, weights = run.split(":")
        qt.convert(model, qt.recipe_from_name(recipe), quantized_weights=weights == "qw", module_filter_fn=not_head)
    layer = model.model.layers[0]
    layer.compile()
    _saved.clear()
    compile_fx.min_cut_rematerialization_partition = _recording_partition
    try:
        tokens = torch.randint(0, config.vocab_size, (config.batch_size, config.sequence_length), device=device)
        model(tokens).logits.float().sum().backward()
    finally:
        compile_fx.min_cut_rematerialization_partition = _partition
        torch._dynamo.reset()
    return _saved[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", default="bf16,torchao,fp8:qw,fp8:hp")
    parser.add_argument("--model", choices=tuple(MODELS), default="llama-2b")
    args = parser.parse_args()
    config = _e2e_model.DecoderConfig(**{**vars(MODELS[args.model]), "num_layers": 1})
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for run in args.runs.split(","):
        saved = saved_by_layer(run, config, device)
        sizes = collections.Counter(saved)
        total = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in saved)
        print(f"== {run}: {len(saved)} tensors, {total / 2**20:.1f} MiB")
        for (shape, dtype), count in sorted(sizes.items(), key=lambda item: -torch.Size(item[0][0]).numel()):
            print(f"   {count} x {shape} {dtype}")


if __name__ == "__main__":
    main()

"""`quant-fsdp demo`: the most complete end-to-end job the project can do today.

Today (quant-core's per-tensor FP8 kernels; the tensor subclasses and FSDP2 hooks come with
issues #4-#6) it quantizes the Linear weights of a small transformer with every recipe the
kernels support and every backend on this machine, and checks what FSDP2 will rely on:
- every backend's codes equal the plain-torch reference bit for bit;
- a simulated `world_size`-rank FSDP2 gather (each shard quantized with the all-reduced amax,
  the shards' bytes concatenated) equals quantizing the unsharded weight, bit for bit;
- the bytes a gather would move, against bf16, and the round-trip error.
It prints a table and writes `demo.json`; the exit code is 1 if any check fails.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import quant_core

_HIDDEN = 256
_LAYERS = 4
# (name, out_features, in_features) of each Linear in one transformer block.
_BLOCK_LINEARS = (
    ("qkv", 3 * _HIDDEN, _HIDDEN),
    ("proj", _HIDDEN, _HIDDEN),
    ("fc1", 4 * _HIDDEN, _HIDDEN),
    ("fc2", _HIDDEN, 4 * _HIDDEN),
)
# (recipe name, FP8 dtype, power-of-two scales)
_RECIPES = (
    ("fp8 e4m3", torch.float8_e4m3fn, False),
    ("fp8 e4m3 pow2", torch.float8_e4m3fn, True),
    ("fp8 e5m2", torch.float8_e5m2, False),
)


@dataclass(frozen=True)
class DemoRow:
    recipe: str
    backend: str
    quantize_ms: float
    gather_bytes_vs_bf16: float
    relative_error: float
    equals_reference: bool
    sharded_gather_equals_unsharded: bool


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    weights = {}
    for layer in range(_LAYERS):
        for name, out_features, in_features in _BLOCK_LINEARS:
            linear = torch.nn.Linear(in_features, out_features, bias=False)
            weights[f"layers.{layer}.{name}.weight"] = linear.weight.detach().to(torch.bfloat16)
    return weights


def _sharded_gather(
    weight: torch.Tensor, fp8_dtype: torch.dtype, power_2_scales: bool, world_size: int
) -> torch.Tensor:
    """Rowwise codes as FSDP2 would gather them: per-shard amax, all-reduced (max), shared scale."""
    shards = weight.chunk(world_size, dim=0)
    global_amax = torch.stack([quant_core.amax(shard) for shard in shards]).max()  # the amax all-reduce
    scale, _ = quant_core.fp8_scale(global_amax, fp8_dtype, power_2_scales=power_2_scales)
    gathered = [quant_core.cast_to_fp8(shard, scale, fp8_dtype)[0].view(torch.uint8) for shard in shards]
    return torch.cat(gathered)  # the all-gather of uint8 bytes along dim 0


def _evaluate(
    weights: dict[str, torch.Tensor], recipe: tuple[str, torch.dtype, bool], backend: str, world_size: int
) -> DemoRow:
    name, fp8_dtype, power_2_scales = recipe
    with quant_core.use_backend(backend):
        start = time.perf_counter()
        quantized = {
            k: quant_core.quantize_fp8(w, fp8_dtype, power_2_scales=power_2_scales, columnwise=True)
            for k, w in weights.items()
        }
        seconds = time.perf_counter() - start
        gathers_match = all(
            torch.equal(
                _sharded_gather(w, fp8_dtype, power_2_scales, world_size), quantized[k].rowwise_data.view(torch.uint8)
            )
            for k, w in weights.items()
        )
    equals_reference = True
    error_sq, norm_sq = 0.0, 0.0
    for k, w in weights.items():
        reference = quant_core.quantize_fp8_reference(w, fp8_dtype, power_2_scales=power_2_scales, columnwise=True)
        q = quantized[k]
        equals_reference &= torch.equal(q.rowwise_data.view(torch.uint8), reference.rowwise_data.view(torch.uint8))
        equals_reference &= torch.equal(
            q.columnwise_data.view(torch.uint8), reference.columnwise_data.view(torch.uint8)
        )
        equals_reference &= torch.equal(q.scale_inv, reference.scale_inv)
        restored = quant_core.dequantize_fp8_reference(q.rowwise_data, q.scale_inv)
        error_sq += float((restored - w.float()).square().sum())
        norm_sq += float(w.float().square().sum())
    # A gather moves rowwise codes (1 B/element) plus one fp32 scale per tensor, against 2 B/element.
    numel = sum(w.numel() for w in weights.values())
    gather_ratio = (numel + 4 * len(weights)) / (2 * numel)
    return DemoRow(
        name, backend, seconds * 1e3, gather_ratio, (error_sq / norm_sq) ** 0.5, equals_reference, gathers_match
    )


def run_demo(out: pathlib.Path, *, world_size: int) -> int:
    """Runs the demo, prints the table, writes demo.json; returns the process exit code."""
    console = Console(width=None if sys.stdout.isatty() else 120)  # logs: no wrapped tables
    weights = _weights()
    backends = quant_core.available_backends("cpu")
    rows = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("quantizing", total=len(_RECIPES) * len(backends))
        for recipe in _RECIPES:
            for backend in backends:
                progress.update(task, description=f"{recipe[0]} on {backend}")
                rows.append(_evaluate(weights, recipe, backend, world_size))
                progress.advance(task)
    numel = sum(w.numel() for w in weights.values())
    table = Table(
        title=f"{len(weights)} Linear weights ({numel / 1e6:.1f}M parameters, bf16), simulated {world_size}-rank FSDP2 gather"
    )
    for column in ("recipe", "backend", "ms", "bytes/bf16", "rel err", "=ref", "shards=full"):
        table.add_column(column, justify="left" if column in ("recipe", "backend") else "right")
    for r in rows:
        table.add_row(
            r.recipe,
            r.backend,
            f"{r.quantize_ms:.1f}",
            f"{r.gather_bytes_vs_bf16:.3f}",
            f"{r.relative_error:.4f}",
            "yes" if r.equals_reference else "[red]NO[/red]",
            "yes" if r.sharded_gather_equals_unsharded else "[red]NO[/red]",
        )
    console.print(table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "demo.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    console.print(f"wrote {out / 'demo.json'}")
    passed = all(r.equals_reference and r.sharded_gather_equals_unsharded for r in rows)
    if not passed:
        console.print("[red]a check failed: see the table above[/red]")
    return 0 if passed else 1

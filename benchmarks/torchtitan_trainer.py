"""quant-fsdp inside torchtitan 0.2's own Trainer, on one GPU: against torchtitan's float8 and bf16.

Imported by torchtitan 0.2 (benchmarks/ on PYTHONPATH, `--job.custom_config_module torchtitan_trainer
--experimental.custom_import torchtitan_trainer`), this module registers:
- the converter `quant_linear` (`--model.converters quant_linear`): `qt.convert` of the model's
  Linear layers under `--quant_linear.recipe_name`, with `--quant_linear.quantized_weights`
  (stepped by FusedAdam) and `--quant_linear.filter_fqns`, selected as quant_fsdp's torchtitan 0.3
  converter selects them (`quant_fsdp.linear_selection`); `--quant_linear.bf16_layers` builds the
  decoder layers' parameters in bf16 (the benchmarks' "qw-bf16"). 0.2's llama3 initialises weights
  with `trunc_normal_` on each weight, which a quantized weight refuses: the converter wraps the
  model's `init_weights` so that it runs on high-precision stand-ins, then quantizes each into its
  weight (`qt.nn.Linear.reset_parameters`, which keeps the value for FusedAdam's master);
- the converter `float8_one_rank_fsdp`: torchtitan's own float8 converter (torchao), whose FSDP
  float8 all-gather also applies under the one-rank FSDP below;
- the train spec `llama3_quant`: llama3's, with flavors of Llama 3 8B's layer shapes and a 32k
  vocabulary (`8B_<n>layers`), optimizer `--optimizer.name FusedAdam` (quant_optim.FusedAdam, with
  `--optimizer.master_weight_dtype`, `--optimizer.exp_avg_dtype`, `--optimizer.exp_avg_sq_dtype`;
  AdamW and Adam stay torchtitan's own), and `--one_rank_fsdp.enable`: torchtitan 0.2 applies
  `fully_shard` only where the data-parallel shard degree is above 1, so on one GPU it trains
  without FSDP under autocast; this option wraps the blocks and the model with FSDP2 on a one-rank
  mesh as torchtitan's `apply_fsdp` does on several (torchtitan still adds its autocast, the same
  for every run).

Run as a script it measures: one process per run, `torchrun --nproc_per_node 1 -m torchtitan.train`
with torchtitan's tokenizer of its tests (benchmarks/assets/torchtitan_tokenizer) and a synthetic
local text set, runs alternating over repeats; it parses tokens/s, MFU and memory from torchtitan's
step lines and writes a table and JSON:

    python benchmarks/torchtitan_trainer.py --out results/torchtitan   # on a CUDA machine, torchtitan 0.2.2 installed

Runs: "bf16" (torchtitan's AdamW), "float8-tensorwise" (float8 all-gather, precomputed scales),
"float8-rowwise", and ours as `<recipe>:<hp|qw|qw-bf16>[+<states>]` (e.g. "fp8:qw-bf16",
"fp8:qw-bf16+master-bf16-m-fp8"): quantized weights step with FusedAdam, high-precision ones with
torchtitan's AdamW; the states are those of benchmarks/_optimizer_states.py. A last
"+rowwise-weights" keeps quantized weights rowwise only (`weight_columnwise_on_demand`); "+fused"
runs the process with QUANT_CORE_COMPILED_KERNELS=inductor (its compiled blocks trace quant-core's
fused kernels: [Note: kernels Inductor fuses] in quant_core._library).
"""

# No `from __future__ import annotations`: torchtitan merges the JobConfig sections below by their
# field types, which must be classes, not strings.
import argparse
import dataclasses
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from _arguments import Parser, positive, positive_seconds, whole_number

HERE = Path(__file__).resolve().parent
TOKENIZER = HERE / "assets" / "torchtitan_tokenizer"
CONVERTER = "quant_linear"
FLOAT8_CONVERTER = "float8_one_rank_fsdp"
TRAIN_SPEC = "llama3_quant"
VOCAB_SIZE = 32000
BASELINES = ("bf16", "float8-tensorwise", "float8-rowwise")
DEFAULT_RUNS = "bf16,float8-tensorwise,float8-rowwise,fp8:qw-bf16"
WEIGHTS = ("hp", "qw", "qw-bf16")
ROWWISE_WEIGHTS = "rowwise-weights"  # run option: quantized weights keep rowwise data only
FUSED = "fused"  # run option: quant-core's compiled kernels "inductor" (QUANT_CORE_COMPILED_KERNELS)
RUN_OPTIONS = (ROWWISE_WEIGHTS, FUSED)


# The JobConfig extension (`--job.custom_config_module torchtitan_trainer`): torchtitan merges these
# sections into its JobConfig, the `optimizer` fields into its own optimizer section.
@dataclass
class QuantLinear:
    recipe_name: str = "fp8"
    """A quant_tensors recipe: "fp8", "fp8-delayed", "mxfp8", "fp8-block" or "nvfp4"."""
    quantized_weights: bool = False
    """Quantized primary weights, stepped by `--optimizer.name FusedAdam`."""
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    """Linear layers to keep in high precision: those whose name contains an entry."""
    bf16_layers: bool = False
    """Build the decoder layers' parameters in bf16 (FusedAdam keeps an fp32 master of each)."""
    weight_columnwise_on_demand: bool = False
    """Quantized weights keep rowwise data only (the recipe's `weight_columnwise_on_demand`)."""


@dataclass
class Optimizer:
    master_weight_dtype: str = "float32"
    """FusedAdam's masters of bf16 and quantized weights: "float32" or "bfloat16"."""
    exp_avg_dtype: str = "float32"
    """FusedAdam's first moment: "float32", "bfloat16", "float8_e4m3fn" or "float8_e5m2"."""
    exp_avg_sq_dtype: str = "float32"
    """FusedAdam's second moment: "float32", "bfloat16", "float8_e4m3fn" or "float8_e5m2"."""


@dataclass
class OneRankFSDP:
    enable: bool = False
    """Wrap the model with FSDP2 (torchtitan's apply_fsdp) where torchtitan would not: one rank."""


@dataclass
class JobConfig:
    quant_linear: QuantLinear = field(default_factory=QuantLinear)
    optimizer: Optimizer = field(default_factory=Optimizer)
    one_rank_fsdp: OneRankFSDP = field(default_factory=OneRankFSDP)


# ---- inside torchtitan ---------------------------------------------------------------------------


def _register_with_torchtitan() -> None:
    """Registers the converters and the train spec (torchtitan 0.2's registries)."""
    import functools

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchtitan.components.optimizer import OptimizersContainer, build_optimizers
    from torchtitan.components.quantization.float8 import Float8LinearConverter
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.models import llama3
    from torchtitan.models.llama3.infra.parallelize import apply_fsdp, parallelize_llama
    from torchtitan.protocols.model_converter import register_model_converter
    from torchtitan.protocols.train_spec import register_train_spec
    from torchtitan.tools.logging import logger

    import quant_tensors as qt
    from quant_fsdp.linear_selection import recipe_of, select_linears
    from quant_optim import FusedAdam

    def high_precision_stand_in(weight: torch.Tensor) -> torch.Tensor:
        """An uninitialised plain tensor shaped (and, for a DTensor, sharded) like `weight`."""
        if isinstance(weight, DTensor):
            local = weight.to_local()
            value = torch.empty(local.shape, dtype=weight.dtype, device=local.device)
            return DTensor.from_local(
                value,
                weight.device_mesh,
                weight.placements,
                run_check=False,
                shape=weight.shape,
                stride=weight.stride(),
            )
        return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)

    def with_quantized_init(model: torch.nn.Module) -> None:
        """Wraps `model.init_weights` (torchtitan calls it after `to_empty`): it runs on
        high-precision stand-ins of the quantized weights, each then quantized into its weight."""
        init_weights = model.init_weights

        def init_quantized(*args, **kwargs):
            layers = [m for m in model.modules() if isinstance(m, qt.nn.Linear) and qt.nn.is_quantized_weight(m.weight)]
            weights = [layer.weight for layer in layers]
            stand_ins = [torch.nn.Parameter(high_precision_stand_in(w), requires_grad=False) for w in weights]
            for layer, stand_in in zip(layers, stand_ins, strict=True):
                layer.weight = stand_in
            try:
                init_weights(*args, **kwargs)
            finally:
                for layer, weight in zip(layers, weights, strict=True):
                    layer.weight = weight  # the Parameter objects FSDP2 holds
            for layer, stand_in in zip(layers, stand_ins, strict=True):
                layer.reset_parameters(init={"weight": functools.partial(_copy_from, stand_in), "bias": _keep})

        model.init_weights = init_quantized

    class QuantLinearConverter:
        """torchtitan 0.2's converter protocol: `qt.convert` of the selected Linear layers."""

        def __init__(self, job_config, parallel_dims) -> None:
            self.config = job_config.quant_linear
            self.recipe = recipe_of(self.config.recipe_name, "--quant_linear")
            if self.config.weight_columnwise_on_demand:
                self.recipe = dataclasses.replace(self.recipe, weight_columnwise_on_demand=True)
            if self.config.quantized_weights and job_config.optimizer.name != "FusedAdam":
                raise ValueError(
                    f"--quant_linear.quantized_weights needs quant_optim's FusedAdam to step the quantized weights; "
                    f"got --optimizer.name {job_config.optimizer.name}. Pass --optimizer.name FusedAdam."
                )

        def convert(self, model: torch.nn.Module) -> None:
            if self.config.bf16_layers:
                model.layers.to(torch.bfloat16)
            linears = [
                (n, m.in_features, m.out_features) for n, m in model.named_modules() if type(m) is torch.nn.Linear
            ]
            selected = select_linears(linears, self.config.recipe_name, self.config.filter_fqns)
            qt.convert(
                model,
                self.recipe,
                quantized_weights=self.config.quantized_weights,
                module_filter_fn=lambda module, fqn: fqn in selected,
            )
            if self.config.quantized_weights:
                with_quantized_init(model)
            logger.info(
                f"quant_linear: {len(selected)} Linear layers to qt.nn.Linear ({self.config.recipe_name}, "
                f"quantized_weights={self.config.quantized_weights}, bf16_layers={self.config.bf16_layers}, "
                f"weight_columnwise_on_demand={self.config.weight_columnwise_on_demand})"
            )

        def post_optimizer_hook(self, model) -> None:
            pass

    class Float8OneRankFSDPConverter(Float8LinearConverter):
        """torchtitan's float8 converter, with the FSDP float8 all-gather under `--one_rank_fsdp.enable`
        too (torchtitan enables it only at a data-parallel shard degree above 1)."""

        def __init__(self, job_config, parallel_dims) -> None:
            super().__init__(job_config, parallel_dims)
            float8 = job_config.quantize.linear.float8
            if job_config.one_rank_fsdp.enable and float8.recipe_name is None and float8.enable_fsdp_float8_all_gather:
                self.config = dataclasses.replace(self.config, enable_fsdp_float8_all_gather=True)
                self.precompute_scale = float8.precompute_float8_dynamic_scale_for_fsdp

    def parallelize(model, parallel_dims, job_config):
        model = parallelize_llama(model, parallel_dims, job_config)
        if job_config.one_rank_fsdp.enable and not parallel_dims.fsdp_enabled:
            if parallel_dims.world_size != 1:
                raise ValueError(
                    f"--one_rank_fsdp.enable wraps one rank; this job has {parallel_dims.world_size}. Leave it off: "
                    "torchtitan applies FSDP itself when data_parallel_shard_degree is above 1."
                )
            device = "cuda" if torch.cuda.is_available() else "cpu"
            mesh = init_device_mesh(device, (1,), mesh_dim_names=("fsdp",))
            apply_fsdp(
                model,
                mesh,
                param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
                reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
                pp_enabled=False,
                cpu_offload=False,
                reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            )
            logger.info("Applied FSDP to the model on one rank (--one_rank_fsdp.enable)")
        return model

    def build_optimizers_quant(model_parts, optimizer_config, parallel_dims, ft_manager=None):
        if optimizer_config.name != "FusedAdam":
            quantized = [
                name
                for part in model_parts
                for name, p in part.named_parameters()
                if p.requires_grad and qt.nn.is_quantized_weight(p)
            ]
            if quantized:
                raise ValueError(
                    f"--optimizer.name {optimizer_config.name} cannot step quantized weights ({', '.join(quantized[:3])}"
                    f"{', ...' if len(quantized) > 3 else ''}): pass --optimizer.name FusedAdam."
                )
            return build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
        kwargs = {
            "lr": optimizer_config.lr,
            "betas": (optimizer_config.beta1, optimizer_config.beta2),
            "eps": optimizer_config.eps,
            "weight_decay": optimizer_config.weight_decay,
            **{
                name: _torch_dtype(getattr(optimizer_config, name), f"--optimizer.{name}")
                for name in ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
            },
        }
        return OptimizersContainer(model_parts, FusedAdam, kwargs)

    flavors = {
        "debugmodel": llama3.llama3_args["debugmodel"],
        **{
            f"8B_{n}layers": dataclasses.replace(llama3.llama3_args["8B"], n_layers=n, vocab_size=VOCAB_SIZE)
            for n in range(1, 33)
        },
    }
    spec = dataclasses.replace(
        llama3.get_train_spec(),
        model_args=flavors,
        parallelize_fn=parallelize,
        build_optimizers_fn=build_optimizers_quant,
    )
    register_model_converter(QuantLinearConverter, CONVERTER)
    register_model_converter(Float8OneRankFSDPConverter, FLOAT8_CONVERTER)
    register_train_spec(TRAIN_SPEC, spec)


def _copy_from(source, value) -> None:
    value.copy_(source)


def _keep(value) -> None:
    """The init of a parameter torchtitan's own init_weights has already initialised."""


def _torch_dtype(name: str, option: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{option} {name!r} is not a torch dtype name; give e.g. 'float32' or 'bfloat16'")
    return dtype


# Imported by torchtitan 0.2's config manager or Trainer (0.3 has no model_converter protocol: this
# module is for 0.2; imported elsewhere it defines the driver's functions only).
if "torchtitan.config.manager" in sys.modules and importlib.util.find_spec("torchtitan.protocols.model_converter"):
    _register_with_torchtitan()


# ---- the driver ----------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"(?:^|\s)step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+.*?memory:\s*(?P<memory>[\d.]+)GiB"
    r".*?tps:\s*(?P<tps>[\d,]+)\s+tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)


@dataclass(frozen=True)
class Step:
    """One of torchtitan's step lines (metrics.log_freq 1)."""

    step: int
    loss: float
    memory_gib: float
    """torchtitan's max reserved memory since the previous line."""
    tps: float
    mfu: float


def parse_steps(log: str) -> list[Step]:
    """The training step lines of a torchtitan log (colours stripped; validation lines left out)."""
    steps = []
    for line in log.splitlines():
        match = _STEP.search(_ANSI.sub("", line))
        if match:
            steps.append(
                Step(
                    step=int(match["step"]),
                    loss=float(match["loss"]),
                    memory_gib=float(match["memory"]),
                    tps=float(match["tps"].replace(",", "")),
                    mfu=float(match["mfu"]),
                )
            )
    return steps


def summarize_run(steps: list[Step], warmup: int) -> dict:
    """Medians of tokens/s and MFU over the steps after the first `warmup`, the peak memory over
    all steps; a ValueError when no step is left to measure."""
    measured = [s for s in steps if s.step > warmup]
    if not measured:
        last = max((s.step for s in steps), default=0)
        raise ValueError(
            f"no step after the {warmup} warm-up steps to measure (the log's last step is {last}): "
            "run more steps or lower --warmup"
        )
    return {
        "tps_median": statistics.median(s.tps for s in measured),
        "mfu_median": statistics.median(s.mfu for s in measured),
        "peak_gib": max(s.memory_gib for s in steps),
        "measured_steps": len(measured),
        "first_loss": steps[0].loss,
        "last_loss": steps[-1].loss,
    }


def summary_table(results: list[dict]) -> tuple[list[dict], str]:
    """Rows per run name (median over its repeats of tokens/s, MFU; the highest peak memory) with
    their ratios to bf16 and to torchtitan's best float8 run, and the Markdown table of them."""
    names = list(dict.fromkeys(r["run"] for r in results))
    rows = []
    for name in names:
        done = [r for r in results if r["run"] == name and "tps_median" in r]
        if not done:
            rows.append({"run": name, "repeats": 0})
            continue
        rows.append(
            {
                "run": name,
                "repeats": len(done),
                "tps": statistics.median(r["tps_median"] for r in done),
                "tps_min": min(r["tps_median"] for r in done),
                "tps_max": max(r["tps_median"] for r in done),
                "mfu": statistics.median(r["mfu_median"] for r in done),
                "peak_gib": max(r["peak_gib"] for r in done),
            }
        )
    by_name = {row["run"]: row for row in rows if row["repeats"]}
    bf16 = by_name.get("bf16", {}).get("tps")
    float8 = [row["tps"] for name, row in by_name.items() if name.startswith("float8-")]
    best_float8 = max(float8, default=None)
    lines = [
        "| run | tokens/s (median) | repeats (min-max) | vs bf16 | vs torchtitan float8 best | MFU % | peak GiB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if not row["repeats"]:
            lines.append(f"| {row['run']} | failed | 0 | | | | |")
            continue
        row["vs_bf16"] = row["tps"] / bf16 if bf16 else None
        row["vs_float8_best"] = row["tps"] / best_float8 if best_float8 else None
        lines.append(
            f"| {row['run']} | {row['tps']:,.0f} | {row['repeats']} ({row['tps_min']:,.0f}-{row['tps_max']:,.0f}) "
            f"| {_ratio(row['vs_bf16'])} | {_ratio(row['vs_float8_best'])} | {row['mfu']:.1f} | {row['peak_gib']:.2f} |"
        )
    return rows, "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}x"


def run_flags(name: str) -> list[str]:
    """torchtitan's command-line flags of one run (see the module's docstring for the names)."""
    if name == "bf16":
        return []
    if name == "float8-tensorwise":
        return [
            "--model.converters",
            FLOAT8_CONVERTER,
            "--quantize.linear.float8.enable_fsdp_float8_all_gather",
            "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp",
            "--quantize.linear.float8.filter_fqns",
            "output",
        ]
    if name == "float8-rowwise":
        return [
            "--model.converters",
            FLOAT8_CONVERTER,
            "--quantize.linear.float8.recipe_name",
            "rowwise",
            "--quantize.linear.float8.filter_fqns",
            "output",
        ]
    base, *options = name.split("+")
    rowwise_weights = ROWWISE_WEIGHTS in options
    states = "+".join(option for option in options if option not in RUN_OPTIONS)
    recipe, _, weights = base.partition(":")
    if weights not in WEIGHTS:
        raise ValueError(
            f"unknown run {name!r}: runs are {', '.join(BASELINES)} or "
            f"<recipe>:<{'|'.join(WEIGHTS)}>[+<states>][+{ROWWISE_WEIGHTS}][+{FUSED}], e.g. fp8:qw-bf16"
        )
    flags = ["--model.converters", CONVERTER, "--quant_linear.recipe_name", recipe]
    if weights == "hp":
        if states or rowwise_weights:
            raise ValueError(
                f"run {name!r}: high-precision weights step with torchtitan's AdamW and are quantized for each "
                f"GEMM; states and +{ROWWISE_WEIGHTS} apply to quantized weights (qw, qw-bf16)"
            )
        return flags
    flags += ["--quant_linear.quantized_weights", "--optimizer.name", "FusedAdam"]
    if weights == "qw-bf16":
        flags.append("--quant_linear.bf16_layers")
    if states:
        from _optimizer_states import FUSED_ADAM_STATES

        if states not in FUSED_ADAM_STATES:
            raise ValueError(f"run {name!r}: unknown states {states!r}; choose one of {', '.join(FUSED_ADAM_STATES)}")
        for option, dtype in FUSED_ADAM_STATES[states].items():
            flags += [f"--optimizer.{option}", str(dtype).removeprefix("torch.")]
    if rowwise_weights:
        flags.append("--quant_linear.weight_columnwise_on_demand")
    return flags


def run_environment(name: str) -> dict[str, str]:
    """What one run adds to the environment of its process (its `+fused` option)."""
    return {"QUANT_CORE_COMPILED_KERNELS": "inductor"} if FUSED in name.split("+")[1:] else {}


def write_text_set(folder: Path, kilobytes: int = 600, seed: int = 0) -> Path:
    """A deterministic synthetic text set (JSON lines of {"text": ...}) of about `kilobytes` KB."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "da", "pe", "qui", "zor", "an", "el", "is", "om"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(600)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "train.jsonl"
    size = 0
    with path.open("w") as f:
        while size < kilobytes * 1024:
            sentences = [" ".join(rng.choices(words, k=rng.randint(6, 18))).capitalize() + "." for _ in range(40)]
            line = json.dumps({"text": " ".join(sentences)}) + "\n"
            f.write(line)
            size += len(line)
    return folder


def torchtitan_command(name: str, args: argparse.Namespace, data: Path, dump: Path) -> list[str]:
    """The torchrun command line of one run."""
    ac = {"op": ["selective", "op"], "none": ["none"], "full": ["full"]}[args.ac]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "1",
        "-m",
        "torchtitan.train",
        "--job.custom_config_module",
        "torchtitan_trainer",
        "--experimental.custom_import",
        "torchtitan_trainer",
        "--job.dump_folder",
        str(dump),
        "--model.name",
        TRAIN_SPEC,
        "--model.flavor",
        f"8B_{args.layers}layers",
        "--model.hf_assets_path",
        str(TOKENIZER),
        "--training.dataset",
        "c4_test",
        "--training.dataset_path",
        str(data),
        "--training.local_batch_size",
        str(args.batch),
        "--training.seq_len",
        str(args.seq_len),
        "--training.steps",
        str(args.steps),
        "--lr_scheduler.warmup_steps",
        "2",
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
        "--compile.enable",
        "--activation_checkpoint.mode",
        ac[0],
        *(["--activation_checkpoint.selective_ac_option", ac[1]] if len(ac) > 1 else []),
        *(["--one_rank_fsdp.enable"] if args.fsdp else []),
        *run_flags(name),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="torchtitan_trainer.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"comma-separated (default {DEFAULT_RUNS})")
    parser.add_argument("--repeats", type=positive, default=2, help="processes per run, alternating over the runs")
    parser.add_argument("--layers", type=positive, default=8, help="decoder layers of Llama 3 8B's shapes (1-32)")
    parser.add_argument("--seq-len", type=positive, default=4096)
    parser.add_argument("--batch", type=positive, default=1, help="local batch size")
    parser.add_argument("--steps", type=positive, default=25)
    parser.add_argument("--warmup", type=whole_number, default=5, help="steps left out of the medians")
    parser.add_argument(
        "--ac",
        choices=("op", "none", "full"),
        default="op",
        help="activation checkpointing (op: selective, torchtitan's for 8B)",
    )
    parser.add_argument(
        "--no-fsdp", dest="fsdp", action="store_false", help="train as torchtitan does on one GPU: without FSDP"
    )
    parser.add_argument(
        "--deadline-s", type=positive_seconds, default=450.0, help="start no run that would end after this many seconds"
    )
    parser.add_argument("--run-timeout-s", type=positive_seconds, default=240.0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "results")) / "torchtitan")
    args = parser.parse_args(argv)
    runs = [r for r in args.runs.split(",") if r]
    for name in runs:
        try:
            run_flags(name)  # unknown names fail before anything runs
        except ValueError as error:
            parser.error(f"--runs: {error}")
    if not runs:
        parser.error("--runs: name at least one run")
    if not 1 <= args.layers <= 32:
        parser.error(f"--layers {args.layers}: Llama 3 8B has 32 layers; give 1 to 32")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup}: give 0 to --steps - 1 ({args.steps - 1}), so that some steps are timed")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="torchtitan_trainer_"))  # the text set and torchtitan's dump folder
    data = write_text_set(scratch / "data")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # As torchtitan's own launcher (run_train.sh) starts every run: the allocator grows segments
        # instead of caching blocks of every size, which keeps its reserved memory near what is allocated.
        "PYTORCH_ALLOC_CONF": os.environ.get("PYTORCH_ALLOC_CONF", "expandable_segments:True"),
    }
    start, longest, results = time.monotonic(), 0.0, []
    config = {k: str(v) for k, v in vars(args).items()} | {
        "model": f"Llama 3 8B shapes, {args.layers} layers, vocab {VOCAB_SIZE}",
        "PYTORCH_ALLOC_CONF": env["PYTORCH_ALLOC_CONF"],
    }
    for repeat in range(args.repeats):
        for name in runs:
            elapsed = time.monotonic() - start
            if elapsed + longest > args.deadline_s:
                print(
                    f"[skip] {name} #{repeat}: {elapsed:.0f} s + the longest run ({longest:.0f} s) passes --deadline-s"
                )
                continue
            log_path = args.out / f"{name.replace(':', '_').replace('+', '_')}-{repeat}.log"
            command = torchtitan_command(name, args, data, scratch / "dump")
            began = time.monotonic()
            try:
                done = subprocess.run(
                    command, env=env | run_environment(name), capture_output=True, text=True, timeout=args.run_timeout_s
                )
                log, returncode = done.stdout + done.stderr, done.returncode
            except subprocess.TimeoutExpired as timeout:
                log = (timeout.stdout or b"").decode() + (timeout.stderr or b"").decode()
                returncode = "timeout"
            wall = time.monotonic() - began
            longest = max(longest, wall)
            log_path.write_text(log)
            result = {
                "run": name,
                "repeat": repeat,
                "returncode": returncode,
                "wall_s": round(wall, 1),
                "log": log_path.name,
            }
            try:
                result |= summarize_run(parse_steps(log), args.warmup)
            except ValueError as error:
                result["error"] = (
                    str(error) if returncode == 0 else f"torchrun exited {returncode}: see {log_path.name}"
                )
            results.append(result)
            status = (
                f"{result['tps_median']:,.0f} tokens/s"
                if "tps_median" in result
                else f"FAILED ({returncode}): see {log_path}"
            )
            print(f"[{time.monotonic() - start:5.0f} s] {name} #{repeat}: {status}, {wall:.0f} s", flush=True)
            if "tps_median" not in result:
                print("\n".join(log.splitlines()[-15:]))
            rows, table = summary_table(results)
            (args.out / "torchtitan_trainer.json").write_text(
                json.dumps({"config": config, "results": results, "summary": rows}, indent=2)
            )
            (args.out / "torchtitan_trainer.md").write_text(table + "\n")
    print(
        f"\ntorchtitan 0.2 Trainer, one GPU: {config['model']}, seq {args.seq_len} x batch {args.batch}, "
        f"{args.steps} steps (median after {args.warmup}), compiled, FSDP2 {'on one rank' if args.fsdp else 'off'}"
    )
    print(summary_table(results)[1])
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if results and all("tps_median" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

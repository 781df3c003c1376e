"""The runs of `benchmarks/multi_gpu.py`: their names, models and how each builds its sharded model and optimizer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from _compile_modes import COMPILED_MODES, compile_backend
from _e2e_model import CONFIGS, DecoderConfig, build_decoder, resolve_model_source
from _optimizer_states import FUSED_ADAM_STATES
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from quant_lab.demo import MarkovTask

RECIPES = ("fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4")
TORCHAO_BASES = ("torchao-tensorwise", "torchao-rowwise")
MODES = ("eager", "compiled")  # bf16 and torchao; our recipes also "fused" (_compile_modes)
RECIPE_MODES = (*MODES, "fused")
MODELS = {
    # The multi-GPU model of docs/benchmarks.md: a 2.2B Llama.
    "llama-2b": DecoderConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=8,
        num_heads=32,
        sequence_length=2048,
        batch_size=2,
    ),
    "e2e": CONFIGS["default"],
    "tiny": CONFIGS["tiny"],
}
SEED = 0


@dataclass(frozen=True)
class RunSpec:
    """One configuration: what converts the Linears, which weights, eager or per-layer compiled,
    the optimizer's states (OPTIMIZER_STATES; "" for the default) and the gradient reduce-scatter
    (REDUCE_SCATTERS; "" for FSDP2's own)."""

    base: str
    weights: str  # a recipe's: "hp", "qw" or "qw-bf16" (WEIGHTS); "" for bf16 and torchao
    mode: str
    states: str = ""
    reduce_scatter: str = ""

    @property
    def name(self) -> str:
        name = ":".join((self.base, self.weights, self.mode) if self.weights else (self.base, self.mode))
        return "+".join(part for part in (name, self.states, self.reduce_scatter) if part)

    @property
    def quantized_weights(self) -> bool:
        return self.weights.startswith("qw")


# hp: high-precision weights gathered quantized, torch's AdamW; qw: quantized primary weights,
# FusedAdam; qw-bf16: the same with the decoder layers' other parameters (norms) built in bf16
# (FusedAdam keeps an fp32 master of each), so FSDP2's sharded gradients of the layers are bf16
# (reduced in fp32); the root's embedding, final norm and lm_head stay fp32, stepped in place.
WEIGHTS = ("hp", "qw", "qw-bf16")


def all_run_names() -> list[str]:
    names = [f"{base}:{mode}" for base in ("bf16", *TORCHAO_BASES) for mode in MODES]
    return names + [f"{r}:{w}:{mode}" for r in RECIPES for w in WEIGHTS for mode in RECIPE_MODES]


# Optimizer states a run may name after "+" (default: fp32 states): FUSED_ADAM_STATES for
# quantized-weight runs; the others step with torch's AdamW, whose peers with smaller states are
# torchao.optim's low-bit AdamWs.
# (torchao's `_AdamW(bf16_stochastic_round=True)` is left out: it rounds bf16 parameters, and
# these runs keep fp32 ones, as torchtitan does.)
TORCHAO_OPTIMIZERS = ("ao-adamw8bit", "ao-adamwfp8")
OPTIMIZER_STATES = (*FUSED_ADAM_STATES, *TORCHAO_OPTIMIZERS)
# Gradient reduce-scatters a recipe run may name after "+": `rs-fp8` is
# `quant_fsdp.fully_shard(..., reduce_scatter="fp8")` (quant_fsdp.QuantizedReduceScatter).
REDUCE_SCATTERS = ("rs-fp8",)


def parse_run(name: str) -> RunSpec:
    """The RunSpec called `name` (`<base>[:<weights>]:<mode>[+<states>][+rs-fp8]`); a ValueError
    listing the valid names otherwise."""
    run, *suffixes = name.strip().split("+")
    parts = run.split(":")
    if ":".join(parts) not in all_run_names():
        raise ValueError(
            f"unknown run {name!r}; runs are <base>[:{'|'.join(WEIGHTS)}]:eager|compiled|fused[+<states>][+rs-fp8] "
            "(fused: our recipes only): "
            f"{', '.join(all_run_names())}"
        )
    reduce_scatter = [s for s in suffixes if s in REDUCE_SCATTERS]
    states = [s for s in suffixes if s not in REDUCE_SCATTERS]
    if len(reduce_scatter) > 1 or len(states) > 1:
        raise ValueError(f"run {name!r}: at most one optimizer-state option and one reduce-scatter option")
    spec = RunSpec(parts[0], parts[1] if len(parts) == 3 else "", parts[-1], "".join(states), "".join(reduce_scatter))
    if spec.reduce_scatter and not spec.weights:
        raise ValueError(
            f"run {name!r}: {spec.reduce_scatter} is quant_fsdp.fully_shard's reduce-scatter, for runs of our "
            f"recipes ({', '.join(RECIPES)}); {spec.base} shards with torch's fully_shard"
        )
    states = spec.states
    allowed = FUSED_ADAM_STATES if spec.quantized_weights else TORCHAO_OPTIMIZERS
    if states and states not in allowed:
        optimizer = "quant_optim.FusedAdam" if spec.quantized_weights else "torch's AdamW"
        raise ValueError(
            f"run {name!r}: {spec.name.partition('+')[0]} steps with {optimizer}, whose state options are "
            f"{', '.join(allowed)}; got {states!r}"
        )
    return spec


def make_optimizer(
    spec: RunSpec, params: list[torch.nn.Parameter], lr: float, device: torch.device
) -> torch.optim.Optimizer:
    """The run's optimizer over `params` (weight decay 0): FusedAdam for quantized weights, else
    torch's AdamW (fused on CUDA) or the torchao.optim AdamW its states name."""
    if spec.quantized_weights:
        from quant_optim import FusedAdam

        return FusedAdam(params, lr=lr, **FUSED_ADAM_STATES.get(spec.states, {}))
    if spec.states:
        import torchao.optim

        low_bit = torchao.optim.AdamW8bit if spec.states == "ao-adamw8bit" else torchao.optim.AdamWFp8
        return low_bit(params, lr=lr, weight_decay=0.0)
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=device.type == "cuda")


@dataclass(frozen=True, kw_only=True)
class Options:
    """What every launch of an invocation shares."""

    model: str
    model_source: str
    num_layers: int | None
    batch_size: int | None = None
    """Sequences per GPU per step instead of the model's."""
    num_warmup: int
    num_steps: int
    learning_rate: float
    compile_backend: str
    profile: bool
    memory_snapshot: bool = False

    @property
    def config(self) -> DecoderConfig:
        overrides = {"num_layers": self.num_layers, "batch_size": self.batch_size}
        return DecoderConfig(**{**asdict(MODELS[self.model]), **{k: v for k, v in overrides.items() if v is not None}})


def build_model(config: DecoderConfig, device: torch.device, source: str) -> torch.nn.Module:
    """A randomly initialised decoder with fp32 parameters on `device` (seed the RNG first)."""
    return build_decoder(config, device, source, dtype=torch.float32)


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """transformers' `model.model.layers`, or the built-in Decoder's `model.layers`."""
    inner = getattr(model, "model", model)
    return inner.layers


def round_layers_to_bf16(model: torch.nn.Module) -> None:
    """Every parameter of the decoder layers rounded to bf16 (the same initial values as every
    other run); the root's parameters and the buffers (RoPE) kept."""
    for param in decoder_layers(model).parameters():
        param.data = param.data.to(torch.bfloat16)


def _not_lm_head(module: torch.nn.Module, name: str) -> bool:
    return name != "lm_head"


def build_run(
    spec: RunSpec, options: Options, device: torch.device, mesh: DeviceMesh
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Callable[[], None]]:
    """(model, optimizer, after_step): the sharded model of one run and what follows each optimizer step."""
    torch.manual_seed(SEED)
    model = build_model(options.config, device, resolve_model_source(options.model_source))
    if spec.weights == "qw-bf16":
        round_layers_to_bf16(model)
    after_step: Callable[[], None] = lambda: None  # noqa: E731
    shard: Callable[..., torch.nn.Module] = torch_fully_shard
    if spec.base.startswith("torchao-"):
        from torchao.float8 import (
            Float8LinearConfig,
            convert_to_float8_training,
            precompute_float8_dynamic_scale_for_fsdp,
        )

        if spec.base == "torchao-tensorwise":
            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
            after_step = functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)
        else:
            config = Float8LinearConfig.from_recipe_name("rowwise")
        convert_to_float8_training(model, config=config, module_filter_fn=_not_lm_head)
    elif spec.base != "bf16":
        import quant_fsdp
        import quant_tensors as qt

        recipe = qt.recipe_from_name(spec.base)
        qt.convert(model, recipe, quantized_weights=spec.quantized_weights, module_filter_fn=_not_lm_head)
        shard = functools.partial(
            quant_fsdp.fully_shard,
            quantize_on_gather=not spec.quantized_weights,
            reduce_scatter="fp8" if spec.reduce_scatter == "rs-fp8" else None,
        )
        if not spec.quantized_weights:  # one amax all-reduce for every weight (docs/fsdp.md), as torchao's precompute
            after_step = lambda: quant_fsdp.sync_amax_(model.parameters())  # noqa: E731
    layers = decoder_layers(model)
    if spec.mode in COMPILED_MODES:
        for layer in layers:
            layer.compile(backend=compile_backend(options.compile_backend, spec.mode))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in layers:
        shard(layer, mesh=mesh, mp_policy=policy)
    shard(model, mesh=mesh, mp_policy=policy)
    optimizer = make_optimizer(spec, list(model.parameters()), options.learning_rate, device)
    return model, optimizer, after_step


def rank_batches(config: DecoderConfig, num_steps: int, rank: int, world_size: int) -> torch.Tensor:
    """This rank's slice of the global batches of steps 0 .. num_steps - 1: (steps, batch, sequence + 1)."""
    task = MarkovTask(config.vocab_size, seed=SEED)
    tokens = task.batches(range(num_steps), config.batch_size * world_size, config.sequence_length)
    return tokens[:, rank * config.batch_size : (rank + 1) * config.batch_size].contiguous()

"""torchtitan (0.3) model converter: the model's Linear layers become qt.nn.Linear under a recipe.

torchtitan 0.3 builds models from a tree of configs; its converters rewrite that tree before the
model is built (`torchtitan.protocols.model.ModelConfigConverter`). `QuantLinearConverter`
replaces each selected `torchtitan.models.common.Linear.Config` by a `QuantLinear.Config`, whose
module is a `qt.nn.Linear` that satisfies torchtitan's Module protocol (built on the meta device,
initialised by torchtitan's `init_weights` with the model's own initialisers, in high precision
and then quantized when the weights are quantized). torchtitan's parallelize function then shards
the model with torch's `fully_shard`, which gathers quantized bytes (the gather hooks are methods
of the quantized tensors; each quantized weight's quantizer holds a quant_fsdp context, so its
gathers count in `comm_stats()`). With `reduce_scatter="fp8"` the converter also wraps the root
config: the model it builds installs a `QuantizedReduceScatter` on each of its FSDP2 modules when
torchtitan initialises it (`init_states`, which the Trainer calls after the parallelize function
and before loading a checkpoint, so that error feedback's residuals load with it).
docs/integrations.md shows a config registry entry that lists the converter beside quant-optim's
FusedAdam optimizer config.

Limits: data parallelism (FSDP2, HSDP) only, under torchtitan's "partial_dtensor" backend
(`QuantLinear.parallelize`, which torchtitan calls for tensor parallelism and for the other
backends, refuses with the fix named).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from types import MethodType
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter  # torch 2.11 to 2.13
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.utils import has_quantization
from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

import quant_tensors as qt
from quant_fsdp._context import ShardedWeight
from quant_fsdp._reduce_scatter import QuantizedReduceScatter
from quant_fsdp._reduce_scatter import install as install_reduce_scatter
from quant_fsdp.linear_selection import recipe_of, select_linears

__all__ = ["QuantLinear", "QuantLinearConverter", "unfuse_qkv"]


class QuantLinear(qt.nn.Linear, Module):
    """qt.nn.Linear as a torchtitan Module, built from a `QuantLinear.Config`."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        """A `Linear.Config` with a recipe: what `QuantLinearConverter` puts in its place."""

        in_features: int
        """Input features, as in `Linear.Config`."""
        out_features: int
        """Output features, as in `Linear.Config`."""
        bias: bool = False
        """Whether the layer has a bias, as in `Linear.Config`."""
        recipe_name: str = "fp8"
        """A quant_tensors recipe name (`qt.recipe_from_name`)."""
        quantized_weights: bool = False
        """Quantized primary weights (stepped by quant_optim's FusedAdam) instead of high-precision ones."""
        weight_columnwise_on_demand: bool = False
        """Weights keep rowwise data only (the recipe's `weight_columnwise_on_demand`)."""

    def __init__(self, config: Config) -> None:
        qt.nn.Linear.__init__(
            self,
            config.in_features,
            config.out_features,
            config.bias,
            recipe=_recipe(config.recipe_name, config.weight_columnwise_on_demand, "QuantLinear.Config"),
        )
        if config.quantized_weights and not self.high_precision_reason:
            # torchtitan shards with torch's fully_shard: the context makes the gathers count in comm_stats()
            self.weight_quantizer.bind(shard_context=ShardedWeight(self.weight_quantizer.format_name))
            weight = self.weight
            if weight.is_meta:  # torchtitan builds models on the meta device
                value = self.weight_quantizer.make_empty(weight.shape, dtype=weight.dtype, device="meta")
                self.weight = torch.nn.Parameter(value, requires_grad=weight.requires_grad)
            else:
                self.weight = qt.nn.quantized_parameter(weight, self.weight_quantizer)

    def _init_self_parameters(self) -> None:
        """torchtitan's initialisation (the config's `param_init`), through `reset_parameters`: a
        quantized weight is initialised in high precision, then quantized; the quantizer states
        (delayed scaling's histories, NVFP4's rounding counter) start from zero."""
        self.reset_parameters(init=self._param_init)

    def parallelize(self, parallel_dims: ParallelDims) -> None:
        """torchtitan calls this for tensor parallelism and its "spmd_types"/"full_dtensor" backends;
        neither is built for quantized layers."""
        raise ValueError(
            f"QuantLinear supports data parallelism (FSDP2, HSDP) under parallelism.spmd_backend='partial_dtensor' "
            f"only; got spmd_backend={parallel_dims.spmd_backend!r}, tensor_parallel_degree={parallel_dims.tp}. "
            "Set parallelism.spmd_backend = 'partial_dtensor' and tensor_parallel_degree = 1."
        )


class QuantLinearConverter(QuantizationConverter):
    """Replaces the model config's `Linear.Config`s by `QuantLinear.Config`s under a quant_tensors recipe."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        """What to quantize and how (torchtitan's configs are mutable slots dataclasses)."""

        recipe_name: str = "fp8"
        """"fp8", "fp8-delayed", "mxfp8", "fp8-block" or "nvfp4" (`qt.recipe_from_name`)."""
        quantized_weights: bool = False
        """Quantized primary weights; needs `quant_optim.torchtitan.FusedAdamOptimizers` as the optimizer."""
        filter_fqns: list[str] = field(default_factory=lambda: ["output", "lm_head"])
        """Layers to keep in high precision: a Linear whose fully qualified name contains any entry."""
        weight_columnwise_on_demand: bool = False
        """Weights keep rowwise data only and derive the dgrad GEMM's operand in each backward: the
        quantized weights' memory and gathered bytes halve (every recipe but "mxfp8"; docs/formats.md)."""
        reduce_scatter: str | None = None
        """None: FSDP2's own gradient reduce-scatter; "fp8": `quant_fsdp.QuantizedReduceScatter` on every
        FSDP2 module of the model, with the four options below (docs/fsdp.md)."""
        reduce_scatter_dtype: str = "float8_e4m3fn"
        """The FP8 reduce-scatter's code dtype: "float8_e4m3fn" or "float8_e5m2"."""
        reduce_scatter_block_size: int = 128
        """Elements per scale of the FP8 reduce-scatter: 16, 32, 64 or 128."""
        reduce_scatter_stochastic_rounding: bool = False
        """Round the FP8 reduce-scatter's codes stochastically."""
        reduce_scatter_error_feedback: bool = False
        """Carry what each FP8 reduce-scatter did not send into the next (residuals saved with the model)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.recipe = _recipe(config.recipe_name, config.weight_columnwise_on_demand, "QuantLinearConverter.Config")
        self.reduce_scatter = _reduce_scatter_options(config)
        if self.reduce_scatter is not None:
            try:
                QuantizedReduceScatter(**self.reduce_scatter)  # refuses a bad block size now
            except ValueError as error:
                raise ValueError(
                    f"QuantLinearConverter.Config(reduce_scatter_block_size={config.reduce_scatter_block_size!r}): {error}"
                ) from None

    def convert(self, model_config: Module.Config) -> Module.Config:
        """Swaps every selected Linear config in `model_config` (in place; returns the root)."""
        if has_quantization(model_config):
            raise ValueError(
                "the model config already holds torchtitan's own quantized Linear configs (Float8LinearConverter, "
                "MXFP8LinearConverter or NVFP4LinearConverter); a layer takes one quantization. List only "
                "QuantLinearConverter.Config in `converters` (recipes 'fp8', 'mxfp8' and 'nvfp4' cover those)."
            )
        if self.config.quantized_weights:
            model_config = unfuse_qkv(model_config)
        linears = list(model_config.traverse(Linear.Config))
        selected = select_linears(
            ((fqn, linear.in_features, linear.out_features) for fqn, linear, _, _ in linears),
            self.config.recipe_name,
            self.config.filter_fqns,
        )
        for fqn, linear, parent, attribute in linears:
            if fqn not in selected:
                continue
            replacement = QuantLinear.Config(
                in_features=linear.in_features,
                out_features=linear.out_features,
                bias=linear.bias,
                param_init=linear.param_init,
                sharding_config=linear.sharding_config,
                recipe_name=self.config.recipe_name,
                quantized_weights=self.config.quantized_weights,
                weight_columnwise_on_demand=self.config.weight_columnwise_on_demand,
            )
            model_config = _replaced(model_config, parent, attribute, replacement)
        if self.reduce_scatter is not None:
            model_config = _with_fp8_reduce_scatter(model_config, self.reduce_scatter)
        return model_config


def _reduce_scatter_options(config: QuantLinearConverter.Config) -> dict[str, Any] | None:
    """QuantizedReduceScatter's keyword arguments from the converter's `reduce_scatter*` fields, or
    None for FSDP2's own reduce-scatter; a ValueError naming the field and its choices."""
    if config.reduce_scatter is None:
        return None
    if config.reduce_scatter != "fp8":
        raise ValueError(
            f"QuantLinearConverter.Config(reduce_scatter={config.reduce_scatter!r}): use None (FSDP2's own "
            'reduce-scatter) or "fp8" (quant_fsdp.QuantizedReduceScatter)'
        )
    dtypes = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}
    if config.reduce_scatter_dtype not in dtypes:
        raise ValueError(
            f"QuantLinearConverter.Config(reduce_scatter_dtype={config.reduce_scatter_dtype!r}): use "
            '"float8_e4m3fn" or "float8_e5m2"'
        )
    return {
        "dtype": dtypes[config.reduce_scatter_dtype],
        "block_size": config.reduce_scatter_block_size,
        "stochastic_rounding": config.reduce_scatter_stochastic_rounding,
        "error_feedback": config.reduce_scatter_error_feedback,
    }


def _with_fp8_reduce_scatter(root: Module.Config, options: dict[str, Any]) -> Module.Config:
    """`root` as an instance of a subclass of its config class whose `build` returns the same model,
    except that the model's `init_states` first gives each FSDP2 module in it a
    `QuantizedReduceScatter(**options)` of its own (as torchtitan's LoRA converter subclasses
    configs to adjust what they build). torchtitan initialises the model after its parallelize
    function and before it loads a checkpoint, so the modules are sharded by then and the error
    feedback residuals exist, zeroed, when the checkpoint is loaded into them."""
    config_class = type(root)

    def init_states_with_fp8_reduce_scatter(model: Module, *args: Any, **kwargs: Any) -> None:
        # One module per FSDP2 state: torchtitan shards [norm, lm_head] as one group.
        states = {}
        for module in model.modules():
            if isinstance(module, FSDPModule):
                states.setdefault(id(module._get_fsdp_state()), module)
        sharded = list(states.values())
        for module in sharded:
            _check_own_reduce_scatter(module)
        for module in sharded:
            # torchtitan sets a gradient divide factor of 1 (PREMUL_SUM), which this comm takes
            # as a SUM with the factor applied around it.
            module.set_force_sum_reduction_for_comms(True)
            install_reduce_scatter(module, QuantizedReduceScatter(**options))
        type(model).init_states(model, *args, **kwargs)

    def build(self: Module.Config, **kwargs: Any) -> Module:
        model = config_class.build(self, **kwargs)
        # A method bound to the model: a deep copy of it (a pipeline stage) binds to the copy.
        model.init_states = MethodType(init_states_with_fp8_reduce_scatter, model)
        return model

    subclass = type(f"FP8ReduceScatter{config_class.__name__}", (config_class,), {"build": build})
    subclass.__qualname__ = f"FP8ReduceScatter{config_class.__qualname__}"
    return subclass(**{f.name: getattr(root, f.name) for f in fields(root) if f.init})


def _check_own_reduce_scatter(module: FSDPModule) -> None:
    """Refuses a module whose reduce-scatter is neither FSDP2's default nor ours (an earlier
    initialisation's): another comm set by the parallelize function, e.g. symmetric memory's."""
    group = module._get_fsdp_state()._fsdp_param_group  # torch 2.11 to 2.13
    comm = None if group is None else group._reduce_scatter_comm
    if comm is not None and not isinstance(comm, (DefaultReduceScatter, QuantizedReduceScatter)):
        raise ValueError(
            f"QuantLinearConverter.Config(reduce_scatter='fp8'): an FSDP2 module of the model already reduce-scatters "
            f"with {type(comm).__name__}, which the FP8 reduce-scatter would replace; set "
            "parallelism.enable_fsdp_symm_mem = False or leave reduce_scatter=None"
        )


def _recipe(recipe_name: str, weight_columnwise_on_demand: bool, owner: str) -> qt.Recipe:
    """The recipe `recipe_name` names, with rowwise-only weights if asked; a ValueError naming `owner`."""
    recipe = recipe_of(recipe_name, owner)
    if not weight_columnwise_on_demand:
        return recipe
    try:
        return replace(recipe, weight_columnwise_on_demand=True)
    except ValueError as error:
        raise ValueError(f"{owner}(recipe_name={recipe_name!r}, weight_columnwise_on_demand=True): {error}") from None


def unfuse_qkv(model_config: Module.Config) -> Module.Config:
    """Replaces each `FusedQKVLinear.Config` by the equivalent three-projection `QKVLinear.Config` (in
    place; returns the root). Same parameters under the same state-dict keys (the fused module saves
    wq/wk/wv through state-dict hooks that slice its weight along a dim a quantized weight cannot be
    sliced along), so `QuantLinearConverter` calls it for quantized primary weights."""
    for _, fused, parent, attribute in list(model_config.traverse(FusedQKVLinear.Config)):
        head_dim = fused.head_dim
        param_init = _stock_qkv_param_init(fused.wqkv.param_init)
        replacement = QKVLinear.Config(
            head_dim=head_dim,
            param_init=fused.param_init,
            sharding_config=fused.sharding_config,
            wq=replace(fused.wqkv, out_features=fused.n_heads * head_dim, param_init=param_init),
            wkv=replace(fused.wqkv, out_features=fused.n_kv_heads * head_dim, param_init=param_init),
        )
        model_config = _replaced(model_config, parent, attribute, replacement)
    return model_config


def _replaced(root: Module.Config, parent: Any, attribute: Any, replacement: Module.Config) -> Module.Config:
    """Puts `replacement` where `traverse` found a config (`parent[attribute]` or `parent.attribute`;
    the root itself where `parent` is None); returns the root."""
    if parent is None:
        return replacement
    if isinstance(parent, list):
        parent[attribute] = replacement
    else:
        setattr(parent, attribute, replacement)
    return root


def _stock_qkv_param_init(fused_init: dict | None) -> dict | None:
    """The initialisers of the stock wq/wk/wv that torchtitan's fused-QKV initialisers wrap
    (`_fused_qkv_param_init` draws q, k and v with them, in that order, so the three separate
    projections get the same values)."""
    if fused_init is None:
        return None
    stock = {}
    for name, init in fused_init.items():
        free = dict(zip(init.__code__.co_freevars, init.__closure__ or (), strict=True))
        if "base_init" not in free:
            return fused_init  # not torchtitan's fused initialiser: an initialiser of any shape
        stock[name] = free["base_init"].cell_contents
    return stock

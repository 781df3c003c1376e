"""torchtitan (0.3) optimizer config: quant_optim.FusedAdam built as torchtitan builds its optimizers.

`FusedAdamOptimizers` is torchtitan's `OptimizersContainer` (param groups matched by FQN regex,
one optimizer per model part, flat FQN-keyed state dicts for torchtitan's checkpointer) whose
optimizer name "FusedAdam" builds `quant_optim.FusedAdam` with the config's master and moment
dtypes. Without `param_groups` one catch-all group steps every parameter with the config's
hyperparameters. Every other optimizer torchtitan knows ("AdamW", ...) may still be named in a
group, for parameters that are not quantized weights:

    from quant_optim.torchtitan import FusedAdamOptimizers, with_quantized_training_checks

    config.optimizer = FusedAdamOptimizers.Config(lr=8e-4, master_weight_dtype="bfloat16")
    config.model_spec = with_quantized_training_checks(config.model_spec)

`check_quantized_training` (what `with_quantized_training_checks` adds to the model spec's
`post_optimizer_build_fn`, which torchtitan's Trainer calls once the optimizers are built) refuses,
before the first step, optimizers other than FusedAdam over quantized weights (torchtitan's default
AdamW among them) and torchtitan's own Float8/MXFP8/NVFP4 Linears next to qt.nn.Linear layers (a
torchtitan quantization converter listed after quant_fsdp's `QuantLinearConverter`).
`FusedAdamOptimizers` runs the second check itself when it is built.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

import quant_tensors as qt
from quant_optim._adam import FusedAdam

__all__ = ["FusedAdamOptimizers", "check_quantized_training", "with_quantized_training_checks"]


def _dtype(field_name: str, name: str) -> torch.dtype:
    """The torch dtype called `name` (FusedAdam says which dtypes each state takes)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"FusedAdamOptimizers.Config.{field_name}={name!r} is not a torch dtype name; give e.g. 'float32' or "
            "'bfloat16'"
        )
    return dtype


class FusedAdamOptimizers(OptimizersContainer):
    """torchtitan's OptimizersContainer whose "FusedAdam" groups are stepped by quant_optim.FusedAdam."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """FusedAdam's settings; `param_groups` (torchtitan's) as in OptimizersContainer, default one for all."""

        lr: float = 8e-4
        """Learning rate of the default param group."""
        betas: tuple[float, float] = (0.9, 0.95)
        """Adam's betas of the default param group."""
        eps: float = 1e-8
        """Adam's epsilon of the default param group."""
        weight_decay: float = 0.1
        """Decoupled (AdamW) weight decay of the default param group."""
        master_weight_dtype: str = "float32"
        """Masters of bf16 and quantized weights: "float32", or "bfloat16" (rounded stochastically)."""
        exp_avg_dtype: str = "float32"
        """First moment: "float32", "bfloat16", "float8_e4m3fn" or "float8_e5m2"."""
        exp_avg_sq_dtype: str = "float32"
        """Second moment: "float32", "bfloat16", "float8_e4m3fn" or "float8_e5m2"."""

    def __init__(self, config: Config, *, model_parts: list[torch.nn.Module]) -> None:
        self._fused_adam_kwargs = {
            name: _dtype(name, getattr(config, name))
            for name in ("master_weight_dtype", "exp_avg_dtype", "exp_avg_sq_dtype")
        }
        if not config.param_groups:
            hyperparameters = {
                "lr": config.lr,
                "betas": config.betas,
                "eps": config.eps,
                "weight_decay": config.weight_decay,
            }
            group = ParamGroupConfig(pattern=r".*", optimizer_name="FusedAdam", optimizer_kwargs=hyperparameters)
            config = replace(config, param_groups=[group])
        _check_no_torchtitan_quantized_linears(model_parts)
        super().__init__(config, model_parts=model_parts)
        for optimizer in self.optimizers:
            names = _quantized_weights_not_stepped_by_fused_adam(optimizer)
            if names:
                raise ValueError(
                    f"{type(optimizer).__name__} cannot step quantized weights ({', '.join(names)}): name "
                    '"FusedAdam" as the optimizer_name of the param group matching them.'
                )

    @staticmethod
    def _build_impl_kwargs(config: OptimizersContainer.Config) -> dict[str, Any]:
        # torchtitan's `implementation` (fused/foreach) picks torch kernels; FusedAdam has one step
        # path (C++ on the CPU, Triton on CUDA) and takes no such arguments.
        return {}

    def _resolve_optimizer_factory(self, name: str) -> Callable[..., Optimizer]:  # type: ignore[override]
        if name == "FusedAdam":
            return functools.partial(FusedAdam, **self._fused_adam_kwargs)
        return OptimizersContainer._resolve_optimizer_factory(name)


def check_quantized_training(optimizers: Any, model_parts: list[torch.nn.Module], parallel_dims: Any = None) -> None:
    """A torchtitan `post_optimizer_build_fn` (`ModelSpec`): raises ValueError, before the first
    step, when an optimizer of `optimizers` (torchtitan's `OptimizersContainer`, or a list) other
    than FusedAdam holds quantized weights, or when the model holds torchtitan's own quantized
    Linears next to qt.nn.Linear layers."""
    _check_no_torchtitan_quantized_linears(model_parts)
    for optimizer in optimizers:
        names = _quantized_weights_not_stepped_by_fused_adam(optimizer)
        if names:
            raise ValueError(
                f"{type(optimizer).__name__} cannot step quantized weights ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}; {len(names)} in all): set config.optimizer = "
                "quant_optim.torchtitan.FusedAdamOptimizers.Config(...), or convert with "
                "QuantLinearConverter.Config(quantized_weights=False) to keep high-precision weights."
            )


def with_quantized_training_checks(model_spec: Any) -> Any:
    """`model_spec` (torchtitan's `ModelSpec`, changed in place and returned) whose
    `post_optimizer_build_fn` runs `check_quantized_training` first, then the one it had (e.g.
    the MoE load-balancing hook)."""
    previous = model_spec.post_optimizer_build_fn
    if getattr(previous, "_checks_quantized_training", False):
        return model_spec

    def post_optimizer_build_fn(optimizers: Any, model_parts: list[torch.nn.Module], parallel_dims: Any) -> None:
        check_quantized_training(optimizers, model_parts, parallel_dims)
        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)

    post_optimizer_build_fn._checks_quantized_training = True  # type: ignore[attr-defined]
    model_spec.post_optimizer_build_fn = post_optimizer_build_fn
    return model_spec


def _quantized_weights_not_stepped_by_fused_adam(optimizer: Optimizer) -> list[str]:
    """The names (torchtitan's `param_names`, else positions) of the quantized weights `optimizer`
    holds, unless it is a FusedAdam."""
    if isinstance(optimizer, FusedAdam):
        return []
    names = []
    for g, group in enumerate(optimizer.param_groups):
        labels = group.get("param_names") or [f"param_groups[{g}][{i}]" for i in range(len(group["params"]))]
        names += [name for name, p in zip(labels, group["params"], strict=True) if qt.nn.is_quantized_weight(p)]
    return names


def _check_no_torchtitan_quantized_linears(model_parts: list[torch.nn.Module]) -> None:
    """Refuses torchtitan's Float8/MXFP8/NVFP4 Linears next to qt.nn.Linear layers in one model."""
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.components.quantization.mx import MXFP8Linear
    from torchtitan.components.quantization.nvfp4 import NVFP4Linear

    theirs = tuple(cls for cls in (Float8Linear, MXFP8Linear, NVFP4Linear) if cls is not None)
    if not theirs:
        return
    found, ours = [], False
    for part in model_parts:
        for name, module in part.named_modules():
            ours = ours or isinstance(module, qt.nn.Linear)
            if isinstance(module, theirs):
                found.append(f"{name} ({type(module).__name__})")
    if ours and found:
        raise ValueError(
            f"the model holds torchtitan's own quantized Linears ({', '.join(found[:3])}"
            f"{', ...' if len(found) > 3 else ''}) next to qt.nn.Linear layers: a torchtitan quantization converter "
            "ran after QuantLinearConverter. List only QuantLinearConverter.Config in `converters` (recipes 'fp8', "
            "'mxfp8' and 'nvfp4' cover those), with filter_fqns for the layers to keep in high precision."
        )

"""torchtitan (0.3) optimizer config: quant_optim.FusedAdam built as torchtitan builds its optimizers.

`FusedAdamOptimizers` is torchtitan's `OptimizersContainer` (param groups matched by FQN regex,
one optimizer per model part, flat FQN-keyed state dicts for torchtitan's checkpointer) whose
optimizer name "FusedAdam" builds `quant_optim.FusedAdam` with the config's master and moment
dtypes. Without `param_groups` one catch-all group steps every parameter with the config's
hyperparameters. Every other optimizer torchtitan knows ("AdamW", ...) may still be named in a
group, for parameters that are not quantized weights:

    from quant_optim.torchtitan import FusedAdamOptimizers

    config.optimizer = FusedAdamOptimizers.Config(lr=8e-4, master_weight_dtype="bfloat16")
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

__all__ = ["FusedAdamOptimizers"]


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
        super().__init__(config, model_parts=model_parts)
        for optimizer in self.optimizers:
            if isinstance(optimizer, FusedAdam):
                continue
            names = [
                name
                for group in optimizer.param_groups
                for name, param in zip(group["param_names"], group["params"], strict=True)
                if qt.nn.is_quantized_weight(param)
            ]
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

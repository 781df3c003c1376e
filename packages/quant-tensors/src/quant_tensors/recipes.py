"""Recipes: which format each GEMM operand uses. `recipe.quantizer(role)` makes the quantizers.

Roles: "weight", "input" (activations) and "grad_output" (gradients of the output). Role
defaults follow DESIGN section 3: "hybrid" FP8 is E4M3 for weights and inputs and E5M2 for
gradients; 2-D tiles (128 x 128, 16 x 16) for weights, 1-D blocks (1 x 128, 1 x 16) for the
others; NVFP4 rounds gradients stochastically.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from quant_tensors.blockwise import Float8BlockQuantizer
from quant_tensors.float8 import AmaxComputeAlgo, Float8DelayedQuantizer, Float8Quantizer
from quant_tensors.mxfp8 import MXFP8Quantizer
from quant_tensors.nvfp4 import NVFP4Quantizer
from quant_tensors.quantizer import Quantizer, columnwise_on_demand_default

Role = Literal["weight", "input", "grad_output"]
Fp8Format = Literal["hybrid", "e4m3", "e5m2"]
ROLES: tuple[Role, ...] = ("weight", "input", "grad_output")
_FP8_FORMATS = ("hybrid", "e4m3", "e5m2")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _fp8_dtype(fp8_format: str, role: Role) -> torch.dtype:
    if fp8_format == "hybrid":
        return torch.float8_e5m2 if role == "grad_output" else torch.float8_e4m3fn
    return torch.float8_e4m3fn if fp8_format == "e4m3" else torch.float8_e5m2


def _check_fp8_format(fp8_format: str) -> None:
    if fp8_format not in _FP8_FORMATS:
        raise ValueError(f"fp8_format must be one of {_FP8_FORMATS}, got {fp8_format!r}")


class Recipe:
    """Base of the recipes: a frozen configuration that makes one quantizer per role."""

    name: str

    def quantizer(self, role: Role) -> Quantizer:
        """A new quantizer for `role` ("weight", "input" or "grad_output")."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8, scale from each tensor's own amax."""

    fp8_format: Fp8Format = "hybrid"
    """"hybrid" (E4M3 weights and inputs, E5M2 gradients), "e4m3" or "e5m2" for all."""
    power_2_scales: bool = False
    """Round every scale down to a power of two."""

    name = "fp8"

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return Float8Quantizer(
            fp8_dtype=_fp8_dtype(self.fp8_format, role),
            power_2_scales=self.power_2_scales,
            columnwise_on_demand=role == "weight" and columnwise_on_demand_default(),
        )


@dataclass(frozen=True, kw_only=True)
class Float8DelayedScaling(Recipe):
    """Per-tensor FP8, scale from the amax history of earlier steps."""

    fp8_format: Fp8Format = "hybrid"
    """"hybrid" (E4M3 weights and inputs, E5M2 gradients), "e4m3" or "e5m2" for all."""
    amax_history_len: int = 16
    """Steps of amax kept per quantizer."""
    amax_compute_algo: AmaxComputeAlgo = "max"
    """"max" of the history or its "most_recent" entry."""
    margin: int = 0
    """Headroom: scales are divided by 2^margin."""

    name = "fp8-delayed"

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return Float8DelayedQuantizer(
            fp8_dtype=_fp8_dtype(self.fp8_format, role),
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            margin=self.margin,
            columnwise_on_demand=role == "weight" and columnwise_on_demand_default(),
        )


@dataclass(frozen=True, kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 for every operand: 1 x 32 blocks, E8M0 scales, E4M3 data."""

    name = "mxfp8"

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return MXFP8Quantizer()


@dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(Recipe):
    """Blockwise FP8: 128 x 128 tiles for weights, 1 x 128 blocks for activations and gradients."""

    fp8_format: Fp8Format = "hybrid"
    """"hybrid" (E4M3 weights and inputs, E5M2 gradients), "e4m3" or "e5m2" for all."""
    power_2_scales: bool = True
    """fp32 scales that are powers of two (exact scaling); False: fmax / block amax."""

    name = "fp8-block"

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return Float8BlockQuantizer(
            tiled=role == "weight",
            fp8_dtype=_fp8_dtype(self.fp8_format, role),
            power_2_scales=self.power_2_scales,
            columnwise_on_demand=role == "weight" and columnwise_on_demand_default(),
        )


@dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: 16 x 16 tiles for weights, 1 x 16 blocks for the others; E4M3 block scales."""

    stochastic_rounding: bool = True
    """Round gradients (grad_output) stochastically."""

    name = "nvfp4"

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return NVFP4Quantizer(
            tiled=role == "weight",
            stochastic_rounding=self.stochastic_rounding and role == "grad_output",
            columnwise_on_demand=role == "weight" and columnwise_on_demand_default(),
        )


_RECIPES: dict[str, type[Recipe]] = {
    "fp8": Float8CurrentScaling,
    "fp8-delayed": Float8DelayedScaling,
    "mxfp8": MXFP8BlockScaling,
    "fp8-block": Float8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}


def recipe_from_name(name: str) -> Recipe:
    """The recipe called `name` with its defaults: "fp8", "fp8-delayed", "mxfp8", "fp8-block" or "nvfp4"."""
    if name not in _RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(_RECIPES)}")
    return _RECIPES[name]()

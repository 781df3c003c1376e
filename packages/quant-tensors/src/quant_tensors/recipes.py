"""Recipes: which format each GEMM operand uses. `recipe.quantizer(role)` makes the quantizers.

Roles: "weight", "input" (activations) and "grad_output" (gradients of the output). Role
defaults follow docs/design.md, 'Numerics': "hybrid" FP8 is E4M3 for weights and inputs and E5M2 for
gradients; 2-D tiles (128 x 128, 16 x 16) for weights, 1-D blocks (1 x 128, 1 x 16) for the
others; NVFP4 rounds gradients stochastically. Every recipe takes `weight_columnwise_on_demand`
([Note: on-demand columnwise] in quant_tensors.quantizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

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


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """Base of the recipes: a frozen configuration that makes one quantizer per role."""

    weight_columnwise_on_demand: bool | None = None
    """Weights keep rowwise data only and derive columnwise for each dgrad GEMM (half the weight
    memory); True needs weights whose columnwise data is a lossless transpose (every recipe but
    MXFP8). None: as the QUANT_TENSORS_COLUMNWISE_ON_DEMAND environment variable says (off unless set)."""
    fprop_fast_accumulation: bool = False
    """The forward GEMM sums FP8 products without promoting them to fp32 on the way, as
    TransformerEngine and torchao run it ([Note: fast accumulation] in quant_tensors.ops); only
    per-tensor FP8 recipes have such a GEMM. The gradient GEMMs always promote."""

    name: ClassVar[str]
    _has_fast_accumulation: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.fprop_fast_accumulation and not self._has_fast_accumulation:
            raise ValueError(
                f"{type(self).__name__}(fprop_fast_accumulation=True): its GEMMs have no fast-accumulation mode "
                "(they accumulate in fp32); leave it False, or use a per-tensor FP8 recipe (Float8CurrentScaling, "
                "Float8DelayedScaling)"
            )
        if not self.weight_columnwise_on_demand:
            return
        weight = self.quantizer("weight")
        if not weight.can_derive_columnwise:
            derive = [name for name, recipe in _RECIPES.items() if recipe().quantizer("weight").can_derive_columnwise]
            raise ValueError(
                f"{type(self).__name__}(weight_columnwise_on_demand=True): {weight.format_name} weights quantize "
                "their columnwise data separately (it is not a lossless transpose of the rowwise data), so it "
                "cannot be derived on demand; leave weight_columnwise_on_demand unset or False, or use a recipe "
                f"whose weights derive it: {', '.join(derive)}"
            )

    def quantizer(self, role: Role) -> Quantizer:
        """A new quantizer for `role` ("weight", "input" or "grad_output")."""
        raise NotImplementedError

    def _columnwise_on_demand(self, role: Role) -> bool:
        """Whether `role`'s quantizer leaves columnwise data out: weights only, as
        `weight_columnwise_on_demand` (or, when it is None, the environment) says."""
        if role != "weight":
            return False
        if self.weight_columnwise_on_demand is None:
            return columnwise_on_demand_default()
        return self.weight_columnwise_on_demand


@dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8, scale from each tensor's own amax."""

    fp8_format: Fp8Format = "hybrid"
    """"hybrid" (E4M3 weights and inputs, E5M2 gradients), "e4m3" or "e5m2" for all."""
    power_2_scales: bool = False
    """Round every scale down to a power of two."""

    name = "fp8"
    _has_fast_accumulation = True

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)
        super().__post_init__()

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return Float8Quantizer(
            fp8_dtype=_fp8_dtype(self.fp8_format, role),
            power_2_scales=self.power_2_scales,
            columnwise_on_demand=self._columnwise_on_demand(role),
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
    _has_fast_accumulation = True

    def __post_init__(self) -> None:
        _check_fp8_format(self.fp8_format)
        if self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be >= 1, got {self.amax_history_len}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")
        super().__post_init__()

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return Float8DelayedQuantizer(
            fp8_dtype=_fp8_dtype(self.fp8_format, role),
            amax_history_len=self.amax_history_len,
            amax_compute_algo=self.amax_compute_algo,
            margin=self.margin,
            columnwise_on_demand=self._columnwise_on_demand(role),
        )


@dataclass(frozen=True, kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 for every operand: 1 x 32 blocks, E8M0 scales, E4M3 data."""

    name = "mxfp8"

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return MXFP8Quantizer()  # columnwise quantized on its own: never on demand (Recipe.__post_init__)


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
        super().__post_init__()

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        return Float8BlockQuantizer(
            tiled=role == "weight",
            fp8_dtype=_fp8_dtype(self.fp8_format, role),
            power_2_scales=self.power_2_scales,
            columnwise_on_demand=self._columnwise_on_demand(role),
        )


@dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: 16 x 16 tiles for weights, 1 x 16 blocks for the others; E4M3 block scales."""

    stochastic_rounding: bool = True
    """Round gradients (grad_output) stochastically."""
    random_hadamard_transform: bool = False
    """Quantize the wgrad operands (columnwise usages of inputs and gradients) after a 16 x 16 random Hadamard transform along the tokens, as TransformerEngine does (its `disable_rht=False`); needs token counts that are multiples of 16."""
    hadamard_seed: int = 0
    """Seed of the transform's 16 random signs, shared by the input and grad_output quantizers (any int; its low 64 bits count)."""

    name = "nvfp4"

    def quantizer(self, role: Role) -> Quantizer:
        _check_role(role)
        # [Note: NVFP4 wgrad operands with the random Hadamard transform] in quant_tensors.nvfp4:
        # one seed for both wgrad operands, weights never transformed.
        transform = self.random_hadamard_transform and role != "weight"
        return NVFP4Quantizer(
            tiled=role == "weight",
            stochastic_rounding=self.stochastic_rounding and role == "grad_output",
            columnwise_on_demand=self._columnwise_on_demand(role),
            random_hadamard_transform=transform,
            hadamard_seed=self.hadamard_seed if transform else 0,
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

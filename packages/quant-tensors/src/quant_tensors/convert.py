"""qt.convert: swap a model's nn.Linear modules for qt.nn.Linear in place."""

from __future__ import annotations

from collections.abc import Callable

import torch

from quant_tensors.nn import Linear, quantized_parameter
from quant_tensors.recipes import Recipe


def convert(
    module: torch.nn.Module,
    recipe: Recipe,
    *,
    quantized_weights: bool = False,
    module_filter_fn: Callable[[torch.nn.Module, str], bool] | None = None,
) -> torch.nn.Module:
    """Replaces every nn.Linear in `module` (in place) by a qt.nn.Linear under `recipe`.

    The new layers keep the old parameters (same objects, same names) unless
    `quantized_weights=True`, which turns each weight into a QuantizedTensor parameter (quantized
    primary weights) and keeps its high-precision value for the optimizer's master copy
    (`qt.high_precision_init_value`). `module_filter_fn(linear, fully_qualified_name)` chooses
    which layers to convert. Works on meta-device models: call `to_empty()` then
    `reset_parameters()` afterwards. Returns `module`.
    """
    if isinstance(module, torch.nn.Linear) and not isinstance(module, Linear):
        raise TypeError("convert swaps the nn.Linear children of a module; wrap a bare nn.Linear in a container first")
    targets = [
        (name, child)
        for name, child in module.named_modules()
        if type(child) is torch.nn.Linear and (module_filter_fn is None or module_filter_fn(child, name))
    ]
    for name, linear in targets:
        parent_name, _, attribute = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        replacement = Linear(
            linear.in_features,
            linear.out_features,
            linear.bias is not None,
            recipe=recipe,
            device="meta",
            dtype=linear.weight.dtype,
        )
        replacement.weight = linear.weight
        replacement.bias = linear.bias
        replacement.make_quantizer_states(linear.weight.device)
        if quantized_weights and not replacement.high_precision_reason:
            if linear.weight.is_meta:
                quantizer = replacement.weight_quantizer
                replacement.weight = torch.nn.Parameter(
                    quantizer.make_empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta"),
                    requires_grad=linear.weight.requires_grad,
                )
            else:
                replacement.weight = quantized_parameter(
                    linear.weight, replacement.weight_quantizer, requires_grad=linear.weight.requires_grad
                )
        replacement.train(linear.training)
        setattr(parent, attribute, replacement)
    return module

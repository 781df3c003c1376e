"""Which Linear layers a torchtitan converter quantizes, importing nothing of torchtitan.

`quant_fsdp.torchtitan` (torchtitan 0.3, which converts model configs) and converters for other
torchtitan versions (which convert built modules, e.g. benchmarks/torchtitan_trainer.py for 0.2)
select layers alike: every Linear whose fully qualified name contains no `filter_fqns` entry and
whose weight the recipe's weight quantizer takes (out x in features multiples of its blocks);
the others stay in high precision, the unquantizable ones with a warning.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import quant_tensors as qt

__all__ = ["recipe_of", "select_linears"]


def recipe_of(recipe_name: str, owner: str) -> qt.Recipe:
    """The quant_tensors recipe `recipe_name` names; a ValueError naming `owner` (the config that
    holds the name) and the recipes there are otherwise."""
    try:
        return qt.recipe_from_name(recipe_name)
    except ValueError as error:
        raise ValueError(f"{owner}(recipe_name={recipe_name!r}): {error}") from None


def select_linears(
    linears: Iterable[tuple[str, int, int]],
    recipe_name: str,
    filter_fqns: Sequence[str],
    *,
    stacklevel: int = 2,
) -> set[str]:
    """The names of the layers to quantize among `linears` (fully qualified name, in_features,
    out_features); warns (at `stacklevel` above the caller) naming those left in high precision
    because the recipe's quantizer cannot take their weight."""
    rows_multiple, k_multiple = qt.recipe_from_name(recipe_name).quantizer("weight").dim_multiple
    selected, unquantizable = set(), []
    for fqn, in_features, out_features in linears:
        if any(pattern in fqn for pattern in filter_fqns):
            continue
        if in_features % k_multiple or out_features % rows_multiple:
            unquantizable.append(f"{fqn} ({out_features} x {in_features})")
            continue
        selected.add(fqn)
    if unquantizable:
        warnings.warn(
            f"QuantLinearConverter ({recipe_name}): {len(unquantizable)} Linear layers stay in high "
            f"precision, their weights not being multiples of {rows_multiple} x {k_multiple} (out x in "
            f"features): {', '.join(unquantizable)}. Pad those features to quantize them, or list them in "
            "filter_fqns to silence this.",
            stacklevel=stacklevel + 1,
        )
    return selected

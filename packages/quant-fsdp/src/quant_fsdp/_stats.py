"""comm_stats(): bytes quant-fsdp's all-gathers and FP8 reduce-scatters hand to the collective, per format and path."""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Sequence

import torch

# format name -> {"quantized": bytes, "fallback": bytes}
_BYTES: defaultdict[str, dict[str, int]] = defaultdict(lambda: {"quantized": 0, "fallback": 0})


def comm_stats() -> dict[str, dict[str, int]]:
    """Bytes all-gathered by quant-fsdp since the last reset, per format: FSDP2's gathers of the
    quantized weights that `quant_fsdp.fully_shard` shards (or `count_gathers` and the torchtitan
    converter opt in) and the sequence-parallel gathers (`gather_along_first_dim`, the TP styles).

    `{format: {"quantized": bytes, "fallback": bytes}}`: "quantized" counts gathers of quantized
    bytes, "fallback" the high-precision gathers of parameters whose shards cannot be quantized on
    their own (see `fully_shard`'s plan). Bytes are what the collective delivers to each rank: the
    all-gather inputs of one rank times the shard world size. Parameters without quantization
    (norms, embeddings, biases) do not pass through the hooks and are not counted.

    Gradient reduce-scatters in FP8 (`QuantizedReduceScatter`, `fully_shard(...,
    reduce_scatter="fp8")`) count under "FP8 reduce-scatter" as "quantized": the bytes one rank
    hands to the all-to-all (codes and scales of all its chunks), to compare with a reduce-scatter
    input of the reduce dtype.
    """
    return {name: dict(counts) for name, counts in _BYTES.items()}


def reset_comm_stats() -> None:
    """Zeroes every counter of `comm_stats()`."""
    _BYTES.clear()


_NBYTES = operator.attrgetter("nbytes")


def count_gather(format_name: str, inputs: Sequence[torch.Tensor], world_size: int, *, quantized: bool) -> None:
    nbytes = sum(map(_NBYTES, inputs)) * world_size  # no Python call per input: runs in every gather hook
    _BYTES[format_name]["quantized" if quantized else "fallback"] += nbytes


def count_reduce_scatter(nbytes: int) -> None:
    _BYTES["FP8 reduce-scatter"]["quantized"] += nbytes

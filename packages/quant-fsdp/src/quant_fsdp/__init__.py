"""quant-fsdp: FSDP2 all-gather of quantized weights, sequence-parallel gather, TP styles
(`quant_fsdp.parallel`), the CLI.

Quantized primary weights (`qt.convert(..., quantized_weights=True)`) gather their low-precision
bytes under torch's own `fully_shard` with or without quant_fsdp: the hooks are the tensors' own,
and importing quant_fsdp changes nothing about them. `quant_fsdp.fully_shard` is the drop-in that
also plans each weight's gather (explicit high-precision fallback for shards that cannot be
quantized on their own), counts it in comm_stats(), loads checkpoints across weight forms and
offers quantize-on-gather for high-precision weights and FP8 gradient reduce-scatters
(`QuantizedReduceScatter`). `export_state_dict` gives a trained model's weights
as plain tensors for the model class before qt.convert. See docs/fsdp.md.
"""

from quant_fsdp import parallel
from quant_fsdp._amax import sync_amax_, sync_amax_histories_
from quant_fsdp._context import count_gathers
from quant_fsdp._export import export_state_dict
from quant_fsdp._fully_shard import fully_shard
from quant_fsdp._plan import GatherPlan, gather_plan
from quant_fsdp._quantize_on_gather import QuantizeOnGatherTensor
from quant_fsdp._reduce_scatter import QuantizedReduceScatter
from quant_fsdp._sequence import (
    GatherHandle,
    gather_along_first_dim,
    gather_many_along_first_dim,
    reduce_scatter_along_first_dim,
)
from quant_fsdp._stats import comm_stats, reset_comm_stats
from quant_fsdp._version import __version__
from quant_fsdp._watch import watch_gathers

__all__ = [
    # FSDP2 with quantized weights
    "fully_shard",
    "QuantizeOnGatherTensor",
    "gather_plan",
    "GatherPlan",
    "comm_stats",
    "reset_comm_stats",
    "count_gathers",
    "watch_gathers",
    # gradient reduce-scatter in FP8
    "QuantizedReduceScatter",
    # export: plain high-precision weights for the unconverted model
    "export_state_dict",
    # per-tensor amax agreement across ranks
    "sync_amax_",
    "sync_amax_histories_",
    # sequence-parallel collectives and tensor-parallel styles
    "gather_along_first_dim",
    "gather_many_along_first_dim",
    "reduce_scatter_along_first_dim",
    "GatherHandle",
    "parallel",
    "__version__",
]

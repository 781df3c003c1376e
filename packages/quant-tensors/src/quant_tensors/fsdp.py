"""FSDP2 and the quantized tensors: the per-weight context a sharding layer binds, and the
all-gather building blocks it can reuse.

Every QuantizedTensor carries FSDP2's `fsdp_pre_all_gather` / `fsdp_post_all_gather`, so torch's
own `fully_shard` gathers its quantized bytes with no other import. What the hooks do beyond the
format's bytes (amax groups, byte counts, checkpoint placement) they ask the weight's
`ShardContext`, a binding of its quantizer ([Note: shard context] in quant_tensors._fsdp);
quant_fsdp's `fully_shard` binds its own to the weights it shards.
"""

from quant_tensors._fsdp import (
    GatherPayload,
    ShardContext,
    all_gather_inputs,
    shard_context,
    unsharded_from_gather,
)
from quant_tensors._tensor import bind_shard_amax_group

__all__ = [
    # what the hooks ask about one sharded weight (a binding of its quantizer)
    "ShardContext",
    "shard_context",
    # the amax group a quantization of a shard needs before FSDP2's first gather binds it
    "bind_shard_amax_group",
    # the all-gather building blocks (quantize-on-gather, sequence-parallel gathers reuse them)
    "GatherPayload",
    "all_gather_inputs",
    "unsharded_from_gather",
]

"""FSDP2 and the quantized tensors: the gather policy a sharding layer registers, and the
all-gather building blocks it can reuse.

Every QuantizedTensor carries FSDP2's `fsdp_pre_all_gather` / `fsdp_post_all_gather`, so torch's
own `fully_shard` gathers its quantized bytes with no other import. What the hooks do beyond the
format's bytes (amax groups, byte counts, checkpoint placement) they ask the registered
`GatherPolicy` ([Note: gather policy] in quant_tensors._fsdp); quant_fsdp registers its own when
imported.
"""

from quant_tensors._fsdp import (
    GatherPayload,
    GatherPolicy,
    all_gather_inputs,
    gather_policy,
    register_gather_policy,
    unsharded_from_gather,
)
from quant_tensors._tensor import bind_shard_amax_group

__all__ = [
    # the policy a sharding layer registers
    "GatherPolicy",
    "register_gather_policy",
    "gather_policy",
    # the amax group a quantization of a shard needs before FSDP2's first gather binds it
    "bind_shard_amax_group",
    # the all-gather building blocks (quantize-on-gather, sequence-parallel gathers reuse them)
    "GatherPayload",
    "all_gather_inputs",
    "unsharded_from_gather",
]

"""quant-tensors: quantized torch tensor subclasses, quantizers and recipes.

`import quant_tensors as qt`. Formats: per-tensor FP8 (current and delayed scaling), MXFP8,
blockwise FP8 and NVFP4, as wrapper subclasses whose `.dtype` is the nominal high-precision dtype
([Note: quantized tensor] in quant_tensors._tensor). Numerics come from quant-core. The tensors
carry FSDP2's all-gather hooks, so torch's `fully_shard` gathers their quantized bytes; a sharding
layer binds a per-weight `qt.fsdp.ShardContext` to say more ([Note: shard context] in quant_tensors._fsdp).
"""

import torch

from quant_tensors import (
    _collectives,  # noqa: F401  (registers the torch.distributed ops)
    _op_table,  # noqa: F401  (registers the shared op table)
    fsdp,
    nn,
    ops,
)
from quant_tensors._block_tensor import BlockQuantizer, BlockScaledTensor
from quant_tensors._tensor import (
    DEQUANTIZE_FALLBACK_OPS,
    QuantizedTensor,
    _rebuild_quantized_tensor,
    local_quantized,
    local_shard,
    shard_like,
)
from quant_tensors._version import __version__
from quant_tensors.blockwise import Float8BlockQuantizer, Float8BlockwiseTensor
from quant_tensors.convert import convert
from quant_tensors.float8 import Float8DelayedQuantizer, Float8Quantizer, Float8Tensor
from quant_tensors.mxfp8 import MXFP8Quantizer, MXFP8Tensor
from quant_tensors.nn import high_precision_init_value
from quant_tensors.nvfp4 import NVFP4Quantizer, NVFP4Tensor
from quant_tensors.quantizer import COLUMNWISE_ON_DEMAND_ENV_VAR, Quantizer
from quant_tensors.recipes import (
    ROLES,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8DelayedScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    Role,
    recipe_from_name,
)

__all__ = [
    # recipes
    "ROLES",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8DelayedScaling",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "Role",
    "recipe_from_name",
    # quantizers
    "COLUMNWISE_ON_DEMAND_ENV_VAR",
    "BlockQuantizer",
    "Float8BlockQuantizer",
    "Float8DelayedQuantizer",
    "Float8Quantizer",
    "MXFP8Quantizer",
    "NVFP4Quantizer",
    "Quantizer",
    # tensors
    "DEQUANTIZE_FALLBACK_OPS",
    "BlockScaledTensor",
    "Float8BlockwiseTensor",
    "Float8Tensor",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "QuantizedTensor",
    "local_quantized",
    "local_shard",
    "shard_like",
    # GEMM, modules, conversion
    "convert",
    "high_precision_init_value",
    "fsdp",
    "nn",
    "ops",
    # version
    "__version__",
]

# torch.load(weights_only=True) rebuilds these from their raw buffers (QuantizedTensor.__reduce_ex__).
torch.serialization.add_safe_globals(
    [
        _rebuild_quantized_tensor,
        Float8Tensor,
        MXFP8Tensor,
        Float8BlockwiseTensor,
        NVFP4Tensor,
        Float8Quantizer,
        Float8DelayedQuantizer,
        MXFP8Quantizer,
        Float8BlockQuantizer,
        NVFP4Quantizer,
    ]
)

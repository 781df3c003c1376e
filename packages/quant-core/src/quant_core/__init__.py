"""quant-core: quantization kernels with a plain-torch reference for each.

Every op runs on the backend registered for its tensors' device (see `quant_core._library`, [Note:
backends]): C++ for CPU tensors, Triton for CUDA tensors, the reference otherwise or when forced
with QUANT_CORE_BACKEND=reference|cpp|triton (read at import; `reload_backend_env()` re-reads it)
or `use_backend(...)` (process-wide). Buffer layouts of every format: [Note: block layouts] in `quant_core.blocks._layout`
and packages/quant-core/README.md.

The public functions check their arguments and then call operators `torch.ops.quant_core.<op>`
([Note: custom ops] in `quant_core._library`), which torch.compile traces as opaque nodes; callers that
have validated already may call those operators directly (contracts in each format module's
docstring), or the functions of `quant_core.unchecked`, which allocate the outputs too.
"""

from quant_core import _backends, unchecked
from quant_core._backends import BACKENDS, Backend, available_backends
from quant_core._library import (
    BACKEND_ENV_VAR,
    COMPILED_KERNELS_ENV_VAR,
    compiled_kernels,
    reload_backend_env,
    selected_backend,
    use_backend,
    use_compiled_kernels,
)
from quant_core._version import __version__
from quant_core.adam._adam import (
    MOMENT_DTYPES,
    AdamScalars,
    adam_step_,
    adam_step_reference,
    has_non_finite,
    has_non_finite_reference,
    power,
)
from quant_core.adam._fp8_moments import FP8_MOMENT_DTYPES
from quant_core.adam._moment_amaxes import adam_moment_amaxes, adam_moment_amaxes_reference
from quant_core.blocks._blockwise import (
    BLOCKWISE_BLOCK,
    dequantize_fp8_blockwise,
    dequantize_fp8_blockwise_reference,
    quantize_fp8_blockwise,
    quantize_fp8_blockwise_reference,
    transpose_fp8_blockwise,
)
from quant_core.blocks._chunks import (
    CHUNK_BLOCK_SIZES,
    chunk_row_bytes,
    dequantize_sum_fp8_chunks,
    dequantize_sum_fp8_chunks_reference,
    quantize_fp8_chunks,
    quantize_fp8_chunks_reference,
)
from quant_core.blocks._layout import BlockQuantized, BlockShape
from quant_core.blocks._many import quantize_fp8_blockwise_many, quantize_mxfp8_many
from quant_core.blocks._mxfp8 import (
    MXFP8_BLOCK,
    dequantize_mxfp8,
    dequantize_mxfp8_pair,
    dequantize_mxfp8_reference,
    quantize_mxfp8,
    quantize_mxfp8_reference,
)
from quant_core.fp8._amax_many import amax_many, amax_many_reference
from quant_core.fp8._cast_many import cast_to_fp8_many
from quant_core.fp8._fp8 import (
    amax,
    amax_reference,
    amax_torch_ops,
    cast_to_fp8,
    cast_to_fp8_reference,
    dequantize_fp8,
    dequantize_fp8_reference,
    transpose_fp8,
)
from quant_core.fp8._quantize import (
    Float8Quantized,
    quantize_fp8,
    quantize_fp8_delayed,
    quantize_fp8_delayed_into,
    quantize_fp8_delayed_reference,
    quantize_fp8_into,
    quantize_fp8_reference,
)
from quant_core.fp8._scale import (
    AmaxComputeAlgo,
    amax_from_history,
    delayed_fp8_scale_,
    delayed_fp8_scale_reference,
    fp8_scale,
    fp8_scale_reference,
    push_amax_,
)
from quant_core.nvfp4._dequantize import (
    dequantize_nvfp4,
    dequantize_nvfp4_pair,
    dequantize_nvfp4_reference,
    nvfp4_gemm_output,
    nvfp4_gemm_output_reference,
)
from quant_core.nvfp4._hadamard import (
    hadamard_amaxes,
    hadamard_amaxes_reference,
    hadamard_inverse_16,
    hadamard_inverse_16_reference,
    hadamard_signs,
    hadamard_transform_16,
    hadamard_transform_16_reference,
)
from quant_core.nvfp4._nvfp4 import NVFP4_BLOCK, nvfp4_tensor_scale, quantize_nvfp4, quantize_nvfp4_reference
from quant_core.nvfp4._transpose import transpose_nvfp4
from quant_core.shared._compile import compiling

# The Triton kernels register on the CUDA dispatch key where they can run ([Note: custom ops] in
# quant_core._library); the C++ kernels registered on the CPU key with their formats' modules.
if _backends.triton_usable():
    _backends.register_triton_kernels()

__all__ = [
    # backends
    "compiling",
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "COMPILED_KERNELS_ENV_VAR",
    "Backend",
    "compiled_kernels",
    "available_backends",
    "reload_backend_env",
    "selected_backend",
    "use_backend",
    "use_compiled_kernels",
    # Adam
    "MOMENT_DTYPES",
    "AdamScalars",
    "adam_step_",
    "adam_step_reference",
    "FP8_MOMENT_DTYPES",
    "adam_moment_amaxes",
    "adam_moment_amaxes_reference",
    "power",
    "has_non_finite",
    "has_non_finite_reference",
    # per-tensor FP8 (current and delayed scaling)
    "AmaxComputeAlgo",
    "Float8Quantized",
    "amax",
    "amax_from_history",
    "amax_many",
    "amax_many_reference",
    "cast_to_fp8_many",
    "amax_reference",
    "amax_torch_ops",
    "cast_to_fp8",
    "cast_to_fp8_reference",
    "delayed_fp8_scale_",
    "delayed_fp8_scale_reference",
    "dequantize_fp8",
    "dequantize_fp8_reference",
    "fp8_scale",
    "fp8_scale_reference",
    "push_amax_",
    "quantize_fp8",
    "quantize_fp8_delayed",
    "quantize_fp8_delayed_into",
    "quantize_fp8_delayed_reference",
    "quantize_fp8_into",
    "quantize_fp8_reference",
    "transpose_fp8",
    # block-scaled formats
    "BlockQuantized",
    "BlockShape",
    # MXFP8
    "MXFP8_BLOCK",
    "dequantize_mxfp8",
    "dequantize_mxfp8_pair",
    "dequantize_mxfp8_reference",
    "quantize_mxfp8",
    "quantize_mxfp8_many",
    "quantize_mxfp8_reference",
    # blockwise FP8
    "BLOCKWISE_BLOCK",
    "dequantize_fp8_blockwise",
    "dequantize_fp8_blockwise_reference",
    "quantize_fp8_blockwise",
    "quantize_fp8_blockwise_many",
    "quantize_fp8_blockwise_reference",
    "transpose_fp8_blockwise",
    # blockwise FP8 chunks of a reduce-scatter
    "CHUNK_BLOCK_SIZES",
    "chunk_row_bytes",
    "dequantize_sum_fp8_chunks",
    "dequantize_sum_fp8_chunks_reference",
    "quantize_fp8_chunks",
    "quantize_fp8_chunks_reference",
    # NVFP4
    "NVFP4_BLOCK",
    "dequantize_nvfp4",
    "dequantize_nvfp4_pair",
    "dequantize_nvfp4_reference",
    "hadamard_amaxes",
    "hadamard_amaxes_reference",
    "hadamard_inverse_16",
    "hadamard_inverse_16_reference",
    "hadamard_signs",
    "hadamard_transform_16",
    "hadamard_transform_16_reference",
    "nvfp4_gemm_output",
    "nvfp4_gemm_output_reference",
    "nvfp4_tensor_scale",
    "quantize_nvfp4",
    "quantize_nvfp4_reference",
    "transpose_nvfp4",
    # unchecked entry points for callers that checked their arguments
    "unchecked",
    # version
    "__version__",
]

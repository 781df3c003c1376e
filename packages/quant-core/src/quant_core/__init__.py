"""quant-core: quantization kernels with a plain-torch reference for each.

Every op picks a backend per call (see `quant_core._backend`, [Note: backends]):
C++ for CPU tensors, Triton for CUDA tensors, the reference otherwise or when forced with
QUANT_CORE_BACKEND=reference|cpp|triton or `use_backend(...)`.
"""

from quant_core._backend import (
    BACKEND_ENV_VAR,
    BACKENDS,
    Backend,
    available_backends,
    selected_backend,
    use_backend,
)
from quant_core._fp8 import (
    Float8Quantized,
    amax,
    amax_reference,
    cast_to_fp8,
    cast_to_fp8_reference,
    dequantize_fp8_reference,
    fp8_scale,
    quantize_fp8,
    quantize_fp8_reference,
)
from quant_core._version import __version__

__all__ = [
    # backends
    "BACKENDS",
    "BACKEND_ENV_VAR",
    "Backend",
    "available_backends",
    "selected_backend",
    "use_backend",
    # per-tensor FP8
    "Float8Quantized",
    "amax",
    "amax_reference",
    "cast_to_fp8",
    "cast_to_fp8_reference",
    "dequantize_fp8_reference",
    "fp8_scale",
    "quantize_fp8",
    "quantize_fp8_reference",
    # version
    "__version__",
]

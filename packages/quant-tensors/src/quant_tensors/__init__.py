"""quant-tensors: quantized torch tensor subclasses, quantizers, recipes, quantized GEMM and Linear.

The formats (per-tensor FP8, MXFP8, blockwise FP8, NVFP4) arrive with issue #4; today the package
holds its version only. Numerics live in quant-core.
"""

from quant_tensors._version import __version__

__all__ = ["__version__"]

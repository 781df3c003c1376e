"""quant-optim: FusedAdam with fp32 master weights for quantized, DTensor-sharded parameters.

FusedAdam (quant_optim._adam) steps fp32 masters with quant-core's fused Adam kernels (C++ on CPU,
Triton on CUDA), keeps DTensor states and agrees per-tensor amaxes in one all-reduce per step.
"""

from quant_optim._adam import FusedAdam
from quant_optim._version import __version__

__all__ = ["FusedAdam", "__version__"]

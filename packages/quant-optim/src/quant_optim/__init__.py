"""quant-optim: FusedAdam with fp32 master weights for quantized, DTensor-sharded parameters.

Issue #7 in progress: the plain-torch FusedAdam step (quant_optim._adam) is here; DTensor states,
fused kernels and the batched amax all-reduce follow.
"""

from quant_optim._adam import FusedAdam
from quant_optim._version import __version__

__all__ = ["FusedAdam", "__version__"]

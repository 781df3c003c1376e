"""quant-optim: FusedAdam with fp32 master weights for quantized, DTensor-sharded parameters.

The optimizer arrives with issue #7; today the package holds its version only.
"""

from quant_optim._version import __version__

__all__ = ["__version__"]

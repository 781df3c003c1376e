"""quant-fsdp: FSDP2 all-gather of quantized weights, sequence-parallel gather, TP styles, the CLI.

The FSDP2 hooks arrive with issue #6; today the package holds the `quant-fsdp` command line
(`demo`, `bench`) over what the lower layers can do.
"""

from quant_fsdp._version import __version__

__all__ = ["__version__"]

"""Unchecked entry points for callers below their own public boundary (quant-tensors' hot path).

Each function is the public op of the same name without its argument checks: the caller
guarantees the contract in its docstring (an operator called outside it may write out of
bounds). They allocate what the op returns and run the operator as the public function does
([Note: eager operator calls] in quant_core._library), so results are bitwise the same.
"""

from quant_core.fp8._fp8 import dequantize_fp8_unchecked as dequantize_fp8
from quant_core.fp8._quantize import quantize_fp8_unchecked as quantize_fp8

__all__ = ["dequantize_fp8", "quantize_fp8"]

"""NVFP4 (E2M1 values, E4M3 block scales and an fp32 tensor scale): the format and its quantize
(`_nvfp4`), dequantize and the GEMM output scaling (`_dequantize`), the lossless transpose
(`_transpose`) and the 16x16 random Hadamard transform (`_hadamard`); Triton kernels in
`_triton_quantize`, `_triton_dequantize`, `_triton_transpose` and `_triton_hadamard` (NVFP4
numerics in `_triton_numerics`); C++ in csrc/quantize_blocks.cpp, dequantize.cpp, transpose.cpp and
hadamard.cpp."""

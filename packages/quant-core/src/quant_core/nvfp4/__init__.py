"""NVFP4 (E2M1 values, E4M3 block scales and an fp32 tensor scale): quantize, dequantize, transpose,
the GEMM output scaling and the 16x16 random Hadamard transform (`_nvfp4`); Triton kernels in
`_triton`; C++ in csrc/blocks.cpp."""

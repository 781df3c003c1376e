"""Per-tensor FP8 (current and delayed scaling): amax and the amaxes of many tensors, scales, cast,
quantize, dequantize and transpose. Each module holds its ops' references, definitions and C++
kernels; `_triton*.py` their Triton kernels; C++ in csrc/fp8.cpp, csrc/scale.cpp and csrc/amax.cpp."""

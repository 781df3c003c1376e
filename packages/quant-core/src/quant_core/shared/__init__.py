"""Shared by every format: argument checks, the reference numerics (`_numerics`) and their Triton
counterparts (`_triton_numerics`), the arguments of the C++ kernels (`_cpp`), Triton launches with
less host time (`_triton_launch`), whether torch.compile is tracing (`_compile`) and the device tables of multi-tensor launches (`_triton_tables`)."""

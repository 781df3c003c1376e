"""The Adam step: `adam_step_` (host-side scalars; C++ kernel for CPU tensors), the capturable step
`adam_step_capturable_` (decisions in device tensors; Triton kernel for CUDA tensors) and the
non-finite check, each with its reference; C++ in csrc/adam.cpp."""

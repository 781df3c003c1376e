"""The Adam step: `adam_step_` (host-side scalars; C++ kernel for CPU tensors), the capturable step
`adam_step_capturable_` (decisions in device tensors; Triton kernel for CUDA tensors), the amaxes
of updated fp8 moments `adam_moment_amaxes` (the first of an fp8-moment step's two passes) and the
non-finite check, each with its reference; C++ in csrc/adam.cpp."""

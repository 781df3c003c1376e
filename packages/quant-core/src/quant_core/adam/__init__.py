"""The Adam step: `adam_step_` (step counts, lr and the skip verdict as tensors; C++ kernel for CPU
tensors, Triton for CUDA), the amaxes of updated fp8 moments `adam_moment_amaxes` (the first of
an fp8-moment step's two passes) and the non-finite check, each with its reference; C++ in
csrc/adam.cpp."""

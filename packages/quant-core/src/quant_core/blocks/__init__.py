"""The FP8 block-scaled formats, MXFP8 (1x32 blocks, E8M0 scales) and blockwise FP8 (1x128 and
128x128 blocks, fp32 scales): their shared buffer layout (`_layout`, [Note: block layouts]), each
format's ops (`_mxfp8`, `_blockwise`), the quantize of many tensors in one call (`_many`), and the
Triton kernels both formats share: quantize (`_triton_quantize`, `_triton_two_pass`, block scales in
`_triton_scales`), dequantize (`_triton_dequantize`) and many tensors (`_triton_many`); C++ in
csrc/quantize_blocks.cpp and csrc/dequantize.cpp."""

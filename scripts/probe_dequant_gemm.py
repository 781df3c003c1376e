"""Can a Triton GEMM that dequantizes MXFP8 operands in registers beat dequantize + cuBLAS on Hopper?

    python3 scripts/probe_dequant_gemm.py     # on the GPU machine; needs only torch and Triton

Times, per GEMM shape of the e2e model, torch.mm on bf16 (cuBLAS) against one Triton kernel in
three variants: v0 loads bf16 operands (Triton's own ceiling), v1 and v2 load E4M3 codes and E8M0
scales and form bf16 values in registers before `tl.dot` (v1 multiplies in bf16, v2 in fp32), for
a few tile configurations. The answer on an H100 (docs/benchmarks.md, eighth session): no, about
2.3x slower than cuBLAS, so the emulated GEMMs keep dequantize + cuBLAS.
"""

import functools

import torch
import triton
import triton.language as tl

CONFIGS = [  # BM, BN, BK, warps, stages
    (128, 128, 64, 4, 3),
    (128, 128, 64, 4, 4),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 4, 3),
    (128, 64, 64, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 256, 64, 4, 3),
]
SHAPES = [(8192, 8192, 2048), (8192, 2048, 8192)]  # M, N, K: the MLP's up and down projections


@triton.jit
def _scales(e_ptr, rows, k0, K, R: tl.constexpr, BK: tl.constexpr, FP32: tl.constexpr):
    """E8M0 scales of rows x [k0, k0 + BK) as (R, BK) factors (fp32 or bf16), each repeated 32 times."""
    blocks = k0 // 32 + tl.arange(0, BK // 32)
    e = tl.load(e_ptr + rows[:, None] * (K // 32) + blocks[None, :]).to(tl.int32)
    if FP32:  # noqa: SIM108 (a constexpr branch: only one side is compiled)
        factor = (e << 23).to(tl.float32, bitcast=True)
    else:
        factor = (e << 7).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.broadcast_to(factor[:, :, None], (R, BK // 32, 32)), (R, BK))


@triton.jit
def _tile(ptr, e_ptr, rows, k0, K, R: tl.constexpr, BK: tl.constexpr, VARIANT: tl.constexpr):
    ks = k0 + tl.arange(0, BK)
    loaded = tl.load(ptr + rows[:, None] * K + ks[None, :])
    if VARIANT == 0:  # bf16 operands
        return loaded
    if VARIANT == 1:  # bf16 codes times bf16 powers of two
        return loaded.to(tl.bfloat16) * _scales(e_ptr, rows, k0, K, R, BK, False)
    return (loaded.to(tl.float32) * _scales(e_ptr, rows, k0, K, R, BK, True)).to(tl.bfloat16)


@triton.jit
def mm_kernel(
    a_ptr, ea_ptr, b_ptr, eb_ptr, out_ptr, M, N, K,
    VARIANT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """out = A @ B^T, programs grouped along M."""
    pid = tl.program_id(0)
    per_group = GROUP_M * tl.cdiv(N, BN)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tl.cdiv(M, BM) - first_m, GROUP_M)
    rows_a = (first_m + (pid % per_group) % group_m) * BM + tl.arange(0, BM)
    rows_b = ((pid % per_group) // group_m) * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = _tile(a_ptr, ea_ptr, rows_a, k0, K, BM, BK, VARIANT)
        b = _tile(b_ptr, eb_ptr, rows_b, k0, K, BN, BK, VARIANT)
        acc = tl.dot(a, tl.trans(b), acc)
    tl.store(out_ptr + rows_a[:, None] * N + rows_b[None, :], acc.to(tl.bfloat16))


def main() -> None:
    torch.manual_seed(0)
    for M, N, K in SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        codes_a, codes_b = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        ea = torch.full((M, K // 32), 127, dtype=torch.uint8, device="cuda")  # 2^0: values are the codes
        eb = torch.full((N, K // 32), 127, dtype=torch.uint8, device="cuda")
        cublas = triton.testing.do_bench(functools.partial(torch.mm, a, b.t()), warmup=5, rep=60)
        exact = codes_a.float() @ codes_b.float().t()
        for variant in (0, 1, 2):
            operands = (a, ea, b, eb) if variant == 0 else (codes_a, ea, codes_b, eb)
            for BM, BN, BK, warps, stages in CONFIGS:
                out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN),)
                run = functools.partial(
                    mm_kernel[grid], *operands, out, M, N, K,
                    VARIANT=variant, BM=BM, BN=BN, BK=BK, GROUP_M=8, num_warps=warps, num_stages=stages,
                )  # fmt: skip
                seconds = triton.testing.do_bench(run, warmup=5, rep=60) / 1e3
                error = ((out.float() - exact).norm() / exact.norm()).item() if variant else 0.0
                print(
                    f"{M}x{N}x{K} v{variant} {(BM, BN, BK, warps, stages)}: {seconds * 1e6:7.1f} us "
                    f"({2 * M * N * K / seconds / 1e12:4.0f} TFLOP/s), cuBLAS bf16 {cublas * 1e3:6.1f} us, "
                    f"relative error vs fp32 {error:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()

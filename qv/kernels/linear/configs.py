"""The GPTQ linear's measured choices: which kernel runs at how many rows, and each kernel's tiles.

Every setting here was the fastest on the H200 at the Qwen3.5-27B shapes; the line above each names the
bench command that re-measures it (bench/kernels.py --sweep gemv times the GEMV variants by CUDA-graph
replay, bench/gemm_rows.py --sweep the decode-batch tiles). Under the CPU interpreter the tiles are tiny so
the tests cross many tile and split boundaries.
"""

from __future__ import annotations

import torch
import triton

from qv.kernels.triton_utils import interpreting

# The raw-CUDA GEMV up to this many rows; at 16 the Triton tiles read the 27B MLP weights faster.
# Re-measure: python bench/gemm_rows.py --sweep
CUDA_GEMV_ROWS = 8


# sm_90 from this many rows: the weight dequantized in L2-sized column chunks, each multiplied by cuBLAS
# (triton.dequant_matmul); below, the tensor-core GEMM (triton_gemm.py). Its 128 x 128 tiles (65-511 rows) ran
# faster, but inside the 64-layer 27B forward under a server's memory plan their TMA loads gave other bits on 6 of
# 48 reruns at 160-256 rows (plain loads: 0 of 72, but 2.6x slower; the chunked path beat them at 448 rows).
# Re-measure: python bench/prefill_sweep.py --only gemm; python bench/piecewise_check.py ... --repeat 16
CHUNKED_ROWS = 65


def gemv_kind(device, m, dtype):
    """Default kernel by rows. On sm_90, where it was measured: the raw-CUDA GEMV up to CUDA_GEMV_ROWS ("cuda",
    cuda_sm90.py; where it does not apply, "fma" at M = 1 and its Triton twin "mma" in triton_gemv.py, the
    next best there), then the tensor-core GEMM ("tc", triton_gemm.py) up to 64 rows, then from CHUNKED_ROWS the
    chunked dequantization ahead of cuBLAS ("chunked"). Other GPUs keep the older kernels: "fma" (CUDA cores) at
    M = 1 and "dot" (gptq_matmul_kernel) above. Re-measure: python bench/kernels.py --sweep gemv;
    python bench/prefill_sweep.py --only gemm"""
    if dtype in (torch.float16, torch.bfloat16) and device.type == "cuda" and \
            torch.cuda.get_device_capability(device)[0] == 9:
        return "cuda" if m <= CUDA_GEMV_ROWS else "tc" if m < CHUNKED_ROWS else "chunked"
    return "fma" if m == 1 else "dot"


def tc_config(device, m):
    """triton_gemm.gemm's tiles by rows, all with the weight as the A operand (SWAP): BLOCK_N weight rows
    (output columns) by BLOCK_M activation rows. Decode batches stream the codes with split K over two
    rounds of the SMs; more rows take 128 x 128 tiles where a config asks for "tc" (by default they go chunked:
    CHUNKED_ROWS). Re-measure: python bench/prefill_sweep.py --only gemm"""
    if interpreting(device):
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, STAGES=1, SWAP=True, waves=2)
    if m <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, STAGES=4, SWAP=True, waves=2)
    if m <= 32:
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, STAGES=4, SWAP=True, waves=2)
    if m <= 64:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, STAGES=4, SWAP=True, waves=2)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, STAGES=4, SWAP=True, waves=1)


def chunked_cols(device, m):
    """Output columns of one dequantized chunk (a 5120-row weight's 8192 columns: 80 MiB of bf16, mostly in
    L2); 4096 from 4096 rows on. Re-measure: python bench/prefill_sweep.py --only gemm"""
    return 4096 if m >= 4096 else 8192


def gemv_cuda_config(device):
    """The raw-CUDA GEMV's launch settings. wk: the 4 warps of a block along K (4) or side by side (1); None
    picks by shape (cuda_sm90.warps_along_k). waves=1: K split so the blocks fill one round of the SMs.
    min_blocks None: the register cap gemv_cuda picks per row count. Eagerly (outside graph capture) only from
    1 GiB of weight on (an lm_head): below, the Triton kernels cost less host time for about the same GPU time
    (cuda_build.worth_launching). Re-measure: python bench/kernels.py --sweep gemv; python bench/host_launch.py"""
    return dict(waves=1, min_blocks=None, wk=None, eager_min_bytes=1 << 30)


def gemv_config(device, m, n, k):
    """CUDA-core GEMV settings: 4-warp programs over 8 waves of the SMs, split-K partials summed by the last
    program of each column tile (fused). Wide outputs (>= 64 column tiles) take 8 rows a warp per step, narrow
    ones (long K ranges per program) 16. Re-measure: python bench/kernels.py --sweep gemv"""
    if interpreting(device):
        return dict(NW=2, BK=4, waves=2, ASM=False, fused=True)
    if triton.cdiv(n, 256) >= 64:
        return dict(NW=4, BK=8, waves=8, ASM=True, fused=True)
    return dict(NW=4, BK=16, waves=8, ASM=True, fused=True)


def gemv_mma_config(device):
    """Tensor-core (weight on the MMA's wide side) GEMV settings. Re-measure: python bench/kernels.py --sweep gemv"""
    if interpreting(device):
        return dict(BLOCK_N=32, BLOCK_K=16, waves=2, fused=True, num_warps=4, num_stages=1)
    return dict(BLOCK_N=64, BLOCK_K=128, waves=4, fused=True, num_warps=4, num_stages=1)


def gptq_config(device, m, n, k, group, f16):
    """gptq_matmul_kernel's tiles by rows m. Re-measure: python bench/kernels.py --sweep gemm,gemv; decode
    batches (17-64 rows): python bench/gemm_rows.py --sweep"""
    if interpreting(device):
        bk = 16 if group % 32 else 32
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=bk, GROUP_M=4, num_warps=4, num_stages=1, split=None)
    if m <= 16:  # decode: memory bound; enough programs in flight to stream the weight at full rate
        return dict(BLOCK_M=16, BLOCK_N=256, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4, split=None)
    if m <= 64 and f16:
        # decode batches: one row tile, bf16 rows to fp16 in one launch, codes by byte permutes, split-K over
        # the SMs; the MLP's long rows or wide outputs in narrower, deeper tiles
        tile = dict(BLOCK_N=64, BLOCK_K=128, waves=4) if n >= 32768 or k >= 16384 else dict(BLOCK_N=128, BLOCK_K=64,
                                                                                           waves=2)
        return dict(BLOCK_M=64, GROUP_M=1, num_warps=4, num_stages=4, split=None, x_f16=True, asm=True, **tile)
    if not f16:  # fp32 (ieee dots on FMA units) or act-order gathers
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2, split=1)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, split=1)

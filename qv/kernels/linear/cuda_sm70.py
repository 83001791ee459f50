"""GPTQ linear (8- and 4-bit codes) for Volta (sm_70) in raw CUDA on m8n8k4 tensor cores (gptq_m884.cu, its
BITS template argument picking the code layout): a GEMV for up to
GEMV_MAX_ROWS rows (decode and speculative verification) and a tiled GEMM above (prefill), fp16 activations
(Volta has no bf16). Compiled at first use by NVRTC through CuPy and launched on torch's current stream;
they run on any GPU from sm_70 (on sm_80 and newer the m8n8k4 MMA is emulated, slowly: that is how an H200
proves them).

Where the kernels do not apply (no CuPy, activations or scales not fp16, act-order g_idx, group sizes not
a multiple of 16, N not a multiple of 8, misaligned tensors, a CUDA graph captured before the kernel was
built), the weight is dequantized by gptq_dequant_kernel or int4_dequant_kernel (Triton, no tl.dot) and multiplied by
cuBLAS:
under the sm70 chain no Triton tl.dot runs (it has no tensor-core path below sm_80, and Triton >= 3.3 has
computed it wrong there). Dense weights go to cuBLAS; block-FP8 and W12 weights to triton_fp8.py's paths without
tl.dot. The low-rank delta rows (grouped_delta's sm70 form, CUDA-core Triton without tl.dot) are a separate
call right after the linear (qv/model/layers.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
import triton

from qv.kernels.cuda_build import KernelBuild, cupy_or_none, kernel_for, launch, pointer, resident_blocks
from qv.kernels.linear import FP8Weight, GPTQWeight, W12Weight, on_rows
from qv.kernels.linear.triton import dequant_matmul
from qv.kernels.linear.triton_fp8 import fp8_linear
from qv.kernels.linear.triton_int4 import dequant_matmul_int4
from qv.kernels.linear.triton_gemv import MAX_TICKET_TILES, k_ranges, split_tickets
from qv.kernels.triton_utils import num_sms

SOURCE = "linear/gptq_m884.cu"  # under qv/kernels (cuda_build.KERNEL_DIR)
GEMV_MAX_ROWS = 16  # two 8-row tiles of x; above, the GEMM
# blocks resident per SM that each kernel's register cap is built for (no spills at these: `qv kernels
# --arch sm_70` prints registers and spills): GEMV by 8-row tiles of x, GEMM (also 3 by its 27 KB of shared
# memory on a V100)
GEMV_MIN_BLOCKS = {1: 3, 2: 2}
GEMM_MIN_BLOCKS = 3
GEMV_COLUMNS, GEMM_ROWS, GEMM_COLUMNS, GEMM_K_STEP = 256, 64, 128, 32  # the kernels' tiles


def gemv_name(mt: int, bits: int) -> str:
    """The GEMV instantiation for `mt` 8-row tiles of x and `bits`-bit codes (8 is the template's default)."""
    return f"gptq_gemv_m884<{mt}, {GEMV_MIN_BLOCKS[mt]}{'' if bits == 8 else f', {bits}'}>"


def gemm_name(bits: int) -> str:
    return f"gptq_gemm_m884<{GEMM_MIN_BLOCKS}{'' if bits == 8 else f', {bits}'}>"


BUILDS = (KernelBuild(SOURCE, tuple(gemv_name(mt, bits) for bits in (8, 4) for mt in GEMV_MIN_BLOCKS)
                      + tuple(gemm_name(bits) for bits in (8, 4)), tensor_cores=True),)
# eager calls launch too: the fallback (dequantize + cuBLAS) is never the cheaper one
CONFIG = dict(eager_min_bytes=0)


def applies(x2: torch.Tensor, w: GPTQWeight, bias: torch.Tensor | None) -> bool:
    """Whether the kernels take these tensors (x2 [M, K] with unit inner stride)."""
    k, n = w.in_features, w.out_features
    tensors = [x2, w.qweight, w.scales] + [t for t in (w.zeros, bias) if t is not None]
    return (x2.is_cuda and torch.cuda.get_device_capability(x2.device) >= (7, 0) and cupy_or_none() is not None
            and x2.dtype == torch.float16 and w.scales.dtype == torch.float16 and w.qweight.dtype == torch.uint8
            and (w.zeros is None or (w.zeros.dtype == torch.float16 and w.zeros.stride() == w.scales.stride()))
            and (bias is None or bias.dtype == torch.float16)
            and w.group_size % 16 == 0 and k % w.group_size == 0 and n % 8 == 0
            and all(t.stride(-1) == 1 for t in tensors)
            and x2.stride(0) % 4 == 0 and x2.data_ptr() % 8 == 0
            and w.qweight.stride(0) % 8 == 0 and w.qweight.data_ptr() % 8 == 0 and w.scales.stride(0) % 8 == 0
            and all(t.data_ptr() % 16 == 0 for t in (w.scales, w.zeros) if t is not None)
            and w.is_sequential())


def _split(tiles: int, k: int, step: int, most: int, resident: int, device) -> tuple[int, int, object]:
    """(K ranges, rows a range, tickets or None): K split in whole `step`s, at most `most` ranges, so that
    the blocks fill one round of what the SMs hold; one range where the ticketed sum cannot run."""
    split = max(1, min(resident // tiles, most))
    split, k_split = k_ranges(k, split, step)
    tickets = split_tickets(device) if split > 1 else None
    if split > 1 and (tickets is None or tiles > MAX_TICKET_TILES):
        return 1, k, None
    return split, k_split, tickets


def _launch(kernel, grid, x2, w, bias, out, split, k_split, tickets) -> None:
    m, k = x2.shape
    n = out.shape[1]
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else None
    args = (pointer(x2), pointer(w.qweight), pointer(w.scales), pointer(w.zeros), pointer(bias), pointer(part),
            pointer(out), pointer(tickets), np.int32(m), np.int32(n), np.int32(k), np.int32(w.group_size),
            np.int32(k_split), np.int64(x2.stride(0)), np.int64(w.qweight.stride(0)), np.int64(w.scales.stride(0)),
            np.int64(out.stride(0)), np.int32(w.zeros is not None), np.int32(bias is not None))
    launch(kernel, (grid, split, 1), (128, 1, 1), args, x2.device)


def gemv_chunk(group: int) -> int:
    """Rows of K the GEMV's warps and splits take at a time: a scale group, or 128 rows of one where groups
    are multiples of 128 (as the kernel computes it)."""
    return 128 if group % 128 == 0 else group


def gemv_m884(x2, w, bias, out) -> bool:
    """out = x2 W^T (+ bias) for M <= 16 with the GEMV; False (nothing launched) where it cannot run.
    The caller has checked `applies`."""
    m, k = x2.shape
    n = out.shape[1]
    if not 1 <= m <= GEMV_MAX_ROWS:
        raise ValueError(f"gemv_m884: {m} rows, the GEMV takes 1 to {GEMV_MAX_ROWS}")
    mt = (m + 7) // 8
    built = kernel_for(SOURCE, gemv_name(mt, w.bits), x2.device, k * n * w.bits // 8, CONFIG)
    if built is None:
        return False
    kernel, regs = built
    tiles = triton.cdiv(n, GEMV_COLUMNS)
    # each of a block's 4 warps takes whole chunks of its K range
    chunk = gemv_chunk(w.group_size)
    split, k_split, tickets = _split(tiles, k, chunk, k // (4 * chunk), resident_blocks(regs, 128, x2.device),
                                     x2.device)
    _launch(kernel, tiles, x2, w, bias, out, split, k_split, tickets)
    return True


def gemm_m884(x2, w, bias, out) -> bool:
    """out = x2 W^T (+ bias), any M, with the GEMM; False (nothing launched) where it cannot run. The
    caller has checked `applies`."""
    m, k = x2.shape
    n = out.shape[1]
    built = kernel_for(SOURCE, gemm_name(w.bits), x2.device, k * n * w.bits // 8, CONFIG)
    if built is None:
        return False
    tiles = triton.cdiv(m, GEMM_ROWS) * triton.cdiv(n, GEMM_COLUMNS)
    # few tiles (decode batches, short chunks): K split so that they fill the SMs, 4 steps a range at least
    split, k_split, tickets = _split(tiles, k, GEMM_K_STEP, k // (4 * GEMM_K_STEP),
                                     GEMM_MIN_BLOCKS * num_sms(x2.device), x2.device)
    _launch(built[0], tiles, x2, w, bias, out, split, k_split, tickets)
    return True


def linear(x, weight, bias=None):
    if isinstance(weight, (FP8Weight, W12Weight)):  # Triton without tl.dot: FMAs for decode rows, widened chunks + cuBLAS above
        return fp8_linear(x, weight, bias, tensor_cores=False)
    if not isinstance(weight, GPTQWeight):
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))
    return on_rows(x, weight.out_features, lambda x2, out: _gptq_rows(x2, weight, bias, out), row_align=4)


def _gptq_rows(x2, weight, bias, out) -> None:
    if applies(x2, weight, bias) and (gemv_m884 if x2.shape[0] <= GEMV_MAX_ROWS else gemm_m884)(x2, weight, bias, out):
        return
    # Triton dequantization (no tl.dot), then cuBLAS
    (dequant_matmul if weight.bits == 8 else dequant_matmul_int4)(x2, weight, bias, out)


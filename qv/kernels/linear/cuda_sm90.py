"""GPTQ GEMV (8- and 4-bit codes) for M <= 16 rows in raw CUDA (gptq_gemv_mma.cu: mma.sync with the weight as
the wide operand, sm_80 and newer), compiled at first use by NVRTC through CuPy and launched on torch's current
stream. gemv_cuda returns False where the kernel does not apply (no CuPy, an older GPU, group sizes other
than 32/64/128, N not a multiple of 16, misaligned tensors, or a CUDA graph being captured before the
kernel was built); the caller then runs the Triton kernels.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from qv.kernels.cuda_build import cupy_or_none, kernel_for, launch, pointer, resident_blocks
from qv.kernels.linear.triton_gemv import MAX_TICKET_TILES, k_ranges, split_tickets
from qv.kernels.triton_utils import num_sms


SOURCE = "linear/gptq_gemv_mma.cu"  # under qv/kernels (cuda_build.KERNEL_DIR)
GROUPS = (32, 64, 128)  # rows per scale group the kernel is built for (16 * S)
_HALF = (torch.float16, torch.bfloat16)


def _applies(x2, w, bias, out) -> bool:
    m, k = x2.shape
    n = w.qweight.shape[1]
    tensors = [x2, w.qweight, w.scales, out] + [t for t in (w.zeros, bias) if t is not None]
    return (x2.is_cuda and torch.cuda.get_device_capability(x2.device)[0] >= 8 and cupy_or_none() is not None
            and 1 <= m <= 16 and w.group_size in GROUPS and k % w.group_size == 0 and n % 16 == 0
            and w.in_features == k and w.is_sequential()
            and x2.dtype in _HALF and out.dtype == x2.dtype and w.scales.dtype in _HALF
            and (w.zeros is None or (w.zeros.dtype == w.scales.dtype and w.zeros.stride() == w.scales.stride()))
            and (bias is None or bias.dtype == x2.dtype)
            and all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0 for t in tensors)
            and x2.stride(0) % 8 == 0 and w.qweight.stride(0) % 16 == 0 and w.scales.stride(0) % 8 == 0
            and out.stride(0) % 8 == 0)


def _grid(k: int, n: int, group: int, wk: int, resident: int, waves: int, splits: int | None = None):
    """(column tiles, K splits, rows a split): K split so that the blocks fill `waves` whole rounds of what
    the SMs hold at once (a partial last round would leave SMs idle while it runs), every warp of a block a
    group at least; or into about `splits` parts where given (the benchmarks' sweep)."""
    tiles = triton.cdiv(n, 128 * 4 // wk)  # 4 warps: 512 columns, or 128 with K split among them
    split = splits or max(1, min(waves * resident // tiles, k // (group * wk)))
    return (tiles, *k_ranges(k, split, group))


def warps_along_k(m: int, k: int, n: int, group: int, resident: int) -> int:
    """wk for one row of x: the layout whose blocks fill more of one round of the SMs (a partly filled round
    leaves SMs idle); with more rows wk 4. Re-measure: python bench/kernels.py --sweep gemv"""
    if m > 1:
        return 4
    fill = {}
    for wk in (4, 1):
        tiles, split, _ = _grid(k, n, group, wk, resident, 1)
        fill[wk] = tiles * split
    return 1 if fill[1] > fill[4] else 4


def gemv_cuda(x2, w, bias, out, cfg) -> bool:
    """out = x2 W^T (+ bias) with the CUDA kernel; False (nothing launched) where it does not apply."""
    if cfg["wk"] not in (None, 1, 4):
        raise ValueError(f"gemv_cuda: wk must be 1 (warps side by side) or 4 (warps along K), got {cfg['wk']}")
    if not _applies(x2, w, bias, out):
        return False
    m, k = x2.shape
    n = w.qweight.shape[1]
    dev = x2.device
    mt = (m + 7) // 8
    min_blocks = cfg["min_blocks"] or (3 if mt == 1 else 2)  # the register caps that do not spill
    wk = cfg["wk"] or warps_along_k(m, k, n, w.group_size, min_blocks * num_sms(dev))
    name = f"gptq_gemv_mma<{mt}, {w.group_size // 16}, {min_blocks}, {wk}, {w.bits}>"
    built = kernel_for(SOURCE, name, dev, k * n * w.bits // 8, cfg)
    if built is None:
        return False
    kernel, regs = built
    tiles, split, k_split = _grid(k, n, w.group_size, wk, resident_blocks(regs, 128, dev), cfg["waves"],
                                  cfg.get("splits"))
    part = tickets = None
    if split > 1:
        tickets = split_tickets(dev)
        if tickets is None or tiles > MAX_TICKET_TILES:
            return False
        part = torch.empty((split, m, n), dtype=torch.float32, device=dev)
    args = (pointer(x2), pointer(w.qweight), pointer(w.scales), pointer(w.zeros), pointer(bias), pointer(part),
            pointer(out), pointer(tickets), np.int32(m), np.int32(n), np.int32(k), np.int32(k_split),
            np.int64(x2.stride(0)), np.int64(w.qweight.stride(0)), np.int64(w.scales.stride(0)),
            np.int64(out.stride(0)), np.int32(x2.dtype == torch.bfloat16), np.int32(w.scales.dtype == torch.bfloat16),
            np.int32(w.zeros is not None), np.int32(bias is not None))
    launch(kernel, (tiles, split, 1), (128, 1, 1), args, dev)
    return True

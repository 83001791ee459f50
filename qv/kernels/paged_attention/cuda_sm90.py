"""Decode attention over the paged int8 KV cache in raw CUDA (paged_decode_mma.cu: keys on the MMA's
16-row side, about one instruction per code byte; runs on sm_80 and newer, the default on sm_90 where it
was measured), built and launched through cuda_build. The registry's "triton" backend runs it, as it does
the CUDA GEMV. decode_cuda returns None where the kernel does not apply (no CuPy, an older GPU, an fp16 or
fp32 cache, head dims other than 128 / 256, pages that are not a power of two >= 16 keys, misaligned
tensors, or a CUDA graph being captured before the kernel was built); the caller then runs the Triton
kernel. It also declines eager calls below cfg["eager_min_bytes"] (cuda_build.worth_launching). Splits are
merged by the Triton decode_reduce_kernel.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from qv.kernels.cuda_build import cupy_or_none, kernel_for, launch, pointer, resident_blocks
from qv.kernels.paged_attention.triton_decode import LOG2E, reduce_splits, split_length, split_outputs


SOURCE = "paged_attention/paged_decode_mma.cu"  # under qv/kernels (cuda_build.KERNEL_DIR)
HEAD_DIMS = (128, 256)
TILE = 16  # keys per MMA tile; WARPS warps a block take tiles in turn (both as in the .cu)
WARPS = 4
THREADS = 32 * WARPS


def _applies(q, k, v, ks, vs, block_tables, cu_q, kv_lens) -> bool:
    d = q.shape[-1]
    bs = k.shape[1]
    return (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] >= 8 and cupy_or_none() is not None
            and k.dtype == v.dtype == torch.int8 and q.dtype in (torch.float16, torch.bfloat16) and d in HEAD_DIMS
            and q.shape[1] % k.shape[2] == 0 and ks.shape == k.shape[:3]
            and bs >= TILE and bs & (bs - 1) == 0
            and k.stride() == v.stride() and k.stride(-1) == 1 and ks.stride() == vs.stride() and ks.stride(-1) == 1
            and ks.dtype == torch.float32 and vs.dtype == torch.float32
            and all(x.data_ptr() % 16 == 0 for x in (q, k, v)) and all(st % 16 == 0 for st in k.stride()[:3])
            and q.stride(-1) == 1 and q.stride(0) % 8 == 0 and q.stride(1) % 8 == 0
            and all(x.dtype == torch.int32 for x in (block_tables, cu_q, kv_lens)) and block_tables.stride(-1) == 1
            and block_tables.shape[1] >= 1 and k.shape[0] >= 1
            and cu_q.stride(0) == 1 and kv_lens.stride(0) == 1)


def decode_cuda(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, cfg):
    """Decode and speculative rows (max_q per sequence) with the CUDA kernel: [T, Hq, D] in q's dtype, or
    None (nothing launched) where it does not apply. Blocks take 8 query rows (token x head of a KV head's
    group) each. The split count depends only on the batch, head counts, max_q, max_kv, the device and
    cfg, as for the Triton kernel: all fixed while a CUDA graph replays."""
    if not _applies(q, k, v, ks, vs, block_tables, cu_q, kv_lens):
        return None
    t, hq, d = q.shape
    hkv = k.shape[2]
    n_seq = cu_q.shape[0] - 1
    dev = q.device
    built = kernel_for(SOURCE, f"paged_decode_mma<{d}, {cfg['min_blocks']}>", dev, n_seq * max_kv * hkv * 2 * (d + 4),
                       cfg)
    if built is None:
        return None
    kernel, regs = built
    # one round of resident blocks over (sequence, KV head, row chunk, split); each warp gets two tiles at least
    chunks = triton.cdiv(max_q * (hq // hkv), 8)
    pairs = n_seq * hkv * chunks
    splits = max(1, min(cfg["waves"] * resident_blocks(regs, THREADS, dev, cap=cfg["min_blocks"]) // pairs,
                        triton.cdiv(max_kv, 2 * WARPS * TILE)))
    splits = cfg.get("splits", splits)
    splits, split_len = split_length(max_kv, splits, TILE)
    out = torch.empty_like(q)
    dst, lse, *strides = split_outputs(out, splits)
    args = (pointer(q), pointer(k), pointer(v), pointer(ks), pointer(vs), pointer(dst), pointer(lse),
            pointer(block_tables), pointer(cu_q), pointer(kv_lens), np.float32(scale * LOG2E), np.int32(t),
            np.int32(hq), np.int32(hq // hkv), np.int64(q.stride(0)), np.int64(q.stride(1)),
            *(np.int64(s) for s in strides), np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(k.stride(2)),
            np.int64(ks.stride(0)), np.int64(ks.stride(1)), np.int64(block_tables.stride(0)),
            np.int32(k.shape[1].bit_length() - 1), np.int32(split_len), np.int32(q.dtype == torch.bfloat16),
            np.int32(chunks), np.int32(block_tables.shape[1]), np.int32(k.shape[0]))
    launch(kernel, (n_seq * chunks, hkv, splits), (THREADS, 1, 1), args, dev)
    if splits > 1:
        reduce_splits(dst, lse, out, cu_q, kv_lens, split_len, cfg.get("reduce_block_d"))
    return out

"""paged_attention on Volta (sm_70), the registry's "sm70" backend: raw CUDA on the m8n8k4 tensor-core MMA
(paged_decode_m884.cu, paged_prefill_m884.cu, m884_attention.cuh), built by NVRTC through CuPy and launched
through cuda_build.

- Decode and speculative rows (max_query_len <= 8): split-K over the context, each split a partial softmax
  (paged_decode_m884), then combine_splits merges them. The split count depends only on host values (batch,
  head counts, max_query_len, max_seq_len, the device), so a captured CUDA graph stays valid while seq_lens
  stay under the max_seq_len it was captured with.
- Prefill chunks: causal FMHA over the paged prefix and the chunk's own keys with N32 score tiles
  (paged_prefill_m884), split-K too when a chunk gives too few blocks to fill the GPU.

Both take fp16 queries (Volta has no bf16) over an int8 cache with fp32 scales or an fp16 cache, head dims
32, 64, 128 and 256, pages of a power of two keys. Where they do not apply (see `unsupported`), or the
build failed, the op runs the fp32 reference math on the device (reference.py), never the Triton kernels
(tl.dot below compute capability 8.0 is slow and has been wrong); inside a CUDA graph capture that fallback
raises instead, naming the cause.
"""

from __future__ import annotations

import numpy as np
import torch

from qv.kernels.cuda_build import (KernelBuild, build, cupy_or_none, device_index, is_built, launch, pointer,
                                   resident_blocks)
from qv.kernels.paged_attention.reference import paged_attention as reference_attention
from qv.kernels.triton_utils import num_sms

DECODE_SOURCE = "paged_attention/paged_decode_m884.cu"  # under qv/kernels (cuda_build.KERNEL_DIR)
PREFILL_SOURCE = "paged_attention/paged_prefill_m884.cu"
HEAD_DIMS = (32, 64, 128, 256)
# as in the .cu: keys a warp step, warps a block, query rows of a prefill block, halves a P tile row
TILE, DECODE_WARPS, PREFILL_WARPS, P_STRIDE = 32, 4, 8, 40
PREFILL_ROWS = 8 * PREFILL_WARPS
DECODE_MAX_Q = 8  # the op's contract: batches of up to 8 query rows a sequence take the decode path
# launch choices, not measured (no V100 here): decode splits fill DECODE_WAVES rounds of the blocks the SMs
# hold; a prefill splits its keys (MIN_SPLIT_KEYS at least a split) while it has fewer than
# PREFILL_BLOCKS_PER_SM blocks a multiprocessor
DECODE_WAVES, PREFILL_BLOCKS_PER_SM, MIN_SPLIT_KEYS = 2, 2, 512
LOG2E = 1.4426950408889634


def decode_name(d: int, int8: bool) -> str:
    return f"paged_decode_m884<{d}, {str(int8).lower()}>"


def prefill_name(d: int, int8: bool) -> str:
    return f"paged_prefill_m884<{d}, {str(int8).lower()}>"


def combine_name(d: int) -> str:
    return f"combine_splits<{d}>"


BUILDS: tuple[KernelBuild, ...] = (
    KernelBuild(DECODE_SOURCE, tuple(decode_name(d, i) for d in HEAD_DIMS for i in (True, False)), tensor_cores=True),
    KernelBuild(PREFILL_SOURCE, tuple(prefill_name(d, i) for d in HEAD_DIMS for i in (True, False)),
                tensor_cores=True),
    KernelBuild(DECODE_SOURCE, tuple(combine_name(d) for d in HEAD_DIMS), tensor_cores=False),
)


def prefill_smem_bytes(d: int) -> int:
    """PrefillSmem<D>::BYTES in paged_prefill_m884.cu: 64 query rows and the K tile (rows of d + 4 halves), the V tile,
    the warps' P tiles, the tile's K and V scales."""
    return 2 * (PREFILL_ROWS * (d + 4) + TILE * (d + 4) + TILE * d + PREFILL_WARPS * 8 * P_STRIDE) + 2 * TILE * 4


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_length(max_kv: int, splits: int, unit: int) -> tuple[int, int]:
    """(splits, keys a split) for about `splits` parts of max_kv keys, each a multiple of `unit` keys."""
    split_len = cdiv(cdiv(max_kv, splits), unit) * unit
    return cdiv(max_kv, split_len), split_len


def unsupported(q, k, v, ks, vs, block_tables, cu_q, kv_lens) -> str | None:
    """Why the m8n8k4 kernels cannot take these inputs, or None where they can."""
    if not q.is_cuda:
        return "tensors not on a CUDA device"
    if cupy_or_none() is None:
        return "CuPy is not installed (the gpu extra)"
    if torch.cuda.get_device_capability(q.device)[0] < 7:
        return "a GPU older than sm_70"
    if q.dtype != torch.float16:
        return f"{q.dtype} queries (the kernels take fp16)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the kernels take {HEAD_DIMS})"
    if q.shape[1] // k.shape[2] > PREFILL_ROWS:
        return f"more than {PREFILL_ROWS} query heads a KV head"
    if k.shape[1] & (k.shape[1] - 1):
        return f"pages of {k.shape[1]} keys (not a power of two)"
    int8 = k.dtype == torch.int8
    if not int8 and k.dtype != torch.float16:
        return f"a {k.dtype} cache (the kernels read int8 or fp16)"
    if v.dtype != k.dtype or k.stride() != v.stride() or k.stride(-1) != 1:
        return "K and V caches of different layouts"
    if any(x.data_ptr() % 16 for x in (k, v)) or any(s * k.element_size() % 16 for s in k.stride()[:3]):
        return "cache rows not 16-byte aligned"
    if int8 and (ks is None or vs is None or ks.dtype != torch.float32 or vs.dtype != torch.float32
                 or ks.shape != k.shape[:3] or ks.stride() != vs.stride() or ks.stride(-1) != 1):
        return "int8 scales that are not fp32 [pages, BS, HKV] of one layout with a unit inner stride"
    if (any(x.dtype != torch.int32 for x in (block_tables, cu_q, kv_lens)) or block_tables.stride(-1) != 1
            or cu_q.stride(0) != 1 or kv_lens.stride(0) != 1):
        return "block tables, cu_seqlens_q or seq_lens not int32 with a unit inner stride"
    if block_tables.shape[1] < 1 or k.shape[0] < 1:
        return "an empty cache or block table"
    return None


_SMEM_SET: set[tuple[tuple[str, str], int]] = set()


def _kernels(kernels, device: torch.device, shared_mem: int = 0):
    """[(function, registers)] of `kernels`, (source, name) pairs, built on first use, or None if a build
    failed; the first may use `shared_mem` bytes of dynamic shared memory. Inside a CUDA graph capture nothing
    is built (NVRTC does not belong there): an unbuilt kernel raises."""
    index = device_index(device)
    missing = [name for source, name in kernels if not is_built(source, name, index)]
    if missing and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"paged_attention (sm70): {', '.join(missing)} not built before this CUDA graph "
                           "capture (an eager call of the same shapes builds it)")
    built = [build(source, name, index) for source, name in kernels]
    if any(b is None for b in built):
        return None
    if shared_mem > 48 << 10 and (kernels[0], index) not in _SMEM_SET:  # past the default dynamic limit
        built[0][0].max_dynamic_shared_size_bytes = shared_mem
        _SMEM_SET.add((kernels[0], index))
    return built


def _partials(splits: int, q: torch.Tensor):
    """fp32 partial outputs [splits, T, Hq, D] and their base-2 log-sum-exps [splits, T, Hq] (unused with one
    split: one element each)."""
    t, hq, d = q.shape
    shape = (splits, t, hq, d) if splits > 1 else (1,)
    part = torch.empty(shape, dtype=torch.float32, device=q.device)
    lse = torch.empty(shape[:3] if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    return part, lse


def _cache_args(k, v, ks, vs):
    int8 = k.dtype == torch.int8
    return (np.int64(k.stride(0)), np.int64(k.stride(1)), np.int64(k.stride(2)),
            np.int64(ks.stride(0) if int8 else 0), np.int64(ks.stride(1) if int8 else 0))


def _combine(combine, part, lse, out, cu_q, kv_lens, split_len):
    splits, t, hq, _ = part.shape
    args = (pointer(part), pointer(lse), pointer(out), pointer(cu_q), pointer(kv_lens), np.int32(cu_q.shape[0] - 1),
            np.int32(t), np.int32(hq), np.int64(out.stride(0)), np.int64(out.stride(1)), np.int32(split_len),
            np.int32(splits))
    launch(combine, (t, hq, 1), (64, 1, 1), args, out.device)


def decode_m884(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, out, splits=None):
    """Decode / speculative rows into `out` [T, Hq, D]; blocks of 8 query rows (token x head of a KV head's
    group). splits: forced split count (tests). Returns out, or None if a kernel did not build."""
    t, hq, d = q.shape
    hkv = k.shape[2]
    rep, n_seq, dev, int8 = hq // hkv, cu_q.shape[0] - 1, q.device, k.dtype == torch.int8
    built = _kernels(((DECODE_SOURCE, decode_name(d, int8)), (DECODE_SOURCE, combine_name(d))), dev)
    if built is None:
        return None
    (decode, regs), (combine, _) = built
    chunks = cdiv(max_q * rep, 8)
    if splits is None:  # one round of DECODE_WAVES x the resident blocks; each warp two tiles at least
        pairs = n_seq * hkv * chunks
        splits = max(1, min(DECODE_WAVES * resident_blocks(regs, 32 * DECODE_WARPS, dev, cap=2) // pairs,
                            cdiv(max_kv, 2 * DECODE_WARPS * TILE)))
    splits, split_len = split_length(max_kv, splits, TILE)
    part, lse = _partials(splits, q)
    args = (pointer(q), pointer(k), pointer(v), pointer(ks if int8 else None), pointer(vs if int8 else None),
            pointer(out), pointer(part), pointer(lse), pointer(block_tables), pointer(cu_q), pointer(kv_lens),
            np.float32(scale * LOG2E), np.int32(t), np.int32(hq), np.int32(rep), np.int64(q.stride(0)),
            np.int64(q.stride(1)), np.int64(out.stride(0)), np.int64(out.stride(1)), *_cache_args(k, v, ks, vs),
            np.int64(block_tables.stride(0)), np.int32(k.shape[1].bit_length() - 1), np.int32(split_len),
            np.int32(chunks), np.int32(block_tables.shape[1]), np.int32(k.shape[0]))
    launch(decode, (n_seq * chunks, hkv, splits), (32 * DECODE_WARPS, 1, 1), args, dev)
    if splits > 1:
        _combine(combine, part, lse, out, cu_q, kv_lens, split_len)
    return out


def _new_kv(k_new, v_new, k):
    """The chunk's own K/V rows the prefill kernel may read instead of the pages (fp16 caches), or None."""
    if k_new is None or k.dtype != torch.float16 or k_new.dtype != torch.float16 or v_new.dtype != torch.float16:
        return None
    if (k_new.stride() != v_new.stride() or k_new.stride(-1) != 1 or any(x.data_ptr() % 16 for x in (k_new, v_new))
            or any(s % 8 for s in k_new.stride()[:2])):
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    return k_new, v_new


def prefill_m884(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, out, k_new=None, v_new=None,
                 splits=None):
    """Prefill chunks into `out`: blocks of 64 query rows (64 // rep tokens x the rep heads of a KV head).
    splits: forced split count (tests). Returns out, or None if a kernel did not build."""
    t, hq, d = q.shape
    hkv = k.shape[2]
    rep, n_seq, dev, int8 = hq // hkv, cu_q.shape[0] - 1, q.device, k.dtype == torch.int8
    smem = prefill_smem_bytes(d)
    built = _kernels(((PREFILL_SOURCE, prefill_name(d, int8)), (DECODE_SOURCE, combine_name(d))), dev, smem)
    if built is None:
        return None
    (prefill, _), (combine, _) = built
    bq = PREFILL_ROWS // rep
    tiles = t // bq + n_seq  # virtual tiles: sequence b owns cu_q[b] // bq + b ..
    if splits is None:
        target = PREFILL_BLOCKS_PER_SM * num_sms(dev)
        splits = 1 if tiles * hkv >= target else min(cdiv(target, tiles * hkv), cdiv(max_kv, MIN_SPLIT_KEYS))
    splits, split_len = split_length(max_kv, max(1, splits), TILE)
    part, lse = _partials(splits, q)
    new = _new_kv(k_new, v_new, k)
    kn, vn = new if new is not None else (None, None)
    args = (pointer(q), pointer(k), pointer(v), pointer(ks if int8 else None), pointer(vs if int8 else None),
            pointer(kn), pointer(vn), pointer(out), pointer(part), pointer(lse), pointer(block_tables),
            pointer(cu_q), pointer(kv_lens), np.float32(scale * LOG2E), np.int32(n_seq), np.int32(t),
            np.int32(hq), np.int32(rep), np.int32(bq), np.int64(q.stride(0)), np.int64(q.stride(1)),
            np.int64(out.stride(0)), np.int64(out.stride(1)), *_cache_args(k, v, ks, vs),
            np.int64(block_tables.stride(0)), np.int64(kn.stride(0) if new else 0),
            np.int64(kn.stride(1) if new else 0), np.int32(k.shape[1].bit_length() - 1), np.int32(split_len),
            np.int32(block_tables.shape[1]), np.int32(k.shape[0]), np.int32(new is not None))
    launch(prefill, (tiles, hkv, splits), (32 * PREFILL_WARPS, 1, 1), args, dev, shared_mem=smem)
    if splits > 1:
        _combine(combine, part, lse, out, cu_q, kv_lens, split_len)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale=None, v_scale=None,
                    max_query_len=None, max_seq_len=None, k_new=None, v_new=None):
    reason = unsupported(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens)
    if reason is None:
        t, n_seq = q.shape[0], cu_seqlens_q.shape[0] - 1
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if t == 0 or n_seq == 0:
            return out
        if max_query_len is None:
            max_query_len = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # one sync; callers pass it
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if q.stride(-1) != 1 or q.stride(0) % 8 or q.stride(1) % 8 or q.data_ptr() % 16:
            q = q.contiguous()
        args = (q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, scale, max_query_len,
                max(int(max_seq_len), 1), out)
        done = decode_m884(*args) if max_query_len <= DECODE_MAX_Q else prefill_m884(*args, k_new, v_new)
        if done is not None:
            return done
        reason = "the CUDA kernels did not build"
    if q.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"paged_attention (sm70): the m8n8k4 kernels do not apply ({reason}), and the fp32 "
                           "fallback cannot run inside a CUDA graph capture")
    return reference_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale, v_scale,
                               max_query_len, max_seq_len)

"""Attention's measured choices: tiles of the flash kernel (prefill chunks, varlen, decode), tiles and
split counts of the decode kernel, and which decode kernel runs by default.

Every setting was the fastest on the H200 at the Qwen3.5-27B shapes (bench/kernels.py --sweep attn,decode
times the variants, decode by CUDA-graph replay); under the CPU interpreter the tiles are tiny so the tests
cross many tile, split and page boundaries.
"""

from __future__ import annotations

import torch

from qv.kernels.triton_utils import interpreting, next_pow2, num_sms


def attn_config(device, dtype, d, rep, decode, max_q, n_seq, hkv):
    """attn_fwd_kernel's tiles: (BLOCK_M rows = query tokens x GQA group, BLOCK_N keys, warps, stages).
    Re-measure: python bench/kernels.py --sweep attn"""
    m_floor = next_pow2(rep, 16)
    if interpreting(device):
        m = next_pow2(max_q * rep, m_floor) if decode else m_floor
        return dict(BLOCK_M=m, BLOCK_N=16, num_warps=4, num_stages=1)
    wide = dtype != torch.float32
    if decode:  # short splits like deeper pipelines
        long_splits = n_seq * hkv >= num_sms(device) // 4  # few (batch, KV head) pairs: many short splits
        return dict(BLOCK_M=next_pow2(max_q * rep, m_floor), BLOCK_N=(128 if long_splits else 64) if wide else 32,
                    num_warps=4, num_stages=(3 if long_splits else 4) if wide else 2)
    if not wide:  # fp32 runs its dots on FMA units (ieee): small tiles
        return dict(BLOCK_M=max(m_floor, 32 if d > 128 else 64), BLOCK_N=32, num_warps=4, num_stages=1)
    # The chunk's new keys by plain loads: TMA copies (config tma=True, sm_90+) gained 5% at 8K-row chunks, which
    # cuDNN takes now, and are the suspect where the piecewise graphs' start-up check failed (docs/BENCHMARKS.md)
    if d <= 64:
        return dict(BLOCK_M=max(m_floor, 128), BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=max(m_floor, 128), BLOCK_N=64, num_warps=8, num_stages=3 if d <= 128 else 2)


def decode_config(device, dtype, d, rep, max_q, n_seq, hkv):
    """paged_decode_kernel's settings: 32-key tiles and 4 warps. Few (sequence, KV head) pairs: one round of
    the programs the SMs hold (waves=3); many pairs: more, shorter splits (waves=24) with K/V through
    cp.async (stages=5: two tiles in flight) at a 168-register cap. fp32 runs ieee dots on FMA units: small
    tiles. Re-measure: python bench/kernels.py --sweep decode"""
    m = next_pow2(max_q * rep, 16)
    if interpreting(device):
        return dict(BLOCK_M=m, BLOCK_N=16, num_warps=4, waves=2)
    if dtype == torch.float32:
        return dict(BLOCK_M=m, BLOCK_N=16, num_warps=4, waves=6)
    if n_seq * hkv < num_sms(device) // 8:
        return dict(BLOCK_M=m, BLOCK_N=32, num_warps=4, waves=3)
    return dict(BLOCK_M=m, BLOCK_N=32, num_warps=4, waves=24, stages=5, maxnreg=168)


def decode_cuda_config(device):
    """The raw-CUDA decode kernel's launch settings: blocks sized so that the splits fill `waves` rounds of
    what the SMs hold at once, 2 blocks per SM by the register cap; eagerly (outside graph capture) only from
    512 MB of K/V on, where the Triton kernel's GPU time passes the CuPy launch's host time
    (cuda_build.worth_launching). Re-measure: python bench/kernels.py --sweep decode; python bench/host_launch.py"""
    return dict(waves=1, min_blocks=2, eager_min_bytes=512 << 20)


# Query rows from which a sequence's prompt chunk runs through cuDNN (sdpa_prefill.py): from there on it beat the
# Triton kernel over an int8 cache at 32K and 128K keys (docs/BENCHMARKS.md).
# Re-measure: python bench/prefill_sweep.py --only attn
CUDNN_MIN_ROWS = 256
# keys a cuDNN piece holds: the piece size nearest SDPA's speed on bf16 keys at 128K in the sweep (the fp16
# workspace: 2 * 32K * Hkv * D * 2 bytes, 128 MiB at the 27B shapes)
CUDNN_PIECE_TOKENS = 32768


def prefill_kind(device, max_q: int, dtype, kv_dtype) -> str:
    """"cudnn" (sdpa_prefill.py) for chunks of at least CUDNN_MIN_ROWS rows of 16-bit activations over an
    int8 or 16-bit cache on sm_90 where torch's cuDNN attention runs, else "triton".
    Re-measure: python bench/prefill_sweep.py --only attn"""
    from qv.kernels.paged_attention import sdpa_prefill

    if (max_q >= CUDNN_MIN_ROWS and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and kv_dtype in (torch.int8, torch.float16, torch.bfloat16) and not torch.cuda.is_current_stream_capturing()
            and sdpa_prefill.available(device)):
        return "cudnn"
    return "triton"


# settings only the Triton split-K decode kernel reads: a config that names one means that kernel
SPLIT_ONLY_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "stages", "words"})


def decode_kind(device, config: dict) -> str:
    """Default decode kernel: on sm_90, where it was measured, the raw-CUDA kernel (cuda_sm90.py) where it
    applies; elsewhere, or for a config with settings of the Triton kernel only, the Triton split-K kernel
    ("split"). Re-measure: python bench/kernels.py --sweep decode"""
    if SPLIT_ONLY_KEYS & set(config):
        return "split"
    return "cuda" if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 else "split"

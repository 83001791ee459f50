"""Attention over the paged KV cache (prefill chunks, decode and speculative rows alike), the
cache write (with int8 quantization), and dense varlen attention for the vision tower."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.attention_kernels import (LOG2E, attn_fwd_kernel, attn_reduce_kernel, paged_decode_kernel,
                                         reduce_splits, split_length, split_outputs)
from qv.kernels.attention_cuda import decode_cuda, decode_cuda_config
from qv.kernels.registry import impl, register
from qv.kernels.triton_utils import interpreting, next_pow2, num_sms


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Store new keys/values in the paged cache. k, v [T, Hkv, D]; caches [NB, BS, Hkv, D];
    slot_mapping [T] (block * BS + offset; -1 skips the row). int8 caches quantize symmetrically
    with one fp32 scale per (token, head) written to k_scale/v_scale [NB, BS, Hkv]."""
    if k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, cache {tuple(k_cache.shape)}")
    if k_cache.dtype == torch.int8 and (k_scale is None or v_scale is None):
        raise ValueError("write_kv: an int8 cache needs k_scale and v_scale tables")
    impl("write_kv", k.device)(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                    max_query_len: int | None = None, max_seq_len: int | None = None,
                    k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of packed queries over each sequence's cached keys (new ones included).

    q [T, Hq, D]; caches [NB, BS, Hkv, D] (+ int8 scales [NB, BS, Hkv]); block_tables [B, MB] int32;
    cu_seqlens_q [B+1] int32; seq_lens [B] int32 = keys of each sequence after this step. Query i
    of sequence b sits at position seq_lens[b] - q_len[b] + i and sees keys up to it, so decode
    (q_len 1), prefill chunks over a cached prefix and the k+1 speculative rows are one op.
    Returns [T, Hq, D].

    max_query_len / max_seq_len: host ints, upper bounds of the query lengths and of seq_lens (each
    computed with a device->host sync when omitted). Decode batches (max_query_len <= 8) split the
    context into a number of parts that depends only on B, the head counts and max_seq_len, and the
    programs past a sequence's own seq_lens[b] exit on the device. So a CUDA graph captured with a
    fixed B, max_query_len and an upper bound for max_seq_len (e.g. the model's max length) stays
    valid for every replay whose seq_lens stay under that bound; only block_tables, cu_seqlens_q,
    seq_lens and q change between replays (in place).

    k_new / v_new [T, Hkv, D] (optional): the keys and values this step wrote with write_kv, rows
    packed like q. They must equal what the cache holds for those positions; a kernel may read the
    chunk's own keys from them (contiguous) instead of from the pages. Ignored where the cache
    stores another dtype (int8).
    """
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"paged_attention: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}")
    if k_new is not None and (k_new.shape != (q.shape[0], *k_cache.shape[2:]) or v_new is None
                              or v_new.shape != k_new.shape):
        raise ValueError(f"paged_attention: k_new/v_new must be [T, Hkv, D] = {(q.shape[0], *k_cache.shape[2:])}")
    return impl("paged_attention", q.device)(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale,
                                             k_scale, v_scale, max_query_len, max_seq_len, k_new, v_new)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
                     causal: bool = False, max_seqlen: int | None = None) -> torch.Tensor:
    """Attention within each packed sequence, no cache. q [T, Hq, D], k/v [T, Hkv, D]; returns [T, Hq, D]."""
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[1] % k.shape[1]:
        raise ValueError(f"varlen_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    return impl("varlen_attention", q.device)(q, k, v, cu_seqlens, scale, causal, max_seqlen)



# ---------------------------------------------------------------------------------------------
# Triton: the cache write (+ int8 quantization)
# ---------------------------------------------------------------------------------------------


@triton.jit
def _store_kv_row(x_ptr, c_ptr, s_ptr, i_t, blk, off, H, D, stride_xt, stride_xh, stride_cb, stride_cs,
                  stride_ch, stride_sb, stride_ss, QUANT: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    o_h = tl.arange(0, BLOCK_H).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_h[:, None] < H) & (o_d[None, :] < D)
    b_x = tl.load(x_ptr + i_t * stride_xt + o_h[:, None] * stride_xh + o_d[None, :], mask=m, other=0.)
    p_c = c_ptr + blk * stride_cb + off * stride_cs + o_h[:, None] * stride_ch + o_d[None, :]
    if QUANT:
        b_x = b_x.to(tl.float32)
        b_a = tl.maximum(tl.max(tl.abs(b_x), axis=1), 1e-30)  # [BLOCK_H]
        b_s = tl.math.div_rn(b_a, tl.full(b_a.shape, 127.0, tl.float32))  # IEEE division, like the reference
        b_q = tl.math.div_rn(b_x, b_s[:, None])
        # +- 1.5 * 2**23 rounds half-to-even like torch.round (libdevice.rint is missing in the interpreter)
        b_q = tl.minimum(tl.maximum((b_q + 12582912.0) - 12582912.0, -127.0), 127.0)
        tl.store(p_c, b_q.to(tl.int8), mask=m)
        tl.store(s_ptr + blk * stride_sb + off * stride_ss + o_h, b_s, mask=o_h < H)
    else:
        tl.store(p_c, b_x.to(c_ptr.dtype.element_ty), mask=m)


@triton.jit
def write_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, slot_ptr, H, D, BS,
                    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                    stride_sb, stride_ss, QUANT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i_t).to(tl.int64)
    if slot >= 0:
        blk, off = slot // BS, slot % BS
        _store_kv_row(k_ptr, kc_ptr, ks_ptr, i_t, blk, off, H, D, stride_kt, stride_kh, stride_cb, stride_cs,
                      stride_ch, stride_sb, stride_ss, QUANT, BLOCK_H, BLOCK_D)
        _store_kv_row(v_ptr, vc_ptr, vs_ptr, i_t, blk, off, H, D, stride_vt, stride_vh, stride_cb, stride_cs,
                      stride_ch, stride_sb, stride_ss, QUANT, BLOCK_H, BLOCK_D)


def _write_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    t, h, d = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("write_kv: K and V caches must share one layout with a unit inner stride")
    quant = k_cache.dtype == torch.int8
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else v_cache
    if quant and (k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1):
        raise ValueError("write_kv: K and V scale tables must share one layout with a unit inner stride")
    if t:
        write_kv_kernel[(t,)](k, v, k_cache, v_cache, ks, vs, slot_mapping, h, d, k_cache.shape[1],
                              k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                              k_cache.stride(1), k_cache.stride(2), ks.stride(0), ks.stride(1),
                              QUANT=quant, BLOCK_H=next_pow2(h), BLOCK_D=next_pow2(d))



# ---------------------------------------------------------------------------------------------
# Triton: attention launchers (kernels in attention_kernels.py)
# ---------------------------------------------------------------------------------------------


def _attn_config(device, dtype, d, rep, decode, max_q, n_seq, hkv):
    """Tile sizes: (BLOCK_M rows = query tokens x GQA group, BLOCK_N keys, warps, stages)."""
    m_floor = next_pow2(rep, 16)
    if interpreting(device):  # tiny tiles so CPU tests cross many tile, split and page boundaries
        m = next_pow2(max_q * rep, m_floor) if decode else m_floor
        return dict(BLOCK_M=m, BLOCK_N=16, num_warps=4, num_stages=1)
    wide = dtype != torch.float32
    if decode:  # measured on the H200 (bench/kernels.py --sweep): short splits like deeper pipelines
        long_splits = n_seq * hkv >= num_sms(device) // 4  # few (batch, KV head) pairs: many short splits
        return dict(BLOCK_M=next_pow2(max_q * rep, m_floor), BLOCK_N=(128 if long_splits else 64) if wide else 32,
                    num_warps=4, num_stages=(3 if long_splits else 4) if wide else 2)
    if not wide:  # fp32 runs its dots on FMA units (ieee): small tiles
        return dict(BLOCK_M=max(m_floor, 32 if d > 128 else 64), BLOCK_N=32, num_warps=4, num_stages=1)
    # Hopper+: the chunk's new keys by TMA bulk copies (H200, 8K d256: 1.61 vs 1.69 ms; docs/BENCHMARKS.md)
    tma = torch.cuda.get_device_capability(device)[0] >= 9
    if d <= 64:
        return dict(BLOCK_M=max(m_floor, 128), BLOCK_N=64, num_warps=4, num_stages=3, tma=tma)
    return dict(BLOCK_M=max(m_floor, 128), BLOCK_N=64, num_warps=8, num_stages=3 if d <= 128 else 2, tma=tma)


def _num_splits(device, programs, max_kv, block_n, min_keys):
    """Split the context so about two programs run per multiprocessor; each split keeps >= min_keys."""
    target = 2 * num_sms(device)
    if programs >= target or max_kv <= min_keys:
        return 1, max_kv
    splits = min(triton.cdiv(target, programs), triton.cdiv(max_kv, min_keys))
    return split_length(max_kv, splits, block_n)


def _decode_config(device, dtype, d, rep, max_q, n_seq, hkv):
    """paged_decode_kernel settings (measured on the H200: bench/kernels.py --sweep decode)."""
    m = next_pow2(max_q * rep, 16)
    if interpreting(device):
        return dict(BLOCK_M=m, BLOCK_N=16, num_warps=4, waves=2)
    if dtype == torch.float32:  # ieee dots on FMA units: small tiles
        return dict(BLOCK_M=m, BLOCK_N=16, num_warps=4, waves=6)
    # measured on the H200 (bench/kernels.py --sweep decode, CUDA-graph replay): 32-key tiles, 4 warps;
    # few (sequence, KV head) pairs: one full wave of programs (3 of 168 registers per SM; 41.9 vs 46.9 us
    # at 32K x 1 for two waves); many pairs: more, shorter splits (24) and K/V through cp.async
    # (stages=5: two tiles in flight; 0.50 vs 0.52 ms at 32K x 16)
    if n_seq * hkv < num_sms(device) // 8:
        return dict(BLOCK_M=m, BLOCK_N=32, num_warps=4, waves=3)
    return dict(BLOCK_M=m, BLOCK_N=32, num_warps=4, waves=24, stages=5, maxnreg=168)


# settings only the Triton split-K decode kernel reads: a config that names one means that kernel
_SPLIT_ONLY_KEYS = frozenset({"BLOCK_M", "BLOCK_N", "num_warps", "stages", "words"})


def _decode_kind(device, config: dict) -> str:
    """Default decode kernel: on sm_90, where it was measured (bench/kernels.py --sweep decode,
    docs/BENCHMARKS.md), the raw-CUDA kernel (attention_cuda.py) where it applies; elsewhere, or for a
    config with settings of the Triton kernel only, the Triton split-K kernel ("split")."""
    if _SPLIT_ONLY_KEYS & set(config):
        return "split"
    return "cuda" if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9 else "split"


def _decode_attention(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, cfg):
    """Decode / speculative rows: split-K over the context with one program per (sequence, KV head,
    split), then the splits are merged by a reduce pass. The split count depends only on the batch size, the
    head counts and max_kv (an upper bound of seq_lens, max_seq_len from the caller), never on device
    values. cfg (from _decode_config, overridable for the sweep): BLOCK_M, BLOCK_N, num_warps; waves
    (programs per multiprocessor the splits aim at) or splits; stages (0: register prefetch, >= 2:
    cp.async pipeline depth); words."""
    t, hq, d = q.shape
    hkv, bs = k.shape[-2], k.shape[1]
    n_seq = cu_q.shape[0] - 1
    cfg = dict(cfg)
    block_m, block_n, waves = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("waves")
    stages = cfg.pop("stages", 0)
    splits = max(1, min(triton.cdiv(waves * num_sms(q.device), n_seq * hkv), triton.cdiv(max_kv, 2 * block_n)))
    splits = cfg.pop("splits", splits)
    splits, split_len = split_length(max_kv, splits, block_n)
    quant = k.dtype == torch.int8
    words = (quant and q.dtype != torch.float32 and d % 4 == 0 and k.data_ptr() % 16 == 0 and v.data_ptr() % 16 == 0
             and all(st % 4 == 0 for st in k.stride()[:3]) and cfg.pop("words", True))
    cfg.pop("words", None)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q)
    o_t, plse, o_s, o_h, o_x = split_outputs(out, splits)
    sc = ks if quant else k
    paged_decode_kernel[(n_seq, hkv, splits)](
        q, k, v, sc, vs if quant else v, o_t, plse, block_tables, cu_q, kv_lens, scale * LOG2E, t,
        hq, q.stride(0), q.stride(1), o_h, o_x, o_s, k.stride(0), k.stride(1), k.stride(2),
        ks.stride(0) if quant else 0, ks.stride(1) if quant else 0, block_tables.stride(0), split_len,
        D=d, REP=hq // hkv, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(d, 16), BS=bs, QUANT=quant,
        SPLIT=splits > 1, WORDS=words, ASM=words and not interpreting(q.device), STAGES=stages,
        num_stages=1, **cfg)
    if splits > 1:
        reduce_splits(o_t, plse, out, cu_q, kv_lens, split_len)
    return out


def _attention(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, causal, paged, max_q, max_kv, config=None,
               k_new=None, v_new=None):
    t, hq, d = q.shape
    hkv = k.shape[-2]
    rep = hq // hkv
    n_seq = cu_q.shape[0] - 1
    out = torch.empty_like(q)
    if t == 0 or n_seq == 0:
        return out
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())  # one sync; callers pass it to avoid this
    if max_kv is None:
        max_kv = int(kv_lens.max()) if paged else max_q
    decode = paged and max_q <= 8
    config = dict(config or {})
    kind = config.pop("kind", None) or (_decode_kind(q.device, config) if decode else "split")
    if decode and kind == "cuda":
        out = decode_cuda(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv,
                          dict(decode_cuda_config(q.device), **config))
        if out is not None:
            return out
        kind, config = "split", {}  # where it does not apply: the Triton kernel below
    if decode and kind == "split":
        cfg = dict(_decode_config(q.device, q.dtype, d, rep, max_q, n_seq, hkv), **config)
        return _decode_attention(q, k, v, ks, vs, block_tables, cu_q, kv_lens, scale, max_q, max_kv, cfg)
    cfg = dict(_attn_config(q.device, q.dtype, d, rep, decode, max_q, n_seq, hkv), **(config or {}))
    block_m, block_n = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    bq = block_m // rep
    grid0 = n_seq if decode else t // bq + n_seq
    splits, split_len = _num_splits(q.device, grid0 * hkv, max_kv, block_n, (4 if decode else 16) * block_n)
    if "splits" in cfg:  # benchmarks may force the split count
        splits = cfg.pop("splits")
        splits, split_len = split_length(max_kv, splits, block_n)
    quant = k.dtype == torch.int8
    if q.stride(-1) != 1:
        q = q.contiguous()
    if paged:
        stride_kb, stride_ks, stride_kh = k.stride(0), k.stride(1), k.stride(2)
        bt, stride_bt, bs = block_tables, block_tables.stride(0), k.shape[1]
    else:
        stride_kb, stride_ks, stride_kh = k.stride(0), 0, k.stride(1)
        bt, stride_bt, bs = cu_q, 0, 1
    sc = ks if quant else k
    stride_sb, stride_ss = (ks.stride(0), ks.stride(1)) if quant else (0, 0)
    # a prefill chunk reads its own keys from the K/V it wrote (contiguous rows) where the cache holds
    # them unchanged; config new_kv=False forces the pages (benchmarks)
    new_kv = cfg.pop("new_kv", True) and k_new is not None and paged and not decode and k_new.dtype == k.dtype
    if new_kv and (k_new.stride() != v_new.stride() or k_new.stride(-1) != 1):  # one layout for both (a small copy)
        k_new, v_new = k_new.contiguous(), v_new.contiguous()
    kn, vn = (k_new, v_new) if new_kv else (k, v)
    tma = (cfg.pop("tma", False) and new_kv and next_pow2(d, 16) == d and not interpreting(q.device)
           and all(x.data_ptr() % 16 == 0 and x.stride(0) * x.element_size() % 16 == 0 for x in (k_new, v_new)))
    if tma:  # tensor descriptors over the rows [T, Hkv * D]; one box = one K or V tile of a head
        from triton.tools.tensor_descriptor import TensorDescriptor
        kn, vn = (TensorDescriptor.from_tensor(x.reshape(t, hkv * d), [block_n, d]) for x in (k_new, v_new))
    o_t, plse, o_s, o_h, o_x = split_outputs(out, splits)
    attn_fwd_kernel[(grid0, hkv, splits)](
        q, k, v, sc, vs if quant else v, o_t, plse, bt, cu_q, kv_lens if paged else cu_q, kn, vn,
        scale * LOG2E, n_seq, t, hq, q.stride(0), q.stride(1), o_h, o_x, o_s,
        stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, stride_bt, bs, split_len, k_new.stride(0) if new_kv else 0,
        k_new.stride(1) if new_kv else 0, D=d, REP=rep, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=next_pow2(d, 16),
        PAGED=paged, QUANT=quant, CAUSAL=causal, DECODE=decode, SPLIT=splits > 1, NEW_KV=new_kv, TMA=tma, **cfg)
    if splits > 1:
        attn_reduce_kernel[(t, hq)](o_t, plse, out, cu_q, kv_lens if paged else cu_q, n_seq, t, hq, out.stride(0),
                                    out.stride(1), split_len, D=d, BLOCK_D=next_pow2(d))
    return out


def _paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, scale, k_scale=None,
                            v_scale=None, max_query_len=None, max_seq_len=None, k_new=None, v_new=None, *,
                            config=None):
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("paged_attention: K and V caches must share one layout with a unit inner stride")
    if k_cache.dtype == torch.int8 and k_scale.stride() != v_scale.stride():
        raise ValueError("paged_attention: K and V scale tables must share one layout")
    return _attention(q, k_cache, v_cache, k_scale, v_scale, block_tables, cu_seqlens_q, seq_lens, scale, True, True,
                      max_query_len, max_seq_len, config, k_new, v_new)


def _varlen_attention_triton(q, k, v, cu_seqlens, scale, causal=False, max_seqlen=None, *, config=None):
    if k.stride(-1) != 1 or k.stride() != v.stride():
        k, v = k.contiguous(), v.contiguous()
    return _attention(q, k, v, None, None, None, cu_seqlens, None, scale, causal, False, max_seqlen, max_seqlen,
                      config)


register("write_kv", "triton", _write_kv_triton)
register("paged_attention", "triton", _paged_attention_triton)
register("varlen_attention", "triton", _varlen_attention_triton)

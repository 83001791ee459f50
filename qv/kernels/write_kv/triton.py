"""Triton cache write: one program per token stores its K and V rows (all heads), quantizing int8 rows
with IEEE division and round-half-to-even like the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from qv.kernels.triton_utils import next_pow2


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


def write_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
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

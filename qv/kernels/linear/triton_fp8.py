"""Triton linear over byte-coded weights: block FP8 (FP8Weight: e4m3 [N, K] as the checkpoint stores it, one fp32
scale per [bn, bk] block) and W12 (W12Weight: 12-bit codes, a low byte plane and a high nibble plane, one
scale per row; its "block" is the whole row). No path keeps a dequantized copy of the weight.

Paths by rows M (fp8_kind; the row limits below):
  M <= GEMV_MAX_ROWS  fp8_gemv_kernel: CUDA-core FMAs, each weight byte read once and widened in registers,
                      K split over the SMs: decode, weight-read bound. No tl.dot, so the sm70 chain runs it
                      too (up to SM70_GEMV_MAX_ROWS).
  M < W8A8_MIN_ROWS   fp8_widen_kernel: [BN, BK] weight tiles widened in registers to x's dtype for tl.dot,
                      the block scale applied per column after the dot; split-K when few tiles (speculative
                      rows, decode batches).
  larger, sm_90      torch._scaled_mm with DeepSeek's block scales (1x128 activation groups, 128x128 weight
                      blocks; CUTLASS inside torch), rows quantized by fp8_quant_rows_kernel: twice the Triton
                      W8A8 kernel's rate at 512-8192 rows. Where torch lacks it (probed once), or off 128x128
                      blocks, the Triton kernel:
  larger, sm_89+      FP8: W8A8 (DeepSeek's block-FP8 scheme): rows quantized to e4m3 per token and group of bk
                      inputs (fp8_quant_rows_kernel), then fp8_w8a8_kernel on FP8 tensor cores, both scales
                      applied per K step. Prefill chunks: the weights are read once per row tile and the
                      products run at twice the bf16 rate.
  larger, otherwise   fp8_dequant_kernel widens `cols` output rows at a time into a chunk in x's dtype (it stays
                      in L2), each chunk multiplied by cuBLAS straight into its output columns.
e4m3 becomes fp16 by moving its bits (sign to bit 15, exponent and mantissa to bits 7..13: the value / 256,
subnormals included), so GPUs without FP8 conversions (Volta, Ampere) run the same source; the 256 joins the
block scale. Only the W8A8 path loads the weight as float8e4nv.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qv.kernels.linear import FP8Weight, W12Weight, on_rows
from qv.kernels.linear.reference import FP8_MAX
from qv.kernels.linear.triton_gemv import k_ranges, store_tile, sum_partials
from qv.kernels.triton_utils import interpreting, next_pow2, num_sms, output_tile

GEMV_MAX_ROWS = 4  # above, tensor cores (fp8_widen_kernel) beat the FMAs' issue rate
SM70_GEMV_MAX_ROWS = 16  # the sm70 chain has no tl.dot: FMAs up to 16 rows, then cuBLAS on widened chunks
W8A8_MIN_ROWS = 128  # decode batches and speculative rows stay weight-only (no activation rounding)
CHUNK_COLS = 8192  # output rows of one widened chunk (a 5120-input weight's 80 MiB of bf16, mostly in L2)
F16_BIAS = 256.0  # the fp16 read of an e4m3 byte's moved bits is its value / 256
WAVES = 4  # split-K: about this many waves of programs over the SMs


@triton.jit
def e4m3_to_f16(b):
    """uint8 e4m3fn bytes -> fp16 values / 256, exactly (NaN bytes excepted): sign to bit 15, exponent and
    mantissa to bits 7..13 make an fp16 whose exponent bias is 8 more (subnormals line up as well)."""
    b16 = b.to(tl.int16)
    return (((b16 & 0x80) << 8) | ((b16 & 0x7F) << 7)).to(tl.float16, bitcast=True)


@triton.jit
def weight_tile(w_ptr, h_ptr, o_n, o_k, m, stride_wn, stride_hn, W12: tl.constexpr):
    """A [BN, BK] tile of weight rows o_n, inputs o_k: FP8 as fp16 values / 256 (e4m3_to_f16), W12 as its
    int32 codes -2047..2047 (low byte from w_ptr, high nibble from byte k // 2 of h_ptr)."""
    b = tl.load(w_ptr + o_n[:, None] * stride_wn + o_k[None, :], mask=m, other=0)
    if W12:  # one return for both: Triton types every return of a function alike, constexpr branch or not
        b_h = tl.load(h_ptr + o_n[:, None] * stride_hn + (o_k // 2)[None, :], mask=m, other=0).to(tl.int32)
        tile = (((b_h >> ((o_k % 2) * 4)[None, :]) & 15) << 8 | b.to(tl.int32)) - 2048
    else:
        tile = e4m3_to_f16(b)
    return tile


@triton.jit
def fp8_gemv_kernel(
    x_ptr, w_ptr, h_ptr, s_ptr, bias_ptr, o_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_hn, stride_sn,
    stride_om, stride_os, BLOCK_BN: tl.constexpr, BLOCK_BK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, W12: tl.constexpr,
):
    """out[:M] (or split partials) for M <= BLOCK_M rows: [BLOCK_N, BLOCK_K] weight tiles widened to fp32, scaled
    and multiplied on CUDA cores into per-lane sums (no shuffles in the loop); BLOCK_K divides bk, so a tile
    lies in one scale block along K."""
    o_m = tl.arange(0, BLOCK_M).to(tl.int64)
    o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_m, m_n = o_m < M, o_n < N
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)  # summed over K once, after the loop
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        b_w = weight_tile(w_ptr, h_ptr, o_n, o_k, m_n[:, None] & m_k[None, :], stride_wn, stride_hn, W12)
        b_s = tl.load(s_ptr + (o_n // BLOCK_BN) * stride_sn + k0 // BLOCK_BK, mask=m_n, other=0.)
        b_w = b_w.to(tl.float32) * (b_s * (1. if W12 else 256.))[:, None]
        b_x = tl.load(x_ptr + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.).to(tl.float32)
        acc += b_x[:, None, :] * b_w[None, :, :]
    store_tile(tl.sum(acc, axis=2), o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, stride_os, HAS_BIAS, SPLIT)


@triton.jit
def fp8_widen_kernel(
    x_ptr, w_ptr, h_ptr, s_ptr, bias_ptr, o_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_hn, stride_sn,
    stride_om, stride_os, BLOCK_BN: tl.constexpr, BLOCK_BK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr, W12: tl.constexpr,
):
    """x [M, K] times the weight's tiles widened to x's dtype on tensor cores, exactly: e4m3 / 256 fits fp16 and
    bf16, a W12 code fits fp16 (and fp32), and in bf16 it goes as two dots, (c >> 8) * 256 + (c & 255). The
    scale (times 256 for FP8) multiplies each column of the K step's dot."""
    o_m, o_n, m_m, m_n = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k_lo = tl.program_id(1) * K_SPLIT
    k_hi = tl.minimum(K, k_lo + K_SPLIT)
    cd = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < k_hi
        b_x = tl.load(x_ptr + o_m[:, None] * stride_xm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
        b_w = weight_tile(w_ptr, h_ptr, o_n, o_k, m_n[:, None] & m_k[None, :], stride_wn, stride_hn, W12)
        b_s = tl.load(s_ptr + (o_n // BLOCK_BN) * stride_sn + k0 // BLOCK_BK, mask=m_n, other=0.)
        if W12 and cd == tl.bfloat16:  # integers past 256 are not exact in bf16: high and low parts apart
            b_d = tl.dot(b_x, tl.trans((b_w >> 8).to(tl.float32).to(cd)), input_precision="ieee") * 256.
            b_d += tl.dot(b_x, tl.trans((b_w & 255).to(tl.float32).to(cd)), input_precision="ieee")
            acc += b_d * b_s[None, :]
        else:
            if W12:
                b_w = b_w.to(tl.float32).to(cd)
            elif cd != tl.float16:
                b_w = b_w.to(tl.float32).to(cd)
            acc += tl.dot(b_x, tl.trans(b_w), input_precision="ieee") * (b_s * (1. if W12 else 256.))[None, :]
    store_tile(acc, o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, stride_os, HAS_BIAS, SPLIT)


@triton.jit
def fp8_quant_rows_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, GROUP: tl.constexpr,
                          BLOCK_R: tl.constexpr):
    """Per-token-group activation quantization (reference.quantize_rows_fp8): BLOCK_R rows of one group of
    GROUP inputs, scaled so the group's largest magnitude maps to 448, rounded to e4m3."""
    o_r = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    o_k = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    m = (o_r < M)[:, None] & (o_k < K)[None, :]
    b_x = tl.load(x_ptr + o_r[:, None] * stride_xm + o_k[None, :], mask=m, other=0.).to(tl.float32)
    b_s = tl.maximum(tl.max(tl.abs(b_x), axis=1), 1e-10) / 448.
    b_q = tl.clamp(b_x / b_s[:, None], -448., 448.)
    tl.store(q_ptr + o_r[:, None] * stride_qm + o_k[None, :], b_q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + o_r * stride_sm + tl.program_id(1), b_s, mask=o_r < M)


@triton.jit
def fp8_w8a8_kernel(
    q_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, o_ptr, M, N, K, stride_qm, stride_xsm, stride_wn, stride_sn, stride_om,
    BLOCK_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_BIAS: tl.constexpr,
):
    """e4m3 rows [M, K] (scales [M, K/BLOCK_K]) times e4m3 weight tiles on FP8 tensor cores; BLOCK_K is the
    weight's bk, so each K step has one activation scale per row and one weight scale per column."""
    o_m, o_n, m_m, m_n = output_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        o_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
        m_k = o_k < K
        b_q = tl.load(q_ptr + o_m[:, None] * stride_qm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.)
        b_w = tl.load(w_ptr + o_n[None, :] * stride_wn + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.)
        b_xs = tl.load(xs_ptr + o_m * stride_xsm + kk, mask=m_m, other=0.)
        b_s = tl.load(s_ptr + (o_n // BLOCK_BN) * stride_sn + kk, mask=m_n, other=0.)
        acc += tl.dot(b_q, b_w) * b_xs[:, None] * b_s[None, :]
    store_tile(acc, o_ptr, bias_ptr, o_m, o_n, m_m, m_n, stride_om, 0, HAS_BIAS, False)


@triton.jit
def fp8_dequant_kernel(w_ptr, h_ptr, s_ptr, o_ptr, N, K, stride_wn, stride_hn, stride_sn, stride_on,
                       BLOCK_BN: tl.constexpr, BLOCK_BK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       W12: tl.constexpr):
    """Rows [N, K] of the weight widened into o's dtype (any block size: one scale gathered per element)."""
    o_n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    o_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    m = (o_n < N)[:, None] & (o_k < K)[None, :]
    b_w = weight_tile(w_ptr, h_ptr, o_n, o_k, m, stride_wn, stride_hn, W12).to(tl.float32)
    b_s = tl.load(s_ptr + (o_n // BLOCK_BN)[:, None] * stride_sn + (o_k // BLOCK_BK)[None, :], mask=m, other=0.)
    tl.store(o_ptr + o_n[:, None] * stride_on + o_k[None, :],
             (b_w * (b_s * (1. if W12 else 256.))).to(o_ptr.dtype.element_ty), mask=m)


W12_BLOCK_K = 1 << 30  # a W12 weight's scale "block" along K: the whole row


@dataclass(frozen=True)
class Operands:
    """What the byte-coded kernels read of an FP8Weight or W12Weight: the code bytes [N, K], W12's high nibbles
    (the code bytes again for FP8: unread), scales [rows, cols] over (bn, bk) blocks (W12: one per row)."""

    codes: torch.Tensor
    high: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    w12: bool

    @classmethod
    def of(cls, w: FP8Weight | W12Weight) -> "Operands":
        if isinstance(w, W12Weight):
            return cls(w.lo, w.hi, w.scale.view(-1, 1), (1, W12_BLOCK_K), True)
        codes = w.weight.view(torch.uint8)
        return cls(codes, codes, w.scale_inv, w.block, False)

    def rows(self, start: int) -> "Operands":
        """The operands from weight row `start` on (a multiple of bn)."""
        return Operands(self.codes[start:], self.high[start:], self.scale[start // self.block[0]:], self.block,
                        self.w12)


def _k_step(bk: int, most: int) -> int | None:
    """The K tile of the GEMV and widening kernels: a power of two dividing bk (so a tile lies in one scale
    block), at most `most`; None where bk has no such divisor of 16 or more."""
    step = min(most, bk & -bk)
    return step if step >= 16 else None


def fp8_kind(device: torch.device, m: int, w: FP8Weight | W12Weight, tensor_cores: bool = True) -> str:
    """The path for `m` rows: "fma", "dot", "scaled_mm", "w8a8" or "chunked" (module docstring)."""
    w12 = isinstance(w, W12Weight)
    bk = W12_BLOCK_K if w12 else w.block[1]
    if _k_step(bk, 128) is None:  # blocks not a multiple of 16 inputs: only the per-element gather takes them
        return "chunked"
    if not tensor_cores:
        return "fma" if m <= SM70_GEMV_MAX_ROWS else "chunked"
    if m <= GEMV_MAX_ROWS:
        return "fma"
    if interpreting(device) or m < W8A8_MIN_ROWS:
        return "dot"
    if w12:  # no 12-bit tensor cores: prompt chunks widen into cuBLAS
        return "chunked"
    fp8_cores = torch.cuda.get_device_capability(device) >= (8, 9)
    if fp8_cores and w.block == (128, 128) and w.shape[0] % 128 == 0 and w.shape[1] % 128 == 0 \
            and scaled_mm_available(device):
        return "scaled_mm"
    return "w8a8" if fp8_cores and bk == bk & -bk and bk >= 32 else "chunked"


_SCALED_MM: dict[int, bool] = {}  # device index -> whether torch's blockwise FP8 GEMM ran right there


def scaled_mm_available(device: torch.device) -> bool:
    """Whether torch._scaled_mm takes block scales on this device (CUDA 12.9+ builds, sm_90): probed once on a
    128 x 128 x 256 product of known value, never while a CUDA graph is being captured."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SCALED_MM:
        if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
            _SCALED_MM[index] = False
        elif torch.cuda.is_current_stream_capturing():
            return False
        else:
            a = torch.ones(128, 256, device=device).to(torch.float8_e4m3fn)
            sa = torch.tensor([[1.0, 2.0]], device=device).expand(128, 2).t().contiguous().t()
            sb = torch.full((1, 2), 0.5, device=device).t()  # as a weight's [N/128, K/128] scales are passed
            y = torch.empty(128, 128, dtype=torch.bfloat16, device=device)
            try:  # into an output of its own, as scaled_mm_fp8 calls it
                torch._scaled_mm(a, a.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, out=y)
                _SCALED_MM[index] = bool((y.float() == 192.0).all())  # 128 (1 * 0.5) + 128 (2 * 0.5)
            except (RuntimeError, TypeError, ValueError):
                _SCALED_MM[index] = False
    return _SCALED_MM[index]


def scaled_mm_fp8(x2: torch.Tensor, w: FP8Weight, bias, out: torch.Tensor) -> None:
    """out = x2 W^T (+ bias) through torch._scaled_mm: rows quantized per token and 128 inputs, the weight's own
    128 x 128 block scales (its [N, K] bytes are the column-major B operand as stored)."""
    q, s = quantize_rows(x2, 128)
    torch._scaled_mm(q, w.weight.t(), scale_a=s.t().contiguous().t(), scale_b=w.scale_inv.t(), out_dtype=out.dtype,
                     out=out)
    if bias is not None:
        out.add_(bias)


def _split(m_tiles_n_tiles: int, k: int, step: int, device, split: int | None) -> tuple[int, int]:
    if split is None:
        split = max(1, min(triton.cdiv(WAVES * num_sms(device), m_tiles_n_tiles), triton.cdiv(k, 4 * step)))
    return k_ranges(k, split, step)


def _launch_split(kernel, grid_tiles, x2, ops: Operands, bias, out, step, split, **meta):
    m, k = x2.shape
    n = out.shape[1]
    split, k_split = _split(grid_tiles, k, step, x2.device, split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x2.device) if split > 1 else out
    bn, bk = ops.block
    kernel[(grid_tiles, split)](
        x2, ops.codes, ops.high, ops.scale, bias if bias is not None else ops.scale, part, m, n, k, k_split,
        x2.stride(0), ops.codes.stride(0), ops.high.stride(0), ops.scale.stride(0), part.stride(-2),
        part.stride(0) if split > 1 else 0, BLOCK_BN=bn, BLOCK_BK=bk, BLOCK_K=step, HAS_BIAS=bias is not None,
        SPLIT=split > 1, W12=ops.w12, **meta)
    if split > 1:
        sum_partials(part, bias, out)


def gemv_fp8(x2, w, bias, out, split=None):
    ops = Operands.of(w)
    m, n = x2.shape[0], out.shape[1]
    block_m = next_pow2(m)
    step = _k_step(ops.block[1], 128 if block_m <= 2 else 32)  # the [BM, BN, BK] products stay ~32 a thread
    block_n = max(16, 4096 // (block_m * step))
    _launch_split(fp8_gemv_kernel, triton.cdiv(n, block_n), x2, ops, bias, out, step, split, BLOCK_M=block_m,
                  BLOCK_N=block_n)


def widen_fp8(x2, w, bias, out, split=None):
    ops = Operands.of(w)
    m, n = x2.shape[0], out.shape[1]
    small = interpreting(x2.device)
    block_m = min(next_pow2(m, 16), 16 if small else 64)
    block_n = 32 if small else 128
    step = _k_step(ops.block[1], 32 if small else 64 if ops.w12 else 128)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _launch_split(fp8_widen_kernel, tiles, x2, ops, bias, out, step, split, BLOCK_M=block_m, BLOCK_N=block_n,
                  GROUP_M=8)


def quantize_rows(x2: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x2 [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/group)]) with fp8_quant_rows_kernel."""
    m, k = x2.shape
    groups = triton.cdiv(k, group)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x2.device)
    block_r = 4 if interpreting(x2.device) else 16
    fp8_quant_rows_kernel[(triton.cdiv(m, block_r), groups)](x2, q, s, m, k, x2.stride(0), q.stride(0), s.stride(0),
                                                             GROUP=group, BLOCK_R=block_r)
    return q, s


def w8a8_fp8(x2, w, bias, out, config=None):
    m, k = x2.shape
    n = out.shape[1]
    bn, bk = w.block
    q, s = quantize_rows(x2, bk)
    small = interpreting(x2.device)
    cfg = dict(dict(BLOCK_M=16, BLOCK_N=32) if small else dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
               **(config or {}))
    bm, bnt = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    fp8_w8a8_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bnt),)](
        q, s, w.weight, w.scale_inv, bias if bias is not None else w.scale_inv, out, m, n, k, q.stride(0),
        s.stride(0), w.weight.stride(0), w.scale_inv.stride(0), out.stride(0), BLOCK_BN=bn, BLOCK_M=bm,
        BLOCK_N=bnt, BLOCK_K=bk, GROUP_M=8, HAS_BIAS=bias is not None, **cfg)


def chunked_fp8(x2, w, bias, out, cols=None):
    """out = x2 W^T (+ bias) through `cols`-row chunks of W widened into x's dtype, each multiplied by cuBLAS."""
    n, k = w.shape
    ops = Operands.of(w)
    bn, bk = ops.block
    cols = min(n, max(bn, (cols or CHUNK_COLS) // bn * bn))  # chunks start on scale blocks
    wd = torch.empty((cols, k), dtype=x2.dtype, device=x2.device)
    tn, tk = (16, 32) if interpreting(x2.device) else (32, 256)
    for a in range(0, n, cols):
        c = min(cols, n - a)
        part = ops.rows(a)
        fp8_dequant_kernel[(triton.cdiv(c, tn), triton.cdiv(k, tk))](
            part.codes, part.high, part.scale, wd, c, k, part.codes.stride(0), part.high.stride(0),
            part.scale.stride(0), wd.stride(0), BLOCK_BN=bn, BLOCK_BK=bk, BLOCK_N=tn, BLOCK_K=tk, W12=ops.w12)
        if bias is not None:
            torch.addmm(bias[a:a + c].to(x2.dtype), x2, wd[:c].t(), out=out[:, a:a + c])
        else:
            torch.mm(x2, wd[:c].t(), out=out[:, a:a + c])


def fp8_linear(x, w: FP8Weight | W12Weight, bias=None, config=None, tensor_cores: bool = True):
    """y = x W^T (+ bias) for an FP8Weight or W12Weight; config: {"kind": fma|dot|scaled_mm|w8a8 (FP8 only)|chunked,
    "split", "cols", tiles}."""
    return on_rows(x, w.out_features, lambda x2, out: _fp8_rows(x2, w, bias, out, config, tensor_cores))


def _fp8_rows(x2, w, bias, out, config, tensor_cores) -> None:
    """fp8_linear on 2-D rows into out (the paths by rows: module docstring)."""
    m = x2.shape[0]
    config = dict(config or {})
    kind = config.pop("kind", None) or fp8_kind(x2.device, m, w, tensor_cores)
    if kind == "scaled_mm" and x2.dtype == torch.float32:
        kind = "w8a8"  # torch's FP8 GEMM writes 16-bit outputs here
    if kind == "scaled_mm":
        if isinstance(w, W12Weight) or w.block != (128, 128):
            raise ValueError("fp8_linear: scaled_mm takes FP8 weights in 128 x 128 blocks")
        scaled_mm_fp8(x2, w, bias, out)
    elif kind == "fma":
        if m > SM70_GEMV_MAX_ROWS:
            raise ValueError(f"fp8_linear: the FMA GEMV takes at most {SM70_GEMV_MAX_ROWS} rows, not {m}")
        gemv_fp8(x2, w, bias, out, config.pop("split", None))
    elif kind == "dot":
        widen_fp8(x2, w, bias, out, config.pop("split", None))
    elif kind == "w8a8":
        if isinstance(w, W12Weight):
            raise ValueError("fp8_linear: W8A8 takes FP8 weights, not W12")
        w8a8_fp8(x2, w, bias, out, config)
    elif kind == "chunked":
        chunked_fp8(x2, w, bias, out, config.pop("cols", None))
    else:
        raise ValueError(f"fp8_linear: unknown kind {kind!r}: expected fma, dot, scaled_mm, w8a8 or chunked")


__all__ = ["FP8_MAX", "fp8_kind", "fp8_linear", "quantize_rows"]

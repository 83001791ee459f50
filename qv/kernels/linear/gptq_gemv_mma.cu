// GPTQ GEMV (8- or 4-bit codes) for a few rows (M <= 16) on tensor cores with mma.sync.m16n8k16 (sm_80 and newer).
// Compiled at run time by NVRTC through CuPy (cuda_sm90.py beside it); no CUDA headers needed.
//
// y[m, n] = sum_k x[m, k] (c[k, n] - z[G(k), n]) s[G(k), n] (+ bias[n]): codes c uint8 [K, N] row-major
// (BITS 8), or [K/2, N] with input 2r in the low nibble of byte row r and 2r + 1 in the high one (BITS 4);
// scale group G(k) = k / group size.
//
// The weight is the MMA's 16-row operand A (rows = output columns n) and x^T the 8-column operand B, so
// every weight byte costs under one instruction whatever M is. Each warp owns 128 output columns; per
// 16-row K step a lane loads 16 codes (one 16-byte load) from each of 4 consecutive rows, which is the
// A fragment of 8 MMAs once the K order inside the step is permuted: logical k 2t, 2t+1, 2t+8, 2t+9 of
// lane group t are rows 4t .. 4t+3 (x is read with the same permutation, so the sum is unchanged), and
// logical rows g, g+8 of MMA j are columns 16g + 2j, 16g + 2j + 1. Codes become fp16 1024 + c by byte
// permutes (0x64 as the high byte: 0.75 instructions a code); the 1024 + z offset leaves after the MMAs
// through the column sums of x, which one more MMA against a tile of ones gives per group. Per group
// (S steps of 16 rows) the fp32 MMA sums are scaled into the running result. bf16 rows of x go to fp16
// scaled per (row, group) by a power of two. Split-K over gridDim.y: partial sums in fp32, and the last
// block of each column range (a ticket) adds them up in split order (deterministic).

#include "../cuda_common.cuh"

// MT: 8-row tiles of x (M <= 8 * MT); S: 16-row steps per group (group size 16 * S); 4 warps a block,
// MIN_BLOCKS resident per SM (a register cap; 1: none). WK: warps along K. WK = 1: the 4 warps own
// 512 columns; WK = 4: they share 128 columns, warp w taking groups w, w + 4, ... of the block's K
// range, summed through shared memory at the end (4x the column blocks, for narrow outputs).
// BITS 4: a lane's rows 4t .. 4t+3 of a step are the nibbles of byte rows 2t, 2t+1 (two 16-byte loads,
// split by masks into the four code rows BITS 8 loads), so everything after the loads is shared.
//
// Registers of one MMA j (lane: groupID g = lane / 4, t = lane % 4; PTX's A elements a0..a7 are pairs):
//   a0 = {A[g][2t], A[g][2t+1]}     = codes of rows 4t, 4t+1 at column 16g + 2j      (t01: bytes 2j of q0, q1)
//   a1 = {A[g+8][2t], A[g+8][2t+1]} = codes of rows 4t, 4t+1 at column 16g + 2j + 1  (t01: bytes 2j + 1)
//   a2, a3: the same for rows 4t+2, 4t+3 (logical k 2t+8, 2t+9)                      (t23 from q2, q3)
//   b0 = {x[m][4t], x[m][4t+1]}, b1 = {x[m][4t+2], x[m][4t+3]} for x row m = 8 mt + g (one 8-byte load)
//   sum[0], [1] = column 16g + 2j, x rows 2t, 2t + 1; sum[2], [3] = column 16g + 2j + 1, the same rows
// prmt(a, b, sel) picks byte sel_i of {b:a} for result byte i: 0x5140 = [a0, b0, a1, b1] (0x7362 the
// upper halves); then 0x4140 = [t0, 0x64, t1, 0x64] and 0x4342 = [t2, 0x64, t3, 0x64]: two fp16 1024 + c.
__device__ __forceinline__ U4 low_nibbles(U4 v) {
  const u32 m = 0x0f0f0f0fu;
  return U4{v.x & m, v.y & m, v.z & m, v.w & m};
}
__device__ __forceinline__ U4 high_nibbles(U4 v) {
  const u32 m = 0x0f0f0f0fu;
  return U4{(v.x >> 4) & m, (v.y >> 4) & m, (v.z >> 4) & m, (v.w >> 4) & m};
}

template <int MT, int S, int MIN_BLOCKS, int WK, int BITS>
__global__ void __launch_bounds__(128, MIN_BLOCKS) gptq_gemv_mma(
    const u16* __restrict__ x, const u8* __restrict__ codes, const u16* __restrict__ scales,
    const u16* __restrict__ zeros, const u16* __restrict__ bias, float* __restrict__ part, u16* __restrict__ y,
    int* __restrict__ tickets, int M, int N, int K, int k_split, long long stride_xm, long long stride_qk,
    long long stride_sg, long long stride_ym, int x_bf16, int s_bf16, int has_zero, int has_bias) {
  static_assert(WK == 1 || WK == 4, "warps side by side (1) or all four along K (4)");
  static_assert(BITS == 8 || BITS == 4, "8-bit codes a byte, or two 4-bit codes a byte");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int warp = threadIdx.x >> 5;
  const int cols = 128 * (4 / WK);  // columns of a block
  const int n_warp = blockIdx.x * cols + (WK == 1 ? warp * 128 : 0);
  const int n_lane = n_warp + 16 * g;  // this lane's 16 columns: n_lane .. n_lane + 15
  const bool n_ok = n_lane < N;
  const int k_lo = blockIdx.y * k_split;
  const int k_hi = min(K, k_lo + k_split);
  const u32 HI64 = 0x64646464u;

  float acc[MT][8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;

  for (int k_group = k_lo + (WK == 1 ? 0 : warp * 16 * S); k_group < k_hi; k_group += 16 * S * WK) {
    // bf16 rows of x: the row's max over this group (rows 4t .. 4t+3 of each step, then across lanes t)
    float row_scale[MT], row_inv[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      row_scale[mt] = row_inv[mt] = 1.f;
      const int m = 8 * mt + g;
      if (x_bf16) {
        float amax = 0.f;
        if (m < M)
          for (int s = 0; s < S; ++s) {
            const U2 v = *reinterpret_cast<const U2*>(x + m * stride_xm + k_group + 16 * s + 4 * t);
            amax = fmaxf(amax, fmaxf(fmaxf(fabsf(bf16_to_float((u16)(v.x & 0xffffu))), fabsf(bf16_to_float((u16)(v.x >> 16)))),
                                     fmaxf(fabsf(bf16_to_float((u16)(v.y & 0xffffu))), fabsf(bf16_to_float((u16)(v.y >> 16))))));
          }
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        // the group max to (8192, 16384]: fp16 keeps both ends of a bf16 row (a max below 1e-30 is
        // treated as 1e-30, so the scale stays a normal fp32 and its inverse finite)
        row_scale[mt] = amax > 0.f ? exp2f(ceilf(log2f(fmaxf(amax, 1e-30f) * (1.f / 16384.f)))) : 1.f;
        row_inv[mt] = 1.f / row_scale[mt];
      }
    }

    float mma_sum[MT][8][4];  // this group's MMA sums (1024 + c against x)
    float xsum[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) xsum[mt][e] = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) mma_sum[mt][j][e] = 0.f;
    }
    // the group's scales are read after its MMAs: started into the L2 now, they arrive with the codes
    // rather than after them (a load into registers here would hold 8 more across the MMAs: spills)
    const int grp = k_group / (16 * S);
    if (n_ok) prefetch_l2(scales + grp * stride_sg + n_lane);
    const int rows_per_byte = 8 / BITS;
    const u8* p = codes + (long long)((k_group + 4 * t) / rows_per_byte) * stride_qk + n_lane;
#pragma unroll
    for (int s = 0; s < S; ++s) {
      U4 q0, q1, q2, q3;
      if (BITS == 8) {
        q0 = load16(p, n_ok), q1 = load16(p + stride_qk, n_ok);
        q2 = load16(p + 2 * stride_qk, n_ok), q3 = load16(p + 3 * stride_qk, n_ok);
      } else {
        const U4 q01 = load16(p, n_ok), q23 = load16(p + stride_qk, n_ok);
        q0 = low_nibbles(q01), q1 = high_nibbles(q01), q2 = low_nibbles(q23), q3 = high_nibbles(q23);
      }
      p += (16 / rows_per_byte) * stride_qk;
      u32 xb[MT][2];  // x^T fragments: rows 4t .. 4t+3 of the step for x row m = 8 mt + g, in fp16
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int m = 8 * mt + g;
        U2 v = {0u, 0u};
        if (m < M) v = *reinterpret_cast<const U2*>(x + m * stride_xm + k_group + 16 * s + 4 * t);
        if (x_bf16) {
          const float inv = row_inv[mt];
          v.x = pack_half2(bf16_to_float((u16)(v.x & 0xffffu)) * inv, bf16_to_float((u16)(v.x >> 16)) * inv);
          v.y = pack_half2(bf16_to_float((u16)(v.y & 0xffffu)) * inv, bf16_to_float((u16)(v.y >> 16)) * inv);
        }
        xb[mt][0] = v.x;
        xb[mt][1] = v.y;
      }
      const u32 w0[4] = {q0.x, q0.y, q0.z, q0.w}, w1[4] = {q1.x, q1.y, q1.z, q1.w};
      const u32 w2[4] = {q2.x, q2.y, q2.z, q2.w}, w3[4] = {q3.x, q3.y, q3.z, q3.w};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // columns 16g + 2j (A rows g) and 16g + 2j + 1 (A rows g + 8): bytes 2j, 2j + 1 of each row
        const u32 sel = (j & 1) ? 0x7362u : 0x5140u;
        const u32 t01 = prmt(w0[j >> 1], w1[j >> 1], sel), t23 = prmt(w2[j >> 1], w3[j >> 1], sel);
        const u32 a0 = prmt(t01, HI64, 0x4140u), a1 = prmt(t01, HI64, 0x4342u);
        const u32 a2 = prmt(t23, HI64, 0x4140u), a3 = prmt(t23, HI64, 0x4342u);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) mma(mma_sum[mt][j], a0, a1, a2, a3, xb[mt][0], xb[mt][1]);
      }
      const u32 ONES = 0x3c003c00u;  // column sums of x: A = 1
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) mma(xsum[mt], ONES, ONES, ONES, ONES, xb[mt][0], xb[mt][1]);
    }

    // acc += s (C - (1024 + z) sum_k x) r, for columns 16g + i and rows m = 2t, 2t + 1 (+ 8 mt)
    float sc[16], off[16];
    if (n_ok) {
      const U4* ps = reinterpret_cast<const U4*>(scales + grp * stride_sg + n_lane);
      const U4 s0 = ps[0], s1 = ps[1];
      const u32 sw[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        sc[2 * i] = to_float((u16)(sw[i] & 0xffffu), s_bf16);
        sc[2 * i + 1] = to_float((u16)(sw[i] >> 16), s_bf16);
      }
      if (has_zero) {
        const U4* pz = reinterpret_cast<const U4*>(zeros + grp * stride_sg + n_lane);
        const U4 z0 = pz[0], z1 = pz[1];
        const u32 zw[8] = {z0.x, z0.y, z0.z, z0.w, z1.x, z1.y, z1.z, z1.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          off[2 * i] = 1024.f + to_float((u16)(zw[i] & 0xffffu), s_bf16);
          off[2 * i + 1] = 1024.f + to_float((u16)(zw[i] >> 16), s_bf16);
        }
      } else {
#pragma unroll
        for (int i = 0; i < 16; ++i) off[i] = 1024.f + (1 << (BITS - 1));  // the middle code
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) sc[i] = off[i] = 0.f;
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // the row scales of rows 2t and 2t + 1 live in lanes 8t and 8t + 4 (groupID 2t, 2t + 1)
      const float r_lo = __shfl_sync(0xffffffffu, row_scale[mt], 8 * t);
      const float r_hi = __shfl_sync(0xffffffffu, row_scale[mt], 8 * t + 4);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc[mt][j][0] += sc[2 * j] * r_lo * (mma_sum[mt][j][0] - off[2 * j] * xsum[mt][0]);
        acc[mt][j][1] += sc[2 * j] * r_hi * (mma_sum[mt][j][1] - off[2 * j] * xsum[mt][1]);
        acc[mt][j][2] += sc[2 * j + 1] * r_lo * (mma_sum[mt][j][2] - off[2 * j + 1] * xsum[mt][0]);
        acc[mt][j][3] += sc[2 * j + 1] * r_hi * (mma_sum[mt][j][3] - off[2 * j + 1] * xsum[mt][1]);
      }
    }
  }

  if (WK > 1) {  // warp 0 adds up the other warps' sums (the same lane holds the same outputs)
    __shared__ float red[3][MT * 32][32];
    if (warp > 0)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) red[warp - 1][mt * 32 + 4 * j + e][lane] = acc[mt][j][e];
    __syncthreads();
    if (warp == 0)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 8; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[mt][j][e] += red[0][mt * 32 + 4 * j + e][lane] + red[1][mt * 32 + 4 * j + e][lane] +
                             red[2][mt * 32 + 4 * j + e][lane];
  }

  // rows m = 8 mt + 2t + h hold columns n_lane + i: acc[mt][i / 2][2 (i % 2) + h]
  const bool split = gridDim.y > 1;
  const bool writer = WK == 1 || warp == 0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int m = 8 * mt + 2 * t + h;
      if (m >= M || !n_ok || !writer) continue;
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) v[i] = acc[mt][i >> 1][2 * (i & 1) + h];
      if (split) {
        float* po = part + ((long long)blockIdx.y * M + m) * N + n_lane;
#pragma unroll
        for (int q = 0; q < 4; ++q)
          reinterpret_cast<float4*>(po)[q] = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
      } else {
        u32 o[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float lo = v[2 * i], hi = v[2 * i + 1];
          if (has_bias) {
            lo += to_float(bias[n_lane + 2 * i], x_bf16);
            hi += to_float(bias[n_lane + 2 * i + 1], x_bf16);
          }
          o[i] = (u32)float_to(lo, x_bf16) | ((u32)float_to(hi, x_bf16) << 16);
        }
        U4* py = reinterpret_cast<U4*>(y + m * stride_ym + n_lane);
        py[0] = U4{o[0], o[1], o[2], o[3]};
        py[1] = U4{o[4], o[5], o[6], o[7]};
      }
    }
  if (!split) return;

  // split-K: the last block of this column range sums every split's partials, in split order
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(tickets + blockIdx.x, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  const int n0 = blockIdx.x * cols, total = M * cols;
  const long long stride = (long long)M * N;
  // four outputs a thread at a time, eight splits deep: up to 32 loads in flight (this tail runs on one
  // block per column range, so it is latency-bound), each output summed in split order
  for (int i0 = threadIdx.x; i0 < total; i0 += 4 * blockDim.x) {
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
    const float* pp[4];
    bool ok[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int i = i0 + u * blockDim.x, m = i / cols, n = n0 + i % cols;
      ok[u] = i < total && n < N;
      pp[u] = part + (long long)m * N + n;
    }
#pragma unroll 8
    for (int sp = 0; sp < (int)gridDim.y; ++sp)
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (ok[u]) sum[u] += load_cg(pp[u] + sp * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (!ok[u]) continue;
      const int i = i0 + u * blockDim.x, m = i / cols, n = n0 + i % cols;
      if (has_bias) sum[u] += to_float(bias[n], x_bf16);
      y[m * stride_ym + n] = float_to(sum[u], x_bf16);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;  // zero again for the next launch (and graph replays)
}

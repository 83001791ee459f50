#pragma once
// What the m8n8k4 attention kernels (paged_decode_m884.cu, paged_prefill_m884.cu) share: attention over the
// paged KV cache (int8 codes with fp32 scales per key and KV head, or fp16) on Volta's tensor cores,
// mma.sync.aligned.m8n8k4 with fp16 inputs and fp32 accumulators, nothing newer (no ldmatrix, movmatrix,
// cp.async, cvt.f16x2 or bf16). cuda_build.source_text pastes this header into each .cu.
//
// m8n8k4 runs four independent 8x8x4 products a warp, one per quad pair qp = (lane >> 2) & 3 (lanes
// 4 qp .. 4 qp + 3 and the same + 16). In a quad pair, with t = lane & 3 and hi = lane >> 4 (PTX ISA,
// "Matrix Fragments for mma.m8n8k4 with .f16"):
//   A row-major:    a_i = A[t + 4 hi][i]            B column-major: b_i = B[i][t + 4 hi]
//   B row-major:    b_i = B[t][i + 4 hi]            C/D fp32:       c_i = C[(lane & 1) + (i & 2) + 4 hi]
//                                                                         [(i & 4) + (lane & 2) + (i & 1)]
// Both kernels give each warp 8 query rows (row r = token r / rep, q head kvh * rep + r % rep) and 32 keys a
// step, key n of the step on quad pair n / 8:
//   S = Q K^T (row.col): A = 8 query rows x 4 head dims (all quad pairs alike), B = K^T with column
//     t + 4 hi = key 8 qp + t + 4 hi, so a lane's B values are 4 consecutive dims of one key row.
//   O += P V (row.row): A = P, 8 rows x keys 4 ks .. 4 ks + 3 (all quad pairs alike, read back from the
//     warp's P tile in shared memory, since S leaves each key on one quad pair); B = V rows of those keys,
//     lane t holding key 4 ks + t; quad pair qp's 8 columns of MMA j are 8 head dims (decode_dim, prefill_dim).
// Codes become fp16 exactly (codes_to_half2); the K scale multiplies the scores and the V scale the
// probabilities, so the MMAs see the codes themselves. Scores are in base 2 (log2 e is in qk_scale).

#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu
constexpr int TILE = 32;      // keys of one warp step
constexpr int P_STRIDE = 40;  // halves a row of a warp's P tile (32 keys + 8: rows on distinct banks)

// lo, hi as one fp16 pair (lo in the low half), rounded to nearest (cvt.rn.f16x2.f32 needs sm_80)
__device__ __forceinline__ u32 halves(float lo, float hi) {
  u16 a, b;
  u32 r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(a) : "f"(lo));
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(b) : "f"(hi));
  asm("mov.b32 %0, {%1, %2};" : "=r"(r) : "h"(a), "h"(b));
  return r;
}
__device__ __forceinline__ u16 to_half(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

// d += A B on each quad pair: A row-major (a0 = rows' elements 0, 1; a1 = 2, 3), B column-major
__device__ __forceinline__ void mma_row_col(float (&d)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
               "{%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}
// d += A B on each quad pair: A row-major, B row-major (b0 = columns 0, 1 of the lane's row; b1 = 2, 3)
__device__ __forceinline__ void mma_row_row(float (&d)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
               "{%0,%1,%2,%3,%4,%5,%6,%7};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
               : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

template <bool INT8, int N>
__device__ __forceinline__ void quad(const u32 (&w)[N], int s, u32& lo, u32& hi) {
  if constexpr (INT8) {
    codes_to_half2(w[s], lo, hi);
  } else {
    lo = w[2 * s];
    hi = w[2 * s + 1];
  }
}

// S column i of this lane (see the C layout): key (i & 4) + (lane & 2) + (i & 1) of the quad pair's 8, row
// (lane & 1) + 2 e with e = (i >> 1) & 1 (+ 4 hi); c = 2 (i >> 2) + (i & 1) numbers the lane's 4 keys
__device__ __forceinline__ int key_of(int i, int lane) { return 8 * ((lane >> 2) & 3) + (i & 4) + (lane & 2) + (i & 1); }
__device__ __forceinline__ int key_slot(int i) { return 2 * (i >> 2) + (i & 1); }

// One 32-key step of the online softmax for this lane's two rows (row_a + 2 e, e = 0, 1): s holds the raw dot
// products (key k0 + key_of(i)); key n is seen by a row iff n < k_end and n <= the row's position. The
// probabilities, times the V scales, go to the warp's P tile [8][P_STRIDE] as fp16; acc is rescaled.
// m_run is each row's running maximum (the same in every lane of the row), l_run this lane's share of
// its sum (its own keys; the lanes' shares are added at the end).
template <int NJ>
__device__ __forceinline__ void softmax_step(float (&s)[8], const float (&kscale)[4], const float (&vscale)[4],
                                             int k0, int k_end, const int (&qpos)[2], float qk_scale,
                                             float (&acc)[NJ][8], float (&m_run)[2], float (&l_run)[2], u16* p_tile,
                                             int lane) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int key = k0 + key_of(i, lane);
    const bool seen = key < k_end && key <= qpos[(i >> 1) & 1];
    s[i] = seen ? s[i] * kscale[key_slot(i)] * qk_scale : NEG_INF;
  }
  float alpha[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float mx = fmaxf(fmaxf(s[2 * e], s[2 * e + 1]), fmaxf(s[2 * e + 4], s[2 * e + 5]));
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));  // the row's other keys: lane bits 1 (key bit 1)
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));  // and 2, 3 (the quad pair)
    mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
    const float m_new = fmaxf(m_run[e], mx);
    const float m_use = m_new == NEG_INF ? 0.f : m_new;  // a row that sees no key yet: keep exp2 finite
    alpha[e] = exp2f(m_run[e] - m_use);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int i = 2 * e + (c & 1) + 4 * (c >> 1);
      s[i] = exp2f(s[i] - m_use);
    }
    l_run[e] = l_run[e] * alpha[e] + (s[2 * e] + s[2 * e + 1]) + (s[2 * e + 4] + s[2 * e + 5]);
    m_run[e] = m_new;
  }
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] *= alpha[(i >> 1) & 1];
  const int row_a = (lane & 1) + 4 * (lane >> 4);
#pragma unroll
  for (int i = 0; i < 8; i += 2)  // values i, i + 1: one row, adjacent keys
    *reinterpret_cast<u32*>(p_tile + (row_a + (i & 2)) * P_STRIDE + key_of(i, lane)) =
        halves(s[i] * vscale[key_slot(i)], s[i + 1] * vscale[key_slot(i + 1)]);
}

// The 4 keys' A fragment of P (row t + 4 hi, keys 4 ks .. 4 ks + 3) from the warp's P tile
__device__ __forceinline__ U2 p_fragment(const u16* p_tile, int ks, int lane) {
  return *reinterpret_cast<const U2*>(p_tile + ((lane & 3) + 4 * (lane >> 4)) * P_STRIDE + 4 * ks);
}

// Chunked Gated DeltaNet prefill on Volta tensor cores: mma.sync.aligned.m8n8k4 (HMMA.884) with fp16 inputs
// and fp32 accumulators. Compiled at run time by NVRTC through CuPy (cuda_sm70.py beside it); no CUDA headers.
//
// Chunks of BT = 64 tokens, the math of triton_chunk.py in the WY form with W folded into the scan:
//   gdn_prep_m884 (chunk, value head): g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), the in-chunk
//     cumulative decay gc, k's inverse l2 norms rk, and Tb = (I + A)^-1 diag(beta) with
//     A[t][s] = beta_t exp(gc_t - gc_s) rk_t rk_s k_t.k_s (s < t): k k^T on the MMAs, the solve in fp32.
//   gdn_scan_m884 (sequence, value head, BV columns), sequential over the chunks: with H the state at the chunk
//     start, v_new = Tb (v - diag(exp(gc) rk) k H) and H <- exp(g_last) H + k^T diag(rk exp(g_last - gc)) v_new
//     (three MMA products a chunk); stores each chunk's start state and v_new (fp16) for the output kernel.
//   gdn_out_m884 (chunk, value head): o = scale (diag(exp(gc) rq) q H + P v_new) with
//     P[t][s] = rq_t rk_s exp(gc_t - gc_s) q_t.k_s (s <= t), rq q's inverse l2 norms.
// q and k enter the MMAs raw (fp16, as loaded); their norms scale the fp32 products instead. Exponents are
// always of non-positive differences. Rows past a sequence's end are zeros in every operand.
//
// The m8n8k4 fragments (PTX ISA, "Matrix Fragments for mma.m8n8k4 with .f16 floating point type"): a warp runs
// four independent 8x8x4 products, one per quad-pair p (lanes 4p..4p+3 and 4p+16..4p+19). With t the lane's
// index in its quad-pair (lane % 4, plus 4 for lanes >= 16):
//   A .row: a_i = A[t][i];  A .col: a_i = A[4 (t / 4) + i][t % 4]        (i = 0..3, two fp16 a register)
//   B .col: b_i = B[i][t];  B .row: b_i = B[t % 4][4 (t / 4) + i]
//   C/D (f32): c_i = C[(t & 1) + (i & 2) + 4 (t / 4)][(i & 1) + (t & 2) + (i & 4)]   (i = 0..7)
// Quad-pair p here computes the 8x8 block (p & 1, p >> 1) of a 16x16 tile, so one instruction is a 16x16x4
// product; every operand is read with one 8-byte load a lane (4 consecutive fp16 of a row in memory).

#include "../cuda_common.cuh"

constexpr int BT = 64;     // tokens a chunk
constexpr int WARPS = 4;   // warps a block
constexpr int THREADS = 32 * WARPS;
constexpr int PAD = 8;     // fp16 padding of shared rows (keeps 8-byte fragment loads aligned, spreads banks)

// fp32 -> fp16, round to nearest even (cuda_common's pack_half2 needs sm_80)
__device__ __forceinline__ u16 to_half(float f) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}

__host__ __device__ constexpr int tiles_per_warp(int tiles) { return (tiles + WARPS - 1) / WARPS; }

// d += a b on one 16x16x4 tile (A_ROW: A read as .row, else .col; B_COL: B read as .col, else .row)
#define MMA884(AL, BL)                                                                                        \
  asm volatile("mma.sync.aligned.m8n8k4." AL "." BL ".f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, "   \
               "{%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};"                                                        \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]) \
               : "r"(a.x), "r"(a.y), "r"(b.x), "r"(b.y))
template <bool A_ROW, bool B_COL>
__device__ __forceinline__ void mma884(float* d, U2 a, U2 b) {
  if constexpr (A_ROW && B_COL) MMA884("row", "col");
  else if constexpr (A_ROW) MMA884("row", "row");
  else if constexpr (B_COL) MMA884("col", "col");
  else MMA884("col", "row");
}
#undef MMA884

// A lane's place in a 16x16 tile: its quad-pair's 8x8 block and its index t in the quad-pair.
struct Frag {
  int lane, row8, col8, t;
  __device__ Frag() {
    lane = threadIdx.x & 31;
    const int p = (lane >> 2) & 3;
    row8 = 8 * (p & 1);
    col8 = 8 * (p >> 1);
    t = (lane & 3) + 4 * ((lane >> 4) & 1);
  }
  __device__ int row(int i) const { return row8 + (t & 1) + (i & 2) + 4 * (t >> 2); }  // of accumulator i
  __device__ int col(int i) const { return col8 + (i & 1) + (t & 2) + (i & 4); }
};

// acc[j] += (A B) on the 16x16 tiles tau = warp + WARPS j of a [16 TM x 16 TN] product over K (a multiple of 4):
// row tile tau / TN, column tile tau % TN. A (m, k) is a[m * lda + k] (A_ROW) or a[k * lda + m]; B (k, n) is
// b[n * ldb + k] (B_COL) or b[k * ldb + n]. B_ROWS: B rows k >= b_rows read as zeros (a global operand past the
// sequence's end; only for B read as .row, where a lane's four values share one k).
template <int TM, int TN, int K, bool A_ROW, bool B_COL, bool B_ROWS = false>
__device__ __forceinline__ void warp_mma(float (&acc)[tiles_per_warp(TM * TN)][8], const u16* a, long long lda,
                                         const u16* b, long long ldb, int b_rows = K) {
  static_assert(K % 4 == 0 && !(B_ROWS && B_COL), "K in steps of 4; row masks only for .row B");
  const Frag f;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < tiles_per_warp(TM * TN); ++j) {
    const int tau = warp + WARPS * j;
    if (tau < TM * TN) {
      const int m0 = 16 * (tau / TN) + f.row8, n0 = 16 * (tau % TN) + f.col8;
      const u16* pa = A_ROW ? a + (m0 + f.t) * lda : a + (f.t & 3) * lda + m0 + 4 * (f.t >> 2);
      const u16* pb = B_COL ? b + (n0 + f.t) * ldb : b + (f.t & 3) * ldb + n0 + 4 * (f.t >> 2);
#pragma unroll 4
      for (int k0 = 0; k0 < K; k0 += 4) {
        const U2 fa = *reinterpret_cast<const U2*>(A_ROW ? pa + k0 : pa + k0 * lda);
        U2 fb = {0u, 0u};
        if (!B_ROWS || k0 + (f.t & 3) < b_rows) fb = *reinterpret_cast<const U2*>(B_COL ? pb + k0 : pb + k0 * ldb);
        mma884<A_ROW, B_COL>(acc[j], fa, fb);
      }
    }
  }
}

// fn(j, i, row, column) for every accumulator element of this lane in the layout of warp_mma<TM, TN, ...>
template <int TM, int TN, class Fn>
__device__ __forceinline__ void for_each_acc(Fn&& fn) {
  const Frag f;
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < tiles_per_warp(TM * TN); ++j) {
    const int tau = warp + WARPS * j;
    if (tau < TM * TN) {
#pragma unroll
      for (int i = 0; i < 8; ++i) fn(j, i, 16 * (tau / TN) + f.row(i), 16 * (tau % TN) + f.col(i));
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(float (&acc)[N][8]) {
#pragma unroll
  for (int j = 0; j < N; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
}

// ROWS x W fp16 values of a row-major source (row r at src + r * stride) into dst[r * ld + c]; zeros at rows >= n
// or columns >= cols.
template <int ROWS, int W>
__device__ __forceinline__ void load_rows(u16* dst, int ld, const u16* src, long long stride, int n, int cols) {
  for (int idx = threadIdx.x; idx < ROWS * W; idx += THREADS) {
    const int r = idx / W, c = idx % W;
    dst[r * ld + c] = (r < n && c < cols) ? src[r * stride + c] : (u16)0;
  }
}

// The inverse l2 norms (eps 1e-6, as the reference) of the BT rows of a [BT][W] shared tile (two threads a
// row), 0 for rows >= n.
template <int W>
__device__ __forceinline__ void inverse_norms(float* out, const u16* x, int ld, int n) {
  const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
  float ss = 0.f;
  for (int c = half * (W / 2); c < (half + 1) * (W / 2); ++c) {
    const float v = half_to_float(x[r * ld + c]);
    ss += v * v;
  }
  ss += __shfl_xor_sync(0xffffffffu, ss, 1);
  if (half == 0) out[r] = r < n ? rsqrtf(ss + 1e-6f) : 0.f;
}

struct Chunk {
  long long bos;  // first row of the sequence
  int len, c0;    // its length; the chunk's first row within it (c0 >= len: no chunk, nothing to do)
};

// The sequence that owns virtual tile `tile` (sequence b owns tiles cu[b] / BT + b, ...: no host sync needed):
// the largest b with cu[b] / BT + b <= tile.
__device__ __forceinline__ Chunk chunk_of_tile(const int* cu, int tile, int n_seq) {
  int lo = 0, hi = n_seq - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] / BT + mid <= tile) lo = mid;
    else hi = mid - 1;
  }
  Chunk c;
  c.bos = cu[lo];
  c.len = cu[lo + 1] - cu[lo];
  c.c0 = (tile - (cu[lo] / BT + lo)) * BT;
  return c;
}

// Warp 0: beta and the cumulative decay gc of the chunk's rows (rows >= n: g = 0, beta = 0, so they carry the
// last decay), gc also stored for the scan and output kernels.
__device__ __forceinline__ void chunk_gates(float* gcs, float* betas, float* gc_out, const u16* a, const u16* b,
                                            long long stride_at, long long stride_bt, long long row0, int n,
                                            int hv, int HV, float a_log, float dt_bias) {
  const int lane = threadIdx.x & 31;
  const float neg_A = -expf(a_log);
  float g[2], beta[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = 2 * lane + j;
    g[j] = beta[j] = 0.f;
    if (r < n) {
      const float x = half_to_float(a[(row0 + r) * stride_at + hv]) + dt_bias;
      g[j] = neg_A * (x > 20.f ? x : log1pf(expf(x)));  // softplus, threshold 20 as torch
      beta[j] = 1.f / (1.f + expf(-half_to_float(b[(row0 + r) * stride_bt + hv])));
    }
  }
  float incl = g[0] + g[1];  // inclusive scan of the pair sums over the lanes
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += y;
  }
  const float gc0 = incl - g[1];
  gcs[2 * lane] = gc0;
  gcs[2 * lane + 1] = incl;
  betas[2 * lane] = beta[0];
  betas[2 * lane + 1] = beta[1];
  if (2 * lane < n) gc_out[(row0 + 2 * lane) * HV + hv] = gc0;
  if (2 * lane + 1 < n) gc_out[(row0 + 2 * lane + 1) * HV + hv] = incl;
}

// Per (chunk, value head): gc, rk [T, HV] (fp32) and Tb [T, HV, BT] (fp16, rows of the chunk; zeros above the
// diagonal). BK: k's head dim padded to a multiple of 16.
template <int BK>
__global__ void __launch_bounds__(THREADS) gdn_prep_m884(
    const u16* __restrict__ k, const u16* __restrict__ a, const u16* __restrict__ b, const float* __restrict__ a_log,
    const float* __restrict__ dt_bias, const int* __restrict__ cu, u16* __restrict__ tb, float* __restrict__ gc_out,
    float* __restrict__ rk_out, int n_seq, int HV, int rep, int DK, long long stride_kt, long long stride_kh,
    long long stride_at, long long stride_bt) {
  static_assert(BK % 16 == 0, "BK in 16-column steps");
  __shared__ __align__(16) u16 ks[BT][BK + PAD];
  __shared__ float am[BT][BT + 1];  // A below the diagonal; the solve writes T's transpose above it
  __shared__ float gcs[BT], betas[BT], rks[BT];
  const Chunk ch = chunk_of_tile(cu, blockIdx.x, n_seq);
  if (ch.c0 >= ch.len) return;
  const int hv = blockIdx.y, hk = hv / rep, n = min(BT, ch.len - ch.c0);
  const long long row0 = ch.bos + ch.c0;
  load_rows<BT, BK>(&ks[0][0], BK + PAD, k + row0 * stride_kt + hk * stride_kh, stride_kt, n, DK);
  if (threadIdx.x < 32) chunk_gates(gcs, betas, gc_out, a, b, stride_at, stride_bt, row0, n, hv, HV, a_log[hv],
                                    dt_bias[hv]);
  __syncthreads();
  inverse_norms<BK>(rks, &ks[0][0], BK + PAD, n);
  float kk[tiles_per_warp(16)][8];
  zero(kk);
  warp_mma<BT / 16, BT / 16, BK, true, true>(kk, &ks[0][0], BK + PAD, &ks[0][0], BK + PAD);  // k k^T
  __syncthreads();
  if (threadIdx.x < BT) {
    const int r = threadIdx.x;
    if (r < n) rk_out[(row0 + r) * HV + hv] = rks[r];
  }
  for_each_acc<BT / 16, BT / 16>([&](int j, int i, int r, int s) {
    if (s < r) am[r][s] = kk[j][i] * betas[r] * rks[r] * rks[s] * expf(gcs[r] - gcs[s]);
  });
  __syncthreads();
  // T = (I + A)^-1 column by column (thread c: column c), each a forward substitution in fp32:
  // T[r][c] = -(A[r][c] + sum_{c < s < r} A[r][s] T[s][c]); T[s][c] (s > c) lives at am[c][s], which only
  // thread c touches, so the columns need no barrier between them.
  if (threadIdx.x < BT) {
    const int c = threadIdx.x;
    for (int r = c + 1; r < BT; ++r) {
      float x = am[r][c];
      for (int s = c + 1; s < r; ++s) x = fmaf(am[r][s], am[c][s], x);
      am[c][r] = -x;
    }
  }
  __syncthreads();
  // Tb[r][c] = T[r][c] beta_c (T[r][r] = 1), two columns a thread
  u16* out = tb + (row0 * HV + hv) * BT;
  for (int idx = threadIdx.x; idx < n * (BT / 2); idx += THREADS) {
    const int r = idx / (BT / 2), c = 2 * (idx % (BT / 2));
    const float t0 = c < r ? am[c][r] : (c == r ? 1.f : 0.f);
    const float t1 = c + 1 < r ? am[c + 1][r] : (c + 1 == r ? 1.f : 0.f);
    *reinterpret_cast<u32*>(out + (long long)r * HV * BT + c) =
        (u32)to_half(t0 * betas[c]) | ((u32)to_half(t1 * betas[c + 1]) << 16);
  }
}

// The state pool's encodings (state_kind): fp32, fp16, int16 codes times one fp32 scale per (slot, head, column)
constexpr int STATE_F32 = 0, STATE_F16 = 1, STATE_I16 = 2;

// The state tile [BK x BV] (columns col0 ..) of a slot into the accumulators (zeros past DK and DV).
template <int TM, int TN>
__device__ __forceinline__ void load_state(float (&h)[tiles_per_warp(TM * TN)][8], const void* state,
                                           const float* scales, long long base, long long stride_k,
                                           long long scale_base, int col0, int DK, int DV, int kind) {
  for_each_acc<TM, TN>([&](int j, int i, int r, int c) {
    float x = 0.f;
    if (r < DK && col0 + c < DV) {
      const long long p = base + r * stride_k + col0 + c;
      if (kind == STATE_F32) x = static_cast<const float*>(state)[p];
      else if (kind == STATE_F16) x = half_to_float(static_cast<const u16*>(state)[p]);
      else x = (float)static_cast<const short*>(state)[p] * scales[scale_base + col0 + c];
    }
    h[j][i] = x;
  });
}

// The accumulators into the slot; int16: scale = max_k |H[k][c]| / 32767 (at least 1e-30 / 32767) and codes
// rounded half to even, as reference.store_state. colmax: BV floats of shared memory. All threads call it.
template <int TM, int TN>
__device__ __forceinline__ void store_state(const float (&h)[tiles_per_warp(TM * TN)][8], void* state,
                                            float* scales, long long base, long long stride_k, long long scale_base,
                                            int col0, int DK, int DV, int kind, float* colmax) {
  if (kind == STATE_I16) {
    if (threadIdx.x < 16 * TN) colmax[threadIdx.x] = 0.f;
    __syncthreads();
    // non-negative floats order as their bit patterns do
    for_each_acc<TM, TN>([&](int j, int i, int r, int c) {
      if (r < DK) atomicMax(reinterpret_cast<int*>(colmax + c), __float_as_int(fabsf(h[j][i])));
    });
    __syncthreads();
  }
  for_each_acc<TM, TN>([&](int j, int i, int r, int c) {
    if (r >= DK || col0 + c >= DV) return;
    const long long p = base + r * stride_k + col0 + c;
    if (kind == STATE_F32) static_cast<float*>(state)[p] = h[j][i];
    else if (kind == STATE_F16) static_cast<u16*>(state)[p] = to_half(h[j][i]);
    else {
      const float sc = __fdiv_rn(fmaxf(colmax[c], 1e-30f), 32767.f);
      const float code = fminf(fmaxf(rintf(__fdiv_rn(h[j][i], sc)), -32767.f), 32767.f);
      static_cast<short*>(state)[p] = (short)code;
    }
  });
  if (kind == STATE_I16 && threadIdx.x < 16 * TN && col0 + (int)threadIdx.x < DV)
    scales[scale_base + col0 + threadIdx.x] = __fdiv_rn(fmaxf(colmax[threadIdx.x], 1e-30f), 32767.f);
}

// Per (sequence, value head, BV state columns), over the sequence's chunks in order. Stores each chunk's start
// state into h_all [tiles, HV, BK, dv_pad] and v_new into vnew [T, HV, dv_pad] (fp16), the final state into
// its slot.
template <int BK, int BV>
__global__ void __launch_bounds__(THREADS) gdn_scan_m884(
    const u16* __restrict__ k, const u16* __restrict__ v, const u16* __restrict__ tb, const float* __restrict__ gc,
    const float* __restrict__ rk, u16* __restrict__ vnew, u16* __restrict__ h_all, void* __restrict__ state,
    float* __restrict__ scales, const int* __restrict__ cu, const long long* __restrict__ slots,
    const u8* __restrict__ init, int HV, int rep, int DK, int DV, int dv_pad, long long stride_kt,
    long long stride_kh, long long stride_vt, long long stride_vh, long long stride_ss, long long stride_sh,
    long long stride_sk, long long stride_cs, long long stride_ch, int state_kind) {
  static_assert(BK % 16 == 0 && BV % 16 == 0, "16-row tiles");
  constexpr int TM = BK / 16, TN = BV / 16;
  __shared__ __align__(16) u16 ks[BT][BK + PAD];  // the chunk's raw k rows
  __shared__ __align__(16) u16 hs[BK][BV + PAD];  // H at the chunk start (fp16)
  __shared__ __align__(16) u16 xs[BT][BV + PAD];  // v - diag(exp(gc) rk) k H, then the scaled v_new
  __shared__ __align__(16) u16 ts[BT][BT + PAD];  // Tb
  __shared__ float gcs[BT], rks[BT];
  const int i_b = blockIdx.x, hv = blockIdx.y, col0 = blockIdx.z * BV, hk = hv / rep;
  const long long bos = cu[i_b];
  const int len = cu[i_b + 1] - cu[i_b], vt0 = cu[i_b] / BT + i_b;
  const long long slot = slots[i_b];
  const long long state_base = slot * stride_ss + hv * stride_sh, scale_base = slot * stride_cs + hv * stride_ch;
  float h[tiles_per_warp(TM * TN)][8];
  if (init[i_b]) load_state<TM, TN>(h, state, scales, state_base, stride_sk, scale_base, col0, DK, DV, state_kind);
  else zero(h);  // a slot without a state may hold anything (NaN included): never read
  for (int c0 = 0; c0 < len; c0 += BT) {
    const int n = min(BT, len - c0);
    const long long row0 = bos + c0;
    const float g_last = gc[(row0 + n - 1) * HV + hv];
    __syncthreads();  // the last chunk's products are done with the shared tiles
    load_rows<BT, BK>(&ks[0][0], BK + PAD, k + row0 * stride_kt + hk * stride_kh, stride_kt, n, DK);
    load_rows<BT, BT>(&ts[0][0], BT + PAD, tb + (row0 * HV + hv) * BT, (long long)HV * BT, n, BT);
    if (threadIdx.x < BT) {
      const int r = threadIdx.x;
      gcs[r] = r < n ? gc[(row0 + r) * HV + hv] : g_last;
      rks[r] = r < n ? rk[(row0 + r) * HV + hv] : 0.f;
    }
    u16* h_out = h_all + ((long long)(vt0 + c0 / BT) * HV + hv) * BK * dv_pad + col0;
    for_each_acc<TM, TN>([&](int j, int i, int r, int c) {
      const u16 x = to_half(h[j][i]);
      hs[r][c] = x;
      h_out[(long long)r * dv_pad + c] = x;
    });
    __syncthreads();
    float x[tiles_per_warp(4 * TN)][8];
    zero(x);
    warp_mma<BT / 16, TN, BK, true, false>(x, &ks[0][0], BK + PAD, &hs[0][0], BV + PAD);  // k H
    const u16* v_rows = v + row0 * stride_vt + hv * stride_vh + col0;
    for_each_acc<BT / 16, TN>([&](int j, int i, int t, int c) {
      const float vt = t < n && col0 + c < DV ? half_to_float(v_rows[t * stride_vt + c]) : 0.f;
      xs[t][c] = to_half(vt - expf(gcs[t]) * rks[t] * x[j][i]);
    });
    __syncthreads();
    float vn[tiles_per_warp(4 * TN)][8];
    zero(vn);
    warp_mma<BT / 16, TN, BT, true, false>(vn, &ts[0][0], BT + PAD, &xs[0][0], BV + PAD);  // v_new = Tb X
    __syncthreads();  // every warp has read xs
    u16* vn_rows = vnew + (row0 * HV + hv) * dv_pad + col0;
    for_each_acc<BT / 16, TN>([&](int j, int i, int t, int c) {
      if (t < n) vn_rows[(long long)t * HV * dv_pad + c] = to_half(vn[j][i]);
      xs[t][c] = to_half(vn[j][i] * rks[t] * expf(g_last - gcs[t]));
    });
    __syncthreads();
    const float decay = expf(g_last);
    for_each_acc<TM, TN>([&](int j, int i, int, int) { h[j][i] *= decay; });
    warp_mma<TM, TN, BT, false, false>(h, &ks[0][0], BK + PAD, &xs[0][0], BV + PAD);  // H += k^T (scaled v_new)
  }
  __syncthreads();  // gcs is reused below
  store_state<TM, TN>(h, state, scales, state_base, stride_sk, scale_base, col0, DK, DV, state_kind, gcs);
}

// Per (chunk, value head): the output rows of the chunk, BV columns at a time, from the scan's chunk-start
// state and v_new (fp16, read as MMA operands straight from global memory).
template <int BK, int BV>
__global__ void __launch_bounds__(THREADS) gdn_out_m884(
    const u16* __restrict__ q, const u16* __restrict__ k, const u16* __restrict__ vnew,
    const u16* __restrict__ h_all, const float* __restrict__ gc, const float* __restrict__ rk, u16* __restrict__ o,
    const int* __restrict__ cu, int n_seq, int HV, int rep, int DK, int DV, int dv_pad, float scale,
    long long stride_qt, long long stride_qh, long long stride_kt, long long stride_kh, long long stride_ot,
    long long stride_oh) {
  static_assert(BK % 16 == 0 && BV % 16 == 0, "16-row tiles");
  constexpr int TN = BV / 16;
  __shared__ __align__(16) u16 qs[BT][BK + PAD];
  __shared__ __align__(16) u16 ks[BT][BK + PAD];
  __shared__ __align__(16) u16 ps[BT][BT + PAD];  // P (fp16)
  __shared__ float gcs[BT], rqs[BT], rks[BT];
  const int tile = blockIdx.x;
  const Chunk ch = chunk_of_tile(cu, tile, n_seq);
  if (ch.c0 >= ch.len) return;
  const int hv = blockIdx.y, hk = hv / rep, n = min(BT, ch.len - ch.c0);
  const long long row0 = ch.bos + ch.c0;
  const float g_last = gc[(row0 + n - 1) * HV + hv];
  load_rows<BT, BK>(&qs[0][0], BK + PAD, q + row0 * stride_qt + hk * stride_qh, stride_qt, n, DK);
  load_rows<BT, BK>(&ks[0][0], BK + PAD, k + row0 * stride_kt + hk * stride_kh, stride_kt, n, DK);
  if (threadIdx.x < BT) {
    const int r = threadIdx.x;
    gcs[r] = r < n ? gc[(row0 + r) * HV + hv] : g_last;
    rks[r] = r < n ? rk[(row0 + r) * HV + hv] : 0.f;
  }
  __syncthreads();
  inverse_norms<BK>(rqs, &qs[0][0], BK + PAD, n);
  float s[tiles_per_warp(16)][8];
  zero(s);
  warp_mma<BT / 16, BT / 16, BK, true, true>(s, &qs[0][0], BK + PAD, &ks[0][0], BK + PAD);  // q k^T
  __syncthreads();
  for_each_acc<BT / 16, BT / 16>([&](int j, int i, int t, int c) {
    ps[t][c] = to_half(c <= t ? s[j][i] * rqs[t] * rks[c] * expf(gcs[t] - gcs[c]) : 0.f);
  });
  __syncthreads();
  const u16* h_tile = h_all + ((long long)tile * HV + hv) * BK * dv_pad;
  const u16* vn_rows = vnew + (row0 * HV + hv) * dv_pad;
  for (int cb = 0; cb < dv_pad; cb += BV) {
    float acc[tiles_per_warp(4 * TN)][8];
    zero(acc);
    warp_mma<BT / 16, TN, BK, true, false>(acc, &qs[0][0], BK + PAD, h_tile + cb, dv_pad);  // q H
    for_each_acc<BT / 16, TN>([&](int j, int i, int t, int) { acc[j][i] *= expf(gcs[t]) * rqs[t]; });
    // + P v_new (rows of v_new past the sequence's end read as zeros)
    warp_mma<BT / 16, TN, BT, true, false, true>(acc, &ps[0][0], BT + PAD, vn_rows + cb, (long long)HV * dv_pad, n);
    for_each_acc<BT / 16, TN>([&](int j, int i, int t, int c) {
      if (t < n && cb + c < DV) o[(row0 + t) * stride_ot + hv * stride_oh + cb + c] = to_half(acc[j][i] * scale);
    });
  }
}

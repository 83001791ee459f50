// Attention over the paged KV cache (int8 codes with fp32 scales per key and KV head, or fp16) on Volta's
// tensor cores: mma.sync.aligned.m8n8k4 with fp16 inputs and fp32 accumulators, nothing newer (no
// ldmatrix, movmatrix, cp.async, cvt.f16x2 or bf16). Compiled at run time by NVRTC through CuPy
// (cuda_sm70.py beside it), for sm_70 and, to prove it on newer GPUs, anything later.
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
//     lane t holding key 4 ks + t; quad pair qp's 8 columns of MMA j are 8 head dims (see dim_of).
// Codes become fp16 exactly (codes_to_half2); the K scale multiplies the scores and the V scale the
// probabilities, so the MMAs see the codes themselves. Scores are in base 2 (log2 e is in qk_scale).

#include "../cuda_common.cuh"

#define NEG_INF __int_as_float(0xff800000)
#define FULL_MASK 0xffffffffu
constexpr int TILE = 32;      // keys of one warp step
constexpr int P_STRIDE = 40;  // halves a row of a warp's P tile (32 keys + 8: rows on distinct banks)
constexpr int DECODE_WARPS = 4;
constexpr int PREFILL_WARPS = 8;
constexpr int PREFILL_ROWS = 8 * PREFILL_WARPS;

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

// N words (4 N bytes) at p through the read-only cache, or zeros where !ok (p aligned to the widest
// vector that N allows: 16 bytes for N % 4 == 0, 8 for N % 2 == 0)
template <int N>
__device__ __forceinline__ void load_words(u32 (&w)[N], const u8* p, bool ok) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      U4 v = {0u, 0u, 0u, 0u};
      if (ok) v = *reinterpret_cast<const U4*>(p + 16 * i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (N % 2 == 0) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      U2 v = {0u, 0u};
      if (ok) v = *reinterpret_cast<const U2*>(p + 8 * i);
      w[2 * i] = v.x, w[2 * i + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = ok ? reinterpret_cast<const u32*>(p)[i] : 0u;
  }
}

// Elements 4 s .. 4 s + 3 of loaded cache words as two fp16 pairs: int8 codes (word s) or fp16 (words 2 s, 2 s + 1)
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

// ---------------------------------------------------------------------------------------------------------
// Decode and speculative rows: block (sequence b, chunk of 8 query rows, KV head, split) of 4 warps; warp w
// takes the 32-key tiles w, w + 4, ... of keys split * split_len .. + split_len, loading K and V from the
// cache straight into fragments: lane L finds key k0 + L's page, the others get its offset by shuffle.
//   K: lane (qp, t, hi) loads the whole row of key 8 qp + t + 4 hi (its S column).
//   V: lane (qp, t, hi) loads, for each ks, dims (2 qp + hi) D / 8 .. + D / 8 of key 4 ks + t; MMA j takes
//      dims + 4 j .. + 4 j + 3 of them, so column n of quad pair qp in MMA j is head dim
//      (2 qp + n / 4) D / 8 + 4 j + n % 4 (decode_dim).
// The 4 warps' partial softmaxes meet in shared memory. With one split the block writes the output (fp16);
// with more, fp32 partials [splits, T, HQ, D] and their base-2 log-sum-exps [splits, T, HQ], which
// combine_splits merges.
__device__ __forceinline__ int decode_dim(int D, int j, int i, int lane) {
  return (2 * ((lane >> 2) & 3) + (i >> 2)) * (D / 8) + 4 * j + (lane & 2) + (i & 1);
}

// q: [T, HQ, D] fp16; caches [pages, BS, HKV, D] (strides in elements) int8 with scales [pages, BS, HKV] fp32
// (head stride 1), or fp16; block_tables [B, bt_cols]; BS = 2^page_shift.
template <int D, bool INT8>
__global__ void __launch_bounds__(32 * DECODE_WARPS, 2) paged_decode_m884(
    const u16* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc, const float* __restrict__ ks,
    const float* __restrict__ vs, u16* __restrict__ out, float* __restrict__ part, float* __restrict__ lse,
    const int* __restrict__ block_tables, const int* __restrict__ cu_q, const int* __restrict__ kv_lens,
    float qk_scale, int T, int HQ, int rep, long long stride_qt, long long stride_qh, long long stride_ot,
    long long stride_oh, long long stride_kb, long long stride_ks, long long stride_kh, long long stride_sb,
    long long stride_ss, long long stride_bt, int page_shift, int split_len, int chunks, int bt_cols, int n_pages) {
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dims 32 .. 256, multiples of 32");
  constexpr int EB = INT8 ? 1 : 2;               // bytes an element
  constexpr int ROW_WORDS = D * EB / 4;          // words of a key row
  constexpr int SLICE_WORDS = D / 8 * EB / 4;    // words of a lane's eighth of a value row
  constexpr int NJ = D / 32;                     // P V MMAs a 4-key step
  const int b = blockIdx.x / chunks, r0 = 8 * (blockIdx.x % chunks), kvh = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = lane & 3, qp = (lane >> 2) & 3, hi = lane >> 4, row_a = (lane & 1) + 4 * hi;
  const int q_start = cu_q[b], q_len = cu_q[b + 1] - q_start, kv_len = kv_lens[b];
  const int k_lo = split * split_len, k_end = min(kv_len, k_lo + split_len);
  const int rows = min(8, q_len * rep - r0);  // this block's query rows r0 .. r0 + rows - 1
  if (rows <= 0 || k_lo >= k_end) return;

  __shared__ __align__(16) u16 s_q[8][D + 4];  // +4: the 8 rows' fragments on distinct banks
  __shared__ __align__(16) u16 s_p[DECODE_WARPS][8][P_STRIDE];
  __shared__ float s_o[8][D];
  __shared__ float s_m[DECODE_WARPS][8], s_l[DECODE_WARPS][8], s_w[DECODE_WARPS][8], s_inv[8], s_lse[8];
  for (int i = threadIdx.x; i < 8 * (D / 4); i += blockDim.x) {
    const int r = i / (D / 4), g = i % (D / 4), row = r0 + r;
    U2 v = {0u, 0u};  // padding rows: zeros
    if (r < rows)
      v = *reinterpret_cast<const U2*>(q + (long long)(q_start + row / rep) * stride_qt +
                                       (long long)(kvh * rep + row % rep) * stride_qh + 4 * g);
    *reinterpret_cast<U2*>(&s_q[r][4 * g]) = v;
  }
  int qpos[2];  // positions of this lane's rows row_a, row_a + 2; padding rows see no key
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = row_a + 2 * e;
    qpos[e] = r < rows ? kv_len - q_len + (r0 + r) / rep : -1;
  }
  __syncthreads();

  float acc[NJ][8];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
  const int* bt = block_tables + (long long)b * stride_bt;
  const int page_mask = (1 << page_shift) - 1;
  const int n_tiles = (k_end - k_lo + TILE - 1) / TILE;
  const u8* k_slice = kc;
  const u8* v_slice = vc + (2 * qp + hi) * (D / 8) * EB;
  u16* p_tile = &s_p[warp][0][0];
  for (int tile = warp; tile < n_tiles; tile += DECODE_WARPS) {
    const int k0 = k_lo + TILE * tile, key = k0 + lane;
    long long off = -1;  // byte offset of key k0 + lane's row in the caches, -1 past k_end
    float k_sc = 0.f, v_sc = 0.f;
    if (key < k_end) {
      const int page = min(max(bt[min(key >> page_shift, bt_cols - 1)], 0), n_pages - 1);
      off = ((long long)page * stride_kb + (long long)(key & page_mask) * stride_ks + (long long)kvh * stride_kh) * EB;
      if constexpr (INT8) {
        const long long soff = (long long)page * stride_sb + (long long)(key & page_mask) * stride_ss + kvh;
        k_sc = ks[soff];
        v_sc = vs[soff];
      }
    }
    u32 kw[ROW_WORDS];
    const long long k_off = __shfl_sync(FULL_MASK, off, 8 * qp + t + 4 * hi);
    load_words(kw, k_slice + k_off, k_off >= 0);
    u32 vw[TILE / 4][SLICE_WORDS];
    auto load_v = [&]() {
#pragma unroll
      for (int kstep = 0; kstep < TILE / 4; ++kstep) {
        const long long v_off = __shfl_sync(FULL_MASK, off, 4 * kstep + t);
        load_words(vw[kstep], v_slice + v_off, v_off >= 0);
      }
    };
    // int8: V's bytes travel during the S MMAs; fp16 rows are twice as many registers, and the K and V of a
    // tile together would spill at D = 256: V loads once the K registers are free (the SM's other warps
    // keep the memory busy meanwhile)
    if constexpr (INT8 || D < 256) load_v();
    float kscale[4], vscale[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int src = 8 * qp + (lane & 2) + 4 * (c >> 1) + (c & 1);  // key_of(i) for key_slot(i) == c
      kscale[c] = INT8 ? __shfl_sync(FULL_MASK, k_sc, src) : 1.f;
      vscale[c] = INT8 ? __shfl_sync(FULL_MASK, v_sc, src) : 1.f;
    }
    float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int st = 0; st < D / 4; ++st) {
      const U2 a = *reinterpret_cast<const U2*>(&s_q[t + 4 * hi][4 * st]);
      u32 b0, b1;
      quad<INT8>(kw, st, b0, b1);
      mma_row_col(s, a.x, a.y, b0, b1);
    }
    if constexpr (!(INT8 || D < 256)) {
      asm volatile("" ::: "memory");  // (keeps the compiler from hoisting the loads above the MMAs)
      load_v();
    }
    softmax_step(s, kscale, vscale, k0, k_end, qpos, qk_scale, acc, m_run, l_run, p_tile, lane);
    __syncwarp();
#pragma unroll
    for (int kstep = 0; kstep < TILE / 4; ++kstep) {
      const U2 a = p_fragment(p_tile, kstep, lane);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        u32 b0, b1;
        quad<INT8>(vw[kstep], j, b0, b1);
        mma_row_row(acc[j], a.x, a.y, b0, b1);
      }
    }
    __syncwarp();  // the P tile is read before the next step writes it
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(FULL_MASK, l_run[e], 2);
    l_run[e] += __shfl_xor_sync(FULL_MASK, l_run[e], 4);
    l_run[e] += __shfl_xor_sync(FULL_MASK, l_run[e], 8);
  }

  if ((lane & 14) == 0)  // lanes 0, 1, 16, 17 hold rows 0 .. 7 between them
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s_m[warp][row_a + 2 * e] = m_run[e];
      s_l[warp][row_a + 2 * e] = l_run[e];
    }
  __syncthreads();
  if (threadIdx.x < 8) {
    const int r = threadIdx.x;
    float m = NEG_INF;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) m = fmaxf(m, s_m[w][r]);
    const float m_use = m == NEG_INF ? 0.f : m;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < DECODE_WARPS; ++w) {
      s_w[w][r] = exp2f(s_m[w][r] - m_use);
      l += s_l[w][r] * s_w[w][r];
    }
    s_inv[r] = l > 0.f ? 1.f / l : 0.f;
    s_lse[r] = l > 0.f ? m_use + log2f(l) : NEG_INF;
  }
  __syncthreads();
  for (int w = 0; w < DECODE_WARPS; ++w) {  // the warps add their weighted outputs in turn (a fixed order)
    if (warp == w)
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int r = row_a + (i & 2);
          float* o = &s_o[r][decode_dim(D, j, i, lane)];
          const float v = acc[j][i] * s_w[w][r];
          *o = w == 0 ? v : *o + v;
        }
    __syncthreads();
  }
  const bool partial = gridDim.z > 1;
  for (int i = threadIdx.x; i < rows * D; i += blockDim.x) {
    const int r = i / D, d = i % D, row = r0 + r;
    const long long tok = q_start + row / rep, h = (long long)kvh * rep + row % rep;
    const float v = s_o[r][d] * s_inv[r];
    if (partial) {
      part[(((long long)split * T + tok) * HQ + h) * D + d] = v;
      if (d == 0) lse[((long long)split * T + tok) * HQ + h] = s_lse[r];
    } else {
      out[tok * stride_ot + h * stride_oh + d] = to_half(v);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------
// The split-K partials of token blockIdx.x, head blockIdx.y merged into the fp16 output: split s holds keys
// s * split_len .. and is used by a row iff its position reaches it (never past the n_splits written).
template <int D>
__global__ void __launch_bounds__(64) combine_splits(const float* __restrict__ part, const float* __restrict__ lse,
                                                      u16* __restrict__ out, const int* __restrict__ cu_q,
                                                      const int* __restrict__ kv_lens, int B, int T, int HQ,
                                                      long long stride_ot, long long stride_oh, int split_len,
                                                      int n_splits) {
  const int tok = blockIdx.x, h = blockIdx.y;
  int lo = 0, hi = B - 1;  // the sequence of tok: the last b with cu_q[b] <= tok
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_q[mid] <= tok) lo = mid;
    else hi = mid - 1;
  }
  const int q_start = cu_q[lo], q_len = cu_q[lo + 1] - q_start;
  const int qpos = kv_lens[lo] - q_len + (tok - q_start);
  const int n = max(1, min(qpos / split_len + 1, n_splits));
  const long long row = (long long)tok * HQ + h, split_stride = (long long)T * HQ;
  float m = NEG_INF;
  for (int s = 0; s < n; ++s) m = fmaxf(m, lse[s * split_stride + row]);
  const float m_use = m == NEG_INF ? 0.f : m;
  constexpr int PER = (D + 63) / 64;  // dims a thread
  float acc[PER], w_sum = 0.f;
#pragma unroll
  for (int k = 0; k < PER; ++k) acc[k] = 0.f;
  for (int s = 0; s < n; ++s) {
    const float w = exp2f(lse[s * split_stride + row] - m_use);
    w_sum += w;
    const float* p = part + (s * split_stride + row) * D;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int d = threadIdx.x + 64 * k;
      if (d < D) acc[k] += w * p[d];
    }
  }
  const float inv = w_sum > 0.f ? 1.f / w_sum : 0.f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int d = threadIdx.x + 64 * k;
    if (d < D) out[(long long)tok * stride_ot + (long long)h * stride_oh + d] = to_half(acc[k] * inv);
  }
}

// ---------------------------------------------------------------------------------------------------------
// Causal prefill chunks over the paged prefix plus the chunk's own keys: block (tile of bq tokens of one
// sequence, KV head, split) of 8 warps holds 64 query rows (bq = 64 / rep tokens x the rep heads of the KV
// head; warp w: rows 8 w .. 8 w + 7) and walks the keys in N32 tiles (an N64 score tile changed sampled tokens
// in the original stack; N32 is its rule). Each tile's K and V are staged as fp16 in shared memory by the whole
// block (codes converted once), the next tile's bytes loading into registers while this one is used.
// Shared-memory layouts, so that the fragment reads of a half warp hit distinct banks:
//   K: key n at row (n % 8) 4 + n / 8, rows of D + 4 halves (a half warp reads keys 8 qp + t: rows 4 t + qp);
//   V: key n at row n, D halves, its 4-dim granule g at g ^ swizzle(n) (a half warp reads granule
//      8 j + 2 qp + hi of keys 4 ks + t); column n of quad pair qp in MMA j is head dim 32 j + 8 qp + n
//      (prefill_dim).
// Virtual tiles: sequence b owns tiles cu_q[b] / bq + b .., the grid's last (most keys) first. k_new / v_new
// (use_new, fp16 caches only): the chunk's own keys (positions >= kv_len - q_len) come from them, rows packed
// like q, instead of from the pages.
__device__ __forceinline__ int prefill_dim(int j, int i, int lane) {
  return 32 * j + 8 * ((lane >> 2) & 3) + 4 * (i >> 2) + (lane & 2) + (i & 1);
}
template <int D>
__device__ __forceinline__ int v_granule(int g, int key) {
  return g ^ (((key & 1) | ((key & 2) << 2)) & (D / 4 - 1));
}

template <int D>
struct PrefillSmem {  // byte offsets in the dynamic shared memory (cuda_sm70.prefill_smem_bytes says the same)
  static constexpr int Q = 0;
  static constexpr int K = Q + PREFILL_ROWS * (D + 4) * 2;
  static constexpr int V = K + TILE * (D + 4) * 2;
  static constexpr int P = V + TILE * D * 2;
  static constexpr int SCALES = P + PREFILL_WARPS * 8 * P_STRIDE * 2;
  static constexpr int BYTES = SCALES + 2 * TILE * 4;
};

template <int D, bool INT8>
struct TileLoad {  // one thread's share of a K/V tile between its global load and its shared-memory store
  static constexpr int EB = INT8 ? 1 : 2;
  static constexpr int CHUNKS = D * EB / 16;               // 16-byte chunks of a key row
  static constexpr int TOTAL = 2 * TILE * CHUNKS;          // K then V
  static constexpr int PER = (TOTAL + 32 * PREFILL_WARPS - 1) / (32 * PREFILL_WARPS);
  U4 data[PER];
  float k_sc, v_sc;  // key threadIdx.x's scales (threads < 32, int8)
};

struct PrefillSeq {  // what a block knows of its sequence
  int b, q_start, q_len, q_lo, prefix, k_end, kvh;
};

template <int D, bool INT8>
__device__ __forceinline__ void load_tile(TileLoad<D, INT8>& tl, int k0, const PrefillSeq& sq, const u8* kc,
                                          const u8* vc, const float* ks, const float* vs, const u8* kn,
                                          const u8* vn, const int* bt, long long stride_kb, long long stride_ks,
                                          long long stride_kh, long long stride_sb, long long stride_ss,
                                          long long stride_nt, long long stride_nh, int page_shift, int bt_cols,
                                          int n_pages, bool use_new) {
  using TL = TileLoad<D, INT8>;
  const int page_mask = (1 << page_shift) - 1;
#pragma unroll
  for (int k = 0; k < TL::PER; ++k) {
    const int c = threadIdx.x + 32 * PREFILL_WARPS * k;
    const int which = c / (TILE * TL::CHUNKS), key = (c / TL::CHUNKS) % TILE, chunk = c % TL::CHUNKS;
    const int pos = k0 + key;
    U4 v = {0u, 0u, 0u, 0u};  // keys past the block's last position: zeros
    if (c < TL::TOTAL && pos < sq.k_end) {
      const u8* src;
      if (use_new && pos >= sq.prefix) {
        src = (which ? vn : kn) + ((long long)(sq.q_start + pos - sq.prefix) * stride_nt + (long long)sq.kvh * stride_nh) * 2;
      } else {
        const int page = min(max(bt[min(pos >> page_shift, bt_cols - 1)], 0), n_pages - 1);
        src = (which ? vc : kc) + ((long long)page * stride_kb + (long long)(pos & page_mask) * stride_ks +
                                   (long long)sq.kvh * stride_kh) * TL::EB;
      }
      v = *reinterpret_cast<const U4*>(src + 16 * chunk);
    }
    tl.data[k] = v;
  }
  if constexpr (INT8) {
    tl.k_sc = tl.v_sc = 0.f;
    const int pos = k0 + threadIdx.x;
    if (threadIdx.x < TILE && pos < sq.k_end) {
      const int page = min(max(bt[min(pos >> page_shift, bt_cols - 1)], 0), n_pages - 1);
      const long long soff = (long long)page * stride_sb + (long long)(pos & page_mask) * stride_ss + sq.kvh;
      tl.k_sc = ks[soff];
      tl.v_sc = vs[soff];
    }
  }
}

template <int D, bool INT8>
__device__ __forceinline__ void store_tile(const TileLoad<D, INT8>& tl, unsigned char* smem) {
  using TL = TileLoad<D, INT8>;
  using SM = PrefillSmem<D>;
  u16* s_k = reinterpret_cast<u16*>(smem + SM::K);
  u16* s_v = reinterpret_cast<u16*>(smem + SM::V);
#pragma unroll
  for (int k = 0; k < TL::PER; ++k) {
    const int c = threadIdx.x + 32 * PREFILL_WARPS * k;
    if (c >= TL::TOTAL) continue;
    const int which = c / (TILE * TL::CHUNKS), key = (c / TL::CHUNKS) % TILE, chunk = c % TL::CHUNKS;
    const u32 w[4] = {tl.data[k].x, tl.data[k].y, tl.data[k].z, tl.data[k].w};
    constexpr int GRANULES = INT8 ? 4 : 2;  // 4-dim granules in 16 bytes
#pragma unroll
    for (int gq = 0; gq < GRANULES; ++gq) {
      U2 pair;
      quad<INT8>(w, gq, pair.x, pair.y);
      const int g = GRANULES * chunk + gq;
      u16* dst = which ? s_v + key * D + 4 * v_granule<D>(g, key)
                       : s_k + ((key & 7) * 4 + (key >> 3)) * (D + 4) + 4 * g;
      *reinterpret_cast<U2*>(dst) = pair;
    }
  }
  if constexpr (INT8) {
    float* s_scales = reinterpret_cast<float*>(smem + SM::SCALES);
    if (threadIdx.x < TILE) {
      s_scales[threadIdx.x] = tl.k_sc;
      s_scales[TILE + threadIdx.x] = tl.v_sc;
    }
  }
}

// One warp's S and P V for the tile in shared memory (keys k0 ..)
template <int D, bool INT8>
__device__ __forceinline__ void prefill_step(const unsigned char* smem, u16* p_tile, int warp, int lane, int k0,
                                             int k_end, const int (&qpos)[2], float qk_scale, float (&acc)[D / 32][8],
                                             float (&m_run)[2], float (&l_run)[2]) {
  using SM = PrefillSmem<D>;
  const u16* s_q = reinterpret_cast<const u16*>(smem + SM::Q) + (8 * warp + (lane & 3) + 4 * (lane >> 4)) * (D + 4);
  const int qp = (lane >> 2) & 3, t = lane & 3, hi = lane >> 4;
  const u16* s_k = reinterpret_cast<const u16*>(smem + SM::K) + ((t + 4 * hi) * 4 + qp) * (D + 4);
  const u16* s_v = reinterpret_cast<const u16*>(smem + SM::V);
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int st = 0; st < D / 4; ++st) {
    const U2 a = *reinterpret_cast<const U2*>(s_q + 4 * st);
    const U2 bk = *reinterpret_cast<const U2*>(s_k + 4 * st);
    mma_row_col(s, a.x, a.y, bk.x, bk.y);
  }
  float kscale[4], vscale[4];
  const float* s_scales = reinterpret_cast<const float*>(smem + SM::SCALES);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int key = 8 * qp + (lane & 2) + 4 * (c >> 1) + (c & 1);
    kscale[c] = INT8 ? s_scales[key] : 1.f;
    vscale[c] = INT8 ? s_scales[TILE + key] : 1.f;
  }
  softmax_step(s, kscale, vscale, k0, k_end, qpos, qk_scale, acc, m_run, l_run, p_tile, lane);
  __syncwarp();
#pragma unroll
  for (int kstep = 0; kstep < TILE / 4; ++kstep) {
    const U2 a = p_fragment(p_tile, kstep, lane);
    const int key = 4 * kstep + t;
#pragma unroll
    for (int j = 0; j < D / 32; ++j) {
      const U2 bv = *reinterpret_cast<const U2*>(s_v + key * D + 4 * v_granule<D>(8 * j + 2 * qp + hi, key));
      mma_row_row(acc[j], a.x, a.y, bv.x, bv.y);
    }
  }
  __syncwarp();
}

// q, out as for decode; kn / vn: [T, HKV, D] fp16 (strides stride_nt, stride_nh) or null. Dynamic shared
// memory: PrefillSmem<D>::BYTES.
template <int D, bool INT8>
__global__ void __launch_bounds__(32 * PREFILL_WARPS, 1) paged_prefill_m884(
    const u16* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc, const float* __restrict__ ks,
    const float* __restrict__ vs, const u8* __restrict__ kn, const u8* __restrict__ vn, u16* __restrict__ out,
    float* __restrict__ part, float* __restrict__ lse, const int* __restrict__ block_tables,
    const int* __restrict__ cu_q, const int* __restrict__ kv_lens, float qk_scale, int B, int T, int HQ, int rep,
    int bq, long long stride_qt, long long stride_qh, long long stride_ot, long long stride_oh, long long stride_kb,
    long long stride_ks, long long stride_kh, long long stride_sb, long long stride_ss, long long stride_bt,
    long long stride_nt, long long stride_nh, int page_shift, int split_len, int bt_cols, int n_pages, int use_new) {
  static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head dims 32 .. 256, multiples of 32");
  using SM = PrefillSmem<D>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int tile_id = gridDim.x - 1 - blockIdx.x, split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, row_a = (lane & 1) + 4 * (lane >> 4);
  PrefillSeq sq;
  int lo = 0, hi = B - 1;  // the sequence of this tile: the last b whose first tile cu_q[b] / bq + b <= tile_id
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu_q[mid] / bq + mid <= tile_id) lo = mid;
    else hi = mid - 1;
  }
  sq.b = lo;
  sq.kvh = blockIdx.y;
  sq.q_start = cu_q[lo];
  sq.q_len = cu_q[lo + 1] - sq.q_start;
  sq.q_lo = (tile_id - (sq.q_start / bq + lo)) * bq;
  if (sq.q_lo >= sq.q_len) return;
  const int n_tok = min(bq, sq.q_len - sq.q_lo), n_rows = n_tok * rep;
  sq.prefix = kv_lens[lo] - sq.q_len;
  const int k_lo = split * split_len;
  sq.k_end = min(sq.prefix + sq.q_lo + n_tok, k_lo + split_len);  // past the block's last position: unseen
  if (k_lo >= sq.k_end) return;
  const int* bt = block_tables + (long long)lo * stride_bt;

  u16* s_q = reinterpret_cast<u16*>(smem + SM::Q);
  for (int i = threadIdx.x; i < PREFILL_ROWS * (D / 4); i += blockDim.x) {
    const int r = i / (D / 4), g = i % (D / 4);
    U2 v = {0u, 0u};
    if (r < n_rows)
      v = *reinterpret_cast<const U2*>(q + (long long)(sq.q_start + sq.q_lo + r / rep) * stride_qt +
                                       (long long)(sq.kvh * rep + r % rep) * stride_qh + 4 * g);
    *reinterpret_cast<U2*>(s_q + r * (D + 4) + 4 * g) = v;
  }
  int qpos[2];  // positions of this lane's rows 8 warp + row_a + 2 e; padding rows see no key
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 8 * warp + row_a + 2 * e;
    qpos[e] = r < n_rows ? sq.prefix + sq.q_lo + r / rep : -1;
  }
  const int warp_last = 8 * warp < n_rows ? sq.prefix + sq.q_lo + min(8 * warp + 7, n_rows - 1) / rep : -1;

  float acc[D / 32][8];
#pragma unroll
  for (int j = 0; j < D / 32; ++j)
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[j][i] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};
  u16* p_tile = reinterpret_cast<u16*>(smem + SM::P) + warp * 8 * P_STRIDE;
  TileLoad<D, INT8> tl;
  load_tile(tl, k_lo, sq, kc, vc, ks, vs, kn, vn, bt, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
            stride_nt, stride_nh, page_shift, bt_cols, n_pages, use_new != 0);
  store_tile(tl, smem);
  __syncthreads();
  for (int k0 = k_lo; k0 < sq.k_end; k0 += TILE) {
    const bool more = k0 + TILE < sq.k_end;
    if (more)  // the next tile's bytes travel while this one is used
      load_tile(tl, k0 + TILE, sq, kc, vc, ks, vs, kn, vn, bt, stride_kb, stride_ks, stride_kh, stride_sb,
                stride_ss, stride_nt, stride_nh, page_shift, bt_cols, n_pages, use_new != 0);
    if (k0 <= warp_last)  // a warp whose rows all precede the tile skips it
      prefill_step<D, INT8>(smem, p_tile, warp, lane, k0, sq.k_end, qpos, qk_scale, acc, m_run, l_run);
    __syncthreads();
    if (more) store_tile(tl, smem);
    __syncthreads();
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(FULL_MASK, l_run[e], 2);
    l_run[e] += __shfl_xor_sync(FULL_MASK, l_run[e], 4);
    l_run[e] += __shfl_xor_sync(FULL_MASK, l_run[e], 8);
  }
  const bool partial = gridDim.z > 1;
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 8 * warp + row_a + 2 * e;
    if (qpos[e] < 0) continue;  // padding row
    const long long tok = sq.q_start + sq.q_lo + r / rep, h = (long long)sq.kvh * rep + r % rep;
    const float inv = l_run[e] > 0.f ? 1.f / l_run[e] : 0.f;
#pragma unroll
    for (int j = 0; j < D / 32; ++j)
#pragma unroll
      for (int i = 2 * e; i < 8; i += 4) {  // values i, i + 1 of row e: adjacent dims
        const int d = prefill_dim(j, i, lane);
        if (partial) {
          *reinterpret_cast<float2*>(part + (((long long)split * T + tok) * HQ + h) * D + d) =
              make_float2(acc[j][i] * inv, acc[j][i + 1] * inv);
        } else {
          *reinterpret_cast<u32*>(out + tok * stride_ot + h * stride_oh + d) =
              halves(acc[j][i] * inv, acc[j][i + 1] * inv);
        }
      }
    if (partial && (lane & 14) == 0)
      lse[((long long)split * T + tok) * HQ + h] = l_run[e] > 0.f ? m_run[e] + log2f(l_run[e]) : NEG_INF;
  }
}

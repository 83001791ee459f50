// Decode and speculative rows over the paged KV cache on Volta's m8n8k4 tensor cores (split-K, then
// combine_splits), and the split merge the prefill kernel shares. Compiled at run time by NVRTC through CuPy
// (cuda_sm70.py beside it), for sm_70 and, to prove it on newer GPUs, anything later; m884_attention.cuh
// says how the MMA fragments are used.

#include "../cuda_common.cuh"
#include "m884_attention.cuh"

constexpr int DECODE_WARPS = 4;

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

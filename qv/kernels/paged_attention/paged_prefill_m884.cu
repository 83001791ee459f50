// Causal prefill chunks (FMHA, N32 score tiles) over the paged KV cache on Volta's m8n8k4 tensor cores.
// Compiled at run time by NVRTC through CuPy (cuda_sm70.py beside it), for sm_70 and, to prove it on newer
// GPUs, anything later; m884_attention.cuh says how the MMA fragments are used. Split partials are merged by
// combine_splits (paged_decode_m884.cu).

#include "../cuda_common.cuh"
#include "m884_attention.cuh"

constexpr int PREFILL_WARPS = 8;
constexpr int PREFILL_ROWS = 8 * PREFILL_WARPS;

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

// Decode attention over the paged int8 KV cache on tensor cores (mma.sync.m16n8k16 and movmatrix, sm_80
// and newer). Compiled at run time by NVRTC through CuPy (cuda_sm90.py beside it).
//
// One block of 4 warps serves (sequence b, KV head, split, chunk of 8 query rows): rows r0 .. r0 + 7 of b's
// GQA group (row r = token r / rep, head kvh * rep + r % rep; speculative rows have several tokens, and the
// blocks of a split's chunks read the same keys at about the same time, from the L2 after the first)
// against the keys split * split_len .. + split_len.
// Warp w takes the 16-key tiles w, w + 4, ... of the split; the 4 partial softmaxes meet in shared
// memory at the end. With more than one split the block writes fp32 partials and their base-2
// log-sum-exps, which decode_reduce_kernel (triton_decode.py) merges, as for the Triton kernel.
//
// The keys sit on the MMA's 16-row side so that each code byte costs about one instruction: S^T = K q^T
// takes a tile of 16 keys as A (rows = keys, columns = head dims) and q^T as B (8 columns = query rows);
// O^T += V^T P^T takes 16 head dims of V^T as A (columns = the tile's keys) and P^T as B. Head dims and
// keys may be visited in any order as long as both operands of one MMA agree, so:
//   K: lane (g, t) loads 16 bytes at i * 64 + 16 t of keys g and g + 8 (i < D / 64); word j of load i is
//      the A fragment of k step 4 i + j (codes 0, 1 -> columns 2t, 2t + 1; codes 2, 3 -> 2t + 8, 2t + 9),
//      and q is read with the same order (its dims i * 64 + 16 t + 4 j + e).
//   V: lane (g, t) loads 16 bytes at h * 128 + 16 g of keys 2t, 2t + 1, 2t + 8, 2t + 9 (h < D / 128); byte
//      4 w + 2 o + e of load h is head dim row g + 8 e of m tile 8 h + 2 w + o, so two keys' words
//      interleave by one byte permute into that tile's pairs of keys (so m tile mt's row r is head dim
//      (mt / 8) 128 + 16 (r % 8) + 2 (mt % 8) + r / 8; the epilogue writes the dims back in order).
//   P: the S^T accumulator (lane: keys g, g + 8; query rows 2t, 2t + 1) becomes P^T's B fragment (keys 2t,
//      2t + 1 and 2t + 8, 2t + 9; query row g) by one 8x8 transpose (movmatrix) per half.
// Codes become fp16 exactly (codes_to_half2); the K scale multiplies the scores and the V scale the
// probabilities (as in the Triton kernel), so the MMAs see the codes themselves.

#include "../cuda_common.cuh"

constexpr int WARPS = 4;
#define NEG_INF __int_as_float(0xff800000)

template <int D>
struct Tile {  // one 16-key tile's codes as this lane loads them, and the scales of keys g and g + 8
  U4 k[2][D / 64];       // keys g, g + 8
  U4 v[4][D / 128];      // keys 2t, 2t + 1, 2t + 8, 2t + 9
  float ks[2], vs[2];    // keys g, g + 8
};

// The scale of key n0 + key (srow0: the tile's first key), or 0 at or past k_end.
__device__ __forceinline__ float scale_of(const float* s, long long srow0, long long stride_ss, int n0, int key,
                                          int k_end) {
  return n0 + key < k_end ? s[srow0 + key * stride_ss] : 0.f;
}

// (NOW: the codes by load16_now, for the first tile, whose loads must stay ahead of the early exit)
template <int D, bool NOW = false>
__device__ __forceinline__ void load_k(Tile<D>& tl, const u8* kc, const float* ks, long long row0, long long srow0,
                                       long long stride_ks, long long stride_ss, int n0, int k_end, int g, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key = g + 8 * h;
#pragma unroll
    for (int i = 0; i < D / 64; ++i)
      tl.k[h][i] = NOW ? load16_now(kc + row0 + key * stride_ks + i * 64 + 16 * t)
                       : load16_nc(kc + row0 + key * stride_ks + i * 64 + 16 * t);
    tl.ks[h] = scale_of(ks, srow0, stride_ss, n0, key, k_end);
  }
}

template <int D, bool NOW = false>
__device__ __forceinline__ void load_v(Tile<D>& tl, const u8* vc, const float* vs, long long row0, long long srow0,
                                       long long stride_ks, long long stride_ss, int n0, int k_end, int g, int t) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int key = 2 * t + (j & 1) + 8 * (j >> 1);
#pragma unroll
    for (int h = 0; h < D / 128; ++h)
      tl.v[j][h] = NOW ? load16_now(vc + row0 + key * stride_ks + h * 128 + 16 * g)
                       : load16_nc(vc + row0 + key * stride_ks + h * 128 + 16 * g);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) tl.vs[h] = scale_of(vs, srow0, stride_ss, n0, g + 8 * h, k_end);
}

template <int D>
__device__ __forceinline__ void load_scales(Tile<D>& tl, const float* ks, const float* vs, long long srow0,
                                            long long stride_ss, int n0, int k_end, int g) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    tl.ks[h] = scale_of(ks, srow0, stride_ss, n0, g + 8 * h, k_end);
    tl.vs[h] = scale_of(vs, srow0, stride_ss, n0, g + 8 * h, k_end);
  }
}

__device__ __forceinline__ u32 word(const U4& u, int i) { return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w; }

// q: [T, HQ, D] fp16/bf16; caches [pages, BS, HKV, D] int8 with scales [pages, BS, HKV] fp32 (head stride 1);
// out: [T, HQ, D] in q's dtype, or with splits fp32 partials [splits, T, HQ, D] (strides given) and lse
// [splits, T, HQ]. MIN_BLOCKS: blocks per SM the register allocation must allow.
template <int D, int MIN_BLOCKS>
__global__ void __launch_bounds__(128, MIN_BLOCKS) paged_decode_mma(
    const u16* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc, const float* __restrict__ ks,
    const float* __restrict__ vs, void* __restrict__ out, float* __restrict__ lse, const int* __restrict__ block_tables,
    const int* __restrict__ cu_q, const int* __restrict__ kv_lens, float qk_scale, int T, int HQ, int rep,
    long long stride_qt, long long stride_qh, long long stride_os, long long stride_ot, long long stride_oh,
    long long stride_kb, long long stride_ks, long long stride_kh, long long stride_sb, long long stride_ss,
    long long stride_bt, int page_shift, int split_len, int q_bf16, int chunks, int bt_cols, int n_pages) {
  // (split_len is a multiple of 16 and pages hold 2^page_shift >= 16 keys: a tile never straddles a page)
  static_assert(D == 128 || D == 256, "head dims 128 and 256");
  const int b = blockIdx.x / chunks, r0 = 8 * (blockIdx.x % chunks), kvh = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int k_lo = split * split_len;
  const int* bt = block_tables + (long long)b * stride_bt;
  const long long head = (long long)kvh * stride_kh;
  const int page_mask = (1 << page_shift) - 1;  // pages of 2^page_shift keys, a multiple of 16
  auto row_of = [&](int tile, int page) {
    return (long long)page * stride_kb + ((k_lo + 16 * tile) & page_mask) * stride_ks + head;
  };
  auto srow_of = [&](int tile, int page) {
    return (long long)page * stride_sb + ((k_lo + 16 * tile) & page_mask) * stride_ss + kvh;
  };
  // This warp's first tile's codes load before the lengths arrive (nothing of them depends on those): its
  // page comes from the table clamped to the table and to the cache, so the loads stay in bounds whatever
  // the sequence's length, and its scales wait for the lengths (k_end 0 here: none loaded). One dependent
  // load fewer before the first keys are on their way.
  int page = min(max(bt[min((k_lo + 16 * warp) >> page_shift, bt_cols - 1)], 0), n_pages - 1);
  Tile<D> ping, pong;  // the two tiles' registers, used in turn (no copies between steps)
  load_k<D, true>(ping, kc, ks, row_of(warp, page), 0, stride_ks, stride_ss, k_lo + 16 * warp, 0, g, t);
  load_v<D, true>(ping, vc, vs, row_of(warp, page), 0, stride_ks, stride_ss, k_lo + 16 * warp, 0, g, t);

  const int q_start = cu_q[b], q_len = cu_q[b + 1] - q_start, kv_len = kv_lens[b];
  const int k_end = min(kv_len, k_lo + split_len);
  const int rows = min(8, q_len * rep - r0);  // this block's query rows r0 .. r0 + rows - 1
  if (rows <= 0 || k_lo >= k_end) return;
  __shared__ U2 s_q[D / 64][4][32];

  // positions of query rows 2t, 2t + 1 (the S^T columns of this lane); padding rows see every key
  int qpos[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int r = 2 * t + e;
    qpos[e] = r < rows ? kv_len - q_len + (r0 + r) / rep : kv_len - 1;
  }

  float acc[D / 16][4];  // O^T: m tile mt, dim rows g / g + 8 x query rows 2t, 2t + 1
#pragma unroll
  for (int mt = 0; mt < D / 16; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mt][e] = 0.f;
  float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.f, 0.f};  // l: this lane's keys only, summed at the end

  const int n_tiles = (k_end - k_lo + 15) >> 4;
  auto page_of = [&](int tile) { return tile < n_tiles ? bt[(k_lo + 16 * tile) >> page_shift] : 0; };

  // One step: tile i's scores, the softmax update, P V, from `cur`; meanwhile tile i + WARPS's keys load
  // into `nxt` (from the step's start) and its values (once the scores are made). Past the last tile the
  // loads re-read this one (a cheaper waste than branching around them). Page numbers are read a step
  // earlier still. (Two tiles in flight a warp would need ~290 registers: they spill.)
  int tile = warp, next_page = page_of(tile + WARPS);
  auto step = [&](const Tile<D>& cur, Tile<D>& nxt) {
    const int n0 = k_lo + 16 * tile, nxt_tile = tile + WARPS;
    const bool more = nxt_tile < n_tiles;
    const long long nxt_row = more ? row_of(nxt_tile, next_page) : row_of(tile, page);
    const long long nxt_srow = more ? srow_of(nxt_tile, next_page) : srow_of(tile, page);
    const int nxt_n0 = more ? k_lo + 16 * nxt_tile : n0;
    load_k(nxt, kc, ks, nxt_row, nxt_srow, stride_ks, stride_ss, nxt_n0, k_end, g, t);

    // S^T: keys g, g + 8 x query rows 2t, 2t + 1 (one chain of MMAs: two measured the same and cost the
    // registers that then spilled)
    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < D / 64; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        u32 a0, a1, a2, a3;
        codes_to_half2(word(cur.k[0][i], j), a0, a2);
        codes_to_half2(word(cur.k[1][i], j), a1, a3);
        const U2 b = s_q[i][j][lane];
        mma(s, a0, a1, a2, a3, b.x, b.y);
      }

    load_v(nxt, vc, vs, nxt_row, nxt_srow, stride_ks, stride_ss, nxt_n0, k_end, g, t);

    // online softmax in base 2; key n is seen by a row iff n < k_end and n <= the row's position
    float p[4], alpha[2];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int key = n0 + g + 8 * (e >> 1);
      const bool seen = key < k_end && key <= qpos[e & 1];
      s[e] = seen ? s[e] * cur.ks[e >> 1] * qk_scale : NEG_INF;
    }
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float mx = fmaxf(s[e], s[e + 2]);
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
      const float m_new = fmaxf(m_run[e], mx);
      const float m_use = m_new == NEG_INF ? 0.f : m_new;
      alpha[e] = exp2f(m_run[e] - m_use);
      p[e] = exp2f(s[e] - m_use);
      p[e + 2] = exp2f(s[e + 2] - m_use);
      l_run[e] = l_run[e] * alpha[e] + p[e] + p[e + 2];
      m_run[e] = m_new;
    }
    // the running max rarely grows after the first tiles: rescale only when some row's did
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f))
#pragma unroll
      for (int mt = 0; mt < D / 16; ++mt) {
        acc[mt][0] *= alpha[0];
        acc[mt][1] *= alpha[1];
        acc[mt][2] *= alpha[0];
        acc[mt][3] *= alpha[1];
      }
    const u32 b0 = transpose8x8(pack_half2(p[0] * cur.vs[0], p[1] * cur.vs[0]));
    const u32 b1 = transpose8x8(pack_half2(p[2] * cur.vs[1], p[3] * cur.vs[1]));

#pragma unroll
    for (int h = 0; h < D / 128; ++h)
#pragma unroll
      for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int o = 0; o < 2; ++o) {
          const int mt = 8 * h + 2 * w + o;
          const u32 sel = o ? 0x7362u : 0x5140u;
          u32 a0, a1, a2, a3;
          codes_to_half2(prmt(word(cur.v[0][h], w), word(cur.v[1][h], w), sel), a0, a1);
          codes_to_half2(prmt(word(cur.v[2][h], w), word(cur.v[3][h], w), sel), a2, a3);
          mma(acc[mt], a0, a1, a2, a3, b0, b1);
        }
    page = next_page;
    next_page = page_of(tile + 2 * WARPS);
    tile += WARPS;
  };
  // (codes are read whole tiles at a time: a page holds them even past k_end)
  if (tile < n_tiles) load_scales(ping, ks, vs, srow_of(tile, page), stride_ss, k_lo + 16 * tile, k_end, g);
  // q^T fragments: query row g, dims i * 64 + 16 t + 0 .. 15 as 8 fp16 pairs per i (padding rows: zeros),
  // in shared memory (registers are short), as the pairs (b0, b1) of k step 4 i + j, lane-major; after the
  // first tile's loads are on their way
  if (warp == 0) {
    const bool ok = g < rows;
    const int r = ok ? r0 + g : 0;
    const u16* p = q + (long long)(q_start + r / rep) * stride_qt + (long long)(kvh * rep + r % rep) * stride_qh;
#pragma unroll
    for (int i = 0; i < D / 64; ++i) {
      const U4 lo = load16(p + i * 64 + 16 * t, ok), hi = load16(p + i * 64 + 16 * t + 8, ok);
      u32 w[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
      for (int e = 0; e < 8; ++e)
        if (q_bf16) w[e] = pack_half2(bf16_to_float((u16)(w[e] & 0xffffu)), bf16_to_float((u16)(w[e] >> 16)));
#pragma unroll
      for (int j = 0; j < 4; ++j) s_q[i][j][lane] = U2{w[2 * j], w[2 * j + 1]};
    }
  }
  __syncthreads();
  while (tile < n_tiles) {
    step(ping, pong);
    if (tile >= n_tiles) break;
    step(pong, ping);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 4);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 8);
    l_run[e] += __shfl_xor_sync(0xffffffffu, l_run[e], 16);
  }

  // The warps' partial softmaxes meet in shared memory: first each row's weights, then the output in four
  // slices of the head dims (m tiles 8 h + 2 c + o for slice c; [dim][row], rows padded to 9 against bank
  // conflicts), so the block keeps little shared memory and the SM a large L1 for the loads in flight.
  __shared__ float s_acc[WARPS][D / 4][9];
  __shared__ float s_m[WARPS][8], s_l[WARPS][8], s_w[WARPS][8], s_inv[8], s_lse[8];
  if (g == 0)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      s_m[warp][2 * t + e] = m_run[e];
      s_l[warp][2 * t + e] = l_run[e];
    }
  __syncthreads();
  if (threadIdx.x < 8) {
    const int r = threadIdx.x;
    float m = NEG_INF;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) m = fmaxf(m, s_m[w][r]);
    const float m_use = m == NEG_INF ? 0.f : m;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      s_w[w][r] = exp2f(s_m[w][r] - m_use);
      l += s_l[w][r] * s_w[w][r];
    }
    s_inv[r] = l > 0.f ? 1.f / l : 0.f;
    s_lse[r] = l > 0.f ? m_use + log2f(l) : NEG_INF;
  }
  const bool partial = gridDim.z > 1;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    __syncthreads();  // (the weights are written; the previous slice is read)
#pragma unroll
    for (int h = 0; h < D / 128; ++h)
#pragma unroll
      for (int o = 0; o < 2; ++o)
#pragma unroll
        for (int e = 0; e < 4; ++e)  // dim h 128 + 16 (row % 8) + 4 c + 2 o + row / 8 -> slice index below
          s_acc[warp][h * 32 + g * 4 + 2 * o + (e >> 1)][2 * t + (e & 1)] = acc[8 * h + 2 * c + o][e];
    __syncthreads();
    for (int i = threadIdx.x; i < rows * (D / 4); i += blockDim.x) {
      const int r = i / (D / 4), j = i % (D / 4);
      const int d = (j >> 5) * 128 + ((j >> 2) & 7) * 16 + 4 * c + (j & 3);
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) v += s_acc[w][j][r] * s_w[w][r];
      v *= s_inv[r];
      const long long row = q_start + (r0 + r) / rep, h = (long long)kvh * rep + (r0 + r) % rep;
      if (partial) {
        static_cast<float*>(out)[split * stride_os + row * stride_ot + h * stride_oh + d] = v;
        if (c == 0 && j == 0) lse[((long long)split * T + row) * HQ + h] = s_lse[r];
      } else {
        static_cast<u16*>(out)[row * stride_ot + h * stride_oh + d] = float_to(v, q_bf16);
      }
    }
  }
}

// GPTQ linear layers (8- and 4-bit codes) for Volta (sm_70) on tensor cores with mma.sync.m8n8k4 (HMMA.884),
// fp16 in and out: a GEMV for a few rows (M <= 16: decode and verification) and a tiled GEMM for any M
// (prefill). Template argument BITS (8 by default) picks the code layout; everything past the code loads is
// one design for both.
// Compiled at run time by NVRTC through CuPy (cuda_sm70.py beside it), and ahead of time for sm_70 by
// `qv kernels --arch sm_70`; no CUDA headers needed.
//
// y[m, n] = sum_k x[m, k] (c[k, n] - z[G(k), n]) s[G(k), n] (+ bias[n]): codes c uint8 [K, N] row-major
// (BITS 8), or two a byte [K/2, N] (BITS 4: byte row r holds input 2r in its low nibble, 2r + 1 in its
// high), scale group G(k) = k / group; zeros z are integers (GPTQ's), 128 (8 at 4 bits) where symmetric.
//
// m8n8k4 runs four independent 8x8x4 products, one per quad pair (QP) of lanes: QP q is lanes 4q .. 4q+3
// and 16 + 4q .. 16 + 4q + 3; within it lane L is thread T = L % 4 + 4 (L / 16). With .row A and .col B
// (PTX ISA, "Matrix Fragments for mma.m8n8k4 with .f16"; CuTe's SM70_8x4_Row and SM70_8x8_32b):
//   A [8 x 4]: thread T holds row T, k 0..3, as two half2 {A[T][0], A[T][1]}, {A[T][2], A[T][3]}
//   B [4 x 8]: thread T holds column T, k 0..3, as {B[0][T], B[1][T]}, {B[2][T], B[3][T]}
//   D [8 x 8] fp32: element i (0..7) of lane L is row (L & 1) + (i & 2) + 4 (L / 16),
//                   column (i & 1) + (L & 2) + (i & 4)
// tests/oracles/m884_model.py models this instruction and both kernels' lane arithmetic in NumPy.
//
// Codes become weights in registers: bytes of 4 rows regrouped by byte permutes into the k-pairs of one
// column, 0x64 as the high byte reads as fp16 1024 + c, minus (1024 + z) is c - z exactly (integers
// below 2048), times s rounds once to fp16. The MMAs accumulate in fp32. At 4 bits two packed byte rows
// become those 4 rows of bytes first by nibble masks and shifts (nibble_rows), in registers.

#include "../cuda_common.cuh"

__device__ __forceinline__ void mma_m8n8k4(float* d, u32 a01, u32 a23, u32 b01, u32 b23) {
  asm volatile(
      "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 {%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, "
      "{%0,%1,%2,%3,%4,%5,%6,%7};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a01), "r"(a23), "r"(b01), "r"(b23));
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
  u32 r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
  u32 r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ U2 load8(const void* p, bool ok) {
  U2 v = {0u, 0u};
  if (ok) v = *reinterpret_cast<const U2*>(p);
  return v;
}

// Per-column dequantization constants of 8 columns from their raw scales and zeros (8 fp16 each):
// off[c] = half2(1024 + z_c), scale[c] = half2(s_c), both halves equal (the two k of an A pair share the
// column).
struct Columns8 {
  u32 off[8], scale[8];
};
__device__ __forceinline__ Columns8 columns8(U4 s, U4 z) {
  Columns8 c;
  const u32 sw[4] = {s.x, s.y, s.z, s.w}, zw[4] = {z.x, z.y, z.z, z.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 off;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(off) : "r"(zw[i]), "r"(0x64006400u));  // 1024 + z, exact
    c.off[2 * i] = prmt(off, off, 0x1010u);  // the low half twice
    c.off[2 * i + 1] = prmt(off, off, 0x3232u);
    c.scale[2 * i] = prmt(sw[i], sw[i], 0x1010u);
    c.scale[2 * i + 1] = prmt(sw[i], sw[i], 0x3232u);
  }
  return c;
}
__device__ __forceinline__ U4 splat4(u32 v) { return U4{v, v, v, v}; }
enum : u32 { SYMMETRIC_ZERO = 0x58005800u, SYMMETRIC_ZERO4 = 0x48004800u };  // fp16 128 twice, fp16 8 twice
template <int BITS>
__device__ __forceinline__ u32 symmetric_zero() {
  return BITS == 8 ? SYMMETRIC_ZERO : SYMMETRIC_ZERO4;
}

// Packed byte rows r and r + 1 of 4-bit codes (one word: 4 columns) to the byte rows 2r .. 2r + 3 that
// dequant4 takes: the low nibbles are the even inputs, the high ones the odd.
__device__ __forceinline__ void nibble_rows(u32 p0, u32 p1, u32* w) {
  w[0] = p0 & 0x0F0F0F0Fu;
  w[1] = (p0 >> 4) & 0x0F0F0F0Fu;
  w[2] = p1 & 0x0F0F0F0Fu;
  w[3] = (p1 >> 4) & 0x0F0F0F0Fu;
}

// Codes of inputs k0 .. k0+3 (k0 % 4 == 0) for 8 columns, one byte each: q[r] = row k0 + r (.x columns
// 0..3, .y 4..7). `row` points at the code row of k0 (BITS 8) or its packed byte row k0 / 2 (BITS 4).
template <int BITS>
__device__ __forceinline__ void load_rows4(const u8* row, long long stride_qk, bool ok, U2* q) {
  if (BITS == 8) {
#pragma unroll
    for (int r = 0; r < 4; ++r) q[r] = load8(row + r * stride_qk, ok);
  } else {
    const U2 p0 = load8(row, ok), p1 = load8(row + stride_qk, ok);
    u32 lo[4], hi[4];
    nibble_rows(p0.x, p1.x, lo);
    nibble_rows(p0.y, p1.y, hi);
#pragma unroll
    for (int r = 0; r < 4; ++r) q[r] = U2{lo[r], hi[r]};
  }
}

// Rows k0 .. k0+3 of 4 columns (word r: the 4 codes of row k0 + r) to the A pairs of each column:
// a[c][0] = {w(k0, c), w(k0+1, c)}, a[c][1] = {w(k0+2, c), w(k0+3, c)} in fp16. prmt(a, b, sel) picks byte
// sel_i of {b:a} for result byte i: 0x5140 = [a0, b0, a1, b1], 0x7362 the upper bytes; then 0x4140 =
// [t0, 0x64, t1, 0x64] and 0x4342 = [t2, 0x64, t3, 0x64]: two fp16 1024 + c.
__device__ __forceinline__ void dequant4(u32 w0, u32 w1, u32 w2, u32 w3, const u32* off, const u32* scale,
                                         u32 (*a)[2]) {
  const u32 HI64 = 0x64646464u;
  const u32 t01[2] = {prmt(w0, w1, 0x5140u), prmt(w0, w1, 0x7362u)};
  const u32 t23[2] = {prmt(w2, w3, 0x5140u), prmt(w2, w3, 0x7362u)};
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const u32 sel = (c & 1) ? 0x4342u : 0x4140u;
    a[c][0] = hmul2(hsub2(prmt(t01[c >> 1], HI64, sel), off[c]), scale[c]);
    a[c][1] = hmul2(hsub2(prmt(t23[c >> 1], HI64, sel), off[c]), scale[c]);
  }
}

// Split-K: y[m, n] for rows m0 .. m0+rows-1 and columns n0 .. n0+cols-1 (multiples of 4, within N) is the
// sum over the splits of part [splits, M, N] in split order (deterministic), plus bias. Four columns a
// thread, eight splits deep in flight: this tail runs on one block per tile, so it is latency-bound.
__device__ void sum_splits(const float* __restrict__ part, const u16* __restrict__ bias, u16* __restrict__ y,
                           int M, int N, int m0, int rows, int n0, int cols, int splits, long long stride_ym,
                           int has_bias) {
  const long long stride = (long long)M * N;
  for (int i = threadIdx.x; i < rows * (cols / 4); i += blockDim.x) {
    const int m = m0 + i / (cols / 4), n = n0 + 4 * (i % (cols / 4));
    const float* p = part + (long long)m * N + n;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
    for (int sp = 0; sp < splits; ++sp) {
      float4 v;
      asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];"
                   : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p + sp * stride));
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    if (has_bias) {
      sum.x += half_to_float(bias[n]);
      sum.y += half_to_float(bias[n + 1]);
      sum.z += half_to_float(bias[n + 2]);
      sum.w += half_to_float(bias[n + 3]);
    }
    *reinterpret_cast<U2*>(y + m * stride_ym + n) = U2{pack_half2(sum.x, sum.y), pack_half2(sum.z, sum.w)};
  }
}

// Whether this block is the last of the splits of `tile` to finish (its partials, written before the
// call by any thread, are then visible to the whole block). The last one sets the ticket back to zero
// once it has summed, for the next launch and for graph replays.
__device__ bool last_of_splits(int* tickets, int tile) {
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(tickets + tile, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// ---------------------------------------------------------------------------------------------------
// GEMV, M <= 8 MT rows. The weight is A (its 8 rows: output columns), x^T is B (its 8 columns: rows of x),
// so every code is loaded and converted once whatever M is. Lane L owns the 8 columns n_L = 256 bx + 8 L
// .. + 7 of a warp's 256: per 4-row K step it loads 8 codes of each of rows k0 .. k0+3 (one 8-byte load
// each), which dequant4 turns into the A fragments of 8 MMAs c = 0..7 (MMA c: A row T = column n_L + c).
// B: lane L holds x row m = 8 mt + T, k0 .. k0+3 (one 8-byte load). D of MMA c, element i of lane L: the
// column n_S + c of lane S = (L & ~2) | (i & 2) (the QP thread whose A row it is) and x row
// 8 mt + (L & 2) + (i & 1) + (i & 4). The 4 warps of a block share the columns and take the chunks
// w, w + 4, ... of the block's K range (gridDim.y ranges of whole chunks: split-K, summed by the last block
// per tile). A chunk is a scale group, or 128 rows of one where groups are multiples of 128 (a single
// group over K still spreads over the warps and the splits).
template <int MT, int MIN_BLOCKS, int BITS = 8>
__global__ void __launch_bounds__(128, MIN_BLOCKS) gptq_gemv_m884(
    const u16* __restrict__ x, const u8* __restrict__ codes, const u16* __restrict__ scales,
    const u16* __restrict__ zeros, const u16* __restrict__ bias, float* __restrict__ part, u16* __restrict__ y,
    int* __restrict__ tickets, int M, int N, int K, int group, int k_split, long long stride_xm,
    long long stride_qk, long long stride_sg, long long stride_ym, int has_zero, int has_bias) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int T = (lane & 3) + 4 * (lane >> 4);
  const int n_lane = blockIdx.x * 256 + 8 * lane;
  const bool n_ok = n_lane < N;  // N % 8 == 0: a lane's 8 columns are all in or all out
  const int k_lo = blockIdx.y * k_split, k_hi = min(K, k_lo + k_split);

  float acc[MT][8][8];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int c = 0; c < 8; ++c)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[mt][c][i] = 0.f;

  const int chunk = group % 128 == 0 ? 128 : group;  // cuda_sm70.gemv_chunk
  for (int kg = k_lo + warp * chunk; kg < k_hi; kg += 4 * chunk) {
    const long long g_off = (long long)(kg / group) * stride_sg + n_lane;
    // columns past N get scale 0: their weights are 0
    const U4 s_raw = n_ok ? *reinterpret_cast<const U4*>(scales + g_off) : splat4(0u);
    const U4 z_raw =
        has_zero && n_ok ? *reinterpret_cast<const U4*>(zeros + g_off) : splat4(symmetric_zero<BITS>());
    const Columns8 col = columns8(s_raw, z_raw);
    const u8* p = codes + (long long)(kg / (8 / BITS)) * stride_qk + n_lane;
    for (int k16 = kg; k16 < kg + chunk; k16 += 16) {  // group % 16 == 0
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        const int k0 = k16 + 4 * s;
        U2 q[4];
        load_rows4<BITS>(p, stride_qk, n_ok, q);
        p += (4 / (8 / BITS)) * stride_qk;
        u32 xb[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const int m = 8 * mt + T;
          const U2 v = load8(x + m * stride_xm + k0, m < M);
          xb[mt][0] = v.x;
          xb[mt][1] = v.y;
        }
        u32 a[8][2];
        dequant4(q[0].x, q[1].x, q[2].x, q[3].x, col.off, col.scale, a);
        dequant4(q[0].y, q[1].y, q[2].y, q[3].y, col.off + 4, col.scale + 4, a + 4);
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) mma_m8n8k4(acc[mt][c], a[c][0], a[c][1], xb[mt][0], xb[mt][1]);
      }
    }
  }

  // the four warps' sums into warp 0's registers, one warp after another (a fixed order)
  __shared__ float red[MT * 64][32];
#pragma unroll 1
  for (int w = 1; w < 4; ++w) {
    if (warp == w)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 8; ++c)
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            float& r = red[mt * 64 + 8 * c + i][lane];
            r = w == 1 ? acc[mt][c][i] : r + acc[mt][c][i];
          }
    __syncthreads();
  }
  const bool split = gridDim.y > 1;
  if (warp == 0) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int m = 8 * mt + (lane & 2) + (i & 1) + (i & 4);
        const int n = blockIdx.x * 256 + 8 * ((lane & ~2) | (i & 2));
        if (m >= M || n >= N) continue;
        float v[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) v[c] = acc[mt][c][i] + red[mt * 64 + 8 * c + i][lane];
        if (split) {
          float4* po = reinterpret_cast<float4*>(part + ((long long)blockIdx.y * M + m) * N + n);
          po[0] = make_float4(v[0], v[1], v[2], v[3]);
          po[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
          u32 o[4];
#pragma unroll
          for (int h = 0; h < 4; ++h) {
            float lo = v[2 * h], hi = v[2 * h + 1];
            if (has_bias) {
              lo += half_to_float(bias[n + 2 * h]);
              hi += half_to_float(bias[n + 2 * h + 1]);
            }
            o[h] = pack_half2(lo, hi);
          }
          *reinterpret_cast<U4*>(y + m * stride_ym + n) = U4{o[0], o[1], o[2], o[3]};
        }
      }
  }
  if (!split || !last_of_splits(tickets, blockIdx.x)) return;
  const int n0 = blockIdx.x * 256;
  sum_splits(part, bias, y, M, N, 0, M, n0, min(256, N - n0), gridDim.y, stride_ym, has_bias);
  __syncthreads();
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}

// ---------------------------------------------------------------------------------------------------
// GEMM, any M: tiles of 64 rows x 128 columns, K in steps of 32 through shared memory (two buffers: the
// next step's global loads are in flight while the MMAs run on this one). The weight tile is stored
// dequantized and transposed, ws[n][k], so that x (A, .row) and W (B, .col) fragments are both one 8-byte
// load of 4 consecutive k. Row pitch 36 halves (72 bytes): the fragment loads of a half warp (rows
// r .. r+3 and r+8 .. r+11 at one k) and the weight loader's stores fall in distinct banks.
// Loaders (128 threads): x, 4 pieces of 4 halves a thread (row = piece / 8, k = 4 (piece % 8)); codes,
// thread (rq = tid % 8, co = tid / 8) loads rows 4 rq .. 4 rq + 3 of columns 8 co .. 8 co + 7 and stores
// each column's 4 weights, ws[8 co + c][4 rq ..]. Warps 2 x 2, each 32 rows x 64 columns: per k step of 4,
// A fragments of 2 row blocks (mi) and B fragments of 4 column blocks (ni), 8 MMAs. In MMA (mi, ni), QP q
// computes rows 16 mi + 8 (q & 1) + 0..7 and columns 16 ni + 8 (q >> 1) + 0..7 of the warp's tile.
enum { BM = 64, BN = 128, BK = 32, PITCH = 36 };

struct GemmTile {
  U2 x[4], q[4];  // the next K step's global loads
  U4 s, z;        // raw scales / zeros of this thread's 8 columns at group `group_index`
  int group_index;
  bool ok;        // this thread's code rows are inside the K range and its columns inside N
};

template <int BITS>
__device__ __forceinline__ void gemm_load(GemmTile& t, const u16* __restrict__ x, const u8* __restrict__ codes,
                                          const u16* __restrict__ scales, const u16* __restrict__ zeros, int M,
                                          int N, int k_end, int group, int m0, int n0, int kt,
                                          long long stride_xm, long long stride_qk, long long stride_sg,
                                          int has_zero) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int piece = tid + 128 * j, m = m0 + piece / 8, k = kt + 4 * (piece % 8);
    t.x[j] = load8(x + (long long)m * stride_xm + k, m < M && k < k_end);
  }
  const int k = kt + 4 * (tid % 8), n = n0 + 8 * (tid / 8);
  t.ok = k < k_end && n < N;
  load_rows4<BITS>(codes + (long long)(k / (8 / BITS)) * stride_qk + n, stride_qk, t.ok, t.q);
  const int g = k / group;
  if (t.ok && g != t.group_index) {
    t.group_index = g;
    t.s = *reinterpret_cast<const U4*>(scales + (long long)g * stride_sg + n);
    if (has_zero) t.z = *reinterpret_cast<const U4*>(zeros + (long long)g * stride_sg + n);
  }
}

template <int BITS>
__device__ __forceinline__ void gemm_store(const GemmTile& t, u16 (*xs)[PITCH], u16 (*ws)[PITCH], int has_zero) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int piece = tid + 128 * j;
    *reinterpret_cast<U2*>(&xs[piece / 8][4 * (piece % 8)]) = t.x[j];
  }
  // rows past the K range or columns past N: scale 0, so their weights are 0
  const Columns8 col = columns8(t.ok ? t.s : splat4(0u), has_zero ? t.z : splat4(symmetric_zero<BITS>()));
  u32 a[8][2];
  dequant4(t.q[0].x, t.q[1].x, t.q[2].x, t.q[3].x, col.off, col.scale, a);
  dequant4(t.q[0].y, t.q[1].y, t.q[2].y, t.q[3].y, col.off + 4, col.scale + 4, a + 4);
  const int rq = tid % 8, co = tid / 8;
#pragma unroll
  for (int c = 0; c < 8; ++c) *reinterpret_cast<U2*>(&ws[8 * co + c][4 * rq]) = U2{a[c][0], a[c][1]};
}

template <int MIN_BLOCKS, int BITS = 8>
__global__ void __launch_bounds__(128, MIN_BLOCKS) gptq_gemm_m884(
    const u16* __restrict__ x, const u8* __restrict__ codes, const u16* __restrict__ scales,
    const u16* __restrict__ zeros, const u16* __restrict__ bias, float* __restrict__ part, u16* __restrict__ y,
    int* __restrict__ tickets, int M, int N, int K, int group, int k_split, long long stride_xm,
    long long stride_qk, long long stride_sg, long long stride_ym, int has_zero, int has_bias) {
  __shared__ __align__(16) u16 xs[2][BM][PITCH];
  __shared__ __align__(16) u16 ws[2][BN][PITCH];
  // tile order: 8 row tiles sweep the column tiles together, so that the codes they share stay in the L2
  const int tiles_n = (N + BN - 1) / BN, tiles_m = (M + BM - 1) / BM;
  const int per_group = 8 * tiles_n, first_m = (blockIdx.x / per_group) * 8;
  const int size_m = min(tiles_m - first_m, 8);
  const int tile_m = first_m + (blockIdx.x % per_group) % size_m, tile_n = (blockIdx.x % per_group) / size_m;
  const int m0 = tile_m * BM, n0 = tile_n * BN;
  const int k_lo = blockIdx.y * k_split, k_end = min(K, k_lo + k_split);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int q = (lane >> 2) & 3, T = (lane & 3) + 4 * (lane >> 4);
  const int wm = 32 * (warp & 1), wn = 64 * (warp >> 1);

  float acc[2][4][8];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[mi][ni][i] = 0.f;

  GemmTile t;
  t.group_index = -1;
  t.s = t.z = splat4(0u);
  gemm_load<BITS>(t, x, codes, scales, zeros, M, N, k_end, group, m0, n0, k_lo, stride_xm, stride_qk, stride_sg,
            has_zero);
  gemm_store<BITS>(t, xs[0], ws[0], has_zero);
  __syncthreads();
  int buf = 0;
  for (int kt = k_lo; kt < k_end; kt += BK) {
    const bool more = kt + BK < k_end;
    if (more)
      gemm_load<BITS>(t, x, codes, scales, zeros, M, N, k_end, group, m0, n0, kt + BK, stride_xm, stride_qk, stride_sg,
                has_zero);
#pragma unroll
    for (int ks = 0; ks < BK / 4; ++ks) {
      U2 af[2], bf[4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
        af[mi] = *reinterpret_cast<const U2*>(&xs[buf][wm + 16 * mi + 8 * (q & 1) + T][4 * ks]);
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
        bf[ni] = *reinterpret_cast<const U2*>(&ws[buf][wn + 16 * ni + 8 * (q >> 1) + T][4 * ks]);
#pragma unroll
      for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) mma_m8n8k4(acc[mi][ni], af[mi].x, af[mi].y, bf[ni].x, bf[ni].y);
    }
    if (more) gemm_store<BITS>(t, xs[buf ^ 1], ws[buf ^ 1], has_zero);
    __syncthreads();
    buf ^= 1;
  }

  // element i of MMA (mi, ni): row (lane & 1) + (i & 2) + 4 (lane / 16), column (i & 1) + (lane & 2) + (i & 4)
  // of the QP's 8 x 8 block; i and i + 1 are neighbouring columns (one 4-byte store)
  const bool split = gridDim.y > 1;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        const int m = m0 + wm + 16 * mi + 8 * (q & 1) + (lane & 1) + (i & 2) + 4 * (lane >> 4);
        const int n = n0 + wn + 16 * ni + 8 * (q >> 1) + (lane & 2) + (i & 4);
        if (m >= M || n >= N) continue;
        float lo = acc[mi][ni][i], hi = acc[mi][ni][i + 1];
        if (split) {
          *reinterpret_cast<float2*>(part + ((long long)blockIdx.y * M + m) * N + n) = make_float2(lo, hi);
        } else {
          if (has_bias) {
            lo += half_to_float(bias[n]);
            hi += half_to_float(bias[n + 1]);
          }
          *reinterpret_cast<u32*>(y + m * stride_ym + n) = pack_half2(lo, hi);
        }
      }
  if (!split || !last_of_splits(tickets, blockIdx.x)) return;
  sum_splits(part, bias, y, M, N, m0, min(BM, M - m0), n0, min(BN, N - n0), gridDim.y, stride_ym, has_bias);
  __syncthreads();
  if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}

// Small device helpers shared by qv's raw-CUDA kernels (linear/gptq_gemv_mma.cu,
// paged_attention/paged_decode_mma.cu, which include it as "../cuda_common.cuh"): fixed-
// width types, fp16/bf16 conversions, byte permutes, the m16n8k16 MMA. cuda_build.source_text pastes it in
// place of the #include before NVRTC sees the code; no CUDA headers are needed.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

struct __align__(16) U4 { u32 x, y, z, w; };
struct __align__(8) U2 { u32 x, y; };

__device__ __forceinline__ float half_to_float(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ float bf16_to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ float to_float(u16 h, bool bf16) { return bf16 ? bf16_to_float(h) : half_to_float(h); }
__device__ __forceinline__ u16 float_to(float f, bool bf16) {
  u16 h;
  if (bf16) asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ u32 pack_half2(float lo, float hi) {
  u32 r;
#if __CUDA_ARCH__ >= 800
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else  // the paired convert is sm_80's: two single ones (the same rounding)
  asm("{.reg .f16 l, h;\n cvt.rn.f16.f32 l, %1;\n cvt.rn.f16.f32 h, %2;\n mov.b32 %0, {l, h};}"
      : "=r"(r) : "f"(lo), "f"(hi));
#endif
  return r;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float load_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ U4 load16(const void* p, bool ok) {
  U4 v = {0u, 0u, 0u, 0u};
  if (ok) v = *reinterpret_cast<const U4*>(p);
  return v;
}
// A 16-byte load through the read-only path (ld.global.nc): explicit, for kernels that also use load16_now
// on the same pointer, which would otherwise keep the compiler from proving the data read-only.
__device__ __forceinline__ U4 load16_nc(const void* p) {
  U4 v;
  asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// A 16-byte load issued where it stands (a volatile load: neither the compiler nor ptxas sinks it below a
// branch such as an early exit, as they do a plain load whose value only the path past the branch uses).
__device__ __forceinline__ U4 load16_now(const void* p) {
  U4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Starts bringing the line at p into the L2 (no register waits on it).
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
// Four int8 codes (one word, byte i = code i) to two fp16 pairs, exactly: c ^ 0x80 = c + 128 as a byte,
// with 0x64 as the high byte that reads as fp16 1024 + 128 + c, less 1152 (5 instructions, no converts).
__device__ __forceinline__ void codes_to_half2(u32 w, u32& lo, u32& hi) {
  const u32 x = w ^ 0x80808080u;
  u32 a = prmt(x, 0x64646464u, 0x4140u), b = prmt(x, 0x64646464u, 0x4342u);
  asm("sub.f16x2 %0, %0, %1;" : "+r"(a) : "r"(0x64806480u));
  asm("sub.f16x2 %0, %0, %1;" : "+r"(b) : "r"(0x64806480u));
  lo = a;
  hi = b;
}
// The 8x8 b16 matrix whose row r the lanes 4r .. 4r + 3 hold (two elements a lane), transposed.
__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

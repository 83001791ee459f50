// A measurement, not a qv kernel: CUTLASS 3's Hopper mixed-input GEMM (int8 codes x bf16 rows, group scales)
// at the 27B shapes, built and timed by bench/cutlass_probe.py beside qv's GPTQ path and cuBLAS.
// Y[M,N] = X[M,K] (Wq[N,K] * S[K/g,N])^T, computed swapped (D^T = W X^T) so the int8 operand is wgmma's A
// from registers; CUTLASS needs it K-major, which is why qv's [K, N] codes are transposed for it.
#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;

template <int TM, int TN, bool Coop>
struct Config {
  using Quant = int8_t;
  using Mma = cutlass::bfloat16_t;
  using Scale = cutlass::bfloat16_t;
  using Out = cutlass::bfloat16_t;
  using LayoutQ = cutlass::layout::RowMajor;      // Wq [N, K]: K-major, the swapped problem's A
  using LayoutX = cutlass::layout::ColumnMajor;   // X [M, K] row-major seen as B [K, M]: K-major
  using LayoutD = cutlass::layout::ColumnMajor;   // D^T [N, M] column-major = Y [M, N] row-major
  using Tile = Shape<Int<TM>, Int<TN>, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using KernelSchedule = cute::conditional_t<Coop, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                             cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using EpiSchedule = cute::conditional_t<Coop, cutlass::epilogue::TmaWarpSpecializedCooperative,
                                          cutlass::epilogue::TmaWarpSpecialized>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      Out, LayoutD, 8, Out, LayoutD, 8, EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<Quant, Scale>, LayoutQ, 16,
      Mma, LayoutX, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static int run(const void* wq, const void* x, const void* s, void* y, int m, int n, int k, int g,
                 void* ws, size_t ws_size, cudaStream_t stream, size_t* need) {
    using StrideA = cutlass::detail::TagToStrideA_t<LayoutQ>;
    using StrideB = cutlass::detail::TagToStrideB_t<LayoutX>;
    using StrideC = typename Kernel::StrideC;
    using StrideD = typename Kernel::StrideD;
    using StrideS = typename Mainloop::StrideScale;
    int groups = (k + g - 1) / g;
    auto sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(n, k, 1));
    auto sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(m, k, 1));
    auto sc = cutlass::make_cute_packed_stride(StrideC{}, make_shape(n, m, 1));
    auto sd = cutlass::make_cute_packed_stride(StrideD{}, make_shape(n, m, 1));
    auto ss = cutlass::make_cute_packed_stride(StrideS{}, make_shape(n, groups, 1));
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm, {n, m, k, 1},
        {static_cast<const Quant*>(wq), sa, static_cast<const Mma*>(x), sb, static_cast<const Scale*>(s), ss, g},
        {{1.0f, 0.0f}, static_cast<const Out*>(y), sc, static_cast<Out*>(y), sd}};
    Gemm gemm;
    size_t want = Gemm::get_workspace_size(args);
    if (need) { *need = want; return 0; }
    if (want > ws_size) return 2;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 3;
    if (gemm.initialize(args, ws, stream) != cutlass::Status::kSuccess) return 4;
    return gemm.run(stream) == cutlass::Status::kSuccess ? 0 : 5;
  }
};

extern "C" int qv_w8a16_gemm(int cfg, const void* wq, const void* x, const void* s, void* y, int m, int n, int k, int g,
                             void* ws, size_t ws_size, void* stream, size_t* need) {
  auto st = static_cast<cudaStream_t>(stream);
  switch (cfg) {
    case 0: return Config<128, 128, true>::run(wq, x, s, y, m, n, k, g, ws, ws_size, st, need);
    case 1: return Config<128, 64, true>::run(wq, x, s, y, m, n, k, g, ws, ws_size, st, need);
    case 2: return Config<128, 256, true>::run(wq, x, s, y, m, n, k, g, ws, ws_size, st, need);
    case 3: return Config<64, 128, false>::run(wq, x, s, y, m, n, k, g, ws, ws_size, st, need);
    case 4: return Config<128, 32, true>::run(wq, x, s, y, m, n, k, g, ws, ws_size, st, need);
    case 5: return Config<64, 64, false>::run(wq, x, s, y, m, n, k, g, ws, ws_size, st, need);
    default: return 1;
  }
}

// CUTLASS 3.x pointer-array grouped GEMM for MoE experts, plus the device-side problem
// description that makes a call free of host synchronisation (CUDA-graph capturable).
//
// A call runs three kernels on the caller's stream:
//   1. prepare_groups: one CTA reads tokens_per_expert on the device, scans it and writes the
//      per-group problem shapes, operand pointers and strides into the workspace;
//   2. the CUTLASS grouped GEMM (persistent, TMA + warp-specialised WGMMA on sm_90a, tcgen05/UMMA
//      on sm_100a), which reads those arrays (no host-side problem shapes);
//   3. a zero fill: rows past sum(tokens_per_expert) (forward) or experts without tokens (wgrad).
// Nothing is copied to or from the host, so the same call can be captured once and replayed
// with new routings.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>

#include "cutlass/cutlass.h"
#include "cute/tensor.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

#include "grouped_gemm.h"

namespace mtp_cuda {

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using GroupShape = ProblemShape::UnderlyingProblemShape;  // (M, N, K) of one group

// ---------------------------------------------------------------------------------------------
// Tile configurations (one place to tune once GPU timings exist).
// ---------------------------------------------------------------------------------------------

// Hopper: persistent cooperative kernel (2 consumer warp groups), TMA loads multicast across a
// 2x1 cluster (two M tiles share the expert's weight tile), 128x128x64 CTA tile.
struct Sm90Config {
  using ArchTag = cutlass::arch::Sm90;
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Hopper, small groups: ping-pong kernel (the two consumer warp groups take alternate 64-row
// tiles, one's epilogue overlapping the other's MMAs), no cluster, 64x128x64 tile. An expert is
// rounded up to 64 rows of MMA instead of the cooperative kernel's 256 (a 2x1 cluster of 128-row
// tiles), which is what decides small-group efficiency (Runner picks it, see bindings.cpp).
struct Sm90SmallConfig {
  using ArchTag = cutlass::arch::Sm90;
  using TileShape = cute::Shape<cute::_64, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// Blackwell: 1-SM UMMA (tcgen05) kernel with the accumulator in tensor memory, 128x256x64 MMA
// tile, no cluster (each CTA loads its own operands).
struct Sm100Config {
  using ArchTag = cutlass::arch::Sm100;
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
};

// Blackwell, small groups: the same 1-SM UMMA kernel with 64x128x64 tiles (tcgen05's smallest
// 1-SM M): an expert is rounded up to 64 rows of MMA instead of 128, and the narrower N tile
// gives twice the tiles to spread over the SMs when the experts are many and short.
struct Sm100SmallConfig {
  using ArchTag = cutlass::arch::Sm100;
  using TileShape = cute::Shape<cute::_64, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using MainloopSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecialized1SmSm100;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecialized1Sm;
};

template <DType kDType> struct ElementOf;
template <> struct ElementOf<kBF16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<kFP16> { using type = cutlass::half_t; };

// Operand layouts in CUTLASS terms (A is M x K, B is K x N, D is M x N).
template <Op kOp> struct OpLayouts;
template <> struct OpLayouts<kFwd> {        // x @ w[e], w[e] is [K, N] with N contiguous
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::RowMajor;
};
template <> struct OpLayouts<kFwdTransB> {  // x @ w[e]^T, w[e] is [N, K] with K contiguous
  using A = cutlass::layout::RowMajor;
  using B = cutlass::layout::ColumnMajor;
};
template <> struct OpLayouts<kWgrad> {      // x_e^T @ dy_e: A = x_e^T is K x r_e, K contiguous
  using A = cutlass::layout::ColumnMajor;
  using B = cutlass::layout::RowMajor;
};

template <class Config, Op kOp, DType kDType>
struct GroupedGemm {
  using Element = typename ElementOf<kDType>::type;
  using LayoutA = typename OpLayouts<kOp>::A;
  using LayoutB = typename OpLayouts<kOp>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignment = 128 / cutlass::sizeof_bits<Element>::value;  // 16 bytes

  // D = 1 * acc (no source operand: ElementC = void), rounded to the input dtype.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      typename Config::ArchTag, cutlass::arch::OpClassTensorOp,
      typename Config::TileShape, typename Config::ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      float, float,
      void, LayoutD*, kAlignment,
      Element, LayoutD*, kAlignment,
      typename Config::EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, float, void>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      typename Config::ArchTag, cutlass::arch::OpClassTensorOp,
      Element, LayoutA*, kAlignment,
      Element, LayoutB*, kAlignment,
      float,
      typename Config::TileShape, typename Config::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Config::MainloopSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

// ---------------------------------------------------------------------------------------------
// Device-side problem description.
// ---------------------------------------------------------------------------------------------

// A packed stride has one dynamic (int64) mode among the first two; set it to `ld`.
template <class Stride>
__device__ __forceinline__ Stride leading_stride(int64_t ld) {
  Stride s{};
  if constexpr (cute::is_static<cute::remove_cvref_t<decltype(cute::get<0>(s))>>::value) {
    cute::get<1>(s) = ld;
  } else {
    cute::get<0>(s) = ld;
  }
  return s;
}

// Per-group arrays that CUTLASS reads, carved out of the workspace.
template <class G>
struct GroupTables {
  using Element = typename G::Element;
  GroupShape* shapes;
  Element const** ptr_a;
  Element const** ptr_b;
  Element** ptr_d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  int* group_rows;      // r_e after clamping to the M rows of x
  int64_t* total_rows;  // min(sum r_e, M)
};

constexpr int kPrepareThreads = 256;

// One CTA: block-wide prefix sum of tokens_per_expert in chunks of kPrepareThreads groups.
// Negative counts are treated as 0 and offsets are clamped to M, so a bad routing can never make
// the GEMM read or write outside x / out (the Python side validates the counts when allowed).
template <class G, Op kOp>
__global__ void __launch_bounds__(kPrepareThreads)
prepare_groups(Problem p, GroupTables<G> t) {
  using Element = typename G::Element;
  __shared__ int64_t scan[kPrepareThreads];
  __shared__ int64_t carry;
  const int tid = threadIdx.x;
  if (tid == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < p.groups; base += kPrepareThreads) {
    const int e = base + tid;
    int64_t count = 0;
    if (e < p.groups) {
      count = p.tokens_int64 ? static_cast<int64_t const*>(p.tokens)[e]
                             : static_cast<int64_t>(static_cast<int32_t const*>(p.tokens)[e]);
      count = count < 0 ? 0 : count;
    }
    scan[tid] = count;
    __syncthreads();
    for (int offset = 1; offset < kPrepareThreads; offset <<= 1) {
      const int64_t add = tid >= offset ? scan[tid - offset] : 0;
      __syncthreads();
      scan[tid] += add;
      __syncthreads();
    }
    const int64_t start = carry + scan[tid] - count;
    __syncthreads();
    if (tid == kPrepareThreads - 1) carry += scan[tid];
    if (e < p.groups) {
      const int64_t lo = start < p.m ? start : p.m;
      const int64_t hi = start + count < p.m ? start + count : p.m;
      const int rows = static_cast<int>(hi - lo);
      t.group_rows[e] = rows;
      auto const* a = static_cast<Element const*>(p.a);
      auto const* b = static_cast<Element const*>(p.b);
      auto* d = static_cast<Element*>(p.d);
      if constexpr (kOp == kWgrad) {
        // out[e] (K x N) = x_e^T (K x r_e) @ dy_e (r_e x N); an empty group gets no tiles and is
        // zeroed by zero_empty_groups (CUTLASS would leave a K = 0 accumulator unwritten).
        t.shapes[e] = rows > 0 ? GroupShape(static_cast<int>(p.k), static_cast<int>(p.n), rows)
                               : GroupShape(0, 0, 0);
        t.ptr_a[e] = a + lo * p.k;
        t.ptr_b[e] = b + lo * p.n;
        t.ptr_d[e] = d + static_cast<int64_t>(e) * p.k * p.n;
        t.stride_a[e] = leading_stride<typename G::StrideA>(p.k);
        t.stride_b[e] = leading_stride<typename G::StrideB>(p.n);
      } else {
        t.shapes[e] = GroupShape(rows, static_cast<int>(p.n), static_cast<int>(p.k));
        t.ptr_a[e] = a + lo * p.k;
        t.ptr_b[e] = b + static_cast<int64_t>(e) * p.k * p.n;
        t.ptr_d[e] = d + lo * p.n;
        t.stride_a[e] = leading_stride<typename G::StrideA>(p.k);
        t.stride_b[e] = leading_stride<typename G::StrideB>(kOp == kFwd ? p.n : p.k);
      }
      t.stride_d[e] = leading_stride<typename G::StrideD>(p.n);
    }
    __syncthreads();
  }
  if (tid == 0) *t.total_rows = carry < p.m ? carry : p.m;
}

namespace {  // internal linkage: every instantiation object carries its own copy

// Zero rows [total_rows, M) of out (forward). 16-byte stores: N is a multiple of 8 elements.
__global__ void zero_tail_rows(uint4* out, int64_t const* total_rows, int64_t m, int64_t n) {
  const int64_t vec_per_row = n / 8;
  const int64_t begin = *total_rows * vec_per_row;
  const int64_t end = m * vec_per_row;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < end;
       i += step) {
    out[i] = make_uint4(0, 0, 0, 0);
  }
}

// Zero out[e] (K x N) for every group without rows (wgrad). Grid: (blocks per group, E).
__global__ void zero_empty_groups(uint4* out, int const* group_rows, int64_t k, int64_t n) {
  const int e = blockIdx.y;
  if (group_rows[e] != 0) return;
  const int64_t vec = k * n / 8;
  uint4* base = out + static_cast<int64_t>(e) * vec;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vec;
       i += step) {
    base[i] = make_uint4(0, 0, 0, 0);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Host side: workspace layout, hardware info, launch.
// ---------------------------------------------------------------------------------------------

constexpr size_t kWorkspaceAlign = 256;
inline size_t align_up(size_t x) { return (x + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Byte offsets of the tables inside the workspace; the CUTLASS workspace follows them.
template <class G>
struct WorkspaceLayout {
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, group_rows, total_rows, cutlass;
  explicit WorkspaceLayout(int groups) {
    const size_t e = static_cast<size_t>(groups);
    size_t at = 0;
    auto take = [&at](size_t bytes) { size_t here = at; at = align_up(at + bytes); return here; };
    shapes = take(e * sizeof(GroupShape));
    ptr_a = take(e * sizeof(void*));
    ptr_b = take(e * sizeof(void*));
    ptr_d = take(e * sizeof(void*));
    stride_a = take(e * sizeof(typename G::StrideA));
    stride_b = take(e * sizeof(typename G::StrideB));
    stride_d = take(e * sizeof(typename G::StrideD));
    group_rows = take(e * sizeof(int));
    total_rows = take(sizeof(int64_t));
    cutlass = at;
  }
  GroupTables<G> tables(void* workspace) const {
    auto* base = static_cast<char*>(workspace);
    using Element = typename G::Element;
    return {reinterpret_cast<GroupShape*>(base + shapes),
            reinterpret_cast<Element const**>(base + ptr_a),
            reinterpret_cast<Element const**>(base + ptr_b),
            reinterpret_cast<Element**>(base + ptr_d),
            reinterpret_cast<typename G::StrideA*>(base + stride_a),
            reinterpret_cast<typename G::StrideB*>(base + stride_b),
            reinterpret_cast<typename G::StrideD*>(base + stride_d),
            reinterpret_cast<int*>(base + group_rows),
            reinterpret_cast<int64_t*>(base + total_rows)};
  }
};

// SM count and cluster occupancy of one kernel on one device: queried once (outside any graph
// capture, since workspace_size() runs before the first launch) and cached.
template <class G>
cutlass::KernelHardwareInfo hardware_info(int device) {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static cutlass::KernelHardwareInfo info[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) {
    return cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename G::Kernel>(device);
  }
  std::call_once(once[device], [device] {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(device);
    info[device] = cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename G::Kernel>(device);
    cudaSetDevice(previous);
  });
  return info[device];
}

template <class G>
typename G::Gemm::Arguments make_arguments(int groups, GroupTables<G> const& t, int device) {
  typename G::Gemm::Arguments args{};
  args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
  args.problem_shape = ProblemShape{groups, t.shapes, nullptr};  // shapes live on the device only
  args.mainloop.ptr_A = t.ptr_a;
  args.mainloop.dA = t.stride_a;
  args.mainloop.ptr_B = t.ptr_b;
  args.mainloop.dB = t.stride_b;
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  args.epilogue.ptr_C = nullptr;
  args.epilogue.dC = t.stride_d;
  args.epilogue.ptr_D = t.ptr_d;
  args.epilogue.dD = t.stride_d;
  args.hw_info = hardware_info<G>(device);
  return args;
}

template <class Config, Op kOp, DType kDType>
struct Runner {
  using G = GroupedGemm<Config, kOp, kDType>;

  static size_t workspace_size(int groups, int device) {
    WorkspaceLayout<G> layout(groups);
    GroupTables<G> t = layout.tables(nullptr);
    auto args = make_arguments<G>(groups, t, device);
    return layout.cutlass + align_up(G::Gemm::get_workspace_size(args));
  }

  static const char* launch(Problem const& p) {
    if (p.groups <= 0) return "grouped GEMM needs at least one group";
    if (p.workspace_bytes < workspace_size(p.groups, p.device)) return "workspace too small";
    WorkspaceLayout<G> layout(p.groups);
    GroupTables<G> t = layout.tables(p.workspace);

    prepare_groups<G, kOp><<<1, kPrepareThreads, 0, p.stream>>>(p, t);
    if (cudaPeekAtLastError() != cudaSuccess) return cudaGetErrorString(cudaGetLastError());

    auto args = make_arguments<G>(p.groups, t, p.device);
    if (G::Gemm::can_implement(args) != cutlass::Status::kSuccess) {
      return "CUTLASS cannot implement this grouped GEMM (alignment or shape)";
    }
    if (const char* error = configure(p.device)) return error;
    // What GemmUniversalAdapter::initialize() + run() do, minus the per-call attribute setting:
    // the workspace's initialisation, the kernel parameters (host-side, from the device tables'
    // addresses) and the launch.
    void* cutlass_workspace = static_cast<char*>(p.workspace) + layout.cutlass;
    cutlass::Status status =
        G::Kernel::initialize_workspace(args, cutlass_workspace, p.stream, nullptr);
    if (status != cutlass::Status::kSuccess) return cutlass::cutlassGetStatusString(status);
    auto params = G::Kernel::to_underlying_arguments(args, cutlass_workspace);
    status = G::Gemm::run(params, p.stream);
    if (status != cutlass::Status::kSuccess) return cutlass::cutlassGetStatusString(status);

    constexpr int kZeroThreads = 256;
    if constexpr (kOp == kWgrad) {
      const int64_t vec = p.k * p.n / 8;
      const int blocks = static_cast<int>(std::min<int64_t>((vec + kZeroThreads - 1) / kZeroThreads, 64));
      if (blocks > 0) {
        zero_empty_groups<<<dim3(blocks, p.groups), kZeroThreads, 0, p.stream>>>(
            static_cast<uint4*>(p.d), t.group_rows, p.k, p.n);
      }
    } else {
      const int blocks = std::max(1, args.hw_info.sm_count);
      zero_tail_rows<<<blocks, kZeroThreads, 0, p.stream>>>(static_cast<uint4*>(p.d),
                                                            t.total_rows, p.m, p.n);
    }
    if (cudaPeekAtLastError() != cudaSuccess) return cudaGetErrorString(cudaGetLastError());
    return nullptr;
  }

  static std::atomic<long>& setup_counter() {
    static std::atomic<long> count{0};
    return count;
  }

  static long setups() { return setup_counter().load(); }

  // The kernel's dynamic shared-memory limit (what CUTLASS's initialize() sets on every call):
  // a property of the kernel on a device, set once per device.
  static const char* configure_now() {
    setup_counter()++;
    const int smem = static_cast<int>(G::Kernel::SharedStorageSize);
    if (smem >= (48 << 10) &&
        cudaFuncSetAttribute(cutlass::device_kernel<typename G::Kernel>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) {
      cudaGetLastError();  // clear the error bit
      return "cudaFuncSetAttribute(cudaFuncAttributeMaxDynamicSharedMemorySize) failed";
    }
    return nullptr;
  }

  static const char* configure(int device) {
    constexpr int kMaxDevices = 64;
    static std::once_flag once[kMaxDevices];
    static const char* error[kMaxDevices] = {};
    if (device < 0 || device >= kMaxDevices) return configure_now();
    std::call_once(once[device], [device] { error[device] = configure_now(); });
    return error[device];
  }

  static KernelEntry entry() { return KernelEntry{&workspace_size, &launch, &setups}; }
};

}  // namespace mtp_cuda

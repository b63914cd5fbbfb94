// Host-side interface of the CUTLASS pointer-array grouped GEMM (sm_90a / sm_100a).
//
// Every kernel instantiation (one architecture, one operation, one dtype) lives in its own object
// file, built from grouped_gemm_instance.cu with -DMTP_ARCH / -DMTP_OP / -DMTP_DTYPE, so that a
// 2-core machine compiles them one at a time with bounded memory. bindings.cpp (plain C++, no
// CUDA compiler needed) picks the instantiation at run time from this table.
//
// Nothing here depends on torch: pointers, sizes and the stream arrive as integers from Python
// (mtp/ops/grouped_gemm/cutlass.py does the torch side).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

namespace mtp_cuda {

// The three shapes of grouped GEMM that an MoE expert layer needs. Per group e, with
// rows r_e = tokens_per_expert[e] starting at row o_e = sum_{j<e} r_j:
//   kFwd:       out[o_e:o_e+r_e, :N] = x[o_e:o_e+r_e, :K] @ w[e]      w: [E, K, N]
//   kFwdTransB: out[o_e:o_e+r_e, :N] = x[o_e:o_e+r_e, :K] @ w[e]^T    w: [E, N, K]
//   kWgrad:     out[e] = x[o_e:o_e+r_e, :K]^T @ dy[o_e:o_e+r_e, :N]  out: [E, K, N]
// kFwd / kFwdTransB also zero rows [sum r_e, M) of out; kWgrad writes exact zeros to out[e]
// for experts with r_e == 0. Data-gradients (dgrad) are kFwd / kFwdTransB with the other one.
enum Op : int { kFwd = 0, kFwdTransB = 1, kWgrad = 2 };
enum DType : int { kBF16 = 0, kFP16 = 1 };

struct Problem {
  const void* a = nullptr;       // x, [M, K] row-major
  const void* b = nullptr;       // w ([E, K, N] or [E, N, K]) for kFwd*, dy [M, N] for kWgrad
  void* d = nullptr;             // out: [M, N] for kFwd*, [E, K, N] for kWgrad
  const void* tokens = nullptr;  // tokens_per_expert, [E] on the device
  bool tokens_int64 = false;     // int64 when true, int32 otherwise
  int64_t m = 0, n = 0, k = 0;   // M (rows of x), N, K
  int groups = 0;                // E
  void* workspace = nullptr;     // device buffer of at least workspace_size(groups) bytes
  size_t workspace_bytes = 0;
  cudaStream_t stream = nullptr;
  int device = 0;                // CUDA device ordinal the pointers live on
};

// One compiled instantiation. `launch` returns nullptr on success, else a static error text.
// `setups`: how many times it has configured its kernel (the dynamic shared-memory attribute):
// once per device it ran on, never per call.
struct KernelEntry {
  size_t (*workspace_size)(int groups, int device);
  const char* (*launch)(const Problem& problem);
  long (*setups)();
};

}  // namespace mtp_cuda

// Symbol of one instantiation, e.g. mtp_cuda_entry_sm90_kFwd_kBF16().
#define MTP_CUDA_ENTRY_NAME_(arch, op, dtype) mtp_cuda_entry_##arch##_##op##_##dtype
#define MTP_CUDA_ENTRY_NAME(arch, op, dtype) MTP_CUDA_ENTRY_NAME_(arch, op, dtype)
#define MTP_CUDA_DECLARE_ENTRY(arch, op, dtype) \
  mtp_cuda::KernelEntry MTP_CUDA_ENTRY_NAME(arch, op, dtype)()

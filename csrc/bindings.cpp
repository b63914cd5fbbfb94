// pybind11 module mtp._cuda_gemm: the CUTLASS grouped GEMM kernels behind a torch-free interface.
//
// Tensors cross this boundary as raw device pointers (ints), sizes and a cudaStream_t handle, so
// the module builds and links without torch (CI has a CPU-only torch). mtp/ops/grouped_gemm/cutlass.py does
// the torch side: argument checks, workspace from the caching allocator, the current stream.
//
// Compiled by the host C++ compiler; the kernels come from the grouped_gemm_instance.cu objects,
// present for the architectures selected at build time (MTP_WITH_SM90 / MTP_WITH_SM100).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "grouped_gemm.h"

namespace py = pybind11;
using mtp_cuda::KernelEntry;

// One op of one family: its two dtypes' entries (declaration, table row).
#define MTP_DECLARE_OP(arch, op)          \
  MTP_CUDA_DECLARE_ENTRY(arch, op, kBF16); \
  MTP_CUDA_DECLARE_ENTRY(arch, op, kFP16)
#define MTP_OP_ROW(arch, op) \
  {MTP_CUDA_ENTRY_NAME(arch, op, kBF16)(), MTP_CUDA_ENTRY_NAME(arch, op, kFP16)()}

// A small-group family has the forward ops only (see csrc/build_ext.py); an architecture's
// default family has the weight gradient too.
#define MTP_DECLARE_SMALL(family) \
  MTP_DECLARE_OP(family, kFwd);   \
  MTP_DECLARE_OP(family, kFwdTransB)
#define MTP_SMALL_TABLE(family) {MTP_OP_ROW(family, kFwd), MTP_OP_ROW(family, kFwdTransB)}

#define MTP_DECLARE_ARCH(arch) \
  MTP_DECLARE_SMALL(arch);     \
  MTP_DECLARE_OP(arch, kWgrad)
#define MTP_ARCH_TABLE(arch) \
  {MTP_OP_ROW(arch, kFwd), MTP_OP_ROW(arch, kFwdTransB), MTP_OP_ROW(arch, kWgrad)}

#ifdef MTP_WITH_SM90
MTP_DECLARE_ARCH(sm90);
MTP_DECLARE_SMALL(sm90_small);
#endif
#ifdef MTP_WITH_SM100
MTP_DECLARE_ARCH(sm100);
MTP_DECLARE_SMALL(sm100_small);
#endif

namespace {

constexpr int kNumOps = 3;
constexpr int kNumDTypes = 2;
constexpr int kNumSmallOps = 2;  // kFwd, kFwdTransB
// Below this many rows per expert on average, the forward ops take the small-group family. The
// default sm_90a kernel computes 128-row tiles in a 2x1 cluster, so every expert costs a
// multiple of 256 rows of MMA; under 256 rows per expert at least half of that would be padding,
// which the small family's 64-row tiles cut to under 64 rows. The default sm_100a kernel has
// 128-row tiles and no cluster: its small family (64 x 128 tiles) takes over under 128 rows per
// expert. Both thresholds are untuned (no GPU timings yet).
constexpr int64_t kSmallRowsPerGroup = 256;
constexpr int64_t kSmallRowsPerGroupSm100 = 128;

struct ArchKernels {
  int arch;  // compute capability as major * 10 + minor: 90, 100
  KernelEntry entries[kNumOps][kNumDTypes];
  KernelEntry small[kNumSmallOps][kNumDTypes];  // the small-group family's forward ops
};

const std::vector<ArchKernels>& kernel_table() {
  static const std::vector<ArchKernels> table = {
#ifdef MTP_WITH_SM90
      {90, MTP_ARCH_TABLE(sm90), MTP_SMALL_TABLE(sm90_small)},
#endif
#ifdef MTP_WITH_SM100
      {100, MTP_ARCH_TABLE(sm100), MTP_SMALL_TABLE(sm100_small)},
#endif
  };
  return table;
}

int64_t small_rows_per_group(int arch) {
  return arch >= 100 ? kSmallRowsPerGroupSm100 : kSmallRowsPerGroup;
}

bool small_groups(int op, int64_t m, int groups, int arch) {
  return op != mtp_cuda::kWgrad && groups > 0 && m < small_rows_per_group(arch) * groups;
}

long kernel_setups() {
  long total = 0;
  for (const auto& t : kernel_table()) {
    for (const auto& row : t.entries) {
      for (const auto& e : row) total += e.setups();
    }
    for (const auto& row : t.small) {
      for (const auto& e : row) total += e.setups();
    }
  }
  return total;
}

std::vector<int> compiled_archs() {
  std::vector<int> archs;
  for (const auto& t : kernel_table()) archs.push_back(t.arch);
  return archs;
}

void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}

int device_arch(int device) {
  int major = 0, minor = 0;
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
             "cudaDeviceGetAttribute(major)");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
             "cudaDeviceGetAttribute(minor)");
  return major * 10 + minor;
}

std::string archs_text() {
  std::string s;
  for (int a : compiled_archs()) s += (s.empty() ? "sm_" : ", sm_") + std::to_string(a);
  return s.empty() ? "none" : s;
}

const ArchKernels& find_arch(int op, int dtype, int device) {
  if (op < 0 || op >= kNumOps) {
    throw py::value_error("op must be 0 (fwd), 1 (fwd, transposed B) or 2 (wgrad), got " +
                          std::to_string(op));
  }
  if (dtype < 0 || dtype >= kNumDTypes) {
    throw py::value_error("dtype must be 0 (bfloat16) or 1 (float16), got " +
                          std::to_string(dtype));
  }
  const int arch = device_arch(device);
  for (const auto& t : kernel_table()) {
    if (t.arch == arch) return t;
  }
  throw std::runtime_error("CUDA device " + std::to_string(device) + " is sm_" +
                           std::to_string(arch) + "; this build has grouped GEMM kernels for " +
                           archs_text() +
                           " only (sm_90 = H100/H200, sm_100 = B200/GB200); use another backend");
}

// The instantiation for this call: the small-group family for the forward ops when the experts
// average fewer than the architecture's small_rows_per_group rows.
const KernelEntry& find_entry(int op, int dtype, int device, int64_t m, int groups) {
  const ArchKernels& t = find_arch(op, dtype, device);
  if (small_groups(op, m, groups, t.arch)) return t.small[op][dtype];
  return t.entries[op][dtype];
}

// Switches to `device` for the lifetime of the guard (kernel launches go to the current device).
struct DeviceGuard {
  int previous = -1;
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous), "cudaGetDevice");
    if (previous != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous) cudaSetDevice(previous);
  }
};

void require(bool ok, const std::string& message) {
  if (!ok) throw py::value_error(message);
}

void require_aligned(const char* name, std::uintptr_t ptr) {
  require(ptr != 0, std::string(name) + " is a null pointer");
  require(ptr % 16 == 0, std::string(name) + " must be 16-byte aligned (CUTLASS TMA), got address " +
                             std::to_string(ptr) + " (" + std::to_string(ptr % 16) +
                             " bytes past a 16-byte boundary)");
}

size_t workspace_size(int op, int dtype, int groups, int device) {
  require(groups > 0, "groups must be positive, got " + std::to_string(groups));
  const ArchKernels& t = find_arch(op, dtype, device);
  DeviceGuard guard(device);
  size_t bytes = t.entries[op][dtype].workspace_size(groups, device);
  if (op != mtp_cuda::kWgrad) {  // either family may run: the larger workspace
    bytes = std::max(bytes, t.small[op][dtype].workspace_size(groups, device));
  }
  return bytes;
}

void grouped_gemm(int op, int dtype, std::uintptr_t a, std::uintptr_t b, std::uintptr_t d,
                  std::uintptr_t tokens, bool tokens_int64, int64_t m, int64_t n, int64_t k,
                  int groups, std::uintptr_t workspace, size_t workspace_bytes,
                  std::uintptr_t stream, int device) {
  const KernelEntry& entry = find_entry(op, dtype, device, m, groups);
  const bool wgrad = op == mtp_cuda::kWgrad;
  require(groups > 0, "groups must be positive, got " + std::to_string(groups));
  require(m >= 0 && n > 0 && k > 0,
          "sizes must be M >= 0, N > 0, K > 0, got M=" + std::to_string(m) +
              ", N=" + std::to_string(n) + ", K=" + std::to_string(k));
  require(n % 8 == 0 && k % 8 == 0,
          "N and K must be multiples of 8 (16-byte rows), got N=" + std::to_string(n) +
              ", K=" + std::to_string(k));
  require(m <= INT32_MAX && n <= INT32_MAX && k <= INT32_MAX,
          "sizes must fit in int32 (CUTLASS problem shapes)");
  require_aligned("x", a);
  require_aligned(wgrad ? "dy" : "w", b);
  require_aligned("out", d);
  require(tokens != 0, "tokens_per_expert is a null pointer");
  require(tokens % (tokens_int64 ? 8 : 4) == 0, "tokens_per_expert is not aligned to its dtype");
  require(workspace != 0, "workspace is a null pointer");
  require(workspace % 256 == 0, "workspace must be 256-byte aligned");

  mtp_cuda::Problem p;
  p.a = reinterpret_cast<const void*>(a);
  p.b = reinterpret_cast<const void*>(b);
  p.d = reinterpret_cast<void*>(d);
  p.tokens = reinterpret_cast<const void*>(tokens);
  p.tokens_int64 = tokens_int64;
  p.m = m;
  p.n = n;
  p.k = k;
  p.groups = groups;
  p.workspace = reinterpret_cast<void*>(workspace);
  p.workspace_bytes = workspace_bytes;
  p.stream = reinterpret_cast<cudaStream_t>(stream);
  p.device = device;

  const char* error = nullptr;
  {
    py::gil_scoped_release no_gil;
    DeviceGuard guard(device);
    error = entry.launch(p);
  }
  if (error != nullptr) throw std::runtime_error(std::string("CUTLASS grouped GEMM: ") + error);
}

}  // namespace

PYBIND11_MODULE(_cuda_gemm, m) {
  m.doc() =
      "CUTLASS pointer-array grouped GEMM (sm_90a, sm_100a) for MoE experts; torch-free: "
      "takes device pointers, sizes and a stream handle. Use mtp.ops.grouped_gemm.cutlass, not this module.";
  m.attr("OP_FWD") = static_cast<int>(mtp_cuda::kFwd);
  m.attr("OP_FWD_TRANS_B") = static_cast<int>(mtp_cuda::kFwdTransB);
  m.attr("OP_WGRAD") = static_cast<int>(mtp_cuda::kWgrad);
  m.attr("DTYPE_BF16") = static_cast<int>(mtp_cuda::kBF16);
  m.attr("DTYPE_FP16") = static_cast<int>(mtp_cuda::kFP16);
  m.def("compiled_archs", &compiled_archs,
        "Compute capabilities (major*10+minor) this build has kernels for, e.g. [90, 100].");
  m.attr("SMALL_ROWS_PER_GROUP") = kSmallRowsPerGroup;
  m.def("small_rows_per_group", &small_rows_per_group, py::arg("arch") = 90,
        "Rows per expert (average) under which the forward ops take the small-group family on "
        "this architecture (major*10+minor): 256 on sm_90a, 128 on sm_100a.");
  m.def("small_groups", &small_groups, py::arg("op"), py::arg("m"), py::arg("groups"),
        py::arg("arch") = 90,
        "Whether a call of `op` on m rows over `groups` experts takes the small-group kernel "
        "family on `arch` (forward ops, under small_rows_per_group(arch) rows per expert).");
  m.def("kernel_setups", &kernel_setups,
        "Kernel configurations (dynamic shared-memory attribute) done so far, all instantiations "
        "together: one per (instantiation, device) used, never per call.");
  m.def("device_arch", &device_arch, py::arg("device"),
        "Compute capability of a CUDA device as major*10+minor.");
  m.def("workspace_size", &workspace_size, py::arg("op"), py::arg("dtype"), py::arg("groups"),
        py::arg("device"), "Bytes of device workspace one grouped_gemm call needs.");
  m.def("grouped_gemm", &grouped_gemm, py::arg("op"), py::arg("dtype"), py::arg("a"),
        py::arg("b"), py::arg("d"), py::arg("tokens"), py::arg("tokens_int64"), py::arg("m"),
        py::arg("n"), py::arg("k"), py::arg("groups"), py::arg("workspace"),
        py::arg("workspace_bytes"), py::arg("stream"), py::arg("device"),
        "Launch one grouped GEMM (problem description, CUTLASS kernel, zero fill) on `stream`. "
        "No host synchronisation; capturable in a CUDA graph.");
}

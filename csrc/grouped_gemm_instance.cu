// One grouped GEMM instantiation, chosen at compile time:
//   nvcc -DMTP_ARCH=sm90|sm90_small|sm100|sm100_small -DMTP_OP=kFwd|kFwdTransB|kWgrad -DMTP_DTYPE=kBF16|kFP16
// The build (csrc/build_ext.py, CMakeLists.txt) compiles this file once per combination, for the
// matching architecture only (sm_90a or sm_100a), so each compiler process holds one CUTLASS
// kernel and memory stays bounded.
#include "grouped_gemm.cuh"

#if !defined(MTP_ARCH) || !defined(MTP_OP) || !defined(MTP_DTYPE)
#error "define MTP_ARCH, MTP_OP and MTP_DTYPE (see csrc/build_ext.py)"
#endif

// MTP_ARCH=sm90_small / sm100_small: the small-group families (same target as sm90 / sm100,
// their own entries).
#define MTP_CONFIG_sm90 mtp_cuda::Sm90Config
#define MTP_CONFIG_sm90_small mtp_cuda::Sm90SmallConfig
#define MTP_CONFIG_sm100 mtp_cuda::Sm100Config
#define MTP_CONFIG_sm100_small mtp_cuda::Sm100SmallConfig
#define MTP_ARCH_IS_sm90 90
#define MTP_ARCH_IS_sm90_small 90
#define MTP_ARCH_IS_sm100 100
#define MTP_ARCH_IS_sm100_small 100
#define MTP_PASTE_(a, b) a##b
#define MTP_PASTE(a, b) MTP_PASTE_(a, b)

// Device passes must target the architecture-specific feature set ("a" targets): without it the
// CUTLASS kernels compile to empty bodies that trap at run time.
#if defined(__CUDA_ARCH__)
#if MTP_PASTE(MTP_ARCH_IS_, MTP_ARCH) == 90 && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "sm90 grouped GEMM must be compiled for sm_90a (-gencode arch=compute_90a,code=sm_90a)"
#endif
#if MTP_PASTE(MTP_ARCH_IS_, MTP_ARCH) == 100 && !defined(__CUDA_ARCH_FEAT_SM100_ALL)
#error "sm100 grouped GEMM must be compiled for sm_100a (-gencode arch=compute_100a,code=sm_100a)"
#endif
#endif

MTP_CUDA_DECLARE_ENTRY(MTP_ARCH, MTP_OP, MTP_DTYPE) {
  return mtp_cuda::Runner<MTP_PASTE(MTP_CONFIG_, MTP_ARCH), mtp_cuda::MTP_OP,
                          mtp_cuda::MTP_DTYPE>::entry();
}

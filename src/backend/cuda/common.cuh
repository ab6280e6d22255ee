// Host-side helpers shared by the CUDA ops: error checks (CUDA_CHECK, CUBLAS_CHECK), the launch
// check with the PRESCOPE_SYNC_DEBUG switch, the per-thread cuBLAS handle, workspaces, device facts.
// Host-only (no device code), so plain C++ files such as the op tests include it too.
#pragma once

#include "core/dtype.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// Lets the few helpers below be called from kernels too (nvcc) while staying plain C++ for g++.
#if defined(__CUDACC__)
#define PRESCOPE_HOST_DEVICE __host__ __device__
#else
#define PRESCOPE_HOST_DEVICE
#endif

namespace prescope::cuda {

/// Prints "file:line: CUDA error <name> (<string>) in <expr>" and aborts (style R13: a failed CUDA
/// call is a bug or a dead device; out-of-memory on allocations is reported by the allocator instead).
[[noreturn]] void cuda_error_abort(const char *file, int line, const char *expr, cudaError_t err);
/// Same for cuBLAS statuses.
[[noreturn]] void cublas_error_abort(const char *file, int line, const char *expr, cublasStatus_t status);
/// Broken invariant in a launcher (wrong shape or pointer from the caller): prints file:line and the
/// expression, aborts. core/error.h's PRESCOPE_ASSERT cannot be used in .cu files (nvcc rejects fmt).
[[noreturn]] void cuda_assert_abort(const char *file, int line, const char *expr);
/// A shape or dtype the CUDA ops do not implement (e.g. a head_dim without a kernel): throws
/// prescope::Error with `what`, so the runtime can report the model as unsupported.
[[noreturn]] void cuda_unsupported(const char *what);

/// True when the environment variable PRESCOPE_SYNC_DEBUG is set to a non-empty value other than 0:
/// every launcher then synchronizes its stream after its kernels, so an asynchronous fault is
/// reported at the launch that caused it. Read once.
bool sync_debug();

/// Whether device.cuh's launch_pdl launches `kernel` (one of this library's) with programmatic dependent launch
/// (decision 0150): the current device is sm_90 or newer, runs code compiled for sm_90 or newer (`kernel`'s PTX
/// version: every kernel of the library is built for the same architectures), and the environment variable
/// PRESCOPE_CUDA_PDL is not 0 (the A/B switch). Decided once per device.
bool pdl_enabled(const void *kernel);

/// After a launcher's kernels: checks the launch (cudaGetLastError) and, with PRESCOPE_SYNC_DEBUG,
/// synchronizes `stream` and checks again. `op` names the launcher in the error message.
void launch_check(const char *op, cudaStream_t stream);

/// The calling thread's cuBLAS handle for the current device, created on first use (not on the decode
/// path: call it once at start-up to pay the creation there). The caller sets the stream.
cublasHandle_t cublas_handle();

/// Multiprocessors of the current device (cached per device).
int sm_count();

/// Lets `kernel` (a __global__ function) use `bytes` of dynamic shared memory on the current device
/// (cudaFuncSetAttribute, needed above 48 KB). Calls the runtime only the first time a kernel needs more
/// on a device, so launchers may call it on every launch.
void raise_dynamic_smem(const void *kernel, size_t bytes);

/// Device scratch memory handed to a launcher: valid for `bytes` bytes, aligned to 256 bytes, used
/// in stream order on the launcher's stream (so it may be reused by the next launch on that stream).
/// Launchers that need scratch have a *_workspace_bytes() twin giving the size.
struct Workspace {
    void *ptr = nullptr;
    size_t bytes = 0;
};

/// Bytes of a row of n elements of `type` (n a multiple of the block size); the same value as
/// core/dtype.h's dtype_row_bytes, computed here so that this library does not link back to core.
PRESCOPE_HOST_DEVICE constexpr size_t row_bytes(DType type, int64_t n) {
    switch (type) {
    case DType::F32: return size_t(n) * 4;
    case DType::F16:
    case DType::BF16: return size_t(n) * 2;
    case DType::Q4_0: return size_t(n / QK4_0) * sizeof(BlockQ4_0);
    case DType::Q4_1: return size_t(n / QK4_1) * sizeof(BlockQ4_1);
    case DType::Q5_0: return size_t(n / QK5_0) * sizeof(BlockQ5_0);
    case DType::Q5_1: return size_t(n / QK5_1) * sizeof(BlockQ5_1);
    case DType::Q8_0: return size_t(n / QK8_0) * sizeof(BlockQ8_0);
    case DType::Q8_1: return size_t(n / QK8_1) * sizeof(BlockQ8_1);
    case DType::Q2_K: return size_t(n / QK_K) * sizeof(BlockQ2_K);
    case DType::Q3_K: return size_t(n / QK_K) * sizeof(BlockQ3_K);
    case DType::Q4_K: return size_t(n / QK_K) * sizeof(BlockQ4_K);
    case DType::Q5_K: return size_t(n / QK_K) * sizeof(BlockQ5_K);
    case DType::Q6_K: return size_t(n / QK_K) * sizeof(BlockQ6_K);
    case DType::Q8_K: return size_t(n / QK_K) * sizeof(BlockQ8_K);
    case DType::IQ4_NL: return size_t(n / QK4_NL) * sizeof(BlockIQ4_NL);
    case DType::IQ4_XS: return size_t(n / QK_K) * sizeof(BlockIQ4_XS);
    case DType::MXFP4: return size_t(n / QK_MXFP4) * sizeof(BlockMXFP4);
    }
    return 0;
}

/// Elements per block of a weight type (1 for F32, F16, BF16).
PRESCOPE_HOST_DEVICE constexpr int64_t block_elems(DType type) {
    switch (type) {
    case DType::F32:
    case DType::F16:
    case DType::BF16: return 1;
    case DType::Q2_K:
    case DType::Q3_K:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
    case DType::Q8_K:
    case DType::IQ4_XS: return QK_K;
    default: return 32;
    }
}

/// Alignment the kernels need of a weight row's first byte: 16 for F32, F16, BF16 (vector loads), 1 for
/// MXFP4 (17-byte blocks, read bytewise), 2 for the other block types (their F16 fields).
PRESCOPE_HOST_DEVICE constexpr size_t weight_alignment(DType type) {
    return type == DType::F32 || type == DType::F16 || type == DType::BF16 ? 16 : type == DType::MXFP4 ? 1 : 2;
}

/// Rounds n up to a multiple of 256 (the alignment of workspace parts).
constexpr size_t align_256(size_t n) { return (n + 255) / 256 * 256; }

} // namespace prescope::cuda

#define CUDA_CHECK(expr)                                                                    \
    do {                                                                                    \
        const cudaError_t err_ = (expr);                                                    \
        if (err_ != cudaSuccess) ::prescope::cuda::cuda_error_abort(__FILE__, __LINE__, #expr, err_); \
    } while (0)

#define CUBLAS_CHECK(expr)                                                                  \
    do {                                                                                    \
        const cublasStatus_t st_ = (expr);                                                  \
        if (st_ != CUBLAS_STATUS_SUCCESS) ::prescope::cuda::cublas_error_abort(__FILE__, __LINE__, #expr, st_); \
    } while (0)

#define CUDA_ASSERT(x)                                                                      \
    do {                                                                                    \
        if (!(x)) ::prescope::cuda::cuda_assert_abort(__FILE__, __LINE__, #x);              \
    } while (0)

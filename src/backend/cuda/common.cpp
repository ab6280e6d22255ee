// Host-side helpers of the CUDA ops (common.cuh): error reporting, the sync-debug switch, the cuBLAS
// handle and cached device facts. Plain C++ (compiled by the host compiler, so fmt may be used).
#include "backend/cuda/common.cuh"

#include "core/error.h"

#include <array>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

namespace prescope::cuda {

void cuda_error_abort(const char *file, int line, const char *expr, cudaError_t err) {
    std::fprintf(stderr, "%s:%d: CUDA error %s (%s) in %s\n", file, line, cudaGetErrorName(err),
                 cudaGetErrorString(err), expr);
    std::fflush(stderr);
    std::abort();
}

void cublas_error_abort(const char *file, int line, const char *expr, cublasStatus_t status) {
    std::fprintf(stderr, "%s:%d: cuBLAS error %s (%s) in %s\n", file, line, cublasGetStatusName(status),
                 cublasGetStatusString(status), expr);
    std::fflush(stderr);
    std::abort();
}

void cuda_assert_abort(const char *file, int line, const char *expr) {
    abort_with(file, line, expr);
}

void cuda_unsupported(const char *what) {
    fail("CUDA backend: {}", what);
}

bool sync_debug() {
    static const bool on = [] {
        const char *v = std::getenv("PRESCOPE_SYNC_DEBUG");
        return v != nullptr && v[0] != '\0' && std::strcmp(v, "0") != 0;
    }();
    return on;
}

bool pdl_enabled(const void *kernel) {
    static const bool allowed = [] {
        const char *v = std::getenv("PRESCOPE_CUDA_PDL");
        return v == nullptr || std::strcmp(v, "0") != 0;
    }();
    static std::array<std::atomic<int8_t>, 64> state{};  // per device: 0 unknown, 1 on, -1 off
    int device = 0;
    if (!allowed) return false;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= int(state.size())) {
        (void)cudaGetLastError();  // not the next launch's error
        return false;
    }
    int8_t s = state[size_t(device)].load(std::memory_order_relaxed);
    if (s == 0) {
        // The device must be sm_90+ and run code compiled for it: a build for older architectures only runs on a
        // Hopper as PTX compiled at load time, in which pdl_wait() was compiled out.
        int major = 0;
        cudaFuncAttributes fa{};
        if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
            cudaFuncGetAttributes(&fa, kernel) != cudaSuccess) {
            (void)cudaGetLastError();
            return false;  // not cached: asked again at the next launch
        }
        s = major >= 9 && fa.ptxVersion >= 90 ? 1 : -1;
        state[size_t(device)].store(s, std::memory_order_relaxed);
    }
    return s > 0;
}

void launch_check(const char *op, cudaStream_t stream) {
    cudaError_t err = cudaGetLastError();
    if (err == cudaSuccess && sync_debug()) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) cuda_error_abort(__FILE__, __LINE__, op, err);
}

namespace {

constexpr int kMaxDevices = 64;

struct CublasHandles {
    std::array<cublasHandle_t, kMaxDevices> handle{};
    ~CublasHandles() {
        for (cublasHandle_t h : handle)
            if (h != nullptr) cublasDestroy(h);
    }
};

int current_device() {
    int dev = 0;
    CUDA_CHECK(cudaGetDevice(&dev));
    CUDA_ASSERT(dev >= 0 && dev < kMaxDevices);
    return dev;
}

} // namespace

cublasHandle_t cublas_handle() {
    // cuBLAS handles must not be used by two host threads at once: one per thread and device.
    thread_local CublasHandles handles;
    const int dev = current_device();
    if (handles.handle[size_t(dev)] == nullptr) CUBLAS_CHECK(cublasCreate(&handles.handle[size_t(dev)]));
    return handles.handle[size_t(dev)];
}

int sm_count() {
    static std::array<std::atomic<int>, kMaxDevices> cached{};
    const int dev = current_device();
    int n = cached[size_t(dev)].load();
    if (n == 0) {
        CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
        cached[size_t(dev)].store(n);
    }
    return n;
}

void raise_dynamic_smem(const void *kernel, size_t bytes) {
    static std::mutex mu;
    static std::vector<std::tuple<int, const void *, size_t>> raised;  // (device, kernel, bytes allowed)
    const int dev = current_device();
    const std::lock_guard<std::mutex> lock(mu);
    for (auto &[d, k, b] : raised) {
        if (d != dev || k != kernel) continue;
        if (b < bytes) {
            CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
            b = bytes;
        }
        return;
    }
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
    raised.emplace_back(dev, kernel, bytes);
}

} // namespace prescope::cuda

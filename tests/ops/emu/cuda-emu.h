// CPU emulation of the CUDA subset src/backend/cuda uses, so that test-backend-ops can check the
// kernels' index math, barriers and shuffles on a machine without a GPU (tests/ops/emu/run.sh).
// Each CUDA thread of a block is a fiber on one OS thread; __syncthreads, __syncwarp and shuffles
// switch fibers. No timing, no memory model, no alignment faults: the device run stays the real test.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------------------------
// language

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static  // blocks run one after another, so one copy per kernel is enough

struct uint3 {
    unsigned x = 0, y = 0, z = 0;
};
struct dim3 {
    unsigned x = 1, y = 1, z = 1;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct float4 {
    float x, y, z, w;
};
struct uint4 {
    uint32_t x, y, z, w;
};
struct uint2 {
    uint32_t x, y;
};
inline uint2 make_uint2(uint32_t a, uint32_t b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint4 make_uint4(uint32_t a, uint32_t b, uint32_t c, uint32_t d) { return {a, b, c, d}; }

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

/// A barrier among the live fibers of a block or warp; finished fibers leave it.
struct EmuBarrier {
    int expected = 0, count = 0;
    uint64_t gen = 0;
};
struct EmuBlock {
    EmuBarrier sync;
    std::vector<EmuBarrier> warp;
    std::vector<uint64_t> xbuf;  // [threads] shuffle exchange
    std::vector<uint8_t> smem;   // dynamic shared memory
};
inline thread_local EmuBlock *emu_block = nullptr;
void emu_arrive(EmuBarrier &b);

inline void __syncthreads() { emu_arrive(emu_block->sync); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_arrive(emu_block->warp[threadIdx.x / 32]); }
/// One warp exchange: every lane publishes v and reads lane `src` of its warp's values.
template <class T> T emu_shfl(T v, unsigned src) {
    static_assert(sizeof(T) <= 8);
    const unsigned base = threadIdx.x - threadIdx.x % 32;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    emu_block->xbuf[threadIdx.x] = bits;
    __syncwarp();
    const uint64_t got = emu_block->xbuf[base + src % 32];
    __syncwarp();
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
template <class T> T __shfl_xor_sync(unsigned, T v, int o) { return emu_shfl(v, (threadIdx.x % 32) ^ unsigned(o)); }
template <class T> T __shfl_sync(unsigned, T v, int src_lane) { return emu_shfl(v, unsigned(src_lane)); }
template <class T> T __ldg(const T *p) { return *p; }
template <class T> T __ldcg(const T *p) { return *p; }
/// c + the dot product of a's and b's four signed bytes.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; ++i) c += int(int8_t(uint32_t(a) >> (8 * i))) * int(int8_t(uint32_t(b) >> (8 * i)));
    return c;
}
// Blocks run one after another on one OS thread: fences order nothing more, atomics need no lock.
inline void __threadfence() {}
template <class T> T atomicAdd(T *p, T v) {
    const T old = *p;
    *p = old + v;
    return old;
}
template <class T> T *emu_dyn_smem() { return reinterpret_cast<T *>(emu_block->smem.data()); }

inline float __uint_as_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __int_as_float(int32_t i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
// Rounded F32 operations that CUDA never contracts into an FMA (the emulation is built without FMA).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __float2int_rn(float a) { return int(std::nearbyint(a)); }  // round half to even (default mode)
template <class A, class B> auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> auto max(A a, B b) { return a < b ? b : a; }
using std::isnan;

// F16 / BF16 through core/dtype.h's conversions (the same round-to-nearest-even).
namespace prescope {
float fp16_to_fp32(uint16_t h);
uint16_t fp32_to_fp16(float f);
uint16_t fp32_to_bf16(float f);
} // namespace prescope
struct __half {
    uint16_t x;
};
struct __nv_bfloat16 {
    uint16_t x;
};
inline __half __ushort_as_half(uint16_t u) { return {u}; }
inline uint16_t __half_as_ushort(__half h) { return h.x; }
inline float __half2float(__half h) { return prescope::fp16_to_fp32(h.x); }
inline __half __float2half_rn(float f) { return {prescope::fp32_to_fp16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return {prescope::fp32_to_bf16(f)}; }
inline uint16_t __bfloat16_as_ushort(__nv_bfloat16 b) { return b.x; }

// ---------------------------------------------------------------------------------------------
// runtime (everything synchronous, "device" memory is host memory)

enum cudaError_t { cudaSuccess = 0 };
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16, cudaDevAttrComputeCapabilityMajor = 75 };
constexpr unsigned cudaStreamNonBlocking = 1;
struct CUstream_st;
using cudaStream_t = CUstream_st *;
struct CUevent_st;
using cudaEvent_t = CUevent_st *;
struct cudaDeviceProp {
    char name[256];
    int multiProcessorCount;
    size_t totalGlobalMem;
    int major, minor;
};
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind, cudaStream_t = nullptr);
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t = nullptr);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned);
cudaError_t cudaStreamDestroy(cudaStream_t);
cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaGetLastError();
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int);
template <class F> cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) { return cudaSuccess; }
struct cudaFuncAttributes {
    int ptxVersion, binaryVersion;
};
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, const void *) {
    a->ptxVersion = a->binaryVersion = 90;
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t *e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t = nullptr);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b);
const char *cudaGetErrorName(cudaError_t);
const char *cudaGetErrorString(cudaError_t);

/// Runs body once per thread of every block of the grid, blocks one after another.
void emu_run_blocks(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body);
/// What `k<<<grid, block, smem, stream>>>(a...)` becomes (prep_cuda.py rewrites the launches).
template <class... P, class... A>
void emu_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t, A &&...a) {
    std::tuple<std::decay_t<P>...> args(std::forward<A>(a)...);
    emu_run_blocks(grid, block, smem, [&] { std::apply(k, args); });
}

/// Programmatic dependent launch (device.cuh's launch_pdl): the emulation runs kernels one after another, so the
/// attribute changes nothing.
enum cudaLaunchAttributeID { cudaLaunchAttributeProgrammaticStreamSerialization = 5 };
struct cudaLaunchAttributeValue {
    unsigned programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
    cudaLaunchAttributeID id;
    cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
    dim3 gridDim, blockDim;
    size_t dynamicSmemBytes;
    cudaStream_t stream;
    cudaLaunchAttribute *attrs;
    unsigned numAttrs;
};
template <class... P, class... A>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t *c, void (*k)(P...), A &&...a) {
    emu_launch(k, c->gridDim, c->blockDim, c->dynamicSmemBytes, c->stream, std::forward<A>(a)...);
    return cudaSuccess;
}

// ---------------------------------------------------------------------------------------------
// cuBLAS: the two GEMMs the ops call, as plain column-major reference products

struct cublasContext;
using cublasHandle_t = cublasContext *;
enum cublasStatus_t { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7 };
enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 };
enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 };
cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasDestroy(cublasHandle_t h);
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t);
const char *cublasGetStatusName(cublasStatus_t);
const char *cublasGetStatusString(cublasStatus_t);
cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc);
cublasStatus_t cublasGemmEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType_t at, int lda, const void *B,
                            cudaDataType_t bt, int ldb, const void *beta, void *C, cudaDataType_t ct, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t);

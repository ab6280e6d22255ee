// The runtime, launch and cuBLAS parts of the CUDA emulation (cuda-emu.h): fibers (ucontext) for the
// threads of a block, synchronous memory calls, reference GEMMs.
#include "cuda-emu.h"

#include <ucontext.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>

// ---------------------------------------------------------------------------------------------
// runtime

cudaError_t cudaMalloc(void **p, size_t n) {
    *p = std::aligned_alloc(256, (n + 255) / 256 * 256);
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    std::free(p);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind, cudaStream_t) {
    std::memcpy(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *dst, int v, size_t n, cudaStream_t) {
    std::memset(dst, v, n);
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    static char token;
    *s = reinterpret_cast<cudaStream_t>(&token);
    return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int *d) {
    *d = 0;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int) {
    std::snprintf(p->name, sizeof p->name, "CPU emulation (tests/ops/emu)");
    p->multiProcessorCount = 132;  // the H200's, so launch plans match the device's
    p->totalGlobalMem = size_t(16) << 30;
    p->major = 9, p->minor = 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr, int) {
    *v = 132;
    return cudaSuccess;
}
struct CUevent_st {
    std::chrono::steady_clock::time_point t;
};
cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = new CUevent_st;
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    e->t = std::chrono::steady_clock::now();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t a, cudaEvent_t b) {
    *ms = std::chrono::duration<float, std::milli>(b->t - a->t).count();
    return cudaSuccess;
}
const char *cudaGetErrorName(cudaError_t) { return "cudaErrorEmulation"; }
const char *cudaGetErrorString(cudaError_t) { return "error in the CUDA emulation"; }

// ---------------------------------------------------------------------------------------------
// launches: one fiber per thread, run round-robin until each finishes or waits at a barrier

namespace {

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done = false;
    unsigned tid = 0;
};
thread_local ucontext_t g_scheduler;
thread_local Fiber *g_current = nullptr;
thread_local const std::function<void()> *g_body = nullptr;

void fiber_main(int lo, int hi) {
    Fiber *f = reinterpret_cast<Fiber *>((uintptr_t(uint32_t(hi)) << 32) | uintptr_t(uint32_t(lo)));
    (*g_body)();
    // A thread that returned no longer holds up its block's or its warp's barriers (as on the GPU).
    for (EmuBarrier *b : {&emu_block->warp[f->tid / 32], &emu_block->sync}) {
        --b->expected;
        if (b->count > 0 && b->count == b->expected) b->count = 0, ++b->gen;
    }
    f->done = true;
    swapcontext(&f->ctx, &g_scheduler);
}

} // namespace

void emu_arrive(EmuBarrier &b) {
    const uint64_t gen = b.gen;
    if (++b.count == b.expected) {
        b.count = 0, ++b.gen;
        return;
    }
    while (b.gen == gen) swapcontext(&g_current->ctx, &g_scheduler);
}

void emu_run_blocks(dim3 grid, dim3 block, size_t smem, const std::function<void()> &body) {
    if (block.y != 1 || block.z != 1) {
        std::fprintf(stderr, "cuda-emu: only 1-D blocks\n");
        std::abort();
    }
    const unsigned nt = block.x, n_warps = (nt + 31) / 32;
    EmuBlock blk;
    blk.xbuf.resize(nt);
    blk.smem.resize(smem + 16);
    std::vector<Fiber> fibers(nt);
    for (Fiber &f : fibers) f.stack.resize(256 * 1024);
    g_body = &body;
    emu_block = &blk;
    blockDim = block, gridDim = grid;
    const uint64_t n_blocks = uint64_t(grid.x) * grid.y * grid.z;
    for (uint64_t b = 0; b < n_blocks; ++b) {
        const uint3 bi = {unsigned(b % grid.x), unsigned(b / grid.x % grid.y), unsigned(b / grid.x / grid.y)};
        blk.sync = EmuBarrier{int(nt), 0, 0};
        blk.warp.assign(n_warps, EmuBarrier{});
        for (unsigned w = 0; w < n_warps; ++w) blk.warp[w].expected = int(std::min(32u, nt - w * 32));
        std::memset(blk.smem.data(), 0xcd, blk.smem.size());  // garbage, as a GPU leaves it
        for (unsigned t = 0; t < nt; ++t) {
            Fiber &f = fibers[t];
            f.done = false, f.tid = t;
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = f.stack.data();
            f.ctx.uc_stack.ss_size = f.stack.size();
            f.ctx.uc_link = nullptr;
            const uintptr_t fp = reinterpret_cast<uintptr_t>(&f);
            makecontext(&f.ctx, reinterpret_cast<void (*)()>(fiber_main), 2, int(uint32_t(fp)),
                        int(uint32_t(fp >> 32)));
        }
        for (bool live = true; live;) {
            live = false;
            for (unsigned t = 0; t < nt; ++t) {
                Fiber &f = fibers[t];
                if (f.done) continue;
                g_current = &f;
                threadIdx = {t, 0, 0};
                blockIdx = bi;
                swapcontext(&g_scheduler, &f.ctx);
                live |= !f.done;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// cuBLAS

struct cublasContext {};
cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = new cublasContext;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t) { return CUBLAS_STATUS_SUCCESS; }
const char *cublasGetStatusName(cublasStatus_t) { return "CUBLAS_STATUS_EMULATION"; }
const char *cublasGetStatusString(cublasStatus_t) { return "error in the cuBLAS emulation"; }

namespace {

float load(cudaDataType_t t, const void *p, size_t i) {
    switch (t) {
    case CUDA_R_32F: return static_cast<const float *>(p)[i];
    case CUDA_R_16F: return prescope::fp16_to_fp32(static_cast<const uint16_t *>(p)[i]);
    case CUDA_R_16BF: return __uint_as_float(uint32_t(static_cast<const uint16_t *>(p)[i]) << 16);
    }
    std::abort();
}

} // namespace

// cuBLAS's definition (column-major): C (m x n) = alpha op(A) (m x k) op(B) (k x n) + beta C.
cublasStatus_t cublasGemmEx(cublasHandle_t, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                            const void *alpha, const void *A, cudaDataType_t at, int lda, const void *B,
                            cudaDataType_t bt, int ldb, const void *beta, void *C, cudaDataType_t ct, int ldc,
                            cublasComputeType_t, cublasGemmAlgo_t) {
    if (ct != CUDA_R_32F || at != bt || lda < (ta == CUBLAS_OP_N ? m : k) || ldb < (tb == CUBLAS_OP_N ? k : n) ||
        ldc < m)
        return CUBLAS_STATUS_INVALID_VALUE;
    const float al = *static_cast<const float *>(alpha), be = *static_cast<const float *>(beta);
    float *c = static_cast<float *>(C);
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            double s = 0.0;
            for (int l = 0; l < k; ++l) {
                const size_t ia = ta == CUBLAS_OP_N ? size_t(i) + size_t(l) * lda : size_t(l) + size_t(i) * lda;
                const size_t ib = tb == CUBLAS_OP_N ? size_t(l) + size_t(j) * ldb : size_t(j) + size_t(l) * ldb;
                s += double(load(at, A, ia)) * double(load(bt, B, ib));
            }
            float &cij = c[size_t(i) + size_t(j) * ldc];
            cij = float(al * s + (be != 0.0f ? be * cij : 0.0f));
        }
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                           const float *alpha, const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc) {
    return cublasGemmEx(h, ta, tb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb, beta, C, CUDA_R_32F, ldc,
                        CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

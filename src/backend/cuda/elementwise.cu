// Elementwise kernels (elementwise.cuh): grid-stride loops, one element per thread and step.
#include "backend/cuda/elementwise.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

namespace prescope::cuda {

namespace {

constexpr int kEltThreads = 256;
constexpr int64_t kEltMaxBlocks = 1 << 16;

unsigned elt_blocks(int64_t n) {
    const int64_t b = ceil_div(n, kEltThreads);
    return unsigned(b < kEltMaxBlocks ? b : kEltMaxBlocks);
}

#define PRESCOPE_ELT_LOOP(i, n) \
    for (int64_t i = int64_t(blockIdx.x) * kEltThreads + threadIdx.x; i < (n); i += int64_t(gridDim.x) * kEltThreads)

__global__ void swiglu_kernel(const float *gate, const float *up, float *out, int64_t n) {
    PRESCOPE_ELT_LOOP(i, n) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

__global__ void swiglu_oai_kernel(const float *gate, const float *up, float *out, int64_t n, float alpha,
                                  float limit) {
    PRESCOPE_ELT_LOOP(i, n) {
        const float g = fminf(gate[i], limit), u = fminf(fmaxf(up[i], -limit), limit);
        out[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}

__global__ void add_kernel(const float *a, const float *b, float *out, int64_t n) {
    PRESCOPE_ELT_LOOP(i, n) out[i] = a[i] + b[i];
}

__global__ void scale_add_kernel(float *__restrict__ y, const float *__restrict__ x, float s, int64_t n) {
    PRESCOPE_ELT_LOOP(i, n) y[i] += s * x[i];
}

__global__ void add_bias_kernel(float *y, const float *__restrict__ b, int64_t n_out, int64_t n) {
    PRESCOPE_ELT_LOOP(i, n) y[i] += b[i % n_out];
}

#undef PRESCOPE_ELT_LOOP

} // namespace

void swiglu(const float *gate, const float *up, float *out, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    swiglu_kernel<<<elt_blocks(n), kEltThreads, 0, stream>>>(gate, up, out, n);
    launch_check("swiglu", stream);
}

void swiglu_oai(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit,
                cudaStream_t stream) {
    if (n <= 0) return;
    swiglu_oai_kernel<<<elt_blocks(n), kEltThreads, 0, stream>>>(gate, up, out, n, alpha, limit);
    launch_check("swiglu_oai", stream);
}

void add(const float *a, const float *b, float *out, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    add_kernel<<<elt_blocks(n), kEltThreads, 0, stream>>>(a, b, out, n);
    launch_check("add", stream);
}

void scale_add(float *y, const float *x, float s, int64_t n, cudaStream_t stream) {
    if (n <= 0) return;
    scale_add_kernel<<<elt_blocks(n), kEltThreads, 0, stream>>>(y, x, s, n);
    launch_check("scale_add", stream);
}

void add_bias(float *y, const float *b, int64_t n_tok, int64_t n_out, cudaStream_t stream) {
    CUDA_ASSERT(n_out > 0 && n_tok >= 0);
    if (n_tok == 0) return;
    add_bias_kernel<<<elt_blocks(n_tok * n_out), kEltThreads, 0, stream>>>(y, b, n_out, n_tok * n_out);
    launch_check("add_bias", stream);
}

} // namespace prescope::cuda

// Row gather + dtype conversion kernels (convert.cuh): one thread per 8 elements.
#include "backend/cuda/convert.cuh"

#include "backend/cuda/common.cuh"
#include "backend/cuda/device.cuh"

#include <type_traits>

namespace prescope::cuda {

namespace {

constexpr int kConvertThreads = 256;
constexpr int kMaxGridY = 65535;

template <DType From, DType To>
__global__ void __launch_bounds__(kConvertThreads)
    convert_rows_kernel(const uint8_t *__restrict__ src, const int32_t *__restrict__ ids, int64_t n,
                        int64_t n_src_rows, int64_t n_rows, uint8_t *__restrict__ out) {
    const int64_t c = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
    if (c >= n / kChunk) return;
    const size_t src_rb = row_bytes(From, n), out_rb = row_bytes(To, n);
    for (int64_t r = blockIdx.y; r < n_rows; r += gridDim.y) {
        const int64_t id = ids != nullptr ? int64_t(ids[r]) : r;
        float v[kChunk];
        if (id >= 0 && id < n_src_rows) {
            load_chunk<From>(src + size_t(id) * src_rb, c, v);
        } else {
#pragma unroll
            for (int k = 0; k < kChunk; ++k) v[k] = __int_as_float(0x7fc00000);  // quiet NaN
        }
        store_chunk<To>(out + size_t(r) * out_rb + size_t(c) * row_bytes(To, kChunk), v);
    }
}

template <DType From>
void launch_convert(const void *src, int64_t n, const int32_t *ids, int64_t n_src_rows, int64_t n_rows, DType to,
                    void *out, cudaStream_t stream) {
    const dim3 grid(unsigned(ceil_div(n / kChunk, kConvertThreads)),
                    unsigned(n_rows < kMaxGridY ? n_rows : kMaxGridY));
    const auto *s = static_cast<const uint8_t *>(src);
    auto *o = static_cast<uint8_t *>(out);
    switch (to) {
    case DType::F32:
        convert_rows_kernel<From, DType::F32><<<grid, kConvertThreads, 0, stream>>>(s, ids, n, n_src_rows, n_rows, o);
        break;
    case DType::F16:
        convert_rows_kernel<From, DType::F16><<<grid, kConvertThreads, 0, stream>>>(s, ids, n, n_src_rows, n_rows, o);
        break;
    case DType::BF16:
        convert_rows_kernel<From, DType::BF16><<<grid, kConvertThreads, 0, stream>>>(s, ids, n, n_src_rows, n_rows, o);
        break;
    default: cuda_unsupported("convert_rows: conversions go to f32, f16 or bf16 only");
    }
}

} // namespace

void convert_rows(DType type, const void *src, int64_t n, const int32_t *ids, int64_t n_src_rows, int64_t n_rows,
                  DType to, void *out, cudaStream_t stream) {
    CUDA_ASSERT(n > 0 && n % kChunk == 0 && n % block_elems(type) == 0);
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(src) % weight_alignment(type) == 0);
    CUDA_ASSERT(reinterpret_cast<uintptr_t>(out) % 16 == 0);
    if (n_rows <= 0) return;
    dispatch_weight_type(type, [&](auto t) {
        launch_convert<decltype(t)::value>(src, n, ids, n_src_rows, n_rows, to, out, stream);
    });
    launch_check("convert_rows", stream);
}

void get_rows(DType type, const void *table, int64_t n_embd, int64_t n_vocab, const int32_t *ids, int64_t n_tok,
              float *out, cudaStream_t stream) {
    convert_rows(type, table, n_embd, ids, n_vocab, n_tok, DType::F32, out, stream);
}

namespace {

__global__ void __launch_bounds__(kConvertThreads)
    scatter_rows_kernel(const float4 *__restrict__ src, int64_t n4, int64_t n_rows, const int32_t *__restrict__ rows,
                        float4 *__restrict__ dst) {
    const int64_t c = int64_t(blockIdx.x) * kConvertThreads + threadIdx.x;
    if (c >= n4) return;
    for (int64_t r = blockIdx.y; r < n_rows; r += gridDim.y) dst[int64_t(rows[r]) * n4 + c] = src[r * n4 + c];
}

} // namespace

void scatter_rows(const float *src, int64_t n_rows, int64_t n, const int32_t *rows, float *dst, cudaStream_t stream) {
    CUDA_ASSERT(n % 4 == 0);
    if (n_rows == 0) return;
    const dim3 grid(unsigned(ceil_div(n / 4, kConvertThreads)), unsigned(n_rows < kMaxGridY ? n_rows : kMaxGridY));
    scatter_rows_kernel<<<grid, kConvertThreads, 0, stream>>>(reinterpret_cast<const float4 *>(src), n / 4, n_rows, rows,
                                                            reinterpret_cast<float4 *>(dst));
    CUDA_CHECK(cudaGetLastError());
}

namespace {

__global__ void __launch_bounds__(kConvertThreads)
    copy_heads_kernel(const float *__restrict__ src, HeadLayout sl, float *__restrict__ dst, HeadLayout dl,
                      int64_t n_head, int64_t n, int64_t n_vec) {
    for (int64_t v = blockIdx.x; v < n_vec; v += gridDim.x) {  // v = t * n_head + h
        const int64_t t = v / n_head, h = v % n_head;
        const float *a = src + t * sl.tok + h * sl.head;
        float *b = dst + t * dl.tok + h * dl.head;
        for (int64_t c = threadIdx.x; c < n; c += kConvertThreads) b[c] = a[c];
    }
}

} // namespace

void copy_heads(const float *src, HeadLayout src_layout, float *dst, HeadLayout dst_layout, int64_t n_tok,
                int64_t n_head, int64_t n, cudaStream_t stream) {
    CUDA_ASSERT(n_tok >= 0 && n_head > 0 && n > 0);
    const int64_t n_vec = n_tok * n_head;
    if (n_vec == 0) return;
    const unsigned grid = unsigned(n_vec < 65536 ? n_vec : 65536);
    copy_heads_kernel<<<grid, kConvertThreads, 0, stream>>>(src, src_layout, dst, dst_layout, n_head, n, n_vec);
    launch_check("copy_heads", stream);
}

} // namespace prescope::cuda

// Weight x activation products: weights (F32, F16, BF16, Q8_0) read in place, activations F32.
// Few tokens: SIMD GEMV (memory-bound decode). Many tokens: weight tiles converted to F32 in L2,
// then OpenBLAS sgemm, one single-threaded sgemm per OpenMP thread. Decision 0011.
#include "backend/cpu/ops.h"

#include "backend/cpu/kernels.h"
#include "core/error.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <vector>

namespace prescope::cpu {

namespace {

// From this many tokens a job takes the tile + sgemm path. Measured (bench-cpu-ops,
// BM_matmul_path): see docs/decisions/0011-cpu-matmul-paths.md.
std::atomic<int64_t> g_gemm_min_tokens{16};
// F32 weight tile per thread on the sgemm path: small enough to stay in L2 while sgemm reads it.
constexpr int64_t kTileBytes = 256 << 10;
// Smallest slice of rows handed to a thread, so each one streams a contiguous stretch of weights.
constexpr int64_t kMinRowsPerItem = 16;

struct WorkItem {
    int64_t job, r0, r1;  // rows [r0, r1) of jobs[job]
};

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

/// y rows [r0, r1) of one job through F32 tiles and sgemm: Y[:, r0:r1] = X . W[r0:r1]^T.
void gemm_rows(const KernelTable &k, DType type, const uint8_t *w, size_t row_bytes, int64_t n_in,
               int64_t n_out, int64_t r0, int64_t r1, const float *x, int64_t n_tok, float *y) {
    const auto sgemm = [&](const float *wt, int64_t r, int64_t nr) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n_tok), int(nr), int(n_in), 1.0f, x, int(n_in),
                    wt, int(n_in), 0.0f, y + r, int(n_out));
    };
    if (type == DType::F32) {
        sgemm(reinterpret_cast<const float *>(w + size_t(r0) * row_bytes), r0, r1 - r0);
        return;
    }
    const int64_t tile_rows = std::max<int64_t>(16, kTileBytes / (n_in * 4));
    thread_local std::vector<float> tile;
    tile.resize(size_t(std::min(tile_rows, r1 - r0) * n_in));
    for (int64_t r = r0; r < r1; r += tile_rows) {
        const int64_t nr = std::min(tile_rows, r1 - r);
        k.convert[dtype_index(type)](w + size_t(r) * row_bytes, row_bytes, nr, n_in, tile.data());
        sgemm(tile.data(), r, nr);
    }
}

} // namespace

int64_t gemm_min_tokens() {
    return g_gemm_min_tokens.load();
}

void set_gemm_min_tokens(int64_t n) {
    g_gemm_min_tokens.store(std::max<int64_t>(1, n));
}

void matmul_batch(DType type, int64_t n_in, int64_t n_out, const MatmulJob *jobs, int64_t n_jobs) {
    PRESCOPE_ASSERT(n_in > 0 && n_in % dtype_block_elems(type) == 0 && n_out >= 0);
    const KernelTable &k = kernels();
    const size_t row_bytes = dtype_row_bytes(type, n_in);
    const int nth = threads_here();
    const int64_t min_gemm_tok = gemm_min_tokens();

    // Share the rows out: GEMV jobs cost about their bytes, so about two slices per thread (dynamic
    // scheduling evens out the rest). sgemm jobs cost tokens x rows: one slice per thread for a single
    // job; several jobs (prefill experts) in slices of about a quarter of a thread's share.
    int64_t gemv_rows = 0, gemm_work = 0, n_gemm_jobs = 0;
    for (int64_t j = 0; j < n_jobs; ++j) {
        PRESCOPE_ASSERT(jobs[j].n_tok >= 0);
        if (jobs[j].n_tok == 0) continue;
        if (jobs[j].n_tok < min_gemm_tok) {
            gemv_rows += n_out;
        } else {
            gemm_work += jobs[j].n_tok * n_out;
            ++n_gemm_jobs;
        }
    }
    const int64_t gemv_chunk = std::max(kMinRowsPerItem, ceil_div(gemv_rows, 2 * int64_t(nth)));
    const int64_t gemm_work_per_item = ceil_div(gemm_work, int64_t(nth) * (n_gemm_jobs > 1 ? 4 : 1));
    std::vector<WorkItem> items;
    for (int64_t j = 0; j < n_jobs; ++j) {
        const int64_t nt = jobs[j].n_tok;
        if (nt == 0) continue;
        const int64_t chunk =
            nt < min_gemm_tok ? gemv_chunk : std::max(kMinRowsPerItem, ceil_div(gemm_work_per_item, nt));
        for (int64_t r0 = 0; r0 < n_out; r0 += chunk) items.push_back({j, r0, std::min(n_out, r0 + chunk)});
    }

    const auto n_items = int64_t(items.size());
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1) if (nth > 1 && n_items > 1)
    for (int64_t i = 0; i < n_items; ++i) {
        const WorkItem &it = items[size_t(i)];
        const MatmulJob &job = jobs[it.job];
        const auto *w = static_cast<const uint8_t *>(job.w);
        if (job.n_tok < min_gemm_tok) {
            k.gemv[dtype_index(type)](w + size_t(it.r0) * row_bytes, row_bytes, it.r1 - it.r0, n_in, job.x, n_in,
                                      job.n_tok, job.y + it.r0, n_out);
        } else {
            gemm_rows(k, type, w, row_bytes, n_in, n_out, it.r0, it.r1, job.x, job.n_tok, job.y);
        }
    }
}

void matmul(DType type, const void *w, int64_t n_in, int64_t n_out, const float *x, int64_t n_tok, float *y) {
    const MatmulJob job{w, x, n_tok, y};
    matmul_batch(type, n_in, n_out, &job, 1);
}

} // namespace prescope::cpu

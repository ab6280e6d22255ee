// Weight x activation products: weights of any supported dtype read in place, activations F32 or (for
// quantized weights, ActivationQuant::INT8) quantized to the weights' vec-dot type. Few tokens: SIMD
// GEMV (memory-bound decode; integer dot products on quantized activations). Many tokens: weight tiles
// converted to F32 in L2, then a register-blocked GEMM on the transposed activations (or OpenBLAS
// sgemm), the activations quantized and dequantized again first so both paths compute the same
// products (for Q4_1 / Q5_1 also the same min term, from the F16 block sums of their Q8_1 activations).
// Decisions 0011, 0060, 0061, 0065.
#include "backend/cpu/ops.h"

#include "backend/cpu/kernels.h"
#include "core/error.h"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <vector>

namespace prescope::cpu {

namespace {

// From this many tokens a job takes the GEMM path. Measured (bench-cpu-ops, matmul_path):
// docs/decisions/0011-cpu-matmul-paths.md.
std::atomic<int64_t> g_gemm_min_tokens{14};
std::atomic<int> g_gemm_backend{int(GemmBackend::OWN)};
// F32 weight tile per thread on the GEMM path: stays in L2 (2 MiB per Sapphire Rapids core) next to
// the slice of transposed activations that the register blocks read.
constexpr int64_t kTileBytes = 512 << 10;
// Smallest slice of rows handed to a thread, so each one streams a contiguous stretch of weights.
constexpr int64_t kMinRowsPerItem = 16;
// Rows of the transposed activations written per packing task.
constexpr int64_t kPackRows = 64;

struct WorkItem {
    int64_t job, r0, r1;  // rows [r0, r1) of jobs[job]
};

struct PackItem {
    int64_t job, k0, k1;  // rows [k0, k1) of jobs[job]'s transposed activations
};

struct QuantItem {
    int64_t job, t0, t1;  // tokens [t0, t1) of jobs[job]'s activations
};

// Tokens quantized per task of the quantization step (GEMM jobs; GEMV jobs have fewer).
constexpr int64_t kQuantTokens = 16;
// Most activation elements matmul_batch quantizes on the calling thread (GEMV-only batches): a decode step's
// expert inputs (8 experts x 4096 = 32768; ~10 us on one core).
constexpr int64_t kSerialQuantElems = 32768;

// BatchInvariantScope instances alive on this thread.
thread_local int t_batch_invariant = 0;

int64_t ceil_div(int64_t a, int64_t b) {
    return (a + b - 1) / b;
}

int64_t round_up(int64_t a, int64_t b) {
    return ceil_div(a, b) * b;
}

/// Rows [r0, r1) of one GEMM job: weight tiles converted to F32, then KernelTable::gemm on the
/// packed activations xt (own), or OpenBLAS sgemm on x.
void gemm_rows(const KernelTable &k, DType type, bool own, const uint8_t *w, size_t row_bytes, int64_t n_in,
               int64_t n_out, int64_t r0, int64_t r1, const float *x, const float *xt, int64_t n_tok, float *y) {
    const int64_t block = own ? k.gemm_row_pad : 1;
    const int64_t tile_rows = std::max<int64_t>(block, kTileBytes / (n_in * 4) / block * block);
    thread_local std::vector<float> tile;
    tile.resize(size_t(std::min(tile_rows, round_up(r1 - r0, block)) * n_in));
    for (int64_t r = r0; r < r1; r += tile_rows) {
        const int64_t nr = std::min(tile_rows, r1 - r);
        k.convert[dtype_index(type)](w + size_t(r) * row_bytes, row_bytes, nr, n_in, tile.data());
        if (own) {
            // The register blocks read whole groups of rows: zero the padding after the last row.
            std::fill(tile.begin() + nr * n_in, tile.begin() + round_up(nr, block) * n_in, 0.0f);
            k.gemm(tile.data(), nr, n_in, xt, n_tok, y + r, n_out);
        } else {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n_tok), int(nr), int(n_in), 1.0f, x, int(n_in),
                        tile.data(), int(n_in), 0.0f, y + r, int(n_out));
        }
    }
}

/// Q4_1 / Q5_1 weights on the GEMM path: the integer kernels (and ggml's vec_dot_q{4,5}_1_q8_1) add each
/// block's min times s, the activation block sum rounded to F16 by the Q8_1 quantizer, while the tiles
/// multiply the min by the sum of the dequantized activations. Adds min * (s - that sum) for rows [r0, r1)
/// so that both paths compute the same: xc [n_tok][n_in / 32] holds s - sum per token and block.
void add_q8_1_min_correction(const uint8_t *w, size_t row_bytes, int64_t n_in, int64_t n_out, int64_t r0,
                             int64_t r1, const float *xc, int64_t n_tok, float *y) {
    static_assert(offsetof(BlockQ4_1, m) == offsetof(BlockQ5_1, m));
    const int64_t nb = n_in / 32;
    const size_t block_bytes = row_bytes / size_t(nb);
    thread_local std::vector<float> mins;
    mins.resize(size_t((r1 - r0) * nb));
    for (int64_t r = r0; r < r1; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            uint16_t m;
            std::memcpy(&m, w + size_t(r) * row_bytes + size_t(b) * block_bytes + offsetof(BlockQ4_1, m), 2);
            mins[size_t((r - r0) * nb + b)] = fp16_to_fp32(m);
        }
    }
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *c = xc + t * nb;
        for (int64_t r = r0; r < r1; ++r) {
            const float *m = &mins[size_t((r - r0) * nb)];
            float acc = 0.0f;
            for (int64_t b = 0; b < nb; ++b) acc += m[b] * c[b];
            y[t * n_out + r] += acc;
        }
    }
}

} // namespace

BatchInvariantScope::BatchInvariantScope(bool on) : on_(on) {
    if (on_) ++t_batch_invariant;
}

BatchInvariantScope::~BatchInvariantScope() {
    if (on_) --t_batch_invariant;
}

bool batch_invariant() {
    return t_batch_invariant > 0;
}

int64_t gemm_min_tokens() {
    return g_gemm_min_tokens.load();
}

void set_gemm_min_tokens(int64_t n) {
    g_gemm_min_tokens.store(std::max<int64_t>(1, n));
}

GemmBackend gemm_backend() {
    return GemmBackend(g_gemm_backend.load());
}

void set_gemm_backend(GemmBackend b) {
    g_gemm_backend.store(int(b));
}

void matmul_batch(DType type, int64_t n_in, int64_t n_out, const MatmulJob *jobs, int64_t n_jobs) {
    const int ti = dtype_index(type);
    PRESCOPE_ASSERT(ti >= 0 && n_in > 0 && n_in % dtype_block_elems(type) == 0 && n_out >= 0);
    const KernelTable &k = kernels();
    const size_t row_bytes = dtype_row_bytes(type, n_in);
    const int nth = threads_here();
    // Batch-invariant: the GEMM path even for one token (the GEMV's accumulator chains depend on how many
    // tokens share a weight row); its outputs do not depend on n_tok.
    const bool invariant = batch_invariant();
    const int64_t min_gemm_tok = invariant ? 1 : gemm_min_tokens();
    const bool own_gemm = invariant || gemm_backend() == GemmBackend::OWN;
    // Quantized activations (decision 0060): GEMV jobs read them as blocks of the vec-dot type; GEMM jobs
    // read them dequantized back to F32, so that every path multiplies the same values.
    const bool qact = quantizes_activations(type);
    const DType at = qact ? vec_dot_type(type) : DType::F32;
    const size_t xq_row = qact ? dtype_row_bytes(at, n_in) : 0;
    const bool q8_1_mins = at == DType::Q8_1;  // GEMM jobs add add_q8_1_min_correction
    const int64_t n_blocks = n_in / 32;

    // Share the rows out: GEMV jobs cost about their bytes, so about two slices per thread (dynamic
    // scheduling evens out the rest). GEMM jobs cost tokens x rows: one slice per thread for a single
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
    // Work lists, the quantized activations of GEMV jobs, the dequantized ones and the packed ones
    // (KernelTable::pack) of GEMM jobs belong to the calling thread and keep their memory between calls
    // (decode makes thousands of calls per token). The workers reach them through the plain pointers
    // below, never by these thread_local names.
    thread_local std::vector<WorkItem> items;
    thread_local std::vector<PackItem> pack;
    thread_local std::vector<QuantItem> quant;
    thread_local std::vector<int64_t> xt_offset, xa_offset;
    thread_local std::vector<float> xt_buf, xf_buf, xc_buf;
    thread_local std::vector<uint8_t> xq_buf;
    items.clear();
    pack.clear();
    quant.clear();
    xt_offset.assign(size_t(n_jobs), 0);
    xa_offset.assign(size_t(n_jobs), 0);  // bytes into xq_buf (GEMV) or floats into xf_buf (GEMM)
    // GEMM jobs with Q8_1 activations: their min corrections sit in xc_buf at xa_offset / 32.
    size_t xt_size = 0, xq_size = 0, xf_size = 0;
    for (int64_t j = 0; j < n_jobs; ++j) {
        const int64_t nt = jobs[j].n_tok;
        if (nt == 0) continue;
        const bool gemm = nt >= min_gemm_tok;
        const int64_t chunk = gemm ? round_up(std::max(kMinRowsPerItem, ceil_div(gemm_work_per_item, nt)), k.gemm_row_pad)
                                   : gemv_chunk;
        for (int64_t r0 = 0; r0 < n_out; r0 += chunk) items.push_back({j, r0, std::min(n_out, r0 + chunk)});
        if (qact) {
            // Consecutive jobs on the same activations (an expert's gate and up) quantize them once.
            if (j > 0 && jobs[j - 1].x == jobs[j].x && jobs[j - 1].n_tok == nt) {
                xa_offset[size_t(j)] = xa_offset[size_t(j - 1)];
            } else {
                size_t &size = gemm ? xf_size : xq_size;
                xa_offset[size_t(j)] = int64_t(size);
                size += gemm ? size_t(nt * n_in) : size_t(nt) * xq_row;
                for (int64_t t0 = 0; t0 < nt; t0 += kQuantTokens) quant.push_back({j, t0, std::min(nt, t0 + kQuantTokens)});
            }
        }
        if (gemm && own_gemm) {
            xt_offset[size_t(j)] = int64_t(xt_size);
            xt_size += size_t(n_in * round_up(nt, k.gemm_tokens));
            for (int64_t k0 = 0; k0 < n_in; k0 += kPackRows) pack.push_back({j, k0, std::min(n_in, k0 + kPackRows)});
        }
    }
    if (xt_buf.size() < xt_size) xt_buf.resize(xt_size);
    if (xq_buf.size() < xq_size) xq_buf.resize(xq_size);
    if (xf_buf.size() < xf_size) xf_buf.resize(xf_size);
    if (q8_1_mins && xc_buf.size() < xf_size / 32) xc_buf.resize(xf_size / 32);
    float *const xt = xt_buf.data();
    uint8_t *const xq = xq_buf.data();
    float *const xf = xf_buf.data();
    float *const xc = xc_buf.data();
    const WorkItem *const item_list = items.data();
    const PackItem *const pack_list = pack.data();
    const QuantItem *const quant_list = quant.data();
    const int64_t *const xt_offsets = xt_offset.data();
    const int64_t *const xa_offsets = xa_offset.data();
    // The F32 activations a GEMM job multiplies: its own, or their quantized-and-back copy.
    const auto gemm_x = [&](int64_t j) { return qact ? xf + xa_offsets[j] : jobs[j].x; };

    const auto quantize_item = [&](const QuantItem &it) {
        const MatmulJob &job = jobs[it.job];
        const bool gemm = job.n_tok >= min_gemm_tok;
        thread_local std::vector<uint8_t> tmp;
        if (gemm) tmp.resize(xq_row);
        for (int64_t t = it.t0; t < it.t1; ++t) {
            const float *x = job.x + t * n_in;
            if (gemm) {
                k.quantize[act_index(at)](x, tmp.data(), n_in);
                float *xd = xf + xa_offsets[it.job] + t * n_in;
                dequantize_row(at, tmp.data(), xd, n_in);
                if (q8_1_mins) {
                    const auto *blocks = reinterpret_cast<const BlockQ8_1 *>(tmp.data());
                    float *c = xc + xa_offsets[it.job] / 32 + t * n_blocks;
                    for (int64_t b = 0; b < n_blocks; ++b) {
                        float sum = 0.0f;
                        for (int i = 0; i < 32; ++i) sum += xd[b * 32 + i];
                        c[b] = fp16_to_fp32(blocks[b].s) - sum;
                    }
                }
            } else {
                k.quantize[act_index(at)](x, xq + xa_offsets[it.job] + size_t(t) * xq_row, n_in);
            }
        }
    };
    const auto n_items = int64_t(items.size()), n_pack = int64_t(pack.size());
    // A decode step's few GEMV activations are quantized here, in a few microseconds: each barrier of the parallel
    // region below costs a sleeping thread's wake-up (passive waiting, decision 0102), several times that.
    int64_t quant_tokens = 0;
    for (const QuantItem &it : quant) quant_tokens += it.t1 - it.t0;
    const bool serial_quant = n_pack == 0 && quant_tokens * n_in <= kSerialQuantElems;
    if (serial_quant) {
        for (const QuantItem &it : quant) quantize_item(it);
    }
    const int64_t n_quant = serial_quant ? 0 : int64_t(quant.size());
#pragma omp parallel num_threads(nth) if (nth > 1 && n_items > 1)
    {
        if (n_quant > 0) {  // the same for every thread: all of them meet this loop's barrier or none
#pragma omp for schedule(dynamic, 1)
            for (int64_t q = 0; q < n_quant; ++q) quantize_item(quant_list[q]);
        }
        if (n_pack > 0) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < n_pack; ++p) {
                const PackItem &pk = pack_list[p];
                k.pack(gemm_x(pk.job), n_in, jobs[pk.job].n_tok, pk.k0, pk.k1, xt + xt_offsets[pk.job]);
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i) {
            const WorkItem &it = item_list[i];
            const MatmulJob &job = jobs[it.job];
            const auto *w = static_cast<const uint8_t *>(job.w) + size_t(it.r0) * row_bytes;
            if (job.n_tok >= min_gemm_tok) {
                gemm_rows(k, type, own_gemm, static_cast<const uint8_t *>(job.w), row_bytes, n_in, n_out, it.r0,
                          it.r1, gemm_x(it.job), xt + xt_offsets[it.job], job.n_tok, job.y);
                if (q8_1_mins) {
                    add_q8_1_min_correction(static_cast<const uint8_t *>(job.w), row_bytes, n_in, n_out, it.r0,
                                            it.r1, xc + xa_offsets[it.job] / 32, job.n_tok, job.y);
                }
            } else if (qact) {
                k.qgemv[ti](w, row_bytes, it.r1 - it.r0, n_in, xq + xa_offsets[it.job], xq_row, job.n_tok,
                            job.y + it.r0, n_out);
            } else {
                k.gemv[ti](w, row_bytes, it.r1 - it.r0, n_in, job.x, n_in, job.n_tok, job.y + it.r0, n_out);
            }
        }
    }
}

void matmul(DType type, const void *w, int64_t n_in, int64_t n_out, const float *x, int64_t n_tok, float *y) {
    const MatmulJob job{w, x, n_tok, y};
    matmul_batch(type, n_in, n_out, &job, 1);
}

} // namespace prescope::cpu

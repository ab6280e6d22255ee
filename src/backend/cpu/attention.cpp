// Causal grouped-query attention over an F32 KV cache (HF eager_attention_forward semantics:
// softmax(q.k * scale) in F32, then the weighted sum of v), threaded over queries and heads; optional attention
// sinks and sliding window (gpt-oss).
#include "backend/cpu/ops.h"

#include "backend/cpu/kernels.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace prescope::cpu {

namespace {

// Cache positions per step of the online softmax: a block of K or V rows (64 x head_dim floats,
// 32 KiB at head_dim 128) stays in L1 while every query head of the task reads it.
constexpr int64_t kKvBlock = 64;

} // namespace

void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0,
               int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float *out, const float *sinks,
               int64_t window) {
    PRESCOPE_ASSERT(n_head_kv > 0 && n_head % n_head_kv == 0 && pos0 >= 0 && window >= 0);
    if (n_tok == 0) return;
    const KernelTable &k = kernels();
    const int64_t group = n_head / n_head_kv;        // query heads per KV head
    const int64_t kv_stride = n_head_kv * head_dim;  // floats per cache position
    const int nth = threads_here();

    // A task is (token, KV head, a run of that KV head's query heads): the run's scores come from one
    // pass over the K rows (a GEMV with the query heads as tokens). Runs are shortened only until
    // every thread has a task (decode: one token, few KV heads), and never under a BatchInvariantScope: the
    // GEMV's accumulator chains per head depend on how many heads it computes together.
    int64_t heads_per_task = group;
    while (!batch_invariant() && heads_per_task > 1 &&
           n_tok * n_head_kv * ((group + heads_per_task - 1) / heads_per_task) < nth)
        heads_per_task = (heads_per_task + 1) / 2;
    const int64_t runs = (group + heads_per_task - 1) / heads_per_task;
    const int64_t n_tasks = n_tok * n_head_kv * runs;

#pragma omp parallel num_threads(nth) if (nth > 1 && n_tasks > 1)
    {
        // Per thread, kept between calls: [head of the run][block position], and per head of the run.
        thread_local std::vector<float> scores, row_max, row_sum;
        scores.resize(size_t(heads_per_task * kKvBlock));
        row_max.resize(size_t(heads_per_task));
        row_sum.resize(size_t(heads_per_task));
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_tasks; ++task) {
            const int64_t t = task / (n_head_kv * runs);
            const int64_t kvh = task / runs % n_head_kv;
            const int64_t h0 = kvh * group + task % runs * heads_per_task;
            const int64_t nh = std::min(heads_per_task, (kvh + 1) * group - h0);
            const int64_t n_kv = pos0 + t + 1;  // causal: positions 0 ..= pos0 + t
            // Sliding window: the last `window` of those positions.
            const int64_t first = window > 0 ? std::max<int64_t>(0, n_kv - window) : 0;
            float *o = out + (t * n_head + h0) * head_dim;
            std::fill(o, o + nh * head_dim, 0.0f);
            // A sink starts each row as a score already seen, with weight exp(0) = 1 and a zero value.
            for (int64_t i = 0; i < nh; ++i) {
                row_max[size_t(i)] = sinks ? sinks[h0 + i] : -INFINITY;
                row_sum[size_t(i)] = sinks ? 1.0f : 0.0f;
            }

            // Online softmax (flash-attention style) over blocks of positions: each block's scores,
            // then its share of P.V, rescaling what came before whenever the running maximum grows.
            for (int64_t j0 = first; j0 < n_kv; j0 += kKvBlock) {
                const int64_t nb = std::min(kKvBlock, n_kv - j0);
                const float *kb = k_cache + j0 * kv_stride + kvh * head_dim;
                const float *vb = v_cache + j0 * kv_stride + kvh * head_dim;
                k.gemv[dtype_index(DType::F32)](reinterpret_cast<const uint8_t *>(kb), size_t(kv_stride) * sizeof(float),
                                                nb, head_dim, q + (t * n_head + h0) * head_dim, head_dim, nh,
                                                scores.data(), nb);
                for (int64_t i = 0; i < nh; ++i) {
                    float *s = scores.data() + i * nb;
                    float mx = row_max[size_t(i)];
                    for (int64_t j = 0; j < nb; ++j) mx = std::max(mx, s[j] *= scale);
                    const float correction = std::exp(row_max[size_t(i)] - mx);  // 0 on the first block (no sink)
                    float sum = 0.0f;
                    for (int64_t j = 0; j < nb; ++j) sum += (s[j] = std::exp(s[j] - mx));
                    row_sum[size_t(i)] = row_sum[size_t(i)] * correction + sum;
                    row_max[size_t(i)] = mx;
                    float *oi = o + i * head_dim;
                    if (correction != 1.0f)
                        for (int64_t d = 0; d < head_dim; ++d) oi[d] *= correction;
                    k.weighted_row_sum(s, vb, kv_stride, nb, head_dim, oi);
                }
            }
            for (int64_t i = 0; i < nh; ++i) {
                const float inv = 1.0f / row_sum[size_t(i)];
                for (int64_t d = 0; d < head_dim; ++d) o[i * head_dim + d] *= inv;
            }
        }
    }
}

} // namespace prescope::cpu

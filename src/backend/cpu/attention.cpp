// Causal grouped-query attention over an F32 KV cache (HF eager_attention_forward semantics:
// softmax(q.k * scale) in F32, then the weighted sum of v), threaded over queries and heads.
#include "backend/cpu/ops.h"

#include "backend/cpu/kernels.h"
#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace prescope::cpu {

void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0,
               int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float *out) {
    PRESCOPE_ASSERT(n_head_kv > 0 && n_head % n_head_kv == 0 && pos0 >= 0);
    if (n_tok == 0) return;
    const KernelTable &k = kernels();
    const int64_t group = n_head / n_head_kv;        // query heads per KV head
    const int64_t kv_stride = n_head_kv * head_dim;  // floats per cache position
    const int nth = threads_here();

    // A task is (token, KV head, a run of that KV head's query heads): the run's scores come from one
    // pass over the K rows (a GEMV with the query heads as tokens). Runs are shortened only until
    // every thread has a task (decode: one token, few KV heads).
    int64_t heads_per_task = group;
    while (heads_per_task > 1 && n_tok * n_head_kv * ((group + heads_per_task - 1) / heads_per_task) < nth)
        heads_per_task = (heads_per_task + 1) / 2;
    const int64_t runs = (group + heads_per_task - 1) / heads_per_task;
    const int64_t n_tasks = n_tok * n_head_kv * runs;

#pragma omp parallel num_threads(nth) if (nth > 1 && n_tasks > 1)
    {
        std::vector<float> scores;  // [heads of the run][positions]
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < n_tasks; ++task) {
            const int64_t t = task / (n_head_kv * runs);
            const int64_t kvh = task / runs % n_head_kv;
            const int64_t h0 = kvh * group + task % runs * heads_per_task;
            const int64_t nh = std::min(heads_per_task, (kvh + 1) * group - h0);
            const int64_t n_kv = pos0 + t + 1;  // causal: positions 0 ..= pos0 + t
            scores.resize(size_t(nh * n_kv));

            k.gemv[dtype_index(DType::F32)](reinterpret_cast<const uint8_t *>(k_cache + kvh * head_dim),
                                            size_t(kv_stride) * sizeof(float), n_kv, head_dim,
                                            q + (t * n_head + h0) * head_dim, head_dim, nh, scores.data(), n_kv);
            for (int64_t i = 0; i < nh; ++i) {
                float *s = scores.data() + i * n_kv;
                float mx = -INFINITY;
                for (int64_t j = 0; j < n_kv; ++j) {
                    s[j] *= scale;
                    mx = std::max(mx, s[j]);
                }
                double sum = 0.0;
                for (int64_t j = 0; j < n_kv; ++j) {
                    s[j] = std::exp(s[j] - mx);
                    sum += s[j];
                }
                const float inv = float(1.0 / sum);
                for (int64_t j = 0; j < n_kv; ++j) s[j] *= inv;
                k.weighted_row_sum(s, v_cache + kvh * head_dim, kv_stride, n_kv, head_dim,
                                   out + (t * n_head + h0 + i) * head_dim);
            }
        }
    }
}

} // namespace prescope::cpu

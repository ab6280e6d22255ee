// MoE router and CPU expert executor.
#include "runtime/moe.h"

#include "core/error.h"
#include "core/memory.h"

#include <algorithm>

namespace prescope {

void moe_route(const HParams &hp, const LayerWeights &l, const float *x, int64_t n_tok, float *probs, Routing &out) {
    const int64_t n_expert = hp.n_expert, k = hp.n_expert_used;
    cpu::matmul(l.gate_inp, x, n_tok, probs);
    cpu::softmax(probs, n_tok, n_expert);
    out.n_tok = n_tok;
    out.k = k;
    out.ids.resize(size_t(n_tok * k));
    out.weights.resize(size_t(n_tok * k));
    for (int64_t t = 0; t < n_tok; ++t) {
        int32_t *ids = out.ids.data() + t * k;
        float *w = out.weights.data() + t * k;
        cpu::top_k(probs + t * n_expert, n_expert, k, ids, w);
        if (hp.norm_topk_prob) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) sum += w[j];
            for (int64_t j = 0; j < k; ++j) w[j] /= sum;
        }
    }
}

void cpu_expert_ffn(const TensorView &gate, const TensorView &up, const TensorView &down, int64_t expert,
                    const float *x, int64_t m, float *scratch, float *y) {
    const int64_t n_ff = gate.ne[1];
    float *g = scratch, *u = scratch + m * n_ff;
    cpu::matmul(gate, x, m, g, expert);
    cpu::matmul(up, x, m, u, expert);
    cpu::swiglu(g, u, g, m * n_ff);
    cpu::matmul(down, g, m, y, expert);
}

CpuExpertExecutor::CpuExpertExecutor(const Model &model, int64_t max_tokens)
    : model_(model), max_tokens_(max_tokens) {
    const HParams &hp = model.hp();
    const size_t pairs = size_t(max_tokens * hp.n_expert_used);
    check_host_memory(pairs * (2 * sizeof(int32_t) + 2 * sizeof(float) * size_t(hp.n_embd + hp.n_ff_exp)),
                      fmt::format("the CPU expert buffers for {} tokens per batch (-b)", max_tokens));
    count_.resize(size_t(hp.n_expert));
    offset_.resize(size_t(hp.n_expert) + 1);
    fill_.resize(size_t(hp.n_expert));
    order_.resize(pairs);
    row_of_.resize(pairs);
    xg_.resize(pairs * size_t(hp.n_embd));
    gate_.resize(pairs * size_t(hp.n_ff_exp));
    up_.resize(pairs * size_t(hp.n_ff_exp));
    y_.resize(pairs * size_t(hp.n_embd));
    jobs_.reserve(2 * size_t(hp.n_expert));
}

void CpuExpertExecutor::run(int64_t layer, const float *x, const Routing &r, float *out) {
    const HParams &hp = model_.hp();
    const LayerWeights &l = model_.weights().layers[size_t(layer)];
    const int64_t n_embd = hp.n_embd, n_ff = hp.n_ff_exp, k = r.k, n_pairs = r.n_tok * r.k;
    PRESCOPE_ASSERT(r.n_tok <= max_tokens_ && k == hp.n_expert_used);

    // Counting sort of the (token, slot) pairs by expert; gather their inputs in that order.
    std::fill(count_.begin(), count_.end(), 0);
    for (int64_t i = 0; i < n_pairs; ++i) count_[size_t(r.ids[size_t(i)])]++;
    offset_[0] = 0;
    for (int64_t e = 0; e < hp.n_expert; ++e) offset_[size_t(e) + 1] = offset_[size_t(e)] + count_[size_t(e)];
    std::copy(offset_.begin(), offset_.end() - 1, fill_.begin());
    for (int64_t i = 0; i < n_pairs; ++i) {
        const int32_t row = fill_[size_t(r.ids[size_t(i)])]++;
        order_[size_t(row)] = int32_t(i);
        row_of_[size_t(i)] = row;
    }
    for (int64_t row = 0; row < n_pairs; ++row) {
        std::copy_n(x + (order_[size_t(row)] / k) * n_embd, n_embd, xg_.data() + row * n_embd);
    }

    // gate and up of every active expert in one batch, SwiGLU, then down in one batch.
    jobs_.clear();
    for (int64_t e = 0; e < hp.n_expert; ++e) {
        if (count_[size_t(e)] == 0) continue;
        const int64_t first = offset_[size_t(e)];
        jobs_.push_back({l.gate_exps.matrix(e), xg_.data() + first * n_embd, count_[size_t(e)], gate_.data() + first * n_ff});
        jobs_.push_back({l.up_exps.matrix(e), xg_.data() + first * n_embd, count_[size_t(e)], up_.data() + first * n_ff});
    }
    cpu::matmul_batch(l.gate_exps.type, n_embd, n_ff, jobs_.data(), int64_t(jobs_.size()));
    cpu::swiglu(gate_.data(), up_.data(), gate_.data(), n_pairs * n_ff);
    jobs_.clear();
    for (int64_t e = 0; e < hp.n_expert; ++e) {
        if (count_[size_t(e)] == 0) continue;
        const int64_t first = offset_[size_t(e)];
        jobs_.push_back({l.down_exps.matrix(e), gate_.data() + first * n_ff, count_[size_t(e)], y_.data() + first * n_embd});
    }
    cpu::matmul_batch(l.down_exps.type, n_ff, n_embd, jobs_.data(), int64_t(jobs_.size()));

    // Weighted sum in top-k order (HF and llama.cpp add the k expert outputs in that order).
    for (int64_t t = 0; t < r.n_tok; ++t) {
        float *o = out + t * n_embd;
        std::fill_n(o, n_embd, 0.0f);
        for (int64_t j = 0; j < k; ++j) {
            const float w = r.weights[size_t(t * k + j)];
            const float *y = y_.data() + int64_t(row_of_[size_t(t * k + j)]) * n_embd;
            for (int64_t c = 0; c < n_embd; ++c) o[c] += w * y[c];
        }
    }
}

} // namespace prescope

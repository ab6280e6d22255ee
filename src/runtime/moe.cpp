// MoE router and CPU expert executor.
#include "runtime/moe.h"

#include "core/error.h"

#include <omp.h>

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
    count_.resize(size_t(hp.n_expert));
    offset_.resize(size_t(hp.n_expert) + 1);
    fill_.resize(size_t(hp.n_expert));
    active_.reserve(size_t(hp.n_expert));
    order_.resize(size_t(max_tokens * hp.n_expert_used));
    slot_out_.resize(size_t(max_tokens * hp.n_expert_used * hp.n_embd));
    // Per thread: gathered x [m][n_embd], gate+up [m][2 n_ff], output [m][n_embd]; m <= max_tokens.
    scratch_.resize(size_t(omp_get_max_threads()));
}

void CpuExpertExecutor::run(int64_t layer, const float *x, const Routing &r, float *out) {
    const HParams &hp = model_.hp();
    const LayerWeights &l = model_.weights().layers[size_t(layer)];
    const int64_t n_embd = hp.n_embd, n_ff = hp.n_ff_exp, k = r.k, n_tok = r.n_tok;
    PRESCOPE_ASSERT(n_tok <= max_tokens_);
    if (scratch_.size() < size_t(omp_get_max_threads())) scratch_.resize(size_t(omp_get_max_threads()));

    // Counting sort of the (token, slot) pairs by expert.
    std::fill(count_.begin(), count_.end(), 0);
    for (int64_t i = 0; i < n_tok * k; ++i) count_[size_t(r.ids[size_t(i)])]++;
    offset_[0] = 0;
    for (int64_t e = 0; e < hp.n_expert; ++e) offset_[size_t(e) + 1] = offset_[size_t(e)] + count_[size_t(e)];
    std::copy(offset_.begin(), offset_.end() - 1, fill_.begin());
    for (int64_t i = 0; i < n_tok * k; ++i) order_[size_t(fill_[size_t(r.ids[size_t(i)])]++)] = int32_t(i);

    active_.clear();
    for (int64_t e = 0; e < hp.n_expert; ++e) {
        if (count_[size_t(e)] > 0) active_.push_back(int32_t(e));
    }
    auto run_expert = [&](int32_t e, std::vector<float> &buf) {
        const int64_t m = count_[size_t(e)];
        buf.resize(size_t(m * (2 * n_embd + 2 * n_ff)));
        float *xg = buf.data(), *y = xg + m * n_embd, *scratch = y + m * n_embd;
        const int32_t *pairs = order_.data() + offset_[size_t(e)];
        for (int64_t i = 0; i < m; ++i) {
            std::copy_n(x + (pairs[i] / k) * n_embd, n_embd, xg + i * n_embd);
        }
        cpu_expert_ffn(l.gate_exps, l.up_exps, l.down_exps, e, xg, m, scratch, y);
        for (int64_t i = 0; i < m; ++i) {
            std::copy_n(y + i * n_embd, n_embd, slot_out_.data() + int64_t(pairs[i]) * n_embd);
        }
    };
    // Many active experts: one expert per thread. Few: experts in turn, each matmul threaded.
    if (int64_t(active_.size()) >= omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
        for (size_t i = 0; i < active_.size(); ++i) run_expert(active_[i], scratch_[size_t(omp_get_thread_num())]);
    } else {
        for (int32_t e : active_) run_expert(e, scratch_[0]);
    }

    for (int64_t t = 0; t < n_tok; ++t) {
        float *o = out + t * n_embd;
        std::fill_n(o, n_embd, 0.0f);
        for (int64_t j = 0; j < k; ++j) {
            const float w = r.weights[size_t(t * k + j)];
            const float *y = slot_out_.data() + (t * k + j) * n_embd;
            for (int64_t c = 0; c < n_embd; ++c) o[c] += w * y[c];
        }
    }
}

} // namespace prescope

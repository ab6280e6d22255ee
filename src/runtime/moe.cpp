// MoE router, the batched CPU expert runner and the CPU engine's executor (the all-CPU plan).
#include "runtime/moe.h"

#include "core/error.h"
#include "core/memory.h"
#include "runtime/hybrid-moe.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace prescope {

void moe_route(const HParams &hp, const LayerWeights &l, const float *x, int64_t n_tok, float *probs, Routing &out) {
    const int64_t n_expert = hp.n_expert, k = hp.n_expert_used;
    cpu::matmul(l.gate_inp, x, n_tok, probs);
    if (l.gate_inp_b) cpu::add_bias(probs, l.gate_inp_b, n_tok, n_expert);
    if (hp.expert_gating == ExpertGating::SIGMOID) {
        for (int64_t i = 0; i < n_tok * n_expert; ++i) probs[i] = 1.0f / (1.0f + std::exp(-probs[i]));
    } else if (hp.expert_gating == ExpertGating::SOFTMAX) {
        cpu::softmax(probs, n_tok, n_expert);
    }  // SOFTMAX_WEIGHT chooses on the logits themselves
    out.n_tok = n_tok;
    out.k = k;
    out.ids.resize(size_t(n_tok * k));
    out.weights.resize(size_t(n_tok * k));
    const bool choose_apart = l.exp_probs_b || hp.n_expert_group > 1;  // choosing scores differ from the weights
    const int64_t per_group = n_expert / hp.n_expert_group;
    std::array<float, kMaxExperts> choice, group_score;  // n_expert <= kMaxExperts (read_common_hparams)
    std::array<int32_t, kMaxExperts> group_ids;
    for (int64_t t = 0; t < n_tok; ++t) {
        const float *p = probs + t * n_expert;
        int32_t *ids = out.ids.data() + t * k;
        float *w = out.weights.data() + t * k;
        if (!choose_apart) {
            cpu::top_k(p, n_expert, k, ids, w);
        } else {
            // DeepSeek-V3 (HF DeepseekV3TopkRouter, llama.cpp build_moe_ffn): choose on score + bias; keep only
            // the groups with the largest sums of their two best choosing scores; the weights are the unbiased
            // scores of the chosen experts.
            for (int64_t e = 0; e < n_expert; ++e) choice[size_t(e)] = p[e] + (l.exp_probs_b ? l.exp_probs_b[e] : 0.0f);
            if (hp.n_expert_group > 1) {
                for (int64_t g = 0; g < hp.n_expert_group; ++g) {
                    float best[2];
                    int32_t unused[2];
                    cpu::top_k(choice.data() + g * per_group, per_group, 2, unused, best);
                    group_score[size_t(g)] = best[0] + best[1];
                }
                std::array<float, kMaxExperts> kept;
                cpu::top_k(group_score.data(), hp.n_expert_group, hp.n_expert_group_used, group_ids.data(), kept.data());
                std::array<bool, kMaxExperts> keep{};
                for (int64_t j = 0; j < hp.n_expert_group_used; ++j) keep[size_t(group_ids[size_t(j)])] = true;
                for (int64_t e = 0; e < n_expert; ++e) {
                    if (!keep[size_t(e / per_group)]) choice[size_t(e)] = -INFINITY;
                }
            }
            cpu::top_k(choice.data(), n_expert, k, ids, w);
            for (int64_t j = 0; j < k; ++j) w[j] = p[ids[j]];
        }
        // HF GptOssTopKRouter, llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT: softmax over the k chosen.
        if (hp.expert_gating == ExpertGating::SOFTMAX_WEIGHT) cpu::softmax(w, 1, k);
        if (hp.norm_topk_prob) {
            float sum = 0.0f;
            for (int64_t j = 0; j < k; ++j) sum += w[j];
            for (int64_t j = 0; j < k; ++j) w[j] /= sum;
        }
        if (hp.expert_weights_scale != 1.0f) {
            for (int64_t j = 0; j < k; ++j) w[j] *= hp.expert_weights_scale;
        }
    }
}

void cpu_expert_ffn(const TensorView &gate, const TensorView &up, const TensorView &down, int64_t expert,
                    const float *x, int64_t m, float *scratch, float *y) {
    const int64_t n_ff = gate.ne[1];
    float *g = scratch, *u = scratch + m * n_ff;
    if (gate.type == up.type) {
        // One batch, so that x is quantized once for both (cpu::matmul_batch).
        const cpu::MatmulJob jobs[2] = {{gate.matrix(expert), x, m, g}, {up.matrix(expert), x, m, u}};
        cpu::matmul_batch(gate.type, gate.ne[0], n_ff, jobs, 2);
    } else {
        cpu::matmul(gate, x, m, g, expert);
        cpu::matmul(up, x, m, u, expert);
    }
    cpu::swiglu(g, u, g, m * n_ff);
    cpu::matmul(down, g, m, y, expert);
}

CpuExpertRunner::CpuExpertRunner(int64_t n_embd, int64_t max_n_ff, int64_t max_pairs, ExpertAct act)
    : n_embd_(n_embd), max_n_ff_(max_n_ff), max_pairs_(max_pairs), act_(act) {
    check_host_memory(size_t(max_pairs) * sizeof(float) * size_t(n_embd + 2 * max_n_ff),
                      fmt::format("the CPU expert buffers for {} (token, expert) pairs per batch (-b)", max_pairs));
    xg_.resize(size_t(max_pairs * n_embd));
    gate_.resize(size_t(max_pairs * max_n_ff));
    up_.resize(size_t(max_pairs * max_n_ff));
}

void CpuExpertRunner::run(const ExpertStore &store, int32_t layer, int32_t n, const int32_t *experts,
                          const int32_t *offsets, const int32_t *rows, const float *x, float *y) {
    if (n == 0) return;
    const int64_t n_pairs = offsets[n];
    PRESCOPE_ASSERT(n_pairs <= max_pairs_);
    const int64_t n_embd = n_embd_;
    for (int64_t p = 0; p < n_pairs; ++p) std::copy_n(x + int64_t(rows[p]) * n_embd, n_embd, xg_.data() + p * n_embd);
    const ExpertViews first = store.cpu_views(layer, experts[0]);
    const int64_t n_ff = first.gate.ne[1];
    PRESCOPE_ASSERT(n_ff <= max_n_ff_);
    const bool one_batch = first.gate.type == first.up.type;
    jobs_.clear();
    for (int32_t i = 0; i < n; ++i) {
        const ExpertViews v = store.cpu_views(layer, experts[i]);
        const int64_t p0 = offsets[i], m = offsets[i + 1] - p0;
        jobs_.push_back({v.gate.matrix(v.index), xg_.data() + p0 * n_embd, m, gate_.data() + p0 * n_ff});
        if (one_batch) jobs_.push_back({v.up.matrix(v.index), xg_.data() + p0 * n_embd, m, up_.data() + p0 * n_ff});
    }
    // gate and up of every expert in one batch (when their dtypes agree), SwiGLU, then down in one batch.
    cpu::matmul_batch(first.gate.type, n_embd, n_ff, jobs_.data(), int64_t(jobs_.size()));
    if (!one_batch) {
        jobs_.clear();
        for (int32_t i = 0; i < n; ++i) {
            const ExpertViews v = store.cpu_views(layer, experts[i]);
            const int64_t p0 = offsets[i], m = offsets[i + 1] - p0;
            jobs_.push_back({v.up.matrix(v.index), xg_.data() + p0 * n_embd, m, up_.data() + p0 * n_ff});
        }
        cpu::matmul_batch(first.up.type, n_embd, n_ff, jobs_.data(), int64_t(jobs_.size()));
    }
    const bool biased = first.gate_b != nullptr;  // all experts of a model or none (HParams::moe_bias)
    if (biased) {
        for (int32_t i = 0; i < n; ++i) {
            const ExpertViews v = store.cpu_views(layer, experts[i]);
            const int64_t p0 = offsets[i], m = offsets[i + 1] - p0;
            cpu::add_bias(gate_.data() + p0 * n_ff, v.gate_b, m, n_ff);
            cpu::add_bias(up_.data() + p0 * n_ff, v.up_b, m, n_ff);
        }
    }
    if (act_ == ExpertAct::SWIGLU_OAI) {
        cpu::swiglu_oai(gate_.data(), up_.data(), gate_.data(), n_pairs * n_ff, cpu::kSwigluOaiAlpha,
                        cpu::kSwigluOaiLimit);
    } else {
        cpu::swiglu(gate_.data(), up_.data(), gate_.data(), n_pairs * n_ff);
    }
    jobs_.clear();
    for (int32_t i = 0; i < n; ++i) {
        const ExpertViews v = store.cpu_views(layer, experts[i]);
        const int64_t p0 = offsets[i], m = offsets[i + 1] - p0;
        jobs_.push_back({v.down.matrix(v.index), gate_.data() + p0 * n_ff, m, y + p0 * n_embd});
    }
    cpu::matmul_batch(first.down.type, n_ff, n_embd, jobs_.data(), int64_t(jobs_.size()));
    for (int32_t i = 0; biased && i < n; ++i) {
        const ExpertViews v = store.cpu_views(layer, experts[i]);
        const int64_t p0 = offsets[i], m = offsets[i + 1] - p0;
        cpu::add_bias(y + p0 * n_embd, v.down_b, m, n_embd);
    }
}

// The all-CPU plan: no GPU cache, so the MoE block's executor runs every routed expert on the host.
struct CpuExpertExecutor::Impl {
    Impl(const Model &model, int64_t max_tokens)
        : store(model, nullptr, cpu_only_store(model)),
          placement(PlacementPlan::uniform(int32_t(model.hp().n_layer), int32_t(model.hp().n_expert))),
          device(model.hp().n_embd, max_tokens * model.hp().n_expert_used),
          moe(model, store, placement, nullptr, nullptr, nullptr, nullptr, device, nullptr, CostModel{}, {}, max_tokens,
              /*shared_on_device=*/false) {}
    static ExpertStoreConfig cpu_only_store(const Model &model) {
        ExpertStoreConfig c;
        c.fetchable.assign(size_t(model.hp().n_layer * model.hp().n_expert), 0);  // read in place, never copied
        return c;
    }
    ExpertStore store;
    PlacementPlan placement;
    HostMoeDevice device;
    HybridMoe moe;
};

CpuExpertExecutor::CpuExpertExecutor(const Model &model, int64_t max_tokens)
    : impl_(std::make_unique<Impl>(model, max_tokens)) {}

CpuExpertExecutor::~CpuExpertExecutor() = default;

void CpuExpertExecutor::run(int64_t layer, const float *x, const Routing &r, float *out) {
    impl_->device.set_output(out);
    impl_->moe.run_layer(int32_t(layer), x, r, {});
}

} // namespace prescope

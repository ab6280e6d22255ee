// MoE router, the batched CPU expert runner and the CPU engine's executor (the all-CPU plan).
#include "runtime/moe.h"

#include "core/error.h"
#include "core/memory.h"
#include "runtime/hybrid-moe.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace prescope {

cpu::RouterSpec router_spec(const HParams &hp) {
    cpu::RouterSpec s;
    s.score = hp.expert_gating == ExpertGating::SIGMOID  ? cpu::RouterScore::SIGMOID
              : hp.expert_gating == ExpertGating::SOFTMAX ? cpu::RouterScore::SOFTMAX
                                                          : cpu::RouterScore::LOGITS;
    s.softmax_topk = hp.expert_gating == ExpertGating::SOFTMAX_WEIGHT;
    s.n_group = int(hp.n_expert_group);
    s.n_group_used = int(hp.n_expert_group_used);
    s.renorm = hp.norm_topk_prob;
    s.scale = hp.expert_weights_scale;
    return s;
}

void moe_route(const HParams &hp, const LayerWeights &l, const float *x, int64_t n_tok, float *probs, Routing &out) {
    const int64_t k = hp.n_expert_used;
    cpu::matmul(l.gate_inp, x, n_tok, probs);
    cpu::RouterSpec spec = router_spec(hp);
    spec.logit_bias = l.gate_inp_b;
    spec.select_bias = l.exp_probs_b;
    out.n_tok = n_tok;
    out.k = k;
    out.ids.resize(size_t(n_tok * k));
    out.weights.resize(size_t(n_tok * k));
    cpu::route(spec, probs, n_tok, hp.n_expert, k, out.ids.data(), out.weights.data());
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

void combine_top_k(int64_t k, const int32_t *pair_ids, const float *weights, const float *rows, int64_t n_embd,
                   float *out) {
    std::fill_n(out, n_embd, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
        const float w = weights[j];
        const float *y = rows + int64_t(pair_ids[j]) * n_embd;
        for (int64_t c = 0; c < n_embd; ++c) out[c] += w * y[c];
    }
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
        : store(model, nullptr, ExpertStoreConfig::cpu_only(model)),
          placement(PlacementPlan::uniform(int32_t(model.hp().n_layer), int32_t(model.hp().n_expert))),
          device(model.hp().n_embd, max_tokens * model.hp().n_expert_used),
          moe(model, store, placement, nullptr, nullptr, nullptr, nullptr, device, nullptr, CostModel{}, {}, max_tokens,
              /*shared_on_device=*/false) {}
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

// ExpertParallelExecutor: dispatch, per-GPU experts, combine over an AllToAll; the drift check of the groups.
#include "runtime/expert-parallel.h"

#include "core/error.h"
#include "core/memory.h"
#include "offload/byte-size.h"

#include <fmt/format.h>

#include <algorithm>

namespace prescope {

ExpertParallelExecutor::ExpertParallelExecutor(const Model &model, ExpertGroups groups, AllToAll &a2a,
                                               int64_t max_tokens, ExpertParallelConfig config)
    : model_(model), groups_(std::move(groups)), a2a_(a2a), config_(std::move(config)),
      store_(model, nullptr, ExpertStoreConfig::cpu_only(model)), replanned_(groups_) {
    const HParams &hp = model.hp();
    const int32_t G = groups_.n_gpus;
    PRESCOPE_ASSERT(max_tokens > 0 && a2a.world() == G && groups_.n_layers == hp.n_layer_moe() &&
                    groups_.n_experts == hp.n_expert);
    const int64_t k = hp.n_expert_used, n_embd = hp.n_embd;
    // Rows of one step over all GPUs: a token goes once to each GPU holding one of its experts (at most
    // min(k, G)); each (token, expert) pair is one expert output.
    const int64_t dispatch = max_tokens * std::min<int64_t>(k, G), pairs = max_tokens * k;
    check_host_memory(uint64_t(2 * dispatch + 3 * pairs) * uint64_t(n_embd) * sizeof(float),
                      fmt::format("the expert-parallel buffers of {} GPUs for -b {}", G, max_tokens));
    int64_t n_ff = 0;
    for (int32_t l = 0; l < store_.n_layers(); ++l) n_ff = std::max(n_ff, store_.layout(l).n_ff);
    runner_ = CpuExpertRunner(n_embd, n_ff, pairs, hp.expert_act);
    plan_.reserve(G, max_tokens, k, int32_t(hp.n_expert));
    if (config_.drift_window > 0) window_ = RoutingStats(groups_.n_layers, groups_.n_experts);
    stats_.gpu_pairs.assign(size_t(groups_.n_layers) * size_t(G), 0);
    home_.resize(size_t(max_tokens));
    row_bytes_ = size_t(n_embd) * sizeof(float);
    dispatch_send_.resize(size_t(dispatch * n_embd));
    dispatch_recv_.resize(size_t(dispatch * n_embd));
    pair_out_.resize(size_t(pairs * n_embd));
    combine_send_.resize(size_t(pairs * n_embd));
    combine_recv_.resize(size_t(pairs * n_embd));
    send_ptr_.resize(size_t(G));
    recv_ptr_.resize(size_t(G));
}

void ExpertParallelExecutor::run(int64_t layer, const float *x, const Routing &r, float *out) {
    const HParams &hp = model_.hp();
    const int32_t ml = int32_t(layer - hp.n_layer_dense), G = groups_.n_gpus;
    const int64_t n_embd = hp.n_embd, n_tok = r.n_tok, k = r.k;
    PRESCOPE_ASSERT(hp.has_experts(layer) && n_tok <= int64_t(home_.size()));
    const std::span<int32_t> home(home_.data(), size_t(n_tok));
    contiguous_homes(G, home);
    build_dispatch_plan(r.ids, k, groups_.layer(ml), home, plan_);
    // GPU g's part of a buffer starts after the rows of GPUs 0..g-1.
    const auto point = [&](auto &ptrs, std::vector<float> &buf, auto rows_of) {
        int64_t at = 0;
        for (int32_t g = 0; g < G; ++g) {
            ptrs[size_t(g)] = buf.data() + at * n_embd;
            at += rows_of(g);
        }
    };

    // Dispatch: each GPU sends the rows of its tokens, by receiver, then token (the plan's order).
    for (size_t i = 0; i < plan_.dispatch_tokens.size(); ++i) {
        const float *row = x + int64_t(plan_.dispatch_tokens[i]) * n_embd;
        std::copy_n(row, n_embd, dispatch_send_.data() + int64_t(i) * n_embd);
    }
    point(send_ptr_, dispatch_send_, [&](int32_t g) { return plan_.dispatch_sent(g); });
    point(recv_ptr_, dispatch_recv_, [&](int32_t g) { return plan_.dispatch_received(g); });
    a2a_.exchange(send_ptr_, recv_ptr_, plan_.dispatch_rows, row_bytes_);
    a2a_.synchronize();

    // Each GPU's experts on the rows it received, then their outputs in the combine's send order.
    float *sent = combine_send_.data();
    for (int32_t g = 0; g < G; ++g) {
        const GpuWork &w = plan_.work[size_t(g)];
        runner_.run(store_, int32_t(layer), w.n(), w.experts.data(), w.offsets.data(), w.rows.data(),
                    static_cast<const float *>(recv_ptr_[size_t(g)]), pair_out_.data());
        for (int64_t i = 0; i < w.pairs(); ++i, sent += n_embd) {
            std::copy_n(pair_out_.data() + int64_t(w.send[size_t(i)]) * n_embd, n_embd, sent);
        }
        stats_.gpu_pairs[size_t(ml) * size_t(G) + size_t(g)] += w.pairs();
    }

    // Combine: the outputs go back to the tokens' home GPUs, which add each token's k outputs in top-k order.
    point(send_ptr_, combine_send_, [&](int32_t g) { return plan_.combine_sent(g); });
    point(recv_ptr_, combine_recv_, [&](int32_t g) { return plan_.combine_received(g); });
    a2a_.exchange(send_ptr_, recv_ptr_, plan_.combine_rows, row_bytes_);
    a2a_.synchronize();
    for (int64_t t = 0; t < n_tok; ++t) {
        combine_top_k(k, &plan_.pair_row[size_t(t * k)], &r.weights[size_t(t * k)],
                      static_cast<const float *>(recv_ptr_[size_t(home[size_t(t)])]), n_embd, out + t * n_embd);
    }

    ++stats_.steps;
    stats_.token_layers += n_tok;
    stats_.dispatch_rows += int64_t(plan_.dispatch_tokens.size());
    for (int32_t s = 0; s < G; ++s) {
        for (int32_t d = 0; d < G; ++d) {
            if (s == d) continue;
            stats_.remote_rows += plan_.dispatch_rows[size_t(s * G + d)] + plan_.combine_rows[size_t(s * G + d)];
        }
    }

    if (config_.drift_window > 0) {
        window_.add(ml, r.ids, k);
        if (window_.tokens[size_t(ml)] >= uint64_t(config_.drift_window)) {
            const double now = group_balance(groups_, window_, ml).imbalance;
            if (now > 1.0 + groups_.tolerance) {
                plan_layer_groups(window_, ml, replanned_);
                if (group_balance(replanned_, window_, ml).imbalance < now) {
                    std::copy_n(replanned_.layer(ml).begin(), groups_.n_experts,
                                groups_.gpu.begin() + ptrdiff_t(ml) * groups_.n_experts);
                    ++stats_.replans;
                }
            }
            window_.decay(ml);
        }
    }
}

std::string ExpertParallelExecutor::describe() const {
    return fmt::format("expert parallel: {} GPUs simulated on the CPU (in-process all-to-all), experts in groups "
                       "from {}; {}\n",
                       groups_.n_gpus, config_.groups_source,
                       config_.drift_window > 0
                           ? fmt::format("groups re-planned when a GPU's load exceeds {:.0f}% of the mean over {} "
                                         "tokens of a layer",
                                         100.0 * (1.0 + groups_.tolerance), config_.drift_window)
                           : std::string("groups fixed"));
}

std::string ExpertParallelExecutor::stats_text() const {
    if (stats_.steps == 0) return {};
    const int32_t G = groups_.n_gpus;
    double sum = 0, worst = 0;
    int32_t worst_layer = 0, counted = 0;
    for (int32_t l = 0; l < groups_.n_layers; ++l) {
        const auto *p = &stats_.gpu_pairs[size_t(l) * size_t(G)];
        int64_t total = 0, most = 0;
        for (int32_t g = 0; g < G; ++g) total += p[g], most = std::max(most, p[g]);
        if (total == 0) continue;
        const double imbalance = double(most) / (double(total) / G);
        sum += imbalance, ++counted;
        if (imbalance > worst) worst = imbalance, worst_layer = l;
    }
    return fmt::format("expert parallel: {} GPUs, {} layer steps, {:.2f} GPUs per token and layer (top-{}), {} "
                       "between GPUs (dispatch + combine), GPU load max/mean {:.2f} (mean over MoE layers; MoE "
                       "layer {}: {:.2f}), {} re-plans\n",
                       G, stats_.steps, double(stats_.dispatch_rows) / double(stats_.token_layers),
                       model_.hp().n_expert_used, format_byte_size(uint64_t(stats_.remote_rows) * row_bytes_),
                       counted ? sum / counted : 1.0, worst_layer, worst, stats_.replans);
}

} // namespace prescope

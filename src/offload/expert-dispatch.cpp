// DispatchPlan: one layer's dispatch and combine over several GPUs, from the routing and the expert groups.
#include "offload/expert-dispatch.h"

#include "core/error.h"

#include <algorithm>

namespace prescope {

void DispatchPlan::reserve(int32_t n_gpus_, int64_t max_tokens, int64_t k_, int32_t n_experts) {
    PRESCOPE_ASSERT(n_gpus_ >= 1 && n_gpus_ <= 8 && max_tokens > 0 && k_ > 0);
    n_gpus = n_gpus_;
    const auto G = size_t(n_gpus), T = size_t(max_tokens), pairs = T * size_t(k_);
    home.reserve(T);
    dispatch_rows.reserve(G * G);
    dispatch_tokens.reserve(T * std::min(G, size_t(k_)));
    work.resize(G);
    for (GpuWork &w : work) {
        w.experts.reserve(size_t(n_experts));
        w.offsets.reserve(size_t(n_experts) + 1);
        w.rows.reserve(pairs);
        w.send.reserve(pairs);
    }
    combine_rows.reserve(G * G);
    pair_row.reserve(pairs);
    gpu_mask.reserve(T);
    by_home.reserve(T);
    recv_row.reserve(T * G);
    pair_index.reserve(pairs);
    fill.reserve(size_t(n_experts));
    at.reserve(G * G);
}

int64_t DispatchPlan::row_sum(const std::vector<int64_t> &m, int32_t g, bool sender) const {
    int64_t n = 0;
    for (int32_t o = 0; o < n_gpus; ++o) n += sender ? m[size_t(g * n_gpus + o)] : m[size_t(o * n_gpus + g)];
    return n;
}

void contiguous_homes(int32_t n_gpus, std::span<int32_t> home) {
    const auto n = int64_t(home.size());
    for (int64_t t = 0; t < n; ++t) home[size_t(t)] = int32_t(t * n_gpus / n);
}

void build_dispatch_plan(std::span<const int32_t> ids, int64_t k, std::span<const int8_t> gpu_of_expert,
                         std::span<const int32_t> home, DispatchPlan &p) {
    const int32_t G = p.n_gpus;
    const auto E = int32_t(gpu_of_expert.size());
    const auto n_tok = int64_t(home.size());
    PRESCOPE_ASSERT(k > 0 && int64_t(ids.size()) == n_tok * k && int64_t(p.work.size()) == G);
    p.n_tok = n_tok;
    p.k = k;
    p.home.assign(home.begin(), home.end());
    const auto gpu = [&](int64_t t, int64_t j) { return int32_t(gpu_of_expert[size_t(ids[size_t(t * k + j)])]); };
    // Segment offsets of a [sender][receiver] matrix: in the receiver's buffer, the senders before s come first.
    const auto recv_base = [&](const std::vector<int64_t> &m, int32_t s, int32_t d) {
        int64_t n = 0;
        for (int32_t o = 0; o < s; ++o) n += m[size_t(o * G + d)];
        return n;
    };

    // Tokens by home GPU (stable, so each home's tokens stay in token order), and the GPUs each token needs.
    p.by_home.resize(size_t(n_tok));
    p.gpu_mask.assign(size_t(n_tok), 0);
    int64_t n_home = 0;
    for (int32_t s = 0; s < G; ++s) {
        for (int64_t t = 0; t < n_tok; ++t) {
            PRESCOPE_ASSERT(home[size_t(t)] >= 0 && home[size_t(t)] < G);
            if (home[size_t(t)] == s) p.by_home[size_t(n_home++)] = int32_t(t);
        }
    }
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < k; ++j) p.gpu_mask[size_t(t)] |= uint8_t(1u << gpu(t, j));
    }

    // Dispatch: one row per (token, GPU holding one of its experts), by sender, receiver, token.
    p.dispatch_rows.assign(size_t(G * G), 0);
    for (int64_t t = 0; t < n_tok; ++t) {
        const int32_t s = home[size_t(t)];
        for (int32_t d = 0; d < G; ++d) p.dispatch_rows[size_t(s * G + d)] += (p.gpu_mask[size_t(t)] >> d) & 1;
    }
    p.dispatch_tokens.clear();
    p.recv_row.assign(size_t(n_tok * G), -1);
    p.at.assign(size_t(G * G), 0);
    for (int32_t s = 0; s < G; ++s) {
        for (int32_t d = 0; d < G; ++d) p.at[size_t(s * G + d)] = recv_base(p.dispatch_rows, s, d);
    }
    // Each sender's tokens (a run of by_home) once per receiver: the send order is sender, receiver, token.
    for (int64_t i = 0, s_end = 0; i < n_tok; i = s_end) {
        const int32_t s = home[size_t(p.by_home[size_t(i)])];
        for (s_end = i; s_end < n_tok && home[size_t(p.by_home[size_t(s_end)])] == s;) ++s_end;
        for (int32_t d = 0; d < G; ++d) {
            for (int64_t x = i; x < s_end; ++x) {
                const int32_t t = p.by_home[size_t(x)];
                if (!((p.gpu_mask[size_t(t)] >> d) & 1)) continue;
                p.dispatch_tokens.push_back(t);
                p.recv_row[size_t(t * G + d)] = int32_t(p.at[size_t(s * G + d)]++);
            }
        }
    }

    // Work: each GPU's routed experts in ascending id, each expert's pairs in token order.
    p.fill.assign(size_t(E), 0);
    for (int64_t i = 0; i < n_tok * k; ++i) ++p.fill[size_t(ids[size_t(i)])];
    for (int32_t g = 0; g < G; ++g) {
        GpuWork &w = p.work[size_t(g)];
        w.experts.clear();
        w.offsets.assign(1, 0);
        for (int32_t e = 0; e < E; ++e) {
            if (gpu_of_expert[size_t(e)] != g || p.fill[size_t(e)] == 0) continue;
            w.experts.push_back(e);
            w.offsets.push_back(w.offsets.back() + p.fill[size_t(e)]);
        }
        for (int32_t i = 0; i < w.n(); ++i) p.fill[size_t(w.experts[size_t(i)])] = w.offsets[size_t(i)];
        w.rows.resize(size_t(w.pairs()));
    }
    p.pair_index.resize(size_t(n_tok * k));
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < k; ++j) {
            const int32_t g = gpu(t, j), pair = p.fill[size_t(ids[size_t(t * k + j)])]++;
            p.work[size_t(g)].rows[size_t(pair)] = p.recv_row[size_t(t * G + g)];
            p.pair_index[size_t(t * k + j)] = pair;
        }
    }

    // Combine: each GPU returns its pairs' outputs by home GPU, token, top-k slot; the home combines them.
    p.combine_rows.assign(size_t(G * G), 0);
    for (int64_t t = 0; t < n_tok; ++t) {
        for (int64_t j = 0; j < k; ++j) ++p.combine_rows[size_t(gpu(t, j) * G + home[size_t(t)])];
    }
    for (int32_t d = 0; d < G; ++d) {
        for (int32_t s = 0; s < G; ++s) p.at[size_t(d * G + s)] = recv_base(p.combine_rows, d, s);
        p.work[size_t(d)].send.clear();
    }
    p.pair_row.resize(size_t(n_tok * k));
    for (int64_t i = 0; i < n_tok; ++i) {
        const int32_t t = p.by_home[size_t(i)], s = home[size_t(t)];
        for (int64_t j = 0; j < k; ++j) {
            const int32_t d = gpu(t, j);
            p.work[size_t(d)].send.push_back(p.pair_index[size_t(t * k + j)]);
            p.pair_row[size_t(t * k + j)] = int32_t(p.at[size_t(d * G + s)]++);
        }
    }
}

} // namespace prescope

// Test-only routing traces with uniformly random routing (offload/trace.h).
#pragma once

#include "offload/trace.h"

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace prescope::test {

/// A trace of L layers, E experts, top-K, with one sequence per entry of seq_lens ("s0", "s1", ...; sources
/// alternate "test-split" and "gsm8k"). Every token routes, at every layer, K distinct experts drawn uniformly
/// (a shuffle of 0..E-1 by mt19937(seed)); the j-th pick gets the gate weight weight(j). Token i (over the
/// whole trace) has id (i * 7919) % 50000, so ids past 16 bits appear. model "test", arch "qwen3moe".
inline RoutingTrace random_trace(int32_t L, int32_t E, int32_t K, const std::vector<int64_t> &seq_lens,
                                 uint32_t seed, const std::function<float(int32_t)> &weight) {
    RoutingTrace t;
    t.model = "test", t.arch = "qwen3moe", t.created_by = "test";
    t.n_layer = L, t.n_expert = E, t.top_k = K;
    std::mt19937 rng(seed);
    std::vector<int32_t> perm(static_cast<size_t>(E));
    uint32_t token = 0;
    for (size_t s = 0; s < seq_lens.size(); ++s) {
        t.sequences.push_back({"s" + std::to_string(s), s % 2 ? "gsm8k" : "test-split", seq_lens[s]});
        for (int64_t i = 0; i < seq_lens[s]; ++i, ++token) {
            std::vector<int32_t> ids;
            std::vector<float> w;
            for (int32_t l = 0; l < L; ++l) {
                std::iota(perm.begin(), perm.end(), 0);
                std::shuffle(perm.begin(), perm.end(), rng);
                for (int32_t j = 0; j < K; ++j) ids.push_back(perm[size_t(j)]), w.push_back(weight(j));
            }
            t.append_token(token * 7919u % 50000u, ids, w);
        }
    }
    return t;
}

} // namespace prescope::test

#include "runtime/sampler.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace prescope {

int32_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; ++i) {
        if (x[i] > x[best]) best = i;
    }
    return int32_t(best);
}

Sampler::Sampler(const SamplerParams &params)
    : p_(params), seed_(params.seed == 0xFFFFFFFFu ? std::random_device{}() : params.seed), rng_(seed_) {}

void Sampler::accept(int32_t token) {
    if (p_.repeat_last_n <= 0) return;
    recent_.push_back(token);
    while (int32_t(recent_.size()) > p_.repeat_last_n) recent_.pop_front();
}

int32_t Sampler::sample(const float *logits, int64_t n_vocab) {
    for (int64_t i = 0; i < n_vocab; ++i) {
        if (std::isnan(logits[i])) fail("the model produced NaN logits (token {}); the weights may be corrupt", i);
    }
    cand_.resize(size_t(n_vocab));
    for (int64_t i = 0; i < n_vocab; ++i) cand_[size_t(i)] = {logits[i], int32_t(i)};

    // Repetition penalty (llama.cpp llama_sampler_penalties / CTRL paper): divide positive logits,
    // multiply negative ones, once per distinct recent token.
    if (p_.repeat_penalty != 1.0f) {
        std::vector<int32_t> seen(recent_.begin(), recent_.end());
        std::sort(seen.begin(), seen.end());
        seen.erase(std::unique(seen.begin(), seen.end()), seen.end());
        for (int32_t t : seen) {
            if (t < 0 || t >= n_vocab) continue;
            float &l = cand_[size_t(t)].first;
            l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
        }
    }
    auto by_logit = [](const auto &a, const auto &b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
    if (p_.temp <= 0.0f) {
        return std::min_element(cand_.begin(), cand_.end(), by_logit)->second;
    }

    size_t n = cand_.size();
    if (p_.top_k > 0 && size_t(p_.top_k) < n) {
        std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
        n = size_t(p_.top_k);
    } else {
        std::sort(cand_.begin(), cand_.end(), by_logit);
    }
    // Softmax over the kept candidates (sorted, descending).
    std::vector<float> prob(n);
    const float max_l = cand_[0].first;
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) sum += prob[i] = std::exp(cand_[i].first - max_l);
    for (float &p : prob) p = float(p / sum);
    if (p_.top_p < 1.0f) {
        double cum = 0.0;
        size_t keep = n;
        for (size_t i = 0; i < n; ++i) {
            cum += prob[i];
            if (cum >= p_.top_p) {
                keep = i + 1;
                break;
            }
        }
        n = keep;
    }
    if (p_.min_p > 0.0f) {
        size_t keep = 1;
        while (keep < n && prob[keep] >= p_.min_p * prob[0]) ++keep;
        n = keep;
    }
    // Temperature, then draw from the renormalised distribution.
    std::vector<double> w(n);
    for (size_t i = 0; i < n; ++i) w[i] = std::exp(double(cand_[i].first - max_l) / p_.temp);
    std::discrete_distribution<size_t> dist(w.begin(), w.end());
    return cand_[dist(rng_)].second;
}

} // namespace prescope

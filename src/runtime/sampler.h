// Token sampling from logits, in llama.cpp's default order (common/sampling.cpp): repetition penalty
// -> top-k -> top-p -> min-p -> temperature -> draw. temp <= 0 is greedy (argmax of the raw logits).
#pragma once

#include <cstdint>
#include <deque>
#include <random>
#include <vector>

namespace prescope {

struct SamplerParams {
    float temp = 0.8f;             // --temp; <= 0: greedy
    int32_t top_k = 40;            // --top-k; <= 0: off
    float top_p = 0.95f;           // --top-p; >= 1: off
    float min_p = 0.05f;           // --min-p; <= 0: off
    float repeat_penalty = 1.0f;   // --repeat-penalty; 1: off
    int32_t repeat_last_n = 64;    // tokens the penalty looks back over
    uint32_t seed = 0xFFFFFFFFu;   // --seed; 0xFFFFFFFF: random
};

class Sampler {
  public:
    explicit Sampler(const SamplerParams &params);
    /// Picks the next token from logits[n_vocab] (not modified). Throws prescope::Error when the
    /// logits contain NaN.
    int32_t sample(const float *logits, int64_t n_vocab);
    /// Records a token for the repetition penalty (prompt and generated tokens).
    void accept(int32_t token);
    uint32_t seed() const { return seed_; }

  private:
    SamplerParams p_;
    uint32_t seed_;
    std::mt19937 rng_;
    std::deque<int32_t> recent_;
    std::vector<std::pair<float, int32_t>> cand_;  // (logit, id) candidates, reused
};

/// Index of the largest value (first one on ties).
int32_t argmax(const float *x, int64_t n);

} // namespace prescope

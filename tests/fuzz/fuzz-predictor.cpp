// Predictor files (LLaPor LSTM / MLP / MLP-prior, offload/predictor-llapor.h): the reader and, when a file
// reads, two decode steps through every layer (a predictor that loads must run, and its scores be finite).
#include "fuzz-common.h"

#include "offload/predictor-llapor.h"

#include <cmath>
#include <numeric>

using namespace prescope;

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const fuzz::MemFile file(data, size);
    std::unique_ptr<ScoringPredictor> p;
    LlaporConfig cfg;
    fuzz::expect_clean([&] { p = load_llapor(file.path(), 2, &cfg); });
    if (!p) return 0;
    // No Error allowed from here on.
    const PredictorShape &s = p->shape();
    constexpr int32_t kTokens = 2;
    std::vector<int32_t> routed(size_t(kTokens * s.top_k));
    for (size_t i = 0; i < routed.size(); ++i) routed[i] = int32_t(i % size_t(s.n_experts));
    std::vector<float> hidden(size_t(kTokens) * size_t(std::max<int64_t>(cfg.dim, 1)), 0.5f);
    std::vector<float> scores(size_t(cfg.window) * kTokens * size_t(s.n_experts));
    for (int step = 0; step < 2; ++step) {
        for (int32_t l = 0; l < s.n_layers; ++l) {
            const PredictorInput in{l, s.n_layers, cfg.window, routed, kTokens, s.top_k,
                                    p->needs_hidden() ? hidden.data() : nullptr, cfg.dim};
            std::fill(scores.begin(), scores.end(), 0.0f);
            p->score(in, scores);
            for (float v : scores) {
                if (std::isnan(v)) std::abort();  // finite weights and inputs must give numbers
            }
        }
    }
    return 0;
}

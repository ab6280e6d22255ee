// moe_route (runtime/moe.h) on a hand-made router against hand-computed scores: gpt-oss's biased router and its
// softmax over the chosen logits (HF GptOssTopKRouter; llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT).
#include "runtime/moe.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace {

using prescope::ExpertGating;

/// A router of 4 experts over n_embd 2 whose logits for x = (1, 0) are w0 + b and for x = (0, 1) are w1 + b.
struct Router {
    std::vector<float> w = {0.5f, -1.0f,  /* expert 0: row (in 0, in 1) */
                            2.0f, 0.0f,   /* expert 1 */
                            1.0f, 3.0f,   /* expert 2 */
                            -2.0f, 1.0f}; /* expert 3 */
    std::vector<float> b = {0.0f, 0.0f, 1.5f, 0.0f};
    prescope::HParams hp;
    prescope::LayerWeights l;
    Router(ExpertGating gating, bool bias) {
        hp.n_embd = 2, hp.n_expert = 4, hp.n_expert_used = 2, hp.expert_gating = gating;
        l.gate_inp.type = prescope::DType::F32;
        l.gate_inp.ne = {2, 4, 1, 1};
        l.gate_inp.data = w.data();
        if (bias) l.gate_inp_b = b.data();
    }
};

double softmax2(double a, double b) { return 1.0 / (1.0 + std::exp(b - a)); }  // weight of a among {a, b}

} // namespace

TEST(MoeRoute, SoftmaxWeightIsTheSoftmaxOfTheChosenBiasedLogits) {
    Router r(ExpertGating::SOFTMAX_WEIGHT, /*bias=*/true);
    const float x[4] = {1.0f, 0.0f, 0.0f, 1.0f};  // two tokens
    std::vector<float> probs(8);
    prescope::Routing out;
    prescope::moe_route(r.hp, r.l, x, 2, probs.data(), out);
    // Token 0: logits (0.5, 2, 1 + 1.5, -2): experts 2 (2.5) and 1 (2). The bias changes the order (without it
    // expert 1 leads), and the weights are the softmax of the two logits alone, not of all four.
    ASSERT_EQ(out.ids, (std::vector<int32_t>{2, 1, 2, 3}));
    EXPECT_NEAR(out.weights[0], softmax2(2.5, 2.0), 1e-6);
    EXPECT_NEAR(out.weights[1], softmax2(2.0, 2.5), 1e-6);
    // Token 1: logits (-1, 0, 3 + 1.5, 1): experts 2 (4.5) and 3 (1).
    EXPECT_NEAR(out.weights[2], softmax2(4.5, 1.0), 1e-6);
    EXPECT_NEAR(out.weights[3], softmax2(1.0, 4.5), 1e-6);
    EXPECT_FLOAT_EQ(probs[2], 2.5f);  // the scores are the logits themselves

    Router plain(ExpertGating::SOFTMAX_WEIGHT, /*bias=*/false);
    prescope::moe_route(plain.hp, plain.l, x, 1, probs.data(), out);
    EXPECT_EQ(out.ids, (std::vector<int32_t>{1, 2}));
    EXPECT_NEAR(out.weights[0], softmax2(2.0, 1.0), 1e-6);
}

// The same router with softmax over all experts keeps those experts' full-softmax scores as weights: what
// SOFTMAX_WEIGHT must not give.
TEST(MoeRoute, SoftmaxOverAllExpertsDiffersFromSoftmaxWeight) {
    Router r(ExpertGating::SOFTMAX, /*bias=*/true);
    const float x[2] = {1.0f, 0.0f};
    std::vector<float> probs(4);
    prescope::Routing out;
    prescope::moe_route(r.hp, r.l, x, 1, probs.data(), out);
    ASSERT_EQ(out.ids, (std::vector<int32_t>{2, 1}));
    const double z = std::exp(0.5) + std::exp(2.0) + std::exp(2.5) + std::exp(-2.0);
    EXPECT_NEAR(out.weights[0], std::exp(2.5) / z, 1e-6);
    EXPECT_GT(std::fabs(out.weights[0] - softmax2(2.5, 2.0)), 0.05);
}

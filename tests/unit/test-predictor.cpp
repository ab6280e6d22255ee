// Expert predictors: metrics on hand-made traces with known answers, the cache replay, gradient checks of the
// LLaPor networks, learning planted structure better than frequency (and, with the routers as a prior, better
// than Fate where Fate is biased), save/load, Fate against the real router, and the layer-group measurement.
#include "../common/random-trace.h"
#include "arch/arch.h"
#include "core/error.h"
#include "offload/predictor-baselines.h"
#include "offload/predictor-eval.h"
#include "offload/predictor-llapor.h"
#include "offload/predictor-train.h"
#include "offload/trace.h"
#include "runtime/context.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>
#include <fstream>
#include <limits>
#include <numeric>
#include <random>
#include <unistd.h>

using namespace prescope;
namespace fs = std::filesystem;

namespace {

fs::path tmp_file(const std::string &name) {
    fs::path d = fs::temp_directory_path() / ("prescope-test-predictor-" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d / name;
}

RoutingTrace empty_trace(int32_t L, int32_t E, int32_t K) {
    RoutingTrace t;
    t.model = "synthetic", t.arch = "qwen3moe", t.created_by = "test-predictor";
    t.n_layer = L, t.n_expert = E, t.top_k = K;
    return t;
}

void add_token(RoutingTrace &t, const std::vector<std::vector<int32_t>> &per_layer) {
    std::vector<int32_t> ids;
    for (const auto &l : per_layer) ids.insert(ids.end(), l.begin(), l.end());
    t.append_token(0, ids, std::vector<float>(ids.size(), 0.5f));
    t.sequences.back().n_tokens += 1;
}

// Scores every layer's experts with the same fixed vector.
class ConstantPredictor final : public ScoringPredictor {
  public:
    ConstantPredictor(PredictorShape s, std::vector<float> v) : ScoringPredictor(s, 4, 4), v_(std::move(v)) {}
    const char *name() const override { return "constant"; }
    void score(const PredictorInput &in, std::span<float> out) override {
        for (int32_t d = 1; d <= in.window && in.layer + d < shape_.n_layers; ++d) {
            for (int32_t t = 0; t < in.n_tokens; ++t) {
                std::copy(v_.begin(), v_.end(), out.begin() + (size_t(d - 1) * size_t(in.n_tokens) + size_t(t)) * v_.size());
            }
        }
    }

  private:
    std::vector<float> v_;
};

// L=3, E=4, K=2, one sequence of two tokens (the answers below are worked out by hand from it).
RoutingTrace hand_trace() {
    RoutingTrace t = empty_trace(3, 4, 2);
    t.sequences.push_back({"hand", "test", 0});
    add_token(t, {{0, 1}, {1, 2}, {2, 3}});
    add_token(t, {{0, 2}, {0, 1}, {1, 3}});
    return t;
}

const nlohmann::json &row(const nlohmann::json &j, int d, const std::string &group) {
    for (const auto &r : j["rows"]) {
        if (r["distance"] == d && r["layer_group"] == group) return r;
    }
    static const nlohmann::json none;
    ADD_FAILURE() << "no row for distance " << d << " group " << group;
    return none;
}

} // namespace

TEST(PredictorEval, HandMadeTraceKnownAnswers) {
    const RoutingTrace t = hand_trace();
    ConstantPredictor p({3, 4, 2}, {0.9f, 0.8f, 0.1f, 0.0f});  // predicts {0, 1}; with k = 3 {0, 1, 2}
    EvalOptions o;
    o.window = 2;
    o.group_start = {0, 1, 2};
    nlohmann::json j = evaluate_predictor(&p, t, nullptr, o, "hand").to_json();
    // d=1: token 0: layer 1 {1,2} 1 hit, layer 2 {2,3} 0 hits; token 1: layer 1 {0,1} 2 hits, layer 2 {1,3} 1 hit.
    EXPECT_DOUBLE_EQ(row(j, 1, "all")["recall_at_k"], (0.5 + 0.0 + 1.0 + 0.5) / 4);
    EXPECT_DOUBLE_EQ(row(j, 1, "all")["precision_at_k"], (0.5 + 0.0 + 1.0 + 0.5) / 4);
    EXPECT_DOUBLE_EQ(row(j, 1, "all")["exact_match"], 0.25);
    EXPECT_DOUBLE_EQ(row(j, 1, "middle")["recall_at_k"], 0.75);
    EXPECT_DOUBLE_EQ(row(j, 1, "output")["recall_at_k"], 0.25);
    EXPECT_DOUBLE_EQ(row(j, 2, "all")["recall_at_k"], 0.25);  // layer 0 -> 2: 0 and 1 hit
    EXPECT_EQ(row(j, 2, "all")["n"], 2);
    for (const auto &r : j["rows"]) EXPECT_NE(r["layer_group"], "input");  // layer 0 is never predicted

    o.k_pred = 3;  // {0, 1, 2}: recall and precision part
    j = evaluate_predictor(&p, t, nullptr, o, "hand").to_json();
    EXPECT_DOUBLE_EQ(row(j, 1, "all")["recall_at_k"], (1.0 + 0.5 + 1.0 + 0.5) / 4);
    EXPECT_DOUBLE_EQ(row(j, 1, "all")["precision_at_k"], (2.0 + 1.0 + 2.0 + 1.0) / 3 / 4);
    EXPECT_DOUBLE_EQ(row(j, 1, "all")["exact_match"], 0.0);
}

TEST(PredictorEval, OracleIsPerfectAndNoneIsEmpty) {
    const RoutingTrace t = hand_trace();
    OraclePredictor oracle(t);
    EvalOptions o;
    o.window = 2;
    const EvalResult r = evaluate_predictor(&oracle, t, nullptr, o, "hand");
    for (int d = 1; d <= 2; ++d) {
        const EvalCell c = r.sum(d, d, 3);
        EXPECT_EQ(c.recall, double(c.n));
        EXPECT_EQ(c.exact, c.n);
    }
    const EvalResult n = evaluate_predictor(nullptr, t, nullptr, o, "hand");
    EXPECT_EQ(n.sum(1, 1, 3).recall, 0.0);
    EXPECT_EQ(n.sum(1, 1, 3).n_nonempty, 0);
}

TEST(PredictorEval, CacheReplayHitRates) {
    const RoutingTrace t = hand_trace();
    EvalOptions o;
    o.window = 2;
    o.cache_slots = 4;  // every expert fits: only first uses miss
    // Unique experts per layer: {0,1,2}, {0,1,2}, {1,2,3}: 9 misses of 12 accesses.
    EXPECT_DOUBLE_EQ(evaluate_predictor(nullptr, t, nullptr, o, "hand").hit_rate, 3.0 / 12);
    // The oracle prefetches every later layer before it routes; only layer 0's 3 first uses miss.
    OraclePredictor oracle(t);
    const EvalResult r = evaluate_predictor(&oracle, t, nullptr, o, "hand");
    EXPECT_DOUBLE_EQ(r.hit_rate, 9.0 / 12);
    EXPECT_EQ(r.demand_misses, 3u);
}

TEST(PredictorEval, CacheReplayTakesHitsBeforeLoads) {
    // 1 layer, 4 experts, top-2, 2 slots (LRU). Token 1 routes {2, 0} in router order with {0, 1} resident.
    // Loading 2 first would evict 0 (least recent), which the same token then misses; the runtime pins the hit
    // 0 first and evicts 1, so 1 of the 4 accesses hits.
    RoutingTrace t = empty_trace(1, 4, 2);
    t.sequences.push_back({"s", "test", 0});
    add_token(t, {{0, 1}});
    add_token(t, {{2, 0}});
    EvalOptions o;
    o.window = 1;
    o.cache_slots = 2;
    const EvalResult r = evaluate_predictor(nullptr, t, nullptr, o, "hits-first");
    EXPECT_DOUBLE_EQ(r.hit_rate, 1.0 / 4);
    EXPECT_EQ(r.demand_misses, 3u);
}

TEST(PredictorEval, BeladyKnownAnswerAndBound) {
    // Top-1 over 3 experts with 2 slots, 0 1 2 0 1 2 0: LRU misses every time; the optimum evicts the expert used
    // farthest ahead (1 at token 2, 0 at token 4) and hits tokens 3 and 5.
    RoutingTrace t = empty_trace(1, 3, 1);
    t.sequences.push_back({"s", "test", 0});
    for (int e : {0, 1, 2, 0, 1, 2, 0}) add_token(t, {{e}});
    std::vector<int64_t> all(7);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_DOUBLE_EQ(belady_hit_rate(t, all, 2), 2.0 / 7);
    EXPECT_DOUBLE_EQ(belady_hit_rate(t, all, 3), 4.0 / 7);  // everything fits: only first uses miss
    EvalOptions o;
    o.window = 1;
    o.cache_slots = 2;
    const EvalResult r = evaluate_predictor(nullptr, t, nullptr, o, "cyclic");
    EXPECT_DOUBLE_EQ(r.hit_rate, 0.0);
    EXPECT_DOUBLE_EQ(r.belady_hit_rate, 2.0 / 7);
    // On random routing no demand-only policy beats the optimum.
    const RoutingTrace rt = test::random_trace(3, 16, 4, {200, 150}, 7, [](int32_t) { return 0.25f; });
    for (EvictionPolicyKind pol : {EvictionPolicyKind::LRU, EvictionPolicyKind::LFU, EvictionPolicyKind::ARC}) {
        for (int32_t slots : {4, 8, 12}) {
            o.cache_slots = slots, o.policy = pol;
            const EvalResult e = evaluate_predictor(nullptr, rt, nullptr, o, "random");
            EXPECT_LE(e.hit_rate, e.belady_hit_rate) << eviction_policy_name(pol) << " at " << slots << " slots";
            EXPECT_GT(e.belady_hit_rate, 0.0);
        }
    }
}

TEST(PredictorEval, FrequencyLearnsPopularityOnline) {
    RoutingTrace t = empty_trace(2, 4, 1);
    t.sequences.push_back({"s", "test", 0});
    for (int i = 0; i < 5; ++i) add_token(t, {{0}, {i < 3 ? 2 : 3}});  // layer 1: expert 2 three times, then 3
    FrequencyPredictor f({2, 4, 1}, 1.0);
    EvalOptions o;
    o.window = 1;
    const EvalResult r = evaluate_predictor(&f, t, nullptr, o, "f");
    // Token 0: no counts yet (no prediction); tokens 1, 2: predict 2 (right); 3: 2 (wrong); 4: 2 (3:1, wrong).
    EXPECT_DOUBLE_EQ(r.sum(1, 1, 2).recall, 2.0);
    EXPECT_EQ(r.sum(1, 1, 2).n_nonempty, 4);
    FrequencyPredictor rec({2, 4, 1}, 0.1);  // recency: the last expert dominates at once
    const EvalResult rr = evaluate_predictor(&rec, t, nullptr, o, "r");
    EXPECT_DOUBLE_EQ(rr.sum(1, 1, 2).recall, 3.0);  // tokens 1, 2 and 4
}

TEST(Predictor, PredictSumsScoresOverTokens) {
    ConstantPredictor p({3, 4, 1}, {0.1f, 0.0f, 0.7f, 0.2f});
    const std::vector<int32_t> routed{0, 1};
    PrefetchList list(16);
    p.predict({0, 3, 2, routed, 2, 1, nullptr, 0}, list);
    // 2 tokens x top-1 = 2 per layer: experts 2 (1.4) and 3 (0.4) of layers 1 and 2.
    ASSERT_EQ(list.size(), 4u);
    EXPECT_EQ(list.items()[0].layer, 1);
    EXPECT_EQ(list.items()[0].expert, 2);
    EXPECT_FLOAT_EQ(list.items()[0].score, 1.4f);
    EXPECT_EQ(list.items()[1].expert, 3);
    EXPECT_EQ(list.items()[3].layer, 2);
}

// ---------------------------------------------------------------------------------------------------------
// Gradient checks

namespace {

RoutingTrace random_trace(int32_t L, int32_t E, int32_t K, int n_seq, int len, uint32_t seed) {
    return test::random_trace(L, E, K, std::vector<int64_t>(size_t(n_seq), len), seed, [](int32_t) { return 0.5f; });
}

/// Every parameter of ps drawn uniformly from [-a, a] (also those that start at zero, e.g. the LSTM's skip rows).
void randomize(nn::ParamSet &ps, std::mt19937 &rng, float a) {
    std::uniform_real_distribution<float> u(-a, a);
    for (size_t i = 0; i < ps.size(); ++i) {
        for (auto &v : ps[i].value) v = u(rng);
    }
}

/// The small MLP of the gradient checks: 4 layers, 6 experts, top-2, window 2, groups {0}, {1, 2}, {3}
/// (group 1 is deep: gated residual block), width 5, dropout 0.25.
LlaporConfig small_mlp_config(const std::string &kind, int64_t dim, int64_t pca_dim) {
    LlaporConfig c;
    c.kind = kind;
    c.shape = {4, 6, 2};
    c.window = 2;
    c.group_start = {0, 1, 3};
    c.hidden = 5;
    c.dim = dim;
    c.pca_dim = pca_dim;
    c.dropout = 0.25f;
    return c;
}

// Compares analytic gradients with central differences on a few entries of every tensor in
// [first_param, last_param) (last_param 0: to the end).
template <typename LossFn>
void check_gradients(nn::ParamSet &ps, LossFn loss, size_t first_param = 0, size_t last_param = 0) {
    ps.zero_grad();
    loss(true);
    std::mt19937 rng(7);
    int checked = 0;
    for (size_t i = first_param; i < (last_param ? last_param : ps.size()); ++i) {
        nn::Param &p = ps[i];
        for (int k = 0; k < 4; ++k) {
            const size_t j = rng() % p.value.size();
            const float v = p.value[j], eps = 1e-2f;
            p.value[j] = v + eps;
            const double up = loss(false);
            p.value[j] = v - eps;
            const double down = loss(false);
            p.value[j] = v;
            const double num = (up - down) / (2 * eps), ana = p.grad[j];
            EXPECT_NEAR(ana, num, 2e-4 + 3e-2 * std::max(std::fabs(ana), std::fabs(num)))
                << p.name << "[" << j << "]";
            ++checked;
        }
    }
    EXPECT_GT(checked, 0);
}

} // namespace

TEST(LlaporNn, LstmGradientsMatchFiniteDifferences) {
    const RoutingTrace t = random_trace(5, 6, 2, 2, 3, 11);
    LlaporConfig c;
    c.kind = "llapor-lstm";
    c.shape = {5, 6, 2};
    c.window = 2;
    c.group_start = {0, 1, 3};
    c.hidden = 4;
    LlaporLstmNet net(c, 3);
    std::mt19937 rng(1);
    randomize(net.params(), rng, 0.5f);
    std::vector<int64_t> tokens{0, 1, 2, 3, 4, 5};
    std::vector<uint8_t> has_prev{0, 1, 1, 0, 1, 1};
    check_gradients(net.params(), [&](bool grad) { return lstm_loss(net, t, tokens, has_prev, grad); });
}

TEST(LlaporNn, MlpGradientsMatchFiniteDifferences) {
    const RoutingTrace t = random_trace(4, 6, 2, 1, 5, 12);
    LlaporMlpNet net(small_mlp_config("llapor-mlp", 6, 4), 4);
    std::mt19937 rng(2);
    randomize(net.params(), rng, 0.6f);
    std::uniform_real_distribution<float> u(-0.6f, 0.6f);
    std::vector<float> x(5 * 6);
    for (auto &v : x) v = u(rng) * 3;
    for (int32_t layer : {0, 1}) {
        // The dropout mask depends only on the seed, so a fixed seed makes the loss a deterministic function.
        auto loss = [&](bool grad) {
            LlaporMlpNet::Tape tape;
            std::vector<float> logits(5 * 12), scratch;
            net.forward(layer, 5, x.data(), logits.data(), tape, /*drop_seed=*/99);
            double l = 0;
            for (int i = 0; i < 5; ++i) {
                for (int d = 1; d <= 2; ++d) {
                    l += nn::softmax_xent_khot(logits.data() + i * 12 + (d - 1) * 6, 6, t.ids(i, layer + d), 2, 0.1f,
                                               grad ? logits.data() + i * 12 + (d - 1) * 6 : nullptr);
                }
            }
            if (grad) net.backward(layer, 5, tape, logits.data(), scratch);
            return l * 0.1;
        };
        check_gradients(net.params(), loss, /*first_param=*/2);  // PCA tensors are fitted, not trained
    }
}

TEST(LlaporNn, NegativesLossGradientAndLargeLogits) {
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    const uint8_t ids[3] = {4, 0, 7};
    std::vector<float> z(9), dz(9);
    for (auto &v : z) v = u(rng);
    nn::softmax_xent_negatives(z.data(), 9, ids, 3, 0.5f, dz.data());
    for (int e = 0; e < 9; ++e) {
        const float v = z[size_t(e)], eps = 1e-2f;
        z[size_t(e)] = v + eps;
        const double up = nn::softmax_xent_negatives(z.data(), 9, ids, 3, 0.5f, nullptr);
        z[size_t(e)] = v - eps;
        const double down = nn::softmax_xent_negatives(z.data(), 9, ids, 3, 0.5f, nullptr);
        z[size_t(e)] = v;
        EXPECT_NEAR(dz[size_t(e)], 0.5 * (up - down) / (2 * eps), 1e-3) << e;
    }
    // Targets far above and far below the non-targets: finite, about 0 and about the gap.
    std::vector<float> big{1000, 0, 0, 0, 0, 0, 0, 0, 0};
    big[4] = 1000, big[7] = -1000;
    const float l = nn::softmax_xent_negatives(big.data(), 9, ids, 3, 1.0f, dz.data());
    EXPECT_TRUE(std::isfinite(l));
    EXPECT_NEAR(l, 1000.0f / 3.0f, 1.0f);
    for (float g : dz) EXPECT_TRUE(std::isfinite(g));
}

namespace {

LlaporConfig prior_config(bool correction, const std::string &drift) {
    LlaporConfig c = small_mlp_config("llapor-mlp-prior", 3, 3);
    c.drift = drift;
    c.correction = correction;
    return c;
}

} // namespace

// The prior's logits are layer l+d's router applied to x moved by the drift map, read with and without the
// previous token, worked out here directly.
TEST(LlaporNn, PriorLogitsApplyTheDriftAndTheNextRouters) {
    LlaporMlpNet net(prior_config(false, "previous"), 1);
    std::mt19937 rng(4);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (const char *name : {"prior.router", "prior.drift0", "prior.drift"}) {
        for (auto &v : net.params().get(name).value) v = u(rng);
    }
    const int64_t D = 3, E = 6, W = 2;
    const std::vector<float> x{0.5f, -1.0f, 2.0f};
    std::vector<float> prev(size_t((W + 1) * D));
    for (auto &v : prev) v = u(rng);
    std::vector<float> out(size_t(W * E)), scratch;
    for (const bool with_prev : {false, true}) {
        const int32_t layer = 1;
        net.prior_logits(layer, 1, x.data(), with_prev ? prev.data() : nullptr, out.data(), scratch);
        for (int64_t d = 1; d <= W; ++d) {
            std::vector<float> f(x);
            if (with_prev) {
                f.insert(f.end(), prev.begin() + d * D, prev.begin() + (d + 1) * D);
                f.insert(f.end(), prev.begin(), prev.begin() + D);
            }
            f.push_back(1.0f);
            const int64_t F = int64_t(f.size());
            const float *a = net.params().get(with_prev ? "prior.drift" : "prior.drift0").value.data() +
                             ((layer * W + d - 1) * D) * F;
            const float *r = net.params().get("prior.router").value.data() + (layer + d) * E * D;
            for (int64_t e = 0; e < E; ++e) {
                double z = 0;
                for (int64_t j = 0; j < D; ++j) {
                    double xh = x[size_t(j)];
                    for (int64_t i = 0; i < F; ++i) xh += double(a[j * F + i]) * f[size_t(i)];
                    z += double(r[e * D + j]) * xh;
                }
                EXPECT_NEAR(out[size_t((d - 1) * E + e)], z, 1e-4) << "d " << d << " e " << e << " prev " << with_prev;
            }
        }
    }
    // Layer 2 predicts layer 3 only: distance 2 is past the last layer and left at 0.
    net.prior_logits(2, 1, x.data(), prev.data(), out.data(), scratch);
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(out[size_t(E + e)], 0.0f);
}

TEST(LlaporNn, MlpPriorGradientsMatchFiniteDifferences) {
    const RoutingTrace t = random_trace(4, 6, 2, 1, 5, 13);
    LlaporMlpNet net(prior_config(true, "previous"), 5);
    std::mt19937 rng(2);
    randomize(net.params(), rng, 0.6f);
    std::uniform_real_distribution<float> u(-0.6f, 0.6f);
    std::vector<float> x(5 * 3), prev(5 * 3 * 3);
    for (auto &v : x) v = u(rng) * 3;
    for (auto &v : prev) v = u(rng) * 3;
    // Trained tensors: the groups' (after pca.mean, pca.proj; before prior.router, drift0, drift, calib).
    const size_t first = net.group_params(0).first, last = net.group_params(2).second;
    EXPECT_EQ(net.params()[first - 1].name, "pca.proj");
    EXPECT_EQ(net.params()[last].name, "prior.router");
    for (int32_t layer : {0, 1, 2}) {
        std::vector<float> prior(5 * 12), scratch;
        net.prior_logits(layer, 5, x.data(), prev.data(), prior.data(), scratch);
        const int nd = std::min(2, 3 - layer);
        auto loss = [&](bool grad) {
            LlaporMlpNet::Tape tape;
            std::vector<float> logits(5 * 12), bscratch;
            net.forward(layer, 5, x.data(), logits.data(), tape, /*drop_seed=*/99, prior.data());
            double l = 0;
            for (int i = 0; i < 5; ++i) {
                for (int d = 1; d <= 2; ++d) {
                    float *z = logits.data() + i * 12 + (d - 1) * 6;
                    if (d > nd) {
                        std::fill(z, z + 6, 0.0f);
                        continue;
                    }
                    l += nn::softmax_xent_negatives(z, 6, t.ids(i, layer + d), 2, 0.1f, grad ? z : nullptr);
                }
            }
            if (grad) net.backward(layer, 5, tape, logits.data(), bscratch);
            return l * 0.1;
        };
        check_gradients(net.params(), loss, first, last);
    }
}

// ---------------------------------------------------------------------------------------------------------
// Learning planted structure

namespace {

// Layer l+1's experts are a fixed function of layer l's (90% of the time), layer 0's are random.
RoutingTrace chained_trace(int n_seq, int len, uint32_t seed) {
    const int32_t L = 6, E = 16, K = 2;
    RoutingTrace t = empty_trace(L, E, K);
    std::mt19937 rng(seed);
    for (int s = 0; s < n_seq; ++s) {
        t.sequences.push_back({"s" + std::to_string(s), "test", 0});
        for (int i = 0; i < len; ++i) {
            std::vector<std::vector<int32_t>> layers;
            std::vector<int32_t> cur{int32_t(rng() % E), 0};
            do cur[1] = int32_t(rng() % E); while (cur[1] == cur[0]);
            layers.push_back(cur);
            for (int32_t l = 1; l < L; ++l) {
                std::vector<int32_t> nx;
                for (int32_t e : cur) {
                    int32_t v = rng() % 10 ? (5 * e + 3 + l) % E : int32_t(rng() % E);
                    while (std::find(nx.begin(), nx.end(), v) != nx.end()) v = (v + 1) % E;
                    nx.push_back(v);
                }
                layers.push_back(nx);
                cur = nx;
            }
            add_token(t, layers);
        }
    }
    return t;
}

/// recall@k of p on t at distance d (window 2), with the router inputs h where p reads them.
double recall_at(ScoringPredictor *p, const RoutingTrace &t, const HiddenTrace *h, int32_t d = 1) {
    EvalOptions o;
    o.window = 2;
    const EvalCell c = evaluate_predictor(p, t, h, o, "test").sum(d, d, t.n_layer);
    return c.recall / double(c.n);
}

} // namespace

TEST(LlaporTrain, LstmLearnsPlantedChainAndBeatsFrequency) {
    const RoutingTrace train = chained_trace(40, 20, 21), test = chained_trace(10, 20, 22);
    TrainOptions o;
    o.kind = "llapor-lstm";
    o.window = 2;
    o.groups = "1";
    o.hidden = 16;
    o.epochs = 8;
    o.batch = 32;
    o.lr = 1e-2f;
    const TrainResult r = train_llapor(train, nullptr, o);
    LlaporLstmPredictor lstm(std::make_shared<LlaporLstmNet>(r.config, r.params));
    FrequencyPredictor freq({6, 16, 2}, 1.0);
    const double rl = recall_at(&lstm, test, nullptr), rf = recall_at(&freq, test, nullptr);
    EXPECT_GT(rl, 0.8) << "frequency " << rf;
    EXPECT_GT(rl, rf + 0.4);

    // Save/load round trip: same scores, bit for bit.
    const fs::path p = tmp_file("lstm.pred");
    save_llapor(p.string(), r.config, r.params);
    LlaporConfig cfg;
    auto loaded = load_llapor(p.string(), 1, &cfg);
    EXPECT_EQ(cfg.to_json(), r.config.to_json());
    LlaporLstmPredictor again(std::make_shared<LlaporLstmNet>(r.config, r.params));
    std::vector<float> a(2 * 16), b(2 * 16);
    std::vector<int32_t> ids(2);
    for (int64_t i = 0; i < 3; ++i) {
        for (int32_t l = 0; l < 6; ++l) {
            ids[0] = test.ids(i, l)[0], ids[1] = test.ids(i, l)[1];
            const PredictorInput in{l, 6, 2, ids, 1, 2, nullptr, 0};
            loaded->score(in, a);
            again.score(in, b);
            EXPECT_EQ(a, b);
        }
    }
}

TEST(LlaporTrain, MlpLearnsPlantedHiddenStatesAndBeatsFrequency) {
    // The router input of layer l encodes layer l+1's experts (a fixed random embedding plus noise).
    auto make = [](int n_seq, int len, uint32_t seed, HiddenTrace &h) {
        RoutingTrace t = random_trace(4, 16, 2, n_seq, len, seed);
        h.trace = "x", h.n_layer = 4, h.dim = 12;
        std::mt19937 rng(seed), emb_rng(5);
        std::normal_distribution<float> nd;
        std::vector<float> emb(16 * 12);
        for (auto &v : emb) v = nd(emb_rng);
        std::vector<float> x(4 * 12);
        for (int64_t i = 0; i < t.n_tokens(); ++i) {
            for (int32_t l = 0; l < 4; ++l) {
                for (int c = 0; c < 12; ++c) {
                    float v = 0.3f * nd(rng);
                    if (l + 1 < 4) v += emb[size_t(t.ids(i, l + 1)[0] * 12 + c)] + emb[size_t(t.ids(i, l + 1)[1] * 12 + c)];
                    x[size_t(l * 12 + c)] = v;
                }
            }
            h.append_token(x.data());
        }
        int64_t pos = 0;
        for (size_t s = 0; s < t.sequences.size(); ++s) h.token_ranges.push_back({int64_t(s), 0, t.sequences[s].n_tokens}), pos += 0;
        return t;
    };
    HiddenTrace htrain, htest;
    const RoutingTrace train = make(40, 25, 31, htrain), test = make(8, 25, 32, htest);
    TrainOptions o;
    o.kind = "llapor-mlp";
    o.window = 2;
    o.groups = "1,3";
    o.hidden = 32;
    o.pca_dim = 12;
    o.epochs = 10;
    o.batch = 32;
    o.lr = 5e-3f;
    const TrainResult r = train_llapor(train, &htrain, o);
    LlaporMlpPredictor mlp(std::make_shared<LlaporMlpNet>(r.config, r.params));
    FrequencyPredictor freq({4, 16, 2}, 1.0);
    const double rm = recall_at(&mlp, test, &htest), rf = recall_at(&freq, test, &htest);
    EXPECT_GT(rm, 0.8) << "frequency " << rf;
    EXPECT_GT(rm, rf + 0.4);

    const fs::path p = tmp_file("mlp.pred");
    save_llapor(p.string(), r.config, r.params);
    auto loaded = load_llapor(p.string());
    EXPECT_DOUBLE_EQ(recall_at(loaded.get(), test, &htest), rm);
}

namespace {

// A model in miniature whose router inputs drift between layers: x_{l+1}(t) = M x_l(t) + temporal * x_{l+1}(t-1)
// + noise, and each layer routes by its own router on its own input plus a per-expert bias, as a real model does
// (the bias stands for what a router input alone does not say). Fate applies layer l+1's router to x_l: it is
// biased by M - I, by the previous token's share and by the bias.
struct DriftWorld {
    static constexpr int32_t L = 4, E = 16, K = 2;
    static constexpr int64_t D = 8;
    float drift = 0.0f, temporal = 0.0f, bias = 0.0f;
    std::vector<std::vector<float>> routers;  // [L][E * D]
    std::vector<float> m;                     // [D][D]

    DriftWorld(float drift_, float temporal_, float bias_) : drift(drift_), temporal(temporal_), bias(bias_) {
        std::mt19937 rng(17);
        std::normal_distribution<float> nd;
        routers.assign(L, std::vector<float>(size_t(E * D)));
        for (auto &r : routers) {
            for (auto &v : r) v = nd(rng);
        }
        m.assign(size_t(D * D), 0.0f);
        for (int64_t i = 0; i < D; ++i) {
            for (int64_t j = 0; j < D; ++j) m[size_t(i * D + j)] = (i == j) + drift * nd(rng) / std::sqrt(float(D));
        }
    }

    RoutingTrace trace(int n_seq, int len, uint32_t seed, HiddenTrace &h) const {
        RoutingTrace t = empty_trace(L, E, K);
        h = HiddenTrace{};
        h.trace = "drift", h.n_layer = L, h.dim = D;
        std::mt19937 rng(seed);
        std::normal_distribution<float> nd;
        std::vector<float> x(size_t(L * D)), prev(size_t(L * D)), z(static_cast<size_t>(E));
        std::vector<int32_t> ids(size_t(L * K)), order(static_cast<size_t>(E));
        for (int s = 0; s < n_seq; ++s) {
            t.sequences.push_back({"s" + std::to_string(s), "test", 0});
            std::fill(prev.begin(), prev.end(), 0.0f);
            for (int i = 0; i < len; ++i) {
                for (int64_t c = 0; c < D; ++c) x[size_t(c)] = nd(rng);
                for (int32_t l = 1; l < L; ++l) {
                    for (int64_t r = 0; r < D; ++r) {
                        float v = temporal * prev[size_t(l * D + r)] + 0.2f * nd(rng);
                        for (int64_t c = 0; c < D; ++c) v += m[size_t(r * D + c)] * x[size_t((l - 1) * D + c)];
                        x[size_t(l * D + r)] = v;
                    }
                }
                for (int32_t l = 0; l < L; ++l) {
                    for (int32_t e = 0; e < E; ++e) {
                        float v = e < 3 ? bias : 0.0f;
                        for (int64_t c = 0; c < D; ++c) v += routers[size_t(l)][size_t(e * D + c)] * x[size_t(l * D + c)];
                        z[size_t(e)] = v;
                    }
                    std::iota(order.begin(), order.end(), 0);
                    std::partial_sort(order.begin(), order.begin() + K, order.end(),
                                      [&](int32_t a, int32_t b) { return z[size_t(a)] > z[size_t(b)]; });
                    std::copy_n(order.begin(), K, ids.begin() + l * K);
                }
                t.append_token(0, ids, std::vector<float>(ids.size(), 0.5f));
                t.sequences.back().n_tokens += 1;
                h.append_token(x.data());
                prev = x;
            }
            h.token_ranges.push_back({int64_t(s), 0, int64_t(len)});
        }
        return t;
    }

    TrainResult train(const RoutingTrace &t, const HiddenTrace &h, const std::string &drift_kind, bool correction,
                      int32_t epochs) const {
        TrainOptions o;
        o.kind = "llapor-mlp-prior";
        o.window = 2;
        o.groups = "1,3";
        o.hidden = 32;
        o.pca_dim = 8;
        o.epochs = epochs;
        o.batch = 32;
        o.lr = 5e-3f;
        o.drift = drift_kind;
        o.correction = correction;
        o.routers = &routers;
        return train_llapor(t, &h, o);
    }
};

} // namespace

// Fate is biased by the drift of the router input and by the previous token's share of it; the prior's drift
// map learns both (the "previous" map reads the previous token), and the file round-trips.
TEST(LlaporTrain, PriorLearnsTheDriftAndBeatsFate) {
    const DriftWorld w(0.9f, 0.6f, 0.0f);
    HiddenTrace htrain, htest;
    const RoutingTrace train = w.trace(30, 20, 41, htrain), test = w.trace(8, 20, 42, htest);
    FatePredictor fate({w.L, w.E, w.K}, w.D, w.routers, 1, 2);
    const TrainResult cur = w.train(train, htrain, "current", false, 0);
    const TrainResult prev = w.train(train, htrain, "previous", false, 0);
    EXPECT_FALSE(prev.config.correction);
    LlaporMlpPredictor pcur(std::make_shared<LlaporMlpNet>(cur.config, cur.params));
    LlaporMlpPredictor pprev(std::make_shared<LlaporMlpNet>(prev.config, prev.params));
    for (int32_t d : {1, 2}) {
        const double rf = recall_at(&fate, test, &htest, d), rc = recall_at(&pcur, test, &htest, d),
                     rp = recall_at(&pprev, test, &htest, d);
        EXPECT_GT(rc, rf + 0.05) << "distance " << d;
        EXPECT_GT(rp, rc + 0.03) << "distance " << d << ", fate " << rf;
    }

    const fs::path p = tmp_file("prior.pred");
    save_llapor(p.string(), prev.config, prev.params);
    LlaporConfig cfg;
    auto loaded = load_llapor(p.string(), 1, &cfg);
    EXPECT_EQ(cfg.to_json(), prev.config.to_json());
    EXPECT_STREQ(loaded->name(), "llapor-mlp-prior");
    EXPECT_DOUBLE_EQ(recall_at(loaded.get(), test, &htest, 2), recall_at(&pprev, test, &htest, 2));

    // The runtime never calls after the last layer: the decode form is still used where the previous token's
    // inputs are known (layer 0 needs layers 0-2 of it) and the form without them where not (layer 2 needs 3).
    auto net = std::make_shared<LlaporMlpNet>(prev.config, prev.params);
    LlaporMlpPredictor all_layers(net), runtime(net), first_token(net);
    std::vector<float> a(2 * 16), b(2 * 16), c(2 * 16), x(size_t(w.D));
    std::vector<int32_t> ids(2);
    for (int64_t i = 0; i < 2; ++i) {
        for (int32_t l = 0; l < w.L; ++l) {
            htest.dequantize(i, l, x.data());
            ids[0] = test.ids(i, l)[0], ids[1] = test.ids(i, l)[1];
            const PredictorInput in{l, w.L, 2, ids, 1, 2, x.data(), w.D};
            all_layers.score(in, a);
            if (l + 1 < w.L) runtime.score(in, b);
            if (i == 1 && l + 1 < w.L) {
                first_token.reset();
                first_token.score(in, c);  // no previous token: the map without it
                if (l == 0) EXPECT_EQ(a, b);
                if (l == 0) EXPECT_NE(a, c);
                if (l == 2) EXPECT_EQ(std::vector<float>(b.begin(), b.begin() + 16),
                                      std::vector<float>(c.begin(), c.begin() + 16));
            }
        }
    }

    // Without routers, or with routers of another shape: a clear error.
    TrainOptions o;
    o.kind = "llapor-mlp-prior";
    o.groups = "1";
    auto expect_error = [&](const std::string &what) {
        try {
            train_llapor(train, &htrain, o);
            ADD_FAILURE() << "accepted: " << what;
        } catch (const Error &e) {
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    expect_error("needs the model's routers");
    const std::vector<std::vector<float>> small(size_t(w.L), std::vector<float>(5));
    o.routers = &small;
    expect_error("expected n_experts 16 x dim 8");
}

// Fate misses what its router input does not say (here a per-expert bias of the real routing); with no drift map,
// the MLP correction on top of Fate's logits learns it.
TEST(LlaporTrain, PriorCorrectionLearnsWhatFateMisses) {
    const DriftWorld w(0.0f, 0.0f, 2.5f);
    HiddenTrace htrain, htest;
    const RoutingTrace train = w.trace(40, 25, 51, htrain), test = w.trace(8, 25, 52, htest);
    FatePredictor fate({w.L, w.E, w.K}, w.D, w.routers, 1, 2);
    const TrainResult r = w.train(train, htrain, "none", true, 6);
    EXPECT_TRUE(r.config.correction) << r.config.notes.dump();
    LlaporMlpPredictor prior(std::make_shared<LlaporMlpNet>(r.config, r.params));
    const double rf = recall_at(&fate, test, &htest, 1), rp = recall_at(&prior, test, &htest, 1);
    EXPECT_GT(rp, rf + 0.1);

    const fs::path p = tmp_file("prior-mlp.pred");
    save_llapor(p.string(), r.config, r.params);
    auto loaded = load_llapor(p.string());
    EXPECT_DOUBLE_EQ(recall_at(loaded.get(), test, &htest, 1), rp);
}

TEST(LlaporFile, RejectsDamagedFiles) {
    LlaporConfig c;
    c.kind = "llapor-lstm";
    c.shape = {4, 8, 2};
    c.group_start = {0};
    c.hidden = 4;
    LlaporLstmNet net(c, 1);
    const fs::path p = tmp_file("bad.pred");
    save_llapor(p.string(), c, net.params());
    std::ifstream in(p, std::ios::binary);
    const std::string good((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    auto expect_error = [&](const std::string &bytes, const std::string &what) {
        std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
        try {
            load_llapor(p.string());
            ADD_FAILURE() << "accepted: " << what;
        } catch (const Error &e) {
            EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
            EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
        }
    };
    expect_error("XSPRED01" + good.substr(8), "bad magic");
    expect_error(good.substr(0, good.size() - 4), "runs past the end");
    std::string kind = good;
    kind.replace(kind.find("llapor-lstm"), 11, "llapor-gru!");
    expect_error(kind, "predictor kind");
    // A NaN weight (bit pattern 0x7fc00000) in the last tensor: refused at load, naming the tensor.
    std::string nan = good;
    const char nan_bytes[4] = {0x00, 0x00, char(0xc0), 0x7f};
    nan.replace(nan.size() - 4, 4, nan_bytes, 4);
    expect_error(nan, "tensor ws holds nan");
    // The header rewritten: numbers of the wrong kind or size (fuzz findings: nlohmann's get<int64_t> casts a
    // float, undefined behaviour out of range; an empty tensor reached memcpy with a null destination).
    auto with_header = [&](const std::function<void(nlohmann::json &)> &edit) {
        uint32_t hlen = 0;
        std::memcpy(&hlen, good.data() + 8, 4);
        nlohmann::json h = nlohmann::json::parse(good.substr(12, hlen));
        edit(h);
        const std::string text = h.dump();
        const uint32_t n = uint32_t(text.size());
        return good.substr(0, 8) + std::string(reinterpret_cast<const char *>(&n), 4) + text + good.substr(12 + hlen);
    };
    expect_error(with_header([](nlohmann::json &h) { h["tensors"][0]["shape"][0] = 3.44e23; }),
                 "expected non-negative integer dimensions");
    expect_error(with_header([](nlohmann::json &h) { h["tensors"][0]["shape"][0] = -1; }),
                 "expected non-negative integer dimensions");
    expect_error(with_header([](nlohmann::json &h) { h["tensors"][0]["offset"] = 0.5; }), "expected a byte count");
    expect_error(with_header([](nlohmann::json &h) { h["config"]["n_layers"] = 1e30; }),
                 "'n_layers' is 1e+30, expected an integer in [0, 2147483647]");
    expect_error(with_header([](nlohmann::json &h) { h["config"]["n_experts"] = int64_t(1) << 33; }),
                 "'n_experts' is 8589934592");
    expect_error(with_header([](nlohmann::json &h) { h["config"]["group_start"] = {0, 2.5}; }), "'group_start' is 2.5");
    expect_error(with_header([](nlohmann::json &h) { h["config"]["dropout"] = 1e300; }), "'dropout' is 1e+300");
    // A zero dimension: the network the config describes does not fit the file's values.
    expect_error(with_header([](nlohmann::json &h) { h["tensors"][0]["shape"][0] = 0; }), "the file holds 1640 in all");
}

// Non-finite weights are never written: save refuses them and leaves no file.
TEST(LlaporFile, RefusesToWriteNonFiniteWeights) {
    LlaporConfig c;
    c.kind = "llapor-lstm";
    c.shape = {4, 8, 2};
    c.group_start = {0};
    c.hidden = 4;
    LlaporLstmNet net(c, 1);
    nn::ParamSet ps = net.params();
    ps[1].value[3] = std::numeric_limits<float>::infinity();
    const fs::path p = tmp_file("inf.pred");
    fs::remove(p);
    try {
        save_llapor(p.string(), c, ps);
        ADD_FAILURE() << "wrote an infinite weight";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("tensor " + ps[1].name + " holds inf at index 3"), std::string::npos)
            << e.what();
    }
    EXPECT_FALSE(fs::exists(p));
}

// A learning rate that blows the weights up: training stops with an error instead of returning parameters.
TEST(LlaporTraining, DivergenceIsAnError) {
    const RoutingTrace train = chained_trace(20, 20, 21);
    TrainOptions o;
    o.kind = "llapor-lstm";
    o.window = 2;
    o.groups = "1";
    o.hidden = 8;
    o.epochs = 3;
    o.batch = 16;
    o.lr = 1e30f;
    try {
        (void)train_llapor(train, nullptr, o);
        ADD_FAILURE() << "lr 1e30 trained without an error";
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("training diverged at epoch"), std::string::npos) << e.what();
    }
    o.lr = std::numeric_limits<float>::quiet_NaN();
    EXPECT_THROW((void)train_llapor(train, nullptr, o), Error);
}

// Fate with the real router weights of a GGUF: given layer l's own router input, it reproduces layer l's routing.
TEST(FatePredictor, ReadsTheRoutersOfTheModel) {
    const auto model = Model::load(std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/models/qwen3moe/tiny-f32.gguf");
    const HParams &hp = model->hp();
    Context ctx(*model, {32, 32});
    std::vector<std::vector<float>> x(size_t(hp.n_layer));
    std::vector<std::vector<int32_t>> ids(size_t(hp.n_layer));
    ctx.on_router_input = [&](int64_t l, const float *h, int64_t n) { x[size_t(l)].assign(h, h + n * hp.n_embd); };
    ctx.on_routing = [&](int64_t l, const Routing &r) { ids[size_t(l)] = r.ids; };
    std::vector<int32_t> tokens{1, 5, 9, 200, 7, 3};
    ctx.eval(tokens);
    const PredictorShape shape{int32_t(hp.n_layer), int32_t(hp.n_expert), int32_t(hp.n_expert_used)};
    FatePredictor fate(shape, hp.n_embd, FatePredictor::read_routers(*model), int32_t(tokens.size()), 1);
    std::vector<float> scores(tokens.size() * size_t(hp.n_expert));
    std::vector<int32_t> order(static_cast<size_t>(hp.n_expert));
    const int32_t K = shape.top_k;
    for (int32_t l = 1; l < shape.n_layers; ++l) {
        // Predict layer l from "layer l-1" while handing it layer l's router input: distance 0 in disguise.
        const PredictorInput in{l - 1, shape.n_layers, 1, ids[size_t(l - 1)], int32_t(tokens.size()), K,
                                x[size_t(l)].data(), hp.n_embd};
        fate.score(in, scores);
        for (size_t t = 0; t < tokens.size(); ++t) {
            const float *row = scores.data() + t * size_t(hp.n_expert);
            std::iota(order.begin(), order.end(), 0);
            std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
            for (int32_t j = 0; j < K; ++j) EXPECT_EQ(order[size_t(j)], ids[size_t(l)][t * size_t(K) + size_t(j)]);
        }
    }
}

TEST(LayerGroups, MeasurementFindsPlantedGroups) {
    // Layers 0-2: random routing; 3-5: the previous token's experts again (90%); 6-8: experts {0, 1} (90%).
    const int32_t L = 9, E = 16, K = 2;
    RoutingTrace t = empty_trace(L, E, K);
    std::mt19937 rng(3);
    auto random_pair = [&] {
        std::vector<int32_t> p{int32_t(rng() % E), 0};
        do p[1] = int32_t(rng() % E); while (p[1] == p[0]);
        return p;
    };
    for (int s = 0; s < 20; ++s) {
        t.sequences.push_back({"s", "test", 0});
        std::vector<std::vector<int32_t>> prev;
        for (int i = 0; i < 50; ++i) {
            std::vector<std::vector<int32_t>> layers;
            for (int32_t l = 0; l < L; ++l) {
                if (l < 3) layers.push_back(random_pair());
                else if (l < 6) layers.push_back(!prev.empty() && rng() % 10 ? prev[size_t(l)] : random_pair());
                else layers.push_back(rng() % 10 ? std::vector<int32_t>{0, 1} : random_pair());
            }
            add_token(t, layers);
            prev = layers;
        }
    }
    const GroupMeasurement m = measure_groups(t);
    EXPECT_EQ(m.group_start, (std::vector<int32_t>{0, 3, 6}));
    EXPECT_GT(m.reuse[4], 0.8);
    EXPECT_LT(m.entropy[7], m.entropy[1]);
    GroupMeasurement unused;
    EXPECT_EQ(parse_groups("2,5", t, &unused), (std::vector<int32_t>{0, 2, 5}));
    EXPECT_EQ(parse_groups("1", t, &unused), (std::vector<int32_t>{0}));
    EXPECT_THROW(parse_groups("5,2", t, &unused), Error);
    EXPECT_THROW(parse_groups("2,9", t, &unused), Error);
}

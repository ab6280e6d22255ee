// LLaPor training (mini-batch Adam with back-propagation through the layers for the LSTM) and the layer-group
// measurement. Deterministic for a given seed.
#include "offload/predictor-train.h"

#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

extern "C" void ssyev_(const char *jobz, const char *uplo, const int *n, float *a, const int *lda, float *w,
                       float *work, const int *lwork, int *info);
extern "C" void sposv_(const char *uplo, const int *n, const int *nrhs, float *a, const int *lda, float *b,
                       const int *ldb, int *info);

namespace prescope {

namespace {

struct Rng {
    uint64_t s;
    explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
    uint64_t next() {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        return s;
    }
    template <typename T> void shuffle(std::vector<T> &v) {
        for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[size_t(next() % i)]);
    }
};

// A training loss of one distance's logits against the token's k experts (nn::softmax_xent_khot or _negatives).
using LossFn = float (*)(const float *logits, int32_t n_experts, const uint8_t *ids, int32_t k, float scale,
                         float *dlogits);

LossFn loss_function(const std::string &name) {
    if (name == "khot") return nn::softmax_xent_khot;
    if (name == "negatives") return nn::softmax_xent_negatives;
    fail("--loss {}: expected khot or negatives", name);
}

double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Recall of the top-k of `logits` against the k true ids.
double topk_recall(const float *logits, int32_t E, const uint8_t *ids, int32_t k, std::vector<int32_t> &order) {
    order.resize(size_t(E));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
    int hits = 0;
    for (int32_t i = 0; i < k; ++i) {
        for (int32_t j = 0; j < k; ++j) hits += order[size_t(i)] == ids[j];
    }
    return double(hits) / k;
}

} // namespace

// ---------------------------------------------------------------------------------------------------------
// Groups

nlohmann::json GroupMeasurement::to_json() const {
    return {{"method", "3 contiguous groups minimising the within-group sum of squares of the standardised "
                       "per-layer statistics (popularity entropy, temporal reuse, co-occurrence recall)"},
            {"entropy", entropy}, {"reuse", reuse}, {"cooccur", cooccur}, {"group_start", group_start},
            {"cost", cost}};
}

GroupMeasurement measure_groups(const RoutingTrace &t, int32_t n_groups, int64_t max_tokens) {
    const int32_t L = t.n_layer, E = t.n_expert, K = t.top_k;
    const int64_t N = std::min(t.n_tokens(), max_tokens);
    if (N < 2) fail("measuring layer groups needs at least 2 tokens in the trace");
    GroupMeasurement m;
    m.entropy.assign(size_t(L), 0.0);
    m.reuse.assign(size_t(L), 0.0);
    m.cooccur.assign(size_t(L), 0.0);
    std::vector<uint8_t> first(size_t(N), 0);
    for (const auto &b : t.sequence_bounds()) {
        if (b[0] < N) first[size_t(b[0])] = 1;
    }
    std::vector<double> pop(static_cast<size_t>(E));
    std::vector<float> cooc(static_cast<size_t>(E * E)), score(static_cast<size_t>(E));
    std::vector<int32_t> order;
    for (int32_t l = 0; l < L; ++l) {
        std::fill(pop.begin(), pop.end(), 0.0);
        double reuse = 0;
        int64_t n_reuse = 0;
        for (int64_t i = 0; i < N; ++i) {
            const uint8_t *ids = t.ids(i, l);
            for (int32_t j = 0; j < K; ++j) pop[ids[j]] += 1;
            if (!first[size_t(i)]) {
                const uint8_t *p = t.ids(i - 1, l);
                int same = 0;
                for (int32_t a = 0; a < K; ++a) {
                    for (int32_t b = 0; b < K; ++b) same += ids[a] == p[b];
                }
                reuse += double(same) / K;
                ++n_reuse;
            }
        }
        double h = 0;
        for (double c : pop) {
            if (c > 0) h -= c / double(N * K) * std::log(c / double(N * K));
        }
        m.entropy[size_t(l)] = E > 1 ? h / std::log(double(E)) : 0.0;
        m.reuse[size_t(l)] = n_reuse ? reuse / double(n_reuse) : 0.0;
        if (l == 0) continue;
        std::fill(cooc.begin(), cooc.end(), 0.0f);
        for (int64_t i = 0; i < N; ++i) {
            const uint8_t *a = t.ids(i, l - 1), *b = t.ids(i, l);
            for (int32_t x = 0; x < K; ++x) {
                for (int32_t y = 0; y < K; ++y) cooc[size_t(a[x]) * size_t(E) + b[y]] += 1.0f;
            }
        }
        double rec = 0;
        for (int64_t i = 0; i < N; ++i) {
            std::fill(score.begin(), score.end(), 0.0f);
            const uint8_t *a = t.ids(i, l - 1);
            for (int32_t x = 0; x < K; ++x) {
                for (int32_t e = 0; e < E; ++e) score[size_t(e)] += cooc[size_t(a[x]) * size_t(E) + size_t(e)];
            }
            rec += topk_recall(score.data(), E, t.ids(i, l), K, order);
        }
        m.cooccur[size_t(l)] = rec / double(N);
    }
    if (L > 1) m.cooccur[0] = m.cooccur[1];

    // Standardise each statistic over the layers, then split into n_groups contiguous runs (DP, exact).
    const int32_t G = std::clamp(n_groups, 1, L);
    std::vector<std::array<double, 3>> f(static_cast<size_t>(L));
    for (int s = 0; s < 3; ++s) {
        const std::vector<double> &v = s == 0 ? m.entropy : s == 1 ? m.reuse : m.cooccur;
        const double mean = std::accumulate(v.begin(), v.end(), 0.0) / L;
        double var = 0;
        for (double x : v) var += (x - mean) * (x - mean);
        const double sd = std::sqrt(var / L);
        for (int32_t l = 0; l < L; ++l) f[size_t(l)][size_t(s)] = sd > 1e-12 ? (v[size_t(l)] - mean) / sd : 0.0;
    }
    auto cost = [&](int32_t a, int32_t b) {  // layers [a, b)
        double c = 0;
        for (int s = 0; s < 3; ++s) {
            double mean = 0;
            for (int32_t l = a; l < b; ++l) mean += f[size_t(l)][size_t(s)];
            mean /= (b - a);
            for (int32_t l = a; l < b; ++l) c += (f[size_t(l)][size_t(s)] - mean) * (f[size_t(l)][size_t(s)] - mean);
        }
        return c;
    };
    const int32_t min_size = std::min(std::max(2, L / 10), L / G);
    const double INF = 1e300;
    std::vector<std::vector<double>> best(size_t(G + 1), std::vector<double>(size_t(L + 1), INF));
    std::vector<std::vector<int32_t>> arg(size_t(G + 1), std::vector<int32_t>(size_t(L + 1), -1));
    best[0][0] = 0;
    for (int32_t g = 1; g <= G; ++g) {
        for (int32_t b = g * min_size; b <= L; ++b) {
            for (int32_t a = (g - 1) * min_size; a + min_size <= b; ++a) {
                if (best[size_t(g - 1)][size_t(a)] >= INF) continue;
                const double c = best[size_t(g - 1)][size_t(a)] + cost(a, b);
                if (c < best[size_t(g)][size_t(b)]) best[size_t(g)][size_t(b)] = c, arg[size_t(g)][size_t(b)] = a;
            }
        }
    }
    m.cost = best[size_t(G)][size_t(L)];
    m.group_start.assign(size_t(G), 0);
    for (int32_t g = G, b = L; g >= 1; --g) {
        const int32_t a = arg[size_t(g)][size_t(b)];
        m.group_start[size_t(g - 1)] = a;
        b = a;
    }
    return m;
}

std::vector<int32_t> parse_groups(const std::string &spec, const RoutingTrace &t, GroupMeasurement *measured) {
    if (spec == "auto") {
        *measured = measure_groups(t);
        return measured->group_start;
    }
    if (spec == "1") return {0};
    std::vector<int32_t> out{0};
    size_t pos = 0;
    while (pos <= spec.size()) {
        const size_t comma = std::min(spec.find(',', pos), spec.size());
        const std::string part = spec.substr(pos, comma - pos);
        char *end = nullptr;
        const long v = std::strtol(part.c_str(), &end, 10);
        if (part.empty() || *end != '\0' || v <= out.back() || v >= t.n_layer) {
            fail("--groups '{}': expected auto, 1, or the first layers of the middle and output groups, "
                 "ascending in (0, {})", spec, t.n_layer);
        }
        out.push_back(int32_t(v));
        pos = comma + 1;
    }
    if (out.size() != 3) fail("--groups '{}': give two layers (middle and output group starts)", spec);
    return out;
}

// ---------------------------------------------------------------------------------------------------------
// LSTM

namespace {

// Everything one LSTM batch keeps for the backward pass.
struct LstmBatch {
    std::vector<int32_t> idx, nnz;                // [L][B][mf], [L][B]
    std::vector<float> gates, c, h, logits;       // [L][B][4H], [L+1][B][H] (row 0 = zero state) x2, [L][B][WE]
    std::vector<float> dh, dc, scratch;
    std::vector<int32_t> prev;                    // [L][K] scratch
    std::vector<int32_t> cur;                     // [K]
};

double lstm_batch(LlaporLstmNet &net, const RoutingTrace &t, std::span<const int64_t> tokens,
                  std::span<const uint8_t> has_prev, bool backward, LossFn loss_fn, LstmBatch &b, double *recall1) {
    const LlaporConfig &c = net.config();
    const int32_t L = c.shape.n_layers, E = c.shape.n_experts, K = c.shape.top_k, W = c.window;
    const int64_t B = int64_t(tokens.size()), H = c.hidden, WE = int64_t(W) * E;
    const int32_t mf = net.max_features();
    b.idx.resize(size_t(L * B * mf));
    b.nnz.resize(size_t(L * B));
    b.gates.resize(size_t(L * B * 4 * H));
    b.c.assign(size_t((L + 1) * B * H), 0.0f);
    b.h.assign(size_t((L + 1) * B * H), 0.0f);
    b.logits.resize(size_t(L * B * WE));
    b.prev.resize(size_t(L * K));
    b.cur.resize(size_t(K));
    for (int64_t i = 0; i < B; ++i) {
        const int64_t tok = tokens[size_t(i)];
        if (has_prev[size_t(i)]) {
            for (int32_t l = 0; l < L; ++l) {
                for (int32_t j = 0; j < K; ++j) b.prev[size_t(l * K + j)] = t.ids(tok - 1, l)[j];
            }
        }
        for (int32_t l = 0; l < L; ++l) {
            for (int32_t j = 0; j < K; ++j) b.cur[size_t(j)] = t.ids(tok, l)[j];
            b.nnz[size_t(l * B + i)] = net.features(l, b.cur.data(), has_prev[size_t(i)] ? b.prev.data() : nullptr,
                                                    b.idx.data() + (l * B + i) * mf);
        }
    }
    for (int32_t l = 0; l < L; ++l) {
        net.forward_step(l, B, b.idx.data() + l * B * mf, b.nnz.data() + l * B, b.h.data() + l * B * H,
                         b.c.data() + l * B * H, b.gates.data() + l * B * 4 * H, b.c.data() + (l + 1) * B * H,
                         b.h.data() + (l + 1) * B * H, b.logits.data() + l * B * WE);
    }
    // Loss: mean over (token, layer, distance) with l + d < L; dlogits written over logits.
    const int64_t n_terms = B * [&] {
        int64_t n = 0;
        for (int32_t l = 0; l < L; ++l) n += std::min(W, L - 1 - l);
        return n;
    }();
    const float scale = 1.0f / float(n_terms);
    double loss = 0, rec = 0;
    int64_t n_rec = 0;
    std::vector<int32_t> order;
    for (int32_t l = 0; l < L; ++l) {
        for (int64_t i = 0; i < B; ++i) {
            float *z = b.logits.data() + (l * B + i) * WE;
            for (int32_t d = 1; d <= W; ++d) {
                float *zd = z + (d - 1) * E;
                if (l + d >= L) {
                    std::fill(zd, zd + E, 0.0f);
                    continue;
                }
                const uint8_t *target = t.ids(tokens[size_t(i)], l + d);
                if (recall1 && d == 1) rec += topk_recall(zd, E, target, K, order), ++n_rec;
                loss += loss_fn(zd, E, target, K, scale, backward ? zd : nullptr);
            }
        }
    }
    if (recall1) *recall1 = n_rec ? rec / double(n_rec) : 0.0;
    if (!backward) return loss / double(n_terms);
    b.dh.assign(size_t(B * H), 0.0f);
    b.dc.assign(size_t(B * H), 0.0f);
    b.scratch.resize(size_t(B * 5 * H));
    for (int32_t l = L - 1; l >= 0; --l) {
        net.backward_step(l, B, b.idx.data() + l * B * mf, b.nnz.data() + l * B, b.h.data() + l * B * H,
                          b.c.data() + l * B * H, b.gates.data() + l * B * 4 * H, b.c.data() + (l + 1) * B * H,
                          b.h.data() + (l + 1) * B * H, b.logits.data() + l * B * WE, b.dh.data(), b.dc.data(),
                          b.scratch.data());
    }
    return loss / double(n_terms);
}

// Token lists of a trace: every token, with whether a previous token of the same sequence exists.
void list_tokens(const RoutingTrace &t, const std::vector<int64_t> &seqs, std::vector<int64_t> &tokens,
                 std::vector<uint8_t> &has_prev) {
    const auto bounds = t.sequence_bounds();
    for (int64_t s : seqs) {
        for (int64_t i = bounds[size_t(s)][0]; i < bounds[size_t(s)][1]; ++i) {
            tokens.push_back(i);
            has_prev.push_back(i > bounds[size_t(s)][0]);
        }
    }
}

} // namespace

double lstm_loss(LlaporLstmNet &net, const RoutingTrace &t, std::span<const int64_t> tokens,
                 std::span<const uint8_t> has_prev, bool accumulate_grad) {
    LstmBatch b;
    return lstm_batch(net, t, tokens, has_prev, accumulate_grad, nn::softmax_xent_khot, b, nullptr);
}

// ---------------------------------------------------------------------------------------------------------
// MLP

namespace {

// Per-layer PCA of the router inputs: mean and the leading pca_dim eigenvectors of the covariance, each scaled
// by 1/sqrt(eigenvalue) (whitened), from at most 20000 rows.
void fit_pca(LlaporMlpNet &net, const HiddenTrace &h, std::vector<float> &x) {
    const LlaporConfig &c = net.config();
    const int64_t D = c.dim, P = c.pca_dim, N = std::min<int64_t>(h.n_tokens(), 20000);
    nn::Param &mean = net.params().get("pca.mean");
    nn::Param &proj = net.params().get("pca.proj");
    x.resize(size_t(N * D));
    std::vector<float> cov(static_cast<size_t>(D * D)), w(static_cast<size_t>(D));
    for (int32_t l = 0; l < c.shape.n_layers; ++l) {
        float *mu = mean.value.data() + l * D;
        std::fill(mu, mu + D, 0.0f);
        for (int64_t i = 0; i < N; ++i) {
            h.dequantize(i * h.n_tokens() / N, l, x.data() + i * D);
            for (int64_t d = 0; d < D; ++d) mu[d] += x[size_t(i * D + d)] / float(N);
        }
        for (int64_t i = 0; i < N; ++i) {
            for (int64_t d = 0; d < D; ++d) x[size_t(i * D + d)] -= mu[d];
        }
        std::fill(cov.begin(), cov.end(), 0.0f);
        nn::linear_backward(x.data(), x.data(), N, D, nullptr, D, cov.data(), nullptr, nullptr);  // X^T X
        for (auto &v : cov) v /= float(std::max<int64_t>(N - 1, 1));
        const int n = int(D), lwork_q = -1;
        int info = 0;
        float wq = 0;
        ssyev_("V", "U", &n, cov.data(), &n, w.data(), &wq, &lwork_q, &info);
        std::vector<float> work(size_t(wq) + 1);
        const int lwork = int(work.size());
        ssyev_("V", "U", &n, cov.data(), &n, w.data(), work.data(), &lwork, &info);
        if (info != 0) fail("PCA of layer {}: LAPACK ssyev failed (info {})", l, info);
        const float floor = std::max(w[size_t(D - 1)], 1e-12f) * 1e-6f;
        for (int64_t i = 0; i < P; ++i) {
            const int64_t j = D - 1 - i;  // eigenvalues ascending; eigenvector j is row j (column-major output)
            const float s = 1.0f / std::sqrt(std::max(w[size_t(j)], floor));
            for (int64_t d = 0; d < D; ++d) proj.value[size_t((l * P + i) * D + d)] = cov[size_t(j * D + d)] * s;
        }
    }
}

struct MlpData {
    const RoutingTrace &t;
    const HiddenTrace &h;
    std::vector<int64_t> flat;      // sidecar row -> flat token index of t
    std::vector<int64_t> prev_row;  // sidecar row -> row of the previous token of its sequence, or -1
};

// The previous token of a row is the row before it when that row holds the previous token of the same sequence.
std::vector<int64_t> previous_rows(const HiddenTrace &h) {
    std::vector<int64_t> prev;
    int64_t row = 0;
    for (size_t r = 0; r < h.token_ranges.size(); ++r) {
        const auto &g = h.token_ranges[r];
        for (int64_t j = 0; j < g[2]; ++j, ++row) {
            const bool joined = r > 0 && h.token_ranges[r - 1][0] == g[0] &&
                                h.token_ranges[r - 1][1] + h.token_ranges[r - 1][2] == g[1];
            prev.push_back(j > 0 || joined ? row - 1 : -1);
        }
    }
    return prev;
}

// Scratch of one MLP batch.
struct MlpScratch {
    LlaporMlpNet::Tape tape;
    std::vector<float> x, logits, scratch, prior, prev, part, pscratch;
    std::vector<int64_t> sel;
};

// MLP-prior: the prior's logits of `rows` at `layer` into m.prior [n][window * E] (m.x holds their router
// inputs). Rows whose previous token is known read it (drift "previous"), the others use the map without it.
void batch_prior(const LlaporMlpNet &net, const MlpData &data, int32_t layer, std::span<const int64_t> rows,
                 MlpScratch &m) {
    const LlaporConfig &c = net.config();
    const int64_t n = int64_t(rows.size()), D = c.dim, W = c.window, WE = W * c.shape.n_experts;
    m.prior.resize(size_t(n * WE));
    if (c.drift != "previous") {
        net.prior_logits(layer, n, m.x.data(), nullptr, m.prior.data(), m.pscratch);
        return;
    }
    for (const bool with_prev : {true, false}) {
        m.sel.clear();
        for (int64_t i = 0; i < n; ++i) {
            if ((data.prev_row[size_t(rows[size_t(i)])] >= 0) == with_prev) m.sel.push_back(i);
        }
        const int64_t k = int64_t(m.sel.size());
        if (k == 0) continue;
        m.part.resize(size_t(k * (D + WE)));
        float *xs = m.part.data(), *out = xs + k * D;
        if (with_prev) m.prev.assign(size_t(k * (W + 1) * D), 0.0f);
        for (int64_t j = 0; j < k; ++j) {
            const int64_t i = m.sel[size_t(j)];
            std::copy_n(m.x.data() + i * D, D, xs + j * D);
            if (!with_prev) continue;
            const int64_t pr = data.prev_row[size_t(rows[size_t(i)])];
            for (int64_t d = 0; d <= W && layer + d < c.shape.n_layers; ++d) {
                data.h.dequantize(pr, int32_t(layer + d), m.prev.data() + (j * (W + 1) + d) * D);
            }
        }
        net.prior_logits(layer, k, xs, with_prev ? m.prev.data() : nullptr, out, m.pscratch);
        for (int64_t j = 0; j < k; ++j) std::copy_n(out + j * WE, WE, m.prior.data() + m.sel[size_t(j)] * WE);
    }
}

// Loss (and gradients when backward) of rows `rows` (sidecar row indices) of one layer; dlogits in m.logits.
// recall, when not null, receives the mean recall@k of each distance 1..window (0 past the last layer).
double mlp_batch(LlaporMlpNet &net, const MlpData &data, int32_t layer, std::span<const int64_t> rows,
                 uint64_t drop_seed, bool backward, LossFn loss_fn, MlpScratch &m, double *recall) {
    const LlaporConfig &c = net.config();
    const int32_t L = c.shape.n_layers, E = c.shape.n_experts, K = c.shape.top_k, W = c.window;
    const int64_t n = int64_t(rows.size()), D = c.dim, WE = int64_t(W) * E;
    m.x.resize(size_t(n * D));
    m.logits.resize(size_t(n * WE));
    for (int64_t i = 0; i < n; ++i) data.h.dequantize(rows[size_t(i)], layer, m.x.data() + i * D);
    if (c.has_prior()) batch_prior(net, data, layer, rows, m);
    net.forward(layer, n, m.x.data(), m.logits.data(), m.tape, drop_seed, c.has_prior() ? m.prior.data() : nullptr);
    const int32_t nd = std::min(W, L - 1 - layer);
    const float scale = 1.0f / float(n * nd);
    double loss = 0;
    std::vector<double> rec(size_t(W), 0.0);
    std::vector<int32_t> order;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = data.flat[size_t(rows[size_t(i)])];
        for (int32_t d = 1; d <= W; ++d) {
            float *z = m.logits.data() + i * WE + (d - 1) * E;
            if (d > nd) {
                std::fill(z, z + E, 0.0f);
                continue;
            }
            if (recall) rec[size_t(d - 1)] += topk_recall(z, E, data.t.ids(tok, layer + d), K, order);
            loss += loss_fn(z, E, data.t.ids(tok, layer + d), K, scale, backward ? z : nullptr);
        }
    }
    if (recall) {
        for (int32_t d = 0; d < W; ++d) recall[d] = rec[size_t(d)] / double(n);
    }
    if (backward) net.backward(layer, n, m.tape, m.logits.data(), m.scratch);
    return loss / double(n * nd);
}

// MLP-prior: fits the drift maps by ridge regression of x_{l+d} - x_l on the map's inputs f (decision 0054):
// A^T = (F^T F + ridge I)^-1 F^T (Y - X) over `rows`; the map with the previous token on the rows that have one.
void fit_drift(LlaporMlpNet &net, const MlpData &data, std::span<const int64_t> rows, float ridge) {
    const LlaporConfig &c = net.config();
    if (c.drift == "none") return;
    const int64_t D = c.dim, W = c.window;
    const int32_t L = c.shape.n_layers;
    for (const bool with_prev : {false, true}) {
        if (with_prev && c.drift != "previous") continue;
        std::vector<int64_t> use;
        for (int64_t r : rows) {
            if (!with_prev || data.prev_row[size_t(r)] >= 0) use.push_back(r);
        }
        const int64_t n = int64_t(use.size()), F = with_prev ? c.drift_prev_inputs() : D + 1;
        if (n == 0) continue;  // the map stays zero (Fate's prior)
        nn::Param &a = net.params().get(with_prev ? "prior.drift" : "prior.drift0");
        std::vector<float> f(size_t(n * F)), y(size_t(n * D)), xl(size_t(n * D)), pl(size_t(n * D));
        std::vector<float> g(size_t(F * F)), bt(size_t(D * F));
        for (int32_t l = 0; l + 1 < L; ++l) {
            for (int64_t i = 0; i < n; ++i) {
                data.h.dequantize(use[size_t(i)], l, xl.data() + i * D);
                if (with_prev) data.h.dequantize(data.prev_row[size_t(use[size_t(i)])], l, pl.data() + i * D);
            }
            for (int64_t d = 1; d <= W && l + d < L; ++d) {
                for (int64_t i = 0; i < n; ++i) {
                    float *row = f.data() + i * F;
                    std::copy_n(xl.data() + i * D, D, row);
                    if (with_prev) {
                        data.h.dequantize(data.prev_row[size_t(use[size_t(i)])], int32_t(l + d), row + D);
                        std::copy_n(pl.data() + i * D, D, row + 2 * D);
                    }
                    row[F - 1] = 1.0f;
                    data.h.dequantize(use[size_t(i)], int32_t(l + d), y.data() + i * D);
                    for (int64_t j = 0; j < D; ++j) y[size_t(i * D + j)] -= xl[size_t(i * D + j)];
                }
                std::fill(g.begin(), g.end(), 0.0f);
                std::fill(bt.begin(), bt.end(), 0.0f);
                nn::linear_backward(f.data(), f.data(), n, F, nullptr, F, g.data(), nullptr, nullptr);   // F^T F
                nn::linear_backward(f.data(), y.data(), n, F, nullptr, D, bt.data(), nullptr, nullptr);  // Y^T F
                for (int64_t j = 0; j < F; ++j) g[size_t(j * F + j)] += ridge;
                // Column-major, bt [D][F] is the F x D right-hand side; the solution [D][F] is A, row j = output j.
                const int fn = int(F), dn = int(D);
                int info = 0;
                sposv_("U", &fn, &dn, g.data(), &fn, bt.data(), &fn, &info);
                if (info != 0) fail("drift fit of layer {} distance {}: LAPACK sposv failed (info {})", l, d, info);
                std::copy(bt.begin(), bt.end(), a.value.begin() + ((l * W + d - 1) * D) * F);
            }
        }
    }
}

// The factor s minimising the sum over rows i of loss_fn(s * z_i) against the token's experts at `target_layer`,
// z_i = z + i * stride (E logits); golden-section search over log(s) in [-7, 9] (both losses are convex in s).
float fit_logit_scale(const MlpData &data, std::span<const int64_t> rows, int32_t target_layer, const float *z,
                      int64_t stride, LossFn loss_fn) {
    const int32_t E = data.t.n_expert, K = data.t.top_k;
    std::vector<float> v(static_cast<size_t>(E));
    auto loss_at = [&](double log_s) {
        const auto sc = float(std::exp(log_s));
        double sum = 0;
        for (size_t i = 0; i < rows.size(); ++i) {
            for (int32_t e = 0; e < E; ++e) v[size_t(e)] = sc * z[int64_t(i) * stride + e];
            sum += loss_fn(v.data(), E, data.t.ids(data.flat[size_t(rows[i])], target_layer), K, 1.0f, nullptr);
        }
        return sum;
    };
    const double phi = 0.5 * (std::sqrt(5.0) - 1.0);
    double a = -7.0, b = 9.0, x1 = b - phi * (b - a), x2 = a + phi * (b - a);
    double f1 = loss_at(x1), f2 = loss_at(x2);
    for (int it = 0; it < 32; ++it) {
        if (f1 < f2) b = x2, x2 = x1, f2 = f1, x1 = b - phi * (b - a), f1 = loss_at(x1);
        else a = x1, x1 = x2, f1 = f2, x2 = a + phi * (b - a), f2 = loss_at(x2);
    }
    return float(std::exp(0.5 * (a + b)));
}

// At most 1024 of `rows`, evenly spaced.
std::vector<int64_t> subsample(std::span<const int64_t> rows) {
    std::vector<int64_t> sub;
    for (size_t i = 0; i < rows.size(); i += std::max<size_t>(1, rows.size() / 1024)) sub.push_back(rows[i]);
    return sub;
}

// MLP-prior: the scale of each (layer, distance) that minimises the training loss of the prior alone on at most
// 1024 of `rows`: where training starts.
void fit_prior_scale(LlaporMlpNet &net, const MlpData &data, std::span<const int64_t> rows, LossFn loss_fn) {
    const LlaporConfig &c = net.config();
    const int32_t L = c.shape.n_layers, W = c.window;
    const std::vector<int64_t> sub = subsample(rows);
    const int64_t n = int64_t(sub.size()), WE = int64_t(W) * c.shape.n_experts, D = c.dim;
    MlpScratch m;
    for (int32_t l = 0; l + 1 < L; ++l) {
        m.x.resize(size_t(n * D));
        for (int64_t i = 0; i < n; ++i) data.h.dequantize(sub[size_t(i)], l, m.x.data() + i * D);
        batch_prior(net, data, l, sub, m);
        for (int32_t d = 1; d <= W && l + d < L; ++d) {
            const float s = fit_logit_scale(data, sub, l + d, m.prior.data() + (d - 1) * c.shape.n_experts, WE, loss_fn);
            for (int32_t g = 0; g < c.n_groups(); ++g) {
                net.params().get(fmt::format("g{}.ps", g)).value[size_t(l * W + d - 1)] = s;
            }
        }
    }
}

// MLP-prior: prior.calib of each (layer, distance): the factor on the trained network's logits that minimises the
// k-hot cross-entropy on at most 1024 of `rows` (its optimum is softmax = P(expert routed) / k: calibrated scores).
void fit_calibration(LlaporMlpNet &net, const MlpData &data, std::span<const int64_t> rows) {
    const LlaporConfig &c = net.config();
    const int32_t L = c.shape.n_layers, W = c.window, E = c.shape.n_experts;
    const std::vector<int64_t> sub = subsample(rows);
    nn::Param &calib = net.params().get("prior.calib");
    MlpScratch m;
    for (int32_t l = 0; l + 1 < L; ++l) {
        mlp_batch(net, data, l, sub, 0, false, nn::softmax_xent_khot, m, nullptr);
        for (int32_t d = 1; d <= W && l + d < L; ++d) {
            calib.value[size_t(l * W + d - 1)] = fit_logit_scale(data, sub, l + d, m.logits.data() + (d - 1) * E,
                                                                 int64_t(W) * E, nn::softmax_xent_khot);
        }
    }
}

// A NaN or infinite loss only gets worse: stop at once rather than write parameters nobody can use.
void check_converging(int32_t epoch, double train_loss, double val_loss, float lr) {
    if (!std::isfinite(train_loss) || !std::isfinite(val_loss)) {
        fail("train-predictor: training diverged at epoch {} (train loss {}, validation loss {}); nothing written; "
             "try a smaller --lr than {}", epoch, train_loss, val_loss, lr);
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------------------
// Training loop

TrainResult train_llapor(const RoutingTrace &train, const HiddenTrace *hidden, const TrainOptions &opt,
                         const std::function<void(const std::string &)> &progress) {
    const bool lstm = opt.kind == "llapor-lstm", prior = opt.kind == "llapor-mlp-prior";
    if (!lstm && !prior && opt.kind != "llapor-mlp") {
        fail("--kind {}: expected llapor-lstm, llapor-mlp or llapor-mlp-prior", opt.kind);
    }
    if (!lstm && !hidden) fail("{} trains on hidden states: pass --hidden (the trace's .hidden.zst sidecar)", opt.kind);
    if (opt.window < 1 || opt.epochs < 0 || (opt.epochs == 0 && !prior) || opt.batch < 1 || opt.val_every < 2) {
        fail("train-predictor: window, epochs and batch must be positive and val-every at least 2");
    }
    if (opt.drift != "none" && opt.drift != "current" && opt.drift != "previous") {
        fail("--drift {}: expected none, current or previous", opt.drift);
    }
    if (!(opt.ridge >= 0.0f)) fail("--ridge {}: must be >= 0", opt.ridge);
    if (!std::isfinite(opt.lr) || opt.lr < 0 || !std::isfinite(opt.weight_decay) || opt.weight_decay < 0 ||
        !(opt.dropout >= 0.0f && opt.dropout < 1.0f) || opt.hidden < 0 || opt.pca_dim < 1) {
        fail("train-predictor: --lr {} and --weight-decay {} must be finite and >= 0, --dropout {} in [0, 1), "
             "--width {} >= 0, --pca-dim {} >= 1", opt.lr, opt.weight_decay, opt.dropout, opt.hidden, opt.pca_dim);
    }
    const std::string loss_name = opt.loss.empty() ? (prior ? "negatives" : "khot") : opt.loss;
    const LossFn loss_fn = loss_function(loss_name);
    if (train.n_layer < 2) fail("train-predictor: the trace has {} layer(s); predicting needs at least 2", train.n_layer);
    LlaporConfig cfg;
    cfg.kind = opt.kind;
    cfg.shape = {train.n_layer, train.n_expert, train.top_k};
    cfg.window = opt.window;
    GroupMeasurement measured;
    cfg.group_start = parse_groups(opt.groups, train, &measured);
    cfg.hidden = opt.hidden > 0 ? opt.hidden : (lstm ? 64 : 128);
    cfg.dropout = opt.dropout;
    if (!lstm) {
        if (hidden->n_layer != train.n_layer) {
            fail("the hidden-state sidecar has {} layers, the trace {}", hidden->n_layer, train.n_layer);
        }
        cfg.dim = hidden->dim;
        cfg.pca_dim = int32_t(std::min<int64_t>(opt.pca_dim, hidden->dim));
    }
    if (prior) {
        cfg.drift = opt.drift;
        cfg.correction = opt.correction;
        if (!opt.routers) fail("llapor-mlp-prior needs the model's routers: pass -m MODEL.gguf or --routers FILE");
        const auto &r = *opt.routers;
        if (int32_t(r.size()) != train.n_layer) fail("{} router matrices for {} layers", r.size(), train.n_layer);
        for (const auto &m : r) {
            if (int64_t(m.size()) != int64_t(train.n_expert) * cfg.dim) {
                fail("a router matrix has {} values, expected n_experts {} x dim {}", m.size(), train.n_expert,
                     cfg.dim);
            }
        }
    }
    cfg.notes = {{"groups", opt.groups == "auto" ? measured.to_json() : nlohmann::json(opt.groups)},
                 {"trained_on", {{"model", train.model}, {"sequences", train.sequences.size()},
                                 {"tokens", train.n_tokens()}}}};

    // Model selection: every val_every-th sequence is kept aside.
    std::vector<int64_t> fit_seqs, val_seqs;
    for (int64_t s = 0; s < int64_t(train.sequences.size()); ++s) {
        (s % opt.val_every == opt.val_every - 1 ? val_seqs : fit_seqs).push_back(s);
    }
    if (val_seqs.empty() && !fit_seqs.empty()) val_seqs.push_back(fit_seqs.back()), fit_seqs.pop_back();
    Rng rng(opt.seed);
    nn::Adam adam;
    adam.lr = opt.lr;
    adam.weight_decay = opt.weight_decay;
    TrainResult res;
    res.config = cfg;
    res.log = nlohmann::json::array();
    double best = INFINITY;
    const auto t0 = std::chrono::steady_clock::now();

    if (lstm) {
        LlaporLstmNet net(cfg, opt.seed);
        std::vector<int64_t> tok, val_tok;
        std::vector<uint8_t> prev, val_prev;
        list_tokens(train, fit_seqs, tok, prev);
        list_tokens(train, val_seqs, val_tok, val_prev);
        if (tok.empty() || val_tok.empty()) fail("train-predictor: the training split has too few sequences");
        std::vector<size_t> order(tok.size());
        std::iota(order.begin(), order.end(), size_t(0));
        if (opt.max_tokens > 0 && int64_t(order.size()) > opt.max_tokens) {
            rng.shuffle(order);
            order.resize(size_t(opt.max_tokens));
        }
        // Validation on at most 4096 tokens, fixed.
        if (val_tok.size() > 4096) val_tok.resize(4096), val_prev.resize(4096);
        LstmBatch b;
        std::vector<int64_t> bt;
        std::vector<uint8_t> bp;
        for (int32_t ep = 0; ep < opt.epochs; ++ep) {
            rng.shuffle(order);
            double tl = 0;
            int64_t nb = 0;
            for (size_t i = 0; i < order.size(); i += size_t(opt.batch)) {
                bt.clear(), bp.clear();
                for (size_t j = i; j < std::min(order.size(), i + size_t(opt.batch)); ++j) {
                    bt.push_back(tok[order[j]]), bp.push_back(prev[order[j]]);
                }
                net.params().zero_grad();
                tl += lstm_batch(net, train, bt, bp, true, loss_fn, b, nullptr);
                net.params().clip_grad_norm(5.0);
                adam.step(net.params());
                ++nb;
            }
            double vrec = 0, vl = 0;
            int64_t vn = 0;
            for (size_t i = 0; i < val_tok.size(); i += 512) {
                const size_t e = std::min(val_tok.size(), i + 512);
                double r = 0;
                const std::span<const int64_t> vt(val_tok.data() + i, e - i);
                const std::span<const uint8_t> vp(val_prev.data() + i, e - i);
                vl += lstm_batch(net, train, vt, vp, false, loss_fn, b, &r) * double(e - i);
                vrec += r * double(e - i);
                vn += int64_t(e - i);
            }
            vl /= double(vn), vrec /= double(vn);
            res.log.push_back({{"epoch", ep + 1}, {"train_loss", tl / double(nb)}, {"val_loss", vl},
                               {"val_recall_at_k_d1", vrec}, {"seconds", seconds_since(t0)}});
            if (progress) progress(res.log.back().dump());
            check_converging(ep + 1, tl / double(nb), vl, opt.lr);
            if (vl < best) best = vl, res.params = net.params();
        }
    } else {
        LlaporMlpNet net(cfg, opt.seed);
        std::vector<float> x;
        if (cfg.has_mlp()) fit_pca(net, *hidden, x);
        MlpData data{train, *hidden, hidden->flat_token_indices(train), previous_rows(*hidden)};
        // Sidecar rows of fitting and validation sequences; the validation sequences are picked among the
        // sequences the sidecar covers.
        std::vector<int64_t> covered;
        for (const auto &r : hidden->token_ranges) {
            if (covered.empty() || covered.back() != r[0]) covered.push_back(r[0]);
        }
        std::vector<uint8_t> is_val(train.sequences.size(), 0);
        int64_t n_val = 0;
        for (size_t i = 0; i < covered.size(); ++i) {
            if (int64_t(i) % opt.val_every == opt.val_every - 1) is_val[size_t(covered[i])] = 1, ++n_val;
        }
        if (n_val == 0 && covered.size() > 1) is_val[size_t(covered.back())] = 1;
        std::vector<int64_t> fit_rows, val_rows;
        int64_t row = 0;
        for (const auto &r : hidden->token_ranges) {
            for (int64_t j = 0; j < r[2]; ++j, ++row) (is_val[size_t(r[0])] ? val_rows : fit_rows).push_back(row);
        }
        if (fit_rows.empty() || val_rows.empty()) fail("train-predictor: the sidecar covers too few sequences");
        if (opt.max_tokens > 0 && int64_t(fit_rows.size()) > opt.max_tokens) {
            rng.shuffle(fit_rows);
            fit_rows.resize(size_t(opt.max_tokens));
        }
        if (val_rows.size() > 2048) val_rows.resize(2048);
        if (prior) {
            const int64_t D = cfg.dim, L = cfg.shape.n_layers;
            nn::Param &router = net.params().get("prior.router");
            for (int64_t l = 0; l < L; ++l) {
                std::copy((*opt.routers)[size_t(l)].begin(), (*opt.routers)[size_t(l)].end(),
                          router.value.begin() + l * cfg.shape.n_experts * D);
            }
            fit_drift(net, data, fit_rows, opt.ridge);
            fit_prior_scale(net, data, fit_rows, loss_fn);
        }
        MlpScratch m;
        const int32_t W = cfg.window;
        // Validation: loss and recall@k per distance (each distance averaged over the layers it reaches).
        auto validate = [&](int32_t epoch, double train_loss) {
            double vl = 0;
            std::vector<double> vrec(size_t(W), 0.0), r(static_cast<size_t>(W));
            std::vector<int32_t> n_rec(size_t(W), 0);
            for (int32_t l = 0; l + 1 < cfg.shape.n_layers; ++l) {
                vl += mlp_batch(net, data, l, val_rows, 0, false, loss_fn, m, r.data());
                for (int32_t d = 1; d <= W && l + d < cfg.shape.n_layers; ++d) {
                    vrec[size_t(d - 1)] += r[size_t(d - 1)], ++n_rec[size_t(d - 1)];
                }
            }
            vl /= double(cfg.shape.n_layers - 1);
            double mean_rec = 0;
            for (int32_t d = 0; d < W; ++d) {
                vrec[size_t(d)] /= std::max(n_rec[size_t(d)], 1), mean_rec += vrec[size_t(d)] / W;
            }
            res.log.push_back({{"epoch", epoch}, {"val_loss", vl}, {"val_recall_at_k_d1", vrec[0]},
                               {"val_recall_at_k", vrec}, {"seconds", seconds_since(t0)}});
            if (epoch > 0) res.log.back()["train_loss"] = train_loss;
            if (progress) progress(res.log.back().dump());
            check_converging(epoch, train_loss, vl, opt.lr);
            // MLP-prior selects on recall@k (its loss is not the metric); LLaPor-MLP on the validation loss.
            const double crit = prior ? -mean_rec : vl;
            if (crit < best) best = crit, res.params = net.params(), res.config.notes["selected_epoch"] = epoch;
        };
        if (prior) validate(0, 0.0);  // the prior alone (the correction starts at zero)
        // Each group is its own network: its own Adam state and batches of its own layers.
        std::vector<nn::Adam> adams(size_t(cfg.n_groups()), adam);
        std::vector<std::pair<int32_t, size_t>> batches;  // (layer, first index into a shuffled copy of fit_rows)
        std::vector<std::vector<int64_t>> shuffled(size_t(cfg.shape.n_layers));
        for (int32_t ep = 0; cfg.has_mlp() && ep < opt.epochs; ++ep) {
            batches.clear();
            for (int32_t l = 0; l + 1 < cfg.shape.n_layers; ++l) {
                shuffled[size_t(l)] = fit_rows;
                rng.shuffle(shuffled[size_t(l)]);
                for (size_t i = 0; i < fit_rows.size(); i += size_t(opt.batch)) batches.push_back({l, i});
            }
            rng.shuffle(batches);
            double tl = 0;
            for (const auto &[l, i] : batches) {
                const auto &rows = shuffled[size_t(l)];
                const std::span<const int64_t> br(rows.data() + i, std::min(rows.size() - i, size_t(opt.batch)));
                net.params().zero_grad();
                tl += mlp_batch(net, data, l, br, rng.next() | 1, true, loss_fn, m, nullptr);
                const int32_t g = cfg.group_of(l);
                const auto [first, last] = net.group_params(g);
                adams[size_t(g)].step(net.params(), first, last);
            }
            validate(ep + 1, tl / double(batches.size()));
        }
        if (prior && cfg.correction && res.config.notes["selected_epoch"] == 0) {
            // No epoch of the correction beat the prior alone on validation: keep the prior alone.
            res.config.correction = false;
            res.config.notes["correction"] = "dropped: no epoch of the correction beat the prior alone on validation";
            LlaporMlpNet alone(res.config, opt.seed);
            for (size_t i = 0; i < alone.params().size(); ++i) {
                alone.params()[i].value = res.params.get(alone.params()[i].name).value;
            }
            res.params = alone.params();
        }
        if (prior) {
            LlaporMlpNet final_net(res.config, res.params);
            fit_calibration(final_net, data, fit_rows);
            res.params = final_net.params();
        }
    }
    for (size_t i = 0; i < res.params.size(); ++i) {
        nn::Param &p = res.params[i];
        p.grad.clear(), p.m.clear(), p.v.clear();
        p.grad.shrink_to_fit(), p.m.shrink_to_fit(), p.v.shrink_to_fit();
    }
    res.config.notes["training"] = {{"log", res.log}, {"options", {{"epochs", opt.epochs}, {"batch", opt.batch},
                                    {"lr", opt.lr}, {"weight_decay", opt.weight_decay}, {"seed", opt.seed},
                                    {"max_tokens", opt.max_tokens}, {"val_every", opt.val_every},
                                    {"dropout", opt.dropout}, {"loss", loss_name}}}};
    if (prior) res.config.notes["training"]["options"]["ridge"] = opt.ridge;
    return res;
}

} // namespace prescope

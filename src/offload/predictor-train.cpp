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
                  std::span<const uint8_t> has_prev, bool backward, LstmBatch &b, double *recall1) {
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
                loss += nn::softmax_xent_khot(zd, E, target, K, scale, backward ? zd : nullptr);
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
    return lstm_batch(net, t, tokens, has_prev, accumulate_grad, b, nullptr);
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
    std::vector<int64_t> flat;  // sidecar row -> flat token index of t
};

// Loss (and gradients when backward) of rows `rows` (sidecar row indices) of one layer; dlogits in `logits`.
double mlp_batch(LlaporMlpNet &net, const MlpData &data, int32_t layer, std::span<const int64_t> rows,
                 uint64_t drop_seed, bool backward, LlaporMlpNet::Tape &tape, std::vector<float> &x,
                 std::vector<float> &logits, std::vector<float> &scratch, double *recall1) {
    const LlaporConfig &c = net.config();
    const int32_t L = c.shape.n_layers, E = c.shape.n_experts, K = c.shape.top_k, W = c.window;
    const int64_t n = int64_t(rows.size()), D = c.dim, WE = int64_t(W) * E;
    x.resize(size_t(n * D));
    logits.resize(size_t(n * WE));
    for (int64_t i = 0; i < n; ++i) data.h.dequantize(rows[size_t(i)], layer, x.data() + i * D);
    net.forward(layer, n, x.data(), logits.data(), tape, drop_seed);
    const int32_t nd = std::min(W, L - 1 - layer);
    const float scale = 1.0f / float(n * nd);
    double loss = 0, rec = 0;
    std::vector<int32_t> order;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t tok = data.flat[size_t(rows[size_t(i)])];
        for (int32_t d = 1; d <= W; ++d) {
            float *z = logits.data() + i * WE + (d - 1) * E;
            if (d > nd) {
                std::fill(z, z + E, 0.0f);
                continue;
            }
            if (recall1 && d == 1) rec += topk_recall(z, E, data.t.ids(tok, layer + d), K, order);
            loss += nn::softmax_xent_khot(z, E, data.t.ids(tok, layer + d), K, scale, backward ? z : nullptr);
        }
    }
    if (recall1) *recall1 = rec / double(n);
    if (backward) net.backward(layer, n, tape, logits.data(), scratch);
    return loss / double(n * nd);
}

} // namespace

// ---------------------------------------------------------------------------------------------------------
// Training loop

TrainResult train_llapor(const RoutingTrace &train, const HiddenTrace *hidden, const TrainOptions &opt,
                         const std::function<void(const std::string &)> &progress) {
    const bool lstm = opt.kind == "llapor-lstm";
    if (!lstm && opt.kind != "llapor-mlp") fail("--kind {}: expected llapor-lstm or llapor-mlp", opt.kind);
    if (!lstm && !hidden) fail("llapor-mlp trains on hidden states: pass --hidden (the trace's .hidden.zst sidecar)");
    if (opt.window < 1 || opt.epochs < 1 || opt.batch < 1 || opt.val_every < 2) {
        fail("train-predictor: window, epochs and batch must be positive and val-every at least 2");
    }
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
                tl += lstm_batch(net, train, bt, bp, true, b, nullptr);
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
                vl += lstm_batch(net, train, vt, vp, false, b, &r) * double(e - i);
                vrec += r * double(e - i);
                vn += int64_t(e - i);
            }
            vl /= double(vn), vrec /= double(vn);
            res.log.push_back({{"epoch", ep + 1}, {"train_loss", tl / double(nb)}, {"val_loss", vl},
                               {"val_recall_at_k_d1", vrec}, {"seconds", seconds_since(t0)}});
            if (progress) progress(res.log.back().dump());
            if (vl < best) best = vl, res.params = net.params();
        }
    } else {
        LlaporMlpNet net(cfg, opt.seed);
        std::vector<float> x;
        fit_pca(net, *hidden, x);
        MlpData data{train, *hidden, hidden->flat_token_indices(train)};
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
        LlaporMlpNet::Tape tape;
        std::vector<float> logits, scratch;
        // Each group is its own network: its own Adam state and batches of its own layers.
        std::vector<nn::Adam> adams(size_t(cfg.n_groups()), adam);
        std::vector<std::pair<int32_t, size_t>> batches;  // (layer, first index into a shuffled copy of fit_rows)
        std::vector<std::vector<int64_t>> shuffled(size_t(cfg.shape.n_layers));
        for (int32_t ep = 0; ep < opt.epochs; ++ep) {
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
                tl += mlp_batch(net, data, l, br, rng.next() | 1, true, tape, x, logits, scratch, nullptr);
                const int32_t g = cfg.group_of(l);
                const auto [first, last] = net.group_params(g);
                adams[size_t(g)].step(net.params(), first, last);
            }
            double vl = 0, vrec = 0;
            int64_t vn = 0;
            for (int32_t l = 0; l + 1 < cfg.shape.n_layers; ++l) {
                double r = 0;
                vl += mlp_batch(net, data, l, val_rows, 0, false, tape, x, logits, scratch, &r);
                vrec += r;
                ++vn;
            }
            vl /= double(vn), vrec /= double(vn);
            res.log.push_back({{"epoch", ep + 1}, {"train_loss", tl / double(batches.size())}, {"val_loss", vl},
                               {"val_recall_at_k_d1", vrec}, {"seconds", seconds_since(t0)}});
            if (progress) progress(res.log.back().dump());
            if (vl < best) best = vl, res.params = net.params();
        }
    }
    for (size_t i = 0; i < res.params.size(); ++i) {
        nn::Param &p = res.params[i];
        p.grad.clear(), p.m.clear(), p.v.clear();
        p.grad.shrink_to_fit(), p.m.shrink_to_fit(), p.v.shrink_to_fit();
    }
    res.config.notes["training"] = {{"log", res.log}, {"options", {{"epochs", opt.epochs}, {"batch", opt.batch},
                                    {"lr", opt.lr}, {"weight_decay", opt.weight_decay}, {"seed", opt.seed},
                                    {"max_tokens", opt.max_tokens}, {"val_every", opt.val_every}}}};
    return res;
}

} // namespace prescope

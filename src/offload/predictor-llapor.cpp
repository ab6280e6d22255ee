// LLaPor-LSTM, LLaPor-MLP and LLaPor-MLP-prior: networks (forward and backward), their ScoringPredictor wrappers
// and file I/O.
#include "offload/predictor-llapor.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace prescope {

// ---------------------------------------------------------------------------------------------------------
// Config

int32_t LlaporConfig::group_of(int32_t layer) const {
    int32_t g = 0;
    while (g + 1 < n_groups() && group_start[size_t(g + 1)] <= layer) ++g;
    return g;
}

nlohmann::json LlaporConfig::to_json() const {
    nlohmann::json j = {{"kind", kind}, {"n_layers", shape.n_layers}, {"n_experts", shape.n_experts},
                        {"top_k", shape.top_k}, {"window", window}, {"group_start", group_start}, {"hidden", hidden},
                        {"dim", dim}, {"pca_dim", pca_dim}, {"dropout", dropout}, {"notes", notes}};
    if (has_prior()) j["drift"] = drift, j["correction"] = correction;
    return j;
}

namespace {

// An integer of a predictor file's config within [lo, hi]. nlohmann's get<int> converts a float by a cast, which
// is undefined behaviour out of range (fuzz finding), and narrows a wide integer silently.
int64_t config_int(const nlohmann::json &v, const char *key, int64_t lo, int64_t hi, const std::string &what) {
    const bool in_range = v.is_number_unsigned()  ? v.get<uint64_t>() <= uint64_t(hi) && v.get<uint64_t>() >= uint64_t(std::max<int64_t>(lo, 0))
                          : v.is_number_integer() ? v.get<int64_t>() >= lo && v.get<int64_t>() <= hi
                                                  : false;
    if (!in_range) fail("{}: predictor config: '{}' is {}, expected an integer in [{}, {}]", what, key, v.dump(), lo, hi);
    return v.get<int64_t>();
}

} // namespace

LlaporConfig LlaporConfig::from_json(const nlohmann::json &j, const std::string &what) {
    LlaporConfig c;
    constexpr int64_t kMax32 = std::numeric_limits<int32_t>::max();
    auto int32 = [&](const char *key) { return int32_t(config_int(j.at(key), key, 0, kMax32, what)); };
    try {
        c.kind = j.at("kind").get<std::string>();
        c.shape = {int32("n_layers"), int32("n_experts"), int32("top_k")};
        c.window = int32("window");
        if (!j.at("group_start").is_array()) fail("{}: predictor config: 'group_start' must be a list", what);
        for (const auto &g : j.at("group_start")) c.group_start.push_back(int32_t(config_int(g, "group_start", 0, kMax32, what)));
        c.hidden = int32("hidden");
        c.dim = config_int(j.at("dim"), "dim", 0, int64_t(1) << 40, what);
        c.pca_dim = int32("pca_dim");
        const nlohmann::json &dropout = j.at("dropout");
        if (!dropout.is_number() || !(dropout.get<double>() >= 0 && dropout.get<double>() < 1)) {
            fail("{}: predictor config: 'dropout' is {}, expected a number in [0, 1)", what, dropout.dump());
        }
        c.dropout = dropout.get<float>();
        if (c.has_prior()) c.drift = j.at("drift").get<std::string>(), c.correction = j.at("correction").get<bool>();
        c.notes = j.value("notes", nlohmann::json::object());
    } catch (const nlohmann::json::exception &e) {
        fail("{}: predictor config is malformed ({})", what, e.what());
    }
    if (c.kind != "llapor-lstm" && c.kind != "llapor-mlp" && c.kind != "llapor-mlp-prior") {
        fail("{}: predictor kind '{}', expected llapor-lstm, llapor-mlp or llapor-mlp-prior", what, c.kind);
    }
    const bool ok_shape = c.shape.n_layers >= 2 && c.shape.n_experts >= 1 && c.shape.n_experts <= 256 &&
                          c.shape.top_k >= 1 && c.shape.top_k <= c.shape.n_experts;
    bool ok_groups = !c.group_start.empty() && c.group_start[0] == 0;
    for (size_t i = 1; i < c.group_start.size(); ++i) {
        ok_groups = ok_groups && c.group_start[i] > c.group_start[i - 1] && c.group_start[i] < c.shape.n_layers;
    }
    const bool ok_drift = c.drift == "none" || c.drift == "current" || c.drift == "previous";
    if (!ok_shape || !ok_groups || !ok_drift || c.window < 1 || c.hidden < 1 ||
        (c.kind != "llapor-lstm" && (c.dim < 1 || c.pca_dim < 1 || c.pca_dim > c.dim))) {
        fail("{}: predictor config is inconsistent ({})", what, c.to_json().dump());
    }
    return c;
}

namespace {

void check_shapes(const nn::ParamSet &want, const nn::ParamSet &have, const std::string &kind) {
    if (want.size() != have.size()) fail("{} file has {} tensors, its config needs {}", kind, have.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
        if (want[i].name != have[i].name || want[i].shape != have[i].shape) {
            fail("{} file: tensor {} is {} {}, its config needs {} {}", kind, i, have[i].name,
                 nlohmann::json(have[i].shape).dump(), want[i].name, nlohmann::json(want[i].shape).dump());
        }
    }
}

void add_rows(const float *table, int64_t width, const int32_t *idx, int32_t nnz, float *dst) {
    for (int32_t j = 0; j < nnz; ++j) {
        const float *row = table + int64_t(idx[j]) * width;
        for (int64_t c = 0; c < width; ++c) dst[c] += row[c];
    }
}

void add_to_rows(float *table, int64_t width, const int32_t *idx, int32_t nnz, const float *src) {
    for (int32_t j = 0; j < nnz; ++j) {
        float *row = table + int64_t(idx[j]) * width;
        for (int64_t c = 0; c < width; ++c) row[c] += src[c];
    }
}

} // namespace

// ---------------------------------------------------------------------------------------------------------
// LSTM

LlaporLstmNet::LlaporLstmNet(LlaporConfig cfg, uint64_t seed, int64_t max_values) : cfg_(std::move(cfg)) {
    ps_.limit_values(max_values);
    const int64_t H = cfg_.hidden, n_in = cfg_.lstm_inputs(), WE = int64_t(cfg_.window) * shape().n_experts;
    const float s = 1.0f / std::sqrt(float(H));
    for (int32_t g = 0; g < cfg_.n_groups(); ++g) {
        const std::string p = fmt::format("g{}.", g);
        ps_.add(p + "wx", {n_in, 4 * H}, s, seed + 10 * uint64_t(g) + 1);
        ps_.add(p + "wh", {4 * H, H}, s, seed + 10 * uint64_t(g) + 2);
        const size_t b = ps_.add(p + "b", {4 * H}, 0.0f, 0);
        std::fill(ps_[b].value.begin() + H, ps_[b].value.begin() + 2 * H, 1.0f);  // forget-gate bias 1
        ps_.add(p + "wo", {WE, H}, s, seed + 10 * uint64_t(g) + 3);
        ps_.add(p + "bo", {WE}, 0.0f, 0);
    }
    ps_.add("ws", {cfg_.skip_inputs(), WE}, 0.0f, 0);
    bind();
}

// The shapes are checked on a network sized by the config, which may not hold more values than the file.
LlaporLstmNet::LlaporLstmNet(LlaporConfig cfg, nn::ParamSet params)
    : LlaporLstmNet(std::move(cfg), 1, params.n_values()) {
    check_shapes(ps_, params, "llapor-lstm");
    ps_ = std::move(params);
    bind();
}

void LlaporLstmNet::bind() {
    g_.clear();
    for (int32_t g = 0; g < cfg_.n_groups(); ++g) {
        const size_t i = size_t(g) * 5;
        g_.push_back({i, i + 1, i + 2, i + 3, i + 4});
    }
    ws_ = size_t(cfg_.n_groups()) * 5;
}

int32_t LlaporLstmNet::skip_row(int32_t layer, int32_t j, int32_t idx) const {
    const int32_t E = shape().n_experts, L = shape().n_layers;
    // The layer's own experts get rows of their own (co-occurrence differs per layer); the previous token's
    // experts and the layer one-hot map to the rows after them.
    return j < shape().top_k ? layer * E + idx : idx + L * E - E;
}

int32_t LlaporLstmNet::features(int32_t layer, const int32_t *cur, const int32_t *prev, int32_t *idx) const {
    const int32_t E = shape().n_experts, K = shape().top_k, L = shape().n_layers;
    int32_t n = 0;
    for (int32_t j = 0; j < K; ++j) idx[n++] = cur[j];
    if (prev) {
        for (int32_t d = 1; d <= cfg_.window && layer + d < L; ++d) {
            for (int32_t j = 0; j < K; ++j) idx[n++] = d * E + prev[(layer + d) * K + j];
        }
    }
    idx[n++] = (1 + cfg_.window) * E + layer;
    return n;
}

void LlaporLstmNet::forward_step(int32_t layer, int64_t n, const int32_t *idx, const int32_t *nnz,
                                 const float *h_prev, const float *c_prev, float *gates, float *c, float *h,
                                 float *logits) const {
    const Group &G = g_[size_t(cfg_.group_of(layer))];
    const int64_t H = cfg_.hidden, H4 = 4 * H, WE = int64_t(cfg_.window) * shape().n_experts;
    const int32_t mf = max_features();
    nn::linear(h_prev, n, H, ps_[G.wh].value.data(), ps_[G.b].value.data(), H4, gates);
    for (int64_t t = 0; t < n; ++t) {
        float *a = gates + t * H4;
        add_rows(ps_[G.wx].value.data(), H4, idx + t * mf, nnz[t], a);
        for (int64_t u = 0; u < H; ++u) {
            const float i = nn::sigmoid(a[u]), f = nn::sigmoid(a[H + u]), g = std::tanh(a[2 * H + u]),
                        o = nn::sigmoid(a[3 * H + u]);
            a[u] = i, a[H + u] = f, a[2 * H + u] = g, a[3 * H + u] = o;
            const float ct = f * c_prev[t * H + u] + i * g;
            c[t * H + u] = ct;
            h[t * H + u] = o * std::tanh(ct);
        }
    }
    nn::linear(h, n, H, ps_[G.wo].value.data(), ps_[G.bo].value.data(), WE, logits);
    const float *ws = ps_[ws_].value.data();
    for (int64_t t = 0; t < n; ++t) {
        for (int32_t j = 0; j < nnz[t]; ++j) {
            const float *row = ws + int64_t(skip_row(layer, j, idx[t * mf + j])) * WE;
            float *z = logits + t * WE;
            for (int64_t o = 0; o < WE; ++o) z[o] += row[o];
        }
    }
}

void LlaporLstmNet::backward_step(int32_t layer, int64_t n, const int32_t *idx, const int32_t *nnz,
                                  const float *h_prev, const float *c_prev, const float *gates, const float *c,
                                  const float *h, const float *dlogits, float *dh, float *dc, float *scratch) {
    const Group &G = g_[size_t(cfg_.group_of(layer))];
    const int64_t H = cfg_.hidden, H4 = 4 * H, WE = int64_t(cfg_.window) * shape().n_experts;
    const int32_t mf = max_features();
    // Head and skip: dh += dlogits . Wo.
    nn::linear_backward(h, dlogits, n, H, ps_[G.wo].value.data(), WE, ps_[G.wo].grad.data(), ps_[G.bo].grad.data(),
                        dh, /*accumulate_dx=*/true);
    float *dws = ps_[ws_].grad.data();
    for (int64_t t = 0; t < n; ++t) {
        for (int32_t j = 0; j < nnz[t]; ++j) {
            float *row = dws + int64_t(skip_row(layer, j, idx[t * mf + j])) * WE;
            const float *dz = dlogits + t * WE;
            for (int64_t o = 0; o < WE; ++o) row[o] += dz[o];
        }
    }
    // Cell: gate pre-activation gradients da, and dc -> dc_prev.
    float *da = scratch;
    for (int64_t t = 0; t < n; ++t) {
        const float *a = gates + t * H4;
        float *d = da + t * H4;
        for (int64_t u = 0; u < H; ++u) {
            const float i = a[u], f = a[H + u], g = a[2 * H + u], o = a[3 * H + u];
            const float tc = std::tanh(c[t * H + u]), dht = dh[t * H + u];
            const float dct = dht * o * (1.0f - tc * tc) + dc[t * H + u];
            d[u] = dct * g * i * (1.0f - i);
            d[H + u] = dct * c_prev[t * H + u] * f * (1.0f - f);
            d[2 * H + u] = dct * i * (1.0f - g * g);
            d[3 * H + u] = dht * tc * o * (1.0f - o);
            dc[t * H + u] = dct * f;
        }
    }
    nn::linear_backward(h_prev, da, n, H, ps_[G.wh].value.data(), H4, ps_[G.wh].grad.data(), ps_[G.b].grad.data(), dh);
    for (int64_t t = 0; t < n; ++t) add_to_rows(ps_[G.wx].grad.data(), H4, idx + t * mf, nnz[t], da + t * H4);
}

// ---------------------------------------------------------------------------------------------------------
// MLP

LlaporMlpNet::LlaporMlpNet(LlaporConfig cfg, uint64_t seed, int64_t max_values) : cfg_(std::move(cfg)) {
    ps_.limit_values(max_values);
    const int64_t H = cfg_.hidden, P = cfg_.pca_dim, D = cfg_.dim, L = cfg_.shape.n_layers, W = cfg_.window;
    const int64_t E = cfg_.shape.n_experts, WE = W * E;
    if (cfg_.has_mlp()) {
        ps_.add("pca.mean", {L, D}, 0.0f, 0);
        const size_t proj = ps_.add("pca.proj", {L, P, D}, 0.0f, 0);
        for (int64_t l = 0; l < L; ++l) {
            // Identity until fitted.
            for (int64_t i = 0; i < P; ++i) ps_[proj].value[size_t((l * P + i) * D + i)] = 1.0f;
        }
    }
    for (int32_t g = 0; g < cfg_.n_groups(); ++g) {
        const std::string p = fmt::format("g{}.", g);
        const uint64_t sd = seed + 16 * uint64_t(g);
        if (cfg_.has_mlp()) {
            ps_.add(p + "w1", {H, P}, 1.0f / std::sqrt(float(P)), sd + 1);
            ps_.add(p + "b1", {H}, 0.0f, 0);
            ps_.add(p + "wl", {L, H}, 0.0f, 0);
            if (cfg_.deep(g)) {
                ps_.add(p + "w2", {H, H}, 1.0f / std::sqrt(float(H)), sd + 2);
                ps_.add(p + "b2", {H}, 0.0f, 0);
                ps_.add(p + "w3", {H, H}, 1.0f / std::sqrt(float(H)), sd + 3);
                ps_.add(p + "b3", {H}, 0.0f, 0);
                ps_.add(p + "wg", {H, H}, 1.0f / std::sqrt(float(H)), sd + 4);
                ps_.add(p + "bg", {H}, 0.0f, 0);
            }
            // Per layer: like its routers. With a prior the correction starts at zero (training starts at the prior).
            ps_.add(p + "wo", {L, WE, H}, cfg_.has_prior() ? 0.0f : 1.0f / std::sqrt(float(H)), sd + 5);
            ps_.add(p + "bo", {WE}, 0.0f, 0);
            ps_.add(p + "bl", {L, WE}, 0.0f, 0);
        }
        if (cfg_.has_prior()) ps_.add(p + "ps", {L, W}, 0.0f, 0, 1.0f);
    }
    if (cfg_.has_prior()) {
        ps_.add("prior.router", {L, E, D}, 0.0f, 0);
        ps_.add("prior.drift0", {L, W, D, D + 1}, 0.0f, 0);
        if (cfg_.drift == "previous") ps_.add("prior.drift", {L, W, D, cfg_.drift_prev_inputs()}, 0.0f, 0);
        ps_.add("prior.calib", {L, W}, 0.0f, 0, 1.0f);
    }
    bind();
}

LlaporMlpNet::LlaporMlpNet(LlaporConfig cfg, nn::ParamSet params) : LlaporMlpNet(std::move(cfg), 1, params.n_values()) {
    check_shapes(ps_, params, cfg_.kind);
    ps_ = std::move(params);
    bind();
}

void LlaporMlpNet::bind() {
    g_.clear();
    size_t i = 0;
    if (cfg_.has_mlp()) mean_ = i++, proj_ = i++;
    for (int32_t g = 0; g < cfg_.n_groups(); ++g) {
        Group G{};
        G.first = i;
        if (cfg_.has_mlp()) {
            G.w1 = i++, G.b1 = i++, G.wl = i++;
            if (cfg_.deep(g)) G.w2 = i++, G.b2 = i++, G.w3 = i++, G.b3 = i++, G.wg = i++, G.bg = i++;
            G.wo = i++, G.bo = i++, G.bl = i++;
        }
        if (cfg_.has_prior()) G.ps = i++;
        G.last = i;
        g_.push_back(G);
    }
    if (cfg_.has_prior()) {
        router_ = i++, drift0_ = i++;
        if (cfg_.drift == "previous") drift_ = i++;
        calib_ = i++;
    }
}

std::pair<size_t, size_t> LlaporMlpNet::group_params(int32_t g) const {
    return {g_[size_t(g)].first, g_[size_t(g)].last};
}

void LlaporMlpNet::calibrate(int32_t layer, int64_t n, float *logits) const {
    if (!cfg_.has_prior()) return;
    const int64_t E = cfg_.shape.n_experts, W = cfg_.window;
    const float *c = ps_[calib_].value.data() + layer * W;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t d = 0; d < W; ++d) {
            float *z = logits + (t * W + d) * E;
            for (int64_t e = 0; e < E; ++e) z[e] *= c[d];
        }
    }
}

void LlaporMlpNet::prior_logits(int32_t layer, int64_t n, const float *x, const float *prev, float *out,
                                std::vector<float> &scratch) const {
    const int64_t D = cfg_.dim, E = cfg_.shape.n_experts, W = cfg_.window, WE = W * E, L = cfg_.shape.n_layers;
    const bool with_prev = prev && cfg_.drift == "previous";
    const int64_t F = with_prev ? cfg_.drift_prev_inputs() : D + 1;
    if (scratch.size() < size_t(n * (F + D + E))) scratch.resize(size_t(n * (F + D + E)));
    float *f = scratch.data(), *xh = f + n * F, *z = xh + n * D;
    for (int64_t d = 1; d <= W; ++d) {
        if (layer + d >= L) {
            for (int64_t t = 0; t < n; ++t) std::fill_n(out + t * WE + (d - 1) * E, E, 0.0f);
            continue;
        }
        std::copy_n(x, n * D, xh);
        if (cfg_.drift != "none") {
            for (int64_t t = 0; t < n; ++t) {
                float *row = f + t * F;
                std::copy_n(x + t * D, D, row);
                if (with_prev) {
                    std::copy_n(prev + (t * (W + 1) + d) * D, D, row + D);  // previous token at layer + d
                    std::copy_n(prev + t * (W + 1) * D, D, row + 2 * D);    // and at layer
                }
                row[F - 1] = 1.0f;
            }
            const float *a = with_prev ? ps_[drift_].value.data() + ((layer * W + d - 1) * D) * F
                                       : ps_[drift0_].value.data() + ((layer * W + d - 1) * D) * F;
            nn::linear(f, n, F, a, nullptr, D, xh, /*accumulate=*/true);
        }
        nn::linear(xh, n, D, ps_[router_].value.data() + (layer + d) * E * D, nullptr, E, z);
        for (int64_t t = 0; t < n; ++t) std::copy_n(z + t * E, E, out + t * WE + (d - 1) * E);
    }
}

void LlaporMlpNet::forward(int32_t layer, int64_t n, const float *x, float *logits, Tape &tp, uint64_t drop_seed,
                           const float *prior) const {
    const Group &G = g_[size_t(cfg_.group_of(layer))];
    const int64_t WE = int64_t(cfg_.window) * cfg_.shape.n_experts;
    if (cfg_.has_mlp()) {
        forward_mlp(layer, n, x, logits, tp, drop_seed);
    } else {
        std::fill_n(logits, n * WE, 0.0f);
    }
    if (!cfg_.has_prior()) return;
    if (!prior) fail("{}: forward needs the prior's logits", cfg_.kind);
    if (tp.prior.size() < size_t(n * WE)) tp.prior.resize(size_t(n * WE));
    std::copy_n(prior, n * WE, tp.prior.begin());
    const int64_t E = cfg_.shape.n_experts, nd = std::min<int64_t>(cfg_.window, cfg_.shape.n_layers - 1 - layer);
    const float *scale = ps_[G.ps].value.data() + int64_t(layer) * cfg_.window;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t d = 0; d < nd; ++d) {
            float *z = logits + t * WE + d * E;
            const float *p = prior + t * WE + d * E;
            for (int64_t e = 0; e < E; ++e) z[e] += scale[d] * p[e];
        }
    }
}

void LlaporMlpNet::forward_mlp(int32_t layer, int64_t n, const float *x, float *logits, Tape &tp,
                               uint64_t drop_seed) const {
    const int32_t gi = cfg_.group_of(layer);
    const Group &G = g_[size_t(gi)];
    const int64_t H = cfg_.hidden, P = cfg_.pca_dim, D = cfg_.dim, WE = int64_t(cfg_.window) * cfg_.shape.n_experts;
    const auto sz = [&](std::vector<float> &v, int64_t w) {
        if (v.size() < size_t(n * w)) v.resize(size_t(n * w));
    };
    sz(tp.xc, D), sz(tp.z, P), sz(tp.a1, H), sz(tp.u1, H), sz(tp.u, H);
    const float *mean = ps_[mean_].value.data() + int64_t(layer) * D;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t c = 0; c < D; ++c) tp.xc[size_t(t * D + c)] = x[t * D + c] - mean[c];
    }
    nn::linear(tp.xc.data(), n, D, ps_[proj_].value.data() + int64_t(layer) * P * D, nullptr, P, tp.z.data());
    nn::linear(tp.z.data(), n, P, ps_[G.w1].value.data(), ps_[G.b1].value.data(), H, tp.a1.data());
    const float *wl = ps_[G.wl].value.data() + int64_t(layer) * H;
    const bool drop = drop_seed != 0 && cfg_.dropout > 0.0f;
    if (drop && tp.mask1.size() < size_t(n * H)) tp.mask1.resize(size_t(n * H));
    uint64_t s = drop_seed * 0x9E3779B97F4A7C15ull + 1;
    const float keep_scale = drop ? 1.0f / (1.0f - cfg_.dropout) : 1.0f;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t u = 0; u < H; ++u) {
            float &a = tp.a1[size_t(t * H + u)];
            a += wl[u];
            float v = nn::gelu(a);
            if (drop) {
                s ^= s << 13, s ^= s >> 7, s ^= s << 17;
                const bool keep = float(double(s >> 11) / double(1ull << 53)) >= cfg_.dropout;
                tp.mask1[size_t(t * H + u)] = keep;
                v = keep ? v * keep_scale : 0.0f;
            }
            tp.u1[size_t(t * H + u)] = v;
        }
    }
    if (cfg_.deep(gi)) {
        sz(tp.a2, H), sz(tp.v, H), sz(tp.s, H), sz(tp.r, H);
        nn::linear(tp.u1.data(), n, H, ps_[G.w2].value.data(), ps_[G.b2].value.data(), H, tp.a2.data());
        for (int64_t i = 0; i < n * H; ++i) tp.v[size_t(i)] = nn::gelu(tp.a2[size_t(i)]);
        nn::linear(tp.u1.data(), n, H, ps_[G.wg].value.data(), ps_[G.bg].value.data(), H, tp.s.data());
        for (int64_t i = 0; i < n * H; ++i) tp.s[size_t(i)] = nn::sigmoid(tp.s[size_t(i)]);
        nn::linear(tp.v.data(), n, H, ps_[G.w3].value.data(), ps_[G.b3].value.data(), H, tp.r.data());
        for (int64_t i = 0; i < n * H; ++i) tp.u[size_t(i)] = tp.u1[size_t(i)] + tp.s[size_t(i)] * tp.r[size_t(i)];
    } else {
        std::copy_n(tp.u1.begin(), n * H, tp.u.begin());
    }
    nn::linear(tp.u.data(), n, H, ps_[G.wo].value.data() + int64_t(layer) * WE * H, ps_[G.bo].value.data(), WE, logits);
    const float *bl = ps_[G.bl].value.data() + int64_t(layer) * WE;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < WE; ++o) logits[t * WE + o] += bl[o];
    }
}

void LlaporMlpNet::backward(int32_t layer, int64_t n, const Tape &tp, const float *dlogits,
                            std::vector<float> &scratch) {
    const int32_t gi = cfg_.group_of(layer);
    const Group &G = g_[size_t(gi)];
    const int64_t H = cfg_.hidden, P = cfg_.pca_dim, WE = int64_t(cfg_.window) * cfg_.shape.n_experts;
    if (cfg_.has_prior()) {
        const int64_t E = cfg_.shape.n_experts, nd = std::min<int64_t>(cfg_.window, cfg_.shape.n_layers - 1 - layer);
        float *dscale = ps_[G.ps].grad.data() + int64_t(layer) * cfg_.window;
        for (int64_t t = 0; t < n; ++t) {
            for (int64_t d = 0; d < nd; ++d) {
                const float *dz = dlogits + t * WE + d * E, *p = tp.prior.data() + t * WE + d * E;
                double acc = 0.0;
                for (int64_t e = 0; e < E; ++e) acc += double(dz[e]) * p[e];
                dscale[d] += float(acc);
            }
        }
    }
    if (!cfg_.has_mlp()) return;
    if (scratch.size() < size_t(6 * n * H)) scratch.resize(size_t(6 * n * H));
    float *du = scratch.data(), *du1 = du + n * H, *dr = du1 + n * H, *dv = dr + n * H, *ds = dv + n * H,
          *da1 = ds + n * H;
    const int64_t wo_off = int64_t(layer) * WE * H;
    nn::linear_backward(tp.u.data(), dlogits, n, H, ps_[G.wo].value.data() + wo_off, WE, ps_[G.wo].grad.data() + wo_off,
                        ps_[G.bo].grad.data(), du);
    float *dbl = ps_[G.bl].grad.data() + int64_t(layer) * WE;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t o = 0; o < WE; ++o) dbl[o] += dlogits[t * WE + o];
    }
    if (cfg_.deep(gi)) {
        for (int64_t i = 0; i < n * H; ++i) {
            dr[i] = du[i] * tp.s[size_t(i)];
            const float sg = tp.s[size_t(i)];
            ds[i] = du[i] * tp.r[size_t(i)] * sg * (1.0f - sg);
        }
        nn::linear_backward(tp.v.data(), dr, n, H, ps_[G.w3].value.data(), H, ps_[G.w3].grad.data(),
                            ps_[G.b3].grad.data(), dv);
        for (int64_t i = 0; i < n * H; ++i) dv[i] *= nn::gelu_grad(tp.a2[size_t(i)]);
        std::copy_n(du, n * H, du1);  // residual path
        nn::linear_backward(tp.u1.data(), dv, n, H, ps_[G.w2].value.data(), H, ps_[G.w2].grad.data(),
                            ps_[G.b2].grad.data(), du1, true);
        nn::linear_backward(tp.u1.data(), ds, n, H, ps_[G.wg].value.data(), H, ps_[G.wg].grad.data(),
                            ps_[G.bg].grad.data(), du1, true);
    } else {
        std::copy_n(du, n * H, du1);
    }
    const bool drop = !tp.mask1.empty() && cfg_.dropout > 0.0f;
    const float keep_scale = drop ? 1.0f / (1.0f - cfg_.dropout) : 1.0f;
    float *dwl = ps_[G.wl].grad.data() + int64_t(layer) * H;
    for (int64_t t = 0; t < n; ++t) {
        for (int64_t u = 0; u < H; ++u) {
            const size_t i = size_t(t * H + u);
            float g = du1[i] * nn::gelu_grad(tp.a1[i]);
            if (drop) g = tp.mask1[i] ? g * keep_scale : 0.0f;
            da1[i] = g;
            dwl[u] += g;
        }
    }
    nn::linear_backward(tp.z.data(), da1, n, P, ps_[G.w1].value.data(), H, ps_[G.w1].grad.data(),
                        ps_[G.b1].grad.data(), nullptr);
}

// ---------------------------------------------------------------------------------------------------------
// Predictors

void logits_to_scores(const float *logits, int32_t layer, int32_t n_layers, int32_t window, int32_t n_experts,
                      int32_t n_tokens, int32_t token, int32_t window_asked, std::span<float> scores) {
    for (int32_t d = 1; d <= window_asked && layer + d < n_layers; ++d) {
        float *row = scores.data() + (size_t(d - 1) * size_t(n_tokens) + size_t(token)) * size_t(n_experts);
        if (d > window) {
            std::fill(row, row + n_experts, 0.0f);
            continue;
        }
        const float *z = logits + size_t(d - 1) * size_t(n_experts);
        const float mx = *std::max_element(z, z + n_experts);
        float sum = 0.0f;
        for (int32_t e = 0; e < n_experts; ++e) sum += row[e] = std::exp(z[e] - mx);
        // Logits that overflowed (huge weights, a diverged file) give no scores: NaN would break the sorts
        // downstream, and nothing is known about the row anyway.
        if (!std::isfinite(sum) || !(sum > 0.0f)) {
            std::fill(row, row + n_experts, 0.0f);
            continue;
        }
        for (int32_t e = 0; e < n_experts; ++e) row[e] /= sum;
    }
}

LlaporLstmPredictor::LlaporLstmPredictor(std::shared_ptr<const LlaporLstmNet> net, int32_t max_tokens)
    : ScoringPredictor(net->config().shape, max_tokens, std::max(net->config().window, 8)), net_(std::move(net)),
      max_tokens_(max_tokens) {
    const LlaporConfig &c = net_->config();
    const size_t H = size_t(c.hidden), n = size_t(max_tokens);
    h_.assign(2 * n * H, 0.0f);
    c_.assign(2 * n * H, 0.0f);
    gates_.resize(n * 4 * H);
    logits_.resize(n * size_t(c.window) * size_t(c.shape.n_experts));
    idx_.resize(n * size_t(net_->max_features()));
    nnz_.resize(n);
    prev_.assign(size_t(c.shape.n_layers) * size_t(c.shape.top_k), 0);
}

void LlaporLstmPredictor::reset() {
    has_prev_ = false;
    std::fill(h_.begin(), h_.end(), 0.0f);
    std::fill(c_.begin(), c_.end(), 0.0f);
}

void LlaporLstmPredictor::score(const PredictorInput &in, std::span<float> scores) {
    const LlaporConfig &c = net_->config();
    if (in.n_tokens > max_tokens_) fail("llapor-lstm: {} tokens in one call, built for {}", in.n_tokens, max_tokens_);
    if (in.top_k != c.shape.top_k) fail("llapor-lstm: top_k {} but the predictor was trained for {}", in.top_k, c.shape.top_k);
    const size_t H = size_t(c.hidden), n = size_t(in.n_tokens), half = size_t(max_tokens_) * H;
    // Double buffers: state of layer l-1 in one half, layer l written to the other.
    float *hp = h_.data() + (in.layer % 2) * half, *cp = c_.data() + (in.layer % 2) * half;
    float *hn = h_.data() + ((in.layer + 1) % 2) * half, *cn = c_.data() + ((in.layer + 1) % 2) * half;
    if (in.layer == 0) {
        std::fill(hp, hp + n * H, 0.0f);
        std::fill(cp, cp + n * H, 0.0f);
    }
    const int32_t mf = net_->max_features(), K = c.shape.top_k;
    // The previous step's routing exists for every layer once a whole step has been seen.
    const int32_t *prev = has_prev_ ? prev_.data() : nullptr;
    for (size_t t = 0; t < n; ++t) {
        nnz_[t] = net_->features(in.layer, in.routed.data() + t * size_t(K), prev, idx_.data() + t * size_t(mf));
    }
    net_->forward_step(in.layer, int64_t(n), idx_.data(), nnz_.data(), hp, cp, gates_.data(), cn, hn, logits_.data());
    const size_t WE = size_t(c.window) * size_t(c.shape.n_experts);
    for (size_t t = 0; t < n; ++t) {
        logits_to_scores(logits_.data() + t * WE, in.layer, c.shape.n_layers, c.window, c.shape.n_experts,
                         in.n_tokens, int32_t(t), in.window, scores);
    }
    std::copy_n(in.routed.data() + (n - 1) * size_t(K), K, prev_.begin() + size_t(in.layer) * size_t(K));
    if (in.layer == c.shape.n_layers - 1) has_prev_ = true;
}

LlaporMlpPredictor::LlaporMlpPredictor(std::shared_ptr<const LlaporMlpNet> net, int32_t max_tokens)
    : ScoringPredictor(net->config().shape, max_tokens, std::max(net->config().window, 8)), net_(std::move(net)),
      max_tokens_(max_tokens) {
    const LlaporConfig &c = net_->config();
    const size_t WE = size_t(c.window) * size_t(c.shape.n_experts), D = size_t(c.dim);
    logits_.resize(size_t(max_tokens) * WE);
    std::vector<float> x(size_t(max_tokens) * D, 0.0f);
    if (c.has_prior()) {
        prior_.resize(size_t(max_tokens) * WE);
        prev_x_.assign(size_t(c.shape.n_layers) * D, 0.0f);
        cur_x_.assign(size_t(c.shape.n_layers) * D, 0.0f);
        prev_seen_.assign(size_t(c.shape.n_layers), 0);
        cur_seen_.assign(size_t(c.shape.n_layers), 0);
        prev_rows_.assign(size_t(c.window + 1) * D, 0.0f);
        // Sizes the scratch once: the decode form (one token with the previous one) and the multi-token form.
        net_->prior_logits(0, 1, x.data(), prev_rows_.data(), prior_.data(), scratch_);
        net_->prior_logits(0, max_tokens, x.data(), nullptr, prior_.data(), scratch_);
    }
    net_->forward(0, max_tokens, x.data(), logits_.data(), tape_, 0, prior_.data());  // sizes the tape once
}

void LlaporMlpPredictor::score(const PredictorInput &in, std::span<float> scores) {
    const LlaporConfig &c = net_->config();
    const char *kind = c.kind.c_str();
    if (!in.hidden) fail("the {} predictor needs the router input (hidden state) of each layer", kind);
    if (in.n_embd != c.dim) fail("{}: hidden state has {} values, the predictor expects {}", kind, in.n_embd, c.dim);
    if (in.n_tokens > max_tokens_) fail("{}: {} tokens in one call, built for {}", kind, in.n_tokens, max_tokens_);
    if (c.has_prior()) {
        const size_t D = size_t(c.dim), L = size_t(c.shape.n_layers), l = size_t(in.layer);
        // A layer not after the last one seen starts a new step: the step before becomes the previous token's.
        // (The runtime never asks after the last layer, so a step is not known to be complete before that.)
        if (in.layer <= last_layer_) {
            std::swap(prev_x_, cur_x_), std::swap(prev_seen_, cur_seen_);
            std::fill(cur_seen_.begin(), cur_seen_.end(), 0);
            has_prev_ = true;
        }
        last_layer_ = in.layer;
        // Decode: the previous token's router inputs at this layer and the predicted ones, when all were seen
        // (rows past the last layer stay unread).
        bool decode = in.n_tokens == 1 && has_prev_;
        for (size_t d = 0; decode && d <= size_t(c.window) && l + d < L; ++d) {
            decode = prev_seen_[l + d] != 0;
            std::copy_n(prev_x_.data() + (l + d) * D, D, prev_rows_.data() + d * D);
        }
        net_->prior_logits(in.layer, in.n_tokens, in.hidden, decode ? prev_rows_.data() : nullptr, prior_.data(),
                           scratch_);
        std::copy_n(in.hidden + size_t(in.n_tokens - 1) * D, D, cur_x_.data() + l * D);
        cur_seen_[l] = 1;
    }
    net_->forward(in.layer, in.n_tokens, in.hidden, logits_.data(), tape_, 0, prior_.data());
    net_->calibrate(in.layer, in.n_tokens, logits_.data());
    const size_t WE = size_t(c.window) * size_t(c.shape.n_experts);
    for (int32_t t = 0; t < in.n_tokens; ++t) {
        logits_to_scores(logits_.data() + size_t(t) * WE, in.layer, c.shape.n_layers, c.window, c.shape.n_experts,
                         in.n_tokens, t, in.window, scores);
    }
}

void save_llapor(const std::string &path, const LlaporConfig &cfg, const nn::ParamSet &ps) {
    nn::save_params(path, cfg.to_json(), ps);
}

std::unique_ptr<ScoringPredictor> load_llapor(const std::string &path, int32_t max_tokens, LlaporConfig *cfg_out) {
    nlohmann::json j;
    nn::ParamSet ps = nn::load_params(path, &j);
    LlaporConfig cfg = LlaporConfig::from_json(j, path);
    if (cfg_out) *cfg_out = cfg;
    try {
        if (cfg.kind == "llapor-lstm") {
            return std::make_unique<LlaporLstmPredictor>(std::make_shared<LlaporLstmNet>(cfg, std::move(ps)), max_tokens);
        }
        return std::make_unique<LlaporMlpPredictor>(std::make_shared<LlaporMlpNet>(cfg, std::move(ps)), max_tokens);
    } catch (const Error &e) {
        fail("{}: {}", path, e.what());
    }
}

} // namespace prescope

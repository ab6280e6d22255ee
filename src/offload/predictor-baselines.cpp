// Training-free predictors: frequency/recency counts, Fate-style next-router scoring, the trace oracle.
#include "offload/predictor-baselines.h"

#include "arch/arch.h"
#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>

namespace prescope {

FrequencyPredictor::FrequencyPredictor(PredictorShape shape, double decay, int32_t max_tokens, int32_t max_window)
    : ScoringPredictor(shape, max_tokens, max_window), decay_(decay),
      counts_(size_t(shape.n_layers) * size_t(shape.n_experts), 0.0), maxc_(size_t(shape.n_layers), 0.0) {
    if (!(decay > 0.0 && decay <= 1.0)) fail("frequency predictor: decay {} must be in (0, 1]", decay);
}

void FrequencyPredictor::score(const PredictorInput &in, std::span<float> scores) {
    const int32_t E = shape_.n_experts;
    // Score first, then count this layer's tokens: a layer is only ever predicted before it routes.
    for (int32_t d = 1; d <= in.window && in.layer + d < shape_.n_layers; ++d) {
        const int32_t tl = in.layer + d;
        const double *c = counts_.data() + size_t(tl) * size_t(E);
        const double inv = maxc_[size_t(tl)] > 0 ? 1.0 / maxc_[size_t(tl)] : 0.0;
        for (int32_t t = 0; t < in.n_tokens; ++t) {
            float *row = scores.data() + (size_t(d - 1) * size_t(in.n_tokens) + size_t(t)) * size_t(E);
            for (int32_t e = 0; e < E; ++e) row[e] = float(c[e] * inv);
        }
    }
    double *c = counts_.data() + size_t(in.layer) * size_t(E);
    for (int32_t t = 0; t < in.n_tokens; ++t) {
        if (decay_ < 1.0) {
            for (int32_t e = 0; e < E; ++e) c[e] *= decay_;
        }
        for (int32_t j = 0; j < in.top_k; ++j) c[in.routed[size_t(t * in.top_k + j)]] += 1.0;
    }
    maxc_[size_t(in.layer)] = *std::max_element(c, c + E);
}

FatePredictor::FatePredictor(PredictorShape shape, int64_t dim, std::vector<std::vector<float>> routers,
                             int32_t max_tokens, int32_t max_window)
    : ScoringPredictor(shape, max_tokens, max_window), dim_(dim), routers_(std::move(routers)) {
    if (int32_t(routers_.size()) != shape.n_layers) {
        fail("fate predictor: {} router matrices for {} layers", routers_.size(), shape.n_layers);
    }
    for (const auto &r : routers_) {
        if (int64_t(r.size()) != int64_t(shape.n_experts) * dim) {
            fail("fate predictor: a router matrix has {} values, expected n_experts {} x dim {}", r.size(),
                 shape.n_experts, dim);
        }
    }
}

std::vector<std::vector<float>> FatePredictor::read_routers(const Model &model) {
    const HParams &hp = model.hp();
    std::vector<std::vector<float>> out(size_t(hp.n_layer_moe()));
    for (int64_t l = 0; l < hp.n_layer_moe(); ++l) {
        const TensorView &g = model.weights().layers[size_t(hp.n_layer_dense + l)].gate_inp;
        auto &r = out[size_t(l)];
        r.resize(size_t(hp.n_expert * hp.n_embd));
        for (int64_t e = 0; e < hp.n_expert; ++e) dequantize_row(g.type, g.row(e), r.data() + e * hp.n_embd, hp.n_embd);
    }
    return out;
}

std::vector<std::vector<float>> FatePredictor::read_routers_safetensors(const std::string &path, int32_t first_layer,
                                                                        int32_t n_layers, int32_t n_experts,
                                                                        int64_t dim) {
    // safetensors: uint64 LE header size, JSON {name: {dtype, shape, data_offsets: [begin, end]}}, then data.
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot open the safetensors file", path);
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    uint64_t hlen = 0;
    if (data.size() < 8) fail("{}: too short for a safetensors file", path);
    std::memcpy(&hlen, data.data(), 8);
    if (hlen > data.size() - 8) fail("{}: safetensors header length {} runs past the end of the file", path, hlen);
    nlohmann::json h;
    try {
        h = nlohmann::json::parse(data.begin() + 8, data.begin() + 8 + int64_t(hlen));
    } catch (const nlohmann::json::exception &e) {
        fail("{}: safetensors header is not valid JSON ({})", path, e.what());
    }
    const uint64_t base = 8 + hlen;
    std::vector<std::vector<float>> out(static_cast<size_t>(n_layers));
    for (int32_t l = 0; l < n_layers; ++l) {
        const int32_t layer = first_layer + l;  // HF numbers every layer, dense ones included
        std::string name = "layers." + std::to_string(layer) + ".mlp.gate.weight";
        if (!h.contains(name)) name = "model." + name;
        if (!h.contains(name)) {
            fail("{}: no tensor layers.{}.mlp.gate.weight (the router of layer {})", path, layer, layer);
        }
        const nlohmann::json &t = h[name];
        const std::string dtype = t.value("dtype", "");
        const auto shape = t.value("shape", std::vector<int64_t>{});
        const auto off = t.value("data_offsets", std::vector<uint64_t>{});
        const size_t esize = dtype == "F32" ? 4 : dtype == "F16" || dtype == "BF16" ? 2 : 0;
        if (esize == 0) fail("{}: tensor {} has dtype {}, expected F32, F16 or BF16", path, name, dtype);
        if (shape != std::vector<int64_t>{n_experts, dim}) {
            fail("{}: tensor {} has shape {}, expected [{}, {}]", path, name, nlohmann::json(shape).dump(), n_experts, dim);
        }
        const uint64_t n = uint64_t(n_experts) * uint64_t(dim);
        if (off.size() != 2 || off[1] < off[0] || off[1] - off[0] != n * esize || base + off[1] > data.size()) {
            fail("{}: tensor {} has data_offsets {} that do not fit its shape or the file", path, name,
                 t.value("data_offsets", nlohmann::json()).dump());
        }
        auto &r = out[size_t(l)];
        r.resize(size_t(n));
        const char *src = data.data() + base + off[0];
        for (uint64_t i = 0; i < n; ++i) {
            if (esize == 4) {
                std::memcpy(&r[size_t(i)], src + 4 * i, 4);
            } else {
                uint16_t v;
                std::memcpy(&v, src + 2 * i, 2);
                r[size_t(i)] = dtype == "F16" ? fp16_to_fp32(v) : bf16_to_fp32(v);
            }
        }
    }
    return out;
}

void FatePredictor::score(const PredictorInput &in, std::span<float> scores) {
    if (!in.hidden) fail("the fate predictor needs the router input (hidden state) of each layer");
    if (in.n_embd != dim_) fail("fate predictor: hidden state has {} values, the routers expect {}", in.n_embd, dim_);
    const int32_t E = shape_.n_experts;
    for (int32_t d = 1; d <= in.window && in.layer + d < shape_.n_layers; ++d) {
        const float *w = routers_[size_t(in.layer + d)].data();
        for (int32_t t = 0; t < in.n_tokens; ++t) {
            const float *x = in.hidden + size_t(t) * size_t(dim_);
            float *row = scores.data() + (size_t(d - 1) * size_t(in.n_tokens) + size_t(t)) * size_t(E);
            // Router logits then softmax over all experts, as moe_route does for the layer itself.
            float mx = -INFINITY;
            for (int32_t e = 0; e < E; ++e) {
                const float *we = w + size_t(e) * size_t(dim_);
                float s = 0.0f;
                for (int64_t c = 0; c < dim_; ++c) s += we[c] * x[c];
                row[e] = s;
                mx = std::max(mx, s);
            }
            float sum = 0.0f;
            for (int32_t e = 0; e < E; ++e) sum += row[e] = std::exp(row[e] - mx);
            for (int32_t e = 0; e < E; ++e) row[e] /= sum;
        }
    }
}

OraclePredictor::OraclePredictor(const RoutingTrace &trace, int32_t max_window)
    : ScoringPredictor({trace.n_layer, trace.n_expert, trace.top_k}, 1, max_window), trace_(trace) {}

void OraclePredictor::score(const PredictorInput &in, std::span<float> scores) {
    PRESCOPE_ASSERT(in.n_tokens == 1 && token_ >= 0 && token_ < trace_.n_tokens());
    const int32_t E = shape_.n_experts;
    for (int32_t d = 1; d <= in.window && in.layer + d < shape_.n_layers; ++d) {
        float *row = scores.data() + size_t(d - 1) * size_t(E);
        std::fill(row, row + E, 0.0f);
        const uint8_t *ids = trace_.ids(token_, in.layer + d);
        for (int32_t j = 0; j < trace_.top_k; ++j) row[ids[j]] = 1.0f;
    }
}

} // namespace prescope

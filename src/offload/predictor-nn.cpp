// Dense layers, losses, Adam and the predictor file format for the LLaPor predictors (predictor-nn.h).
#include "offload/predictor-nn.h"

#include "core/error.h"
#include "core/output-file.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>

namespace prescope::nn {

void linear(const float *x, int64_t n, int64_t in, const float *w, const float *b, int64_t out, float *y,
            bool accumulate) {
    if (n == 1) {
        cblas_sgemv(CblasRowMajor, CblasNoTrans, int(out), int(in), 1.0f, w, int(in), x, 1, accumulate ? 1.0f : 0.0f,
                    y, 1);
    } else {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(n), int(out), int(in), 1.0f, x, int(in), w, int(in),
                    accumulate ? 1.0f : 0.0f, y, int(out));
    }
    if (b) {
        for (int64_t i = 0; i < n; ++i) {
            float *row = y + i * out;
            for (int64_t o = 0; o < out; ++o) row[o] += b[o];
        }
    }
}

void linear_backward(const float *x, const float *dy, int64_t n, int64_t in, const float *w, int64_t out, float *dw,
                     float *db, float *dx, bool accumulate_dx) {
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(out), int(in), int(n), 1.0f, dy, int(out), x, int(in),
                1.0f, dw, int(in));
    if (db) {
        for (int64_t i = 0; i < n; ++i) {
            const float *row = dy + i * out;
            for (int64_t o = 0; o < out; ++o) db[o] += row[o];
        }
    }
    if (dx) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(n), int(in), int(out), 1.0f, dy, int(out), w,
                    int(in), accumulate_dx ? 1.0f : 0.0f, dx, int(in));
    }
}

float softmax_xent_khot(const float *logits, int32_t n_experts, const uint8_t *ids, int32_t k, float scale,
                        float *dlogits) {
    float mx = logits[0];
    for (int32_t e = 1; e < n_experts; ++e) mx = std::max(mx, logits[e]);
    double sum = 0.0;
    for (int32_t e = 0; e < n_experts; ++e) sum += std::exp(double(logits[e] - mx));
    const double lse = double(mx) + std::log(sum);
    double loss = 0.0;
    for (int32_t j = 0; j < k; ++j) loss += lse - double(logits[ids[j]]);
    loss /= k;
    if (dlogits) {
        for (int32_t e = 0; e < n_experts; ++e) dlogits[e] = scale * float(std::exp(double(logits[e]) - lse));
        for (int32_t j = 0; j < k; ++j) dlogits[ids[j]] -= scale / float(k);
    }
    return float(loss);
}

float softmax_xent_negatives(const float *logits, int32_t n_experts, const uint8_t *ids, int32_t k, float scale,
                             float *dlogits) {
    bool target[256] = {};
    for (int32_t j = 0; j < k; ++j) target[ids[j]] = true;
    // lse = log sum over non-targets of exp(z); each target's term is log(exp(z_t) + exp(lse)) - z_t
    // = softplus(lse - z_t), with gradient -sigmoid(lse - z_t) for z_t and softmax_neg(n) * sigmoid(lse - z_t)
    // for each non-target n.
    float mx = -INFINITY;
    for (int32_t e = 0; e < n_experts; ++e) {
        if (!target[e]) mx = std::max(mx, logits[e]);
    }
    double sum = 0.0;
    for (int32_t e = 0; e < n_experts; ++e) {
        if (!target[e]) sum += std::exp(double(logits[e] - mx));
    }
    const double lse = double(mx) + std::log(sum);
    double loss = 0.0, w = 0.0;
    for (int32_t j = 0; j < k; ++j) {
        const double u = lse - double(logits[ids[j]]);
        loss += u > 0 ? u + std::log1p(std::exp(-u)) : std::log1p(std::exp(u));
        const double sg = 1.0 / (1.0 + std::exp(-u));
        w += sg;
        if (dlogits) dlogits[ids[j]] = -scale / float(k) * float(sg);
    }
    if (dlogits) {
        for (int32_t e = 0; e < n_experts; ++e) {
            if (!target[e]) dlogits[e] = scale / float(k) * float(std::exp(double(logits[e]) - lse) * w);
        }
    }
    return float(loss / k);
}

size_t ParamSet::add(const std::string &name, std::vector<int64_t> shape, float scale, uint64_t seed, float fill) {
    Param p;
    p.name = name;
    p.shape = std::move(shape);
    int64_t n = 1;
    for (int64_t d : p.shape) {
        if (d < 0 || (d > 0 && n > std::numeric_limits<int64_t>::max() / d)) {
            fail("predictor parameters: tensor {} has shape {}, too large", name, nlohmann::json(p.shape).dump());
        }
        n *= d;
    }
    if (limit_ >= 0 && n > limit_ - n_values()) {
        fail("predictor parameters: tensor {} needs {} values, but the file holds {} in all and the tensors before "
             "it take {}", name, n, limit_, n_values());
    }
    p.value.assign(size_t(n), fill);
    if (scale != 0.0f) {
        uint64_t s = seed * 0x9E3779B97F4A7C15ull + 0x2545F4914F6CDD1Dull;
        for (auto &v : p.value) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;  // xorshift64
            v = scale * (2.0f * float(double(s >> 11) / double(1ull << 53)) - 1.0f);
        }
    }
    p.grad.assign(size_t(n), 0.0f);
    params_.push_back(std::move(p));
    return params_.size() - 1;
}

Param &ParamSet::get(const std::string &name) {
    for (auto &p : params_) {
        if (p.name == name) return p;
    }
    fail("predictor parameters: no tensor named {}", name);
}

const Param &ParamSet::get(const std::string &name) const { return const_cast<ParamSet *>(this)->get(name); }

int64_t ParamSet::n_values() const {
    int64_t n = 0;
    for (const auto &p : params_) n += p.size();
    return n;
}

void ParamSet::zero_grad() {
    for (auto &p : params_) std::fill(p.grad.begin(), p.grad.end(), 0.0f);
}

double ParamSet::clip_grad_norm(double max_norm) {
    double sq = 0.0;
    for (const auto &p : params_) {
        for (float g : p.grad) sq += double(g) * g;
    }
    const double norm = std::sqrt(sq);
    if (norm > max_norm) {
        const auto s = float(max_norm / norm);
        for (auto &p : params_) {
            for (float &g : p.grad) g *= s;
        }
    }
    return norm;
}

void Adam::step(ParamSet &ps, size_t first, size_t last) {
    if (last == 0) last = ps.size();
    ++t;
    const float c1 = 1.0f - std::pow(beta1, float(t)), c2 = 1.0f - std::pow(beta2, float(t));
    for (size_t i = first; i < last; ++i) {
        Param &p = ps[i];
        if (p.m.empty()) {
            p.m.assign(p.value.size(), 0.0f);
            p.v.assign(p.value.size(), 0.0f);
        }
        for (size_t j = 0; j < p.value.size(); ++j) {
            const float g = p.grad[j];
            p.m[j] = beta1 * p.m[j] + (1.0f - beta1) * g;
            p.v[j] = beta2 * p.v[j] + (1.0f - beta2) * g * g;
            p.value[j] -= lr * ((p.m[j] / c1) / (std::sqrt(p.v[j] / c2) + eps) + weight_decay * p.value[j]);
        }
    }
}

namespace {
constexpr char MAGIC[8] = {'P', 'S', 'P', 'R', 'E', 'D', '0', '1'};
}

void save_params(const std::string &path, const nlohmann::json &config, const ParamSet &ps) {
    nlohmann::json tensors = nlohmann::json::array();
    uint64_t offset = 0;
    for (size_t i = 0; i < ps.size(); ++i) {
        tensors.push_back({{"name", ps[i].name}, {"shape", ps[i].shape}, {"offset", offset}});
        offset += uint64_t(ps[i].size()) * 4;
    }
    for (size_t i = 0; i < ps.size(); ++i) {
        const auto bad = std::find_if(ps[i].value.begin(), ps[i].value.end(), [](float v) { return !std::isfinite(v); });
        if (bad != ps[i].value.end()) {
            fail("{}: not written: tensor {} holds {} at index {} (training diverged?)", path, ps[i].name, *bad,
                 bad - ps[i].value.begin());
        }
    }
    const std::string header =
        nlohmann::json{{"format_version", 1}, {"config", config}, {"tensors", tensors}}.dump();
    OutputFile out(path);
    const auto hlen = uint32_t(header.size());
    char head[12];
    std::memcpy(head, MAGIC, 8);
    for (int b = 0; b < 4; ++b) head[8 + b] = char((hlen >> (8 * b)) & 0xff);
    out.write(head, sizeof head);
    out.write(header);
    for (size_t i = 0; i < ps.size(); ++i) out.write(ps[i].value.data(), ps[i].value.size() * 4);
    out.commit();
}

ParamSet load_params(const std::string &path, nlohmann::json *config) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot open the predictor file", path);
    const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (data.size() < 12 || std::memcmp(data.data(), MAGIC, 8) != 0) {
        fail("{}: not a predictor file (bad magic, expected \"PSPRED01\")", path);
    }
    uint32_t hlen = 0;
    for (int b = 0; b < 4; ++b) hlen |= uint32_t(uint8_t(data[size_t(8 + b)])) << (8 * b);
    if (12 + uint64_t(hlen) > data.size()) fail("{}: header length {} runs past the end of the file", path, hlen);
    nlohmann::json h;
    try {
        h = nlohmann::json::parse(data.begin() + 12, data.begin() + 12 + hlen);
        if (h.at("format_version") != 1) fail("{}: format_version {}, expected 1", path, h["format_version"].dump());
        *config = h.at("config");
        const uint64_t body = 12 + uint64_t(hlen);
        ParamSet ps;
        for (const auto &t : h.at("tensors")) {
            const std::string name = t.at("name").get<std::string>();
            // Integers only: nlohmann's get<int64_t> casts a float, undefined behaviour out of range (fuzz finding).
            const nlohmann::json &js = t.at("shape"), &jo = t.at("offset");
            if (!js.is_array()) fail("{}: tensor {} has shape {}, expected a list of dimensions", path, name, js.dump());
            // Every count is bounded by the file before it is multiplied or allocated.
            std::vector<int64_t> shape;
            uint64_t n = 1;
            for (const auto &jd : js) {
                if (!jd.is_number_unsigned()) {
                    fail("{}: tensor {} has shape {}, expected non-negative integer dimensions", path, name, js.dump());
                }
                const uint64_t d = jd.get<uint64_t>();
                if (d > 0 && n > data.size() / d) {
                    fail("{}: tensor {} of shape {} holds more values than the file has bytes", path, name, js.dump());
                }
                n *= d;
                shape.push_back(int64_t(d));
            }
            if (!jo.is_number_unsigned()) fail("{}: tensor {} has offset {}, expected a byte count", path, name, jo.dump());
            const uint64_t off = jo.get<uint64_t>();
            if (n > data.size() || off > data.size() || body + off + n * 4 > data.size()) {
                fail("{}: tensor {} ({} values at offset {}) runs past the end of the file", path, name, n, off);
            }
            const float *values = reinterpret_cast<const float *>(data.data() + body + off);
            for (uint64_t j = 0; j < n; ++j) {
                float v;
                std::memcpy(&v, values + j, 4);
                if (!std::isfinite(v)) fail("{}: tensor {} holds {} at index {}; expected finite weights", path, name, v, j);
            }
            const size_t i = ps.add(name, shape, 0.0f, 0);
            if (n > 0) std::memcpy(ps[i].value.data(), data.data() + body + off, n * 4);  // empty: no buffer to copy to
        }
        return ps;
    } catch (const nlohmann::json::exception &e) {
        fail("{}: predictor header is malformed ({})", path, e.what());
    }
}

} // namespace prescope::nn

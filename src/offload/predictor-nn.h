// Small neural-network pieces for the LLaPor predictors: dense layers over OpenBLAS, GELU, LSTM gates,
// softmax cross-entropy against k-hot targets, named parameters with Adam, and the predictor file format.
// Own code rather than a library: docs/decisions/0050-predictor-nn-library.md says why.
#pragma once

#include <nlohmann/json.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

namespace prescope::nn {

/// y[n][out] = x[n][in] . W^T + b, W: [out][in] row-major, b: [out] or null. accumulate: y += instead of =.
void linear(const float *x, int64_t n, int64_t in, const float *w, const float *b, int64_t out, float *y,
            bool accumulate = false);
/// Backward of linear for dy[n][out]: dw[out][in] += dy^T . x; db[out] += sum over n of dy (when db is not
/// null); dx[n][in] = dy . W (or += with accumulate_dx; skipped when dx is null).
void linear_backward(const float *x, const float *dy, int64_t n, int64_t in, const float *w, int64_t out, float *dw,
                     float *db, float *dx, bool accumulate_dx = false);

/// GELU, the erf form (PyTorch nn.GELU default): x * Phi(x), and its derivative Phi(x) + x * phi(x).
inline float gelu(float x) { return 0.5f * x * (1.0f + std::erf(x * 0.70710678f)); }
inline float gelu_grad(float x) {
    return 0.5f * (1.0f + std::erf(x * 0.70710678f)) + x * 0.39894228f * std::exp(-0.5f * x * x);
}
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

/// Softmax cross-entropy of logits[n_experts] against the k-hot target `ids` (each of the k ids weighs 1/k):
/// returns -sum_e t_e log softmax(z)_e; dlogits = scale * (softmax(z) - t) when not null.
float softmax_xent_khot(const float *logits, int32_t n_experts, const uint8_t *ids, int32_t k, float scale,
                        float *dlogits);

/// Softmax cross-entropy of each target against the non-targets only: for each of the k ids t,
/// -log(exp(z_t) / (exp(z_t) + sum over non-targets n of exp(z_n))), averaged over the k ids. Unlike
/// softmax_xent_khot it does not ask the targets to share the probability equally, only to rank above every
/// non-target, which is what recall@k measures (docs/decisions/0054). ids must be distinct, n_experts <= 256.
/// dlogits = scale * gradient when not null (it may alias logits).
float softmax_xent_negatives(const float *logits, int32_t n_experts, const uint8_t *ids, int32_t k, float scale,
                             float *dlogits);

/// A named tensor with its gradient and Adam moments (moments allocated on the first Adam step).
struct Param {
    std::string name;
    std::vector<int64_t> shape;
    std::vector<float> value, grad, m, v;
    int64_t size() const { return int64_t(value.size()); }
};

/// The parameters of one predictor, in a fixed order (the order of the file).
class ParamSet {
  public:
    /// Adds a parameter initialised uniformly in [-scale, scale] (xorshift stream from `seed`), or to
    /// `fill` when scale == 0. Returns its index; pointers stay valid until the next add().
    /// Throws prescope::Error when the shape overflows or the set would exceed limit_values().
    size_t add(const std::string &name, std::vector<int64_t> shape, float scale, uint64_t seed, float fill = 0.0f);
    /// At most max_values values in all (max_values < 0: no limit). A network built to check a loaded file
    /// sets the file's count first, so a config asking for far more than the file holds fails before it
    /// allocates.
    void limit_values(int64_t max_values) { limit_ = max_values; }
    Param &operator[](size_t i) { return params_[i]; }
    const Param &operator[](size_t i) const { return params_[i]; }
    /// The parameter called `name`; throws prescope::Error naming it when absent.
    Param &get(const std::string &name);
    const Param &get(const std::string &name) const;
    size_t size() const { return params_.size(); }
    int64_t n_values() const;
    void zero_grad();
    /// Scales all gradients so that their global L2 norm is at most max_norm; returns the norm before.
    double clip_grad_norm(double max_norm);

  private:
    std::vector<Param> params_;
    int64_t limit_ = -1;
};

/// Adam (Kingma & Ba 2015) with decoupled weight decay (AdamW, Loshchilov & Hutter 2019).
struct Adam {
    float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
    int64_t t = 0;
    /// One update of the parameters with indices [first, last) of `ps` (all when last == 0).
    void step(ParamSet &ps, size_t first = 0, size_t last = 0);
};

/// Predictor file: magic "PSPRED01", uint32 LE header length, JSON header {"format_version": 1, "config": ...,
/// "tensors": [{"name", "shape", "offset"}]}, then the F32 LE values of each tensor at its byte offset.
/// Written under a temporary name and renamed when complete; throws prescope::Error naming the file and the
/// tensor, writing nothing, when a value is NaN or infinite.
void save_params(const std::string &path, const nlohmann::json &config, const ParamSet &ps);
/// Reads a predictor file written by save_params; validates magic, version, shapes and offsets against the
/// file size, and that every value is finite. Throws prescope::Error naming the file (and the tensor).
ParamSet load_params(const std::string &path, nlohmann::json *config);

} // namespace prescope::nn

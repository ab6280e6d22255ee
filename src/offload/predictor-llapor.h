// LLaPor, the learned expert predictors of PreScope (arXiv 2509.23638), group-aware (input / middle / output
// layer groups, each with its own weights): LLaPor-LSTM reads the gating history, LLaPor-MLP the PCA-compressed
// router input, LLaPor-MLP-prior adds the later layers' routers as a prior. Networks, inference
// (ScoringPredictor) and file I/O; training is in predictor-train.h.
#pragma once

#include "offload/predictor-nn.h"
#include "offload/predictor.h"

#include <nlohmann/json.hpp>

#include <memory>
#include <string>
#include <vector>

namespace prescope {

/// Hyper-parameters of a LLaPor predictor; stored in its file.
struct LlaporConfig {
    std::string kind;                   // "llapor-lstm", "llapor-mlp" or "llapor-mlp-prior"
    PredictorShape shape;
    int32_t window = 3;                 // predicts layers l+1 .. l+window
    std::vector<int32_t> group_start;   // first layer of each group, ascending, [0] = 0; 1 group or 3 (in/mid/out)
    int32_t hidden = 64;                // LSTM state size; MLP width
    int64_t dim = 0;                    // MLP: router input size (n_embd)
    int32_t pca_dim = 0;                // MLP: principal components kept per layer
    float dropout = 0.1f;               // MLP: dropout after each GELU while training
    std::string drift = "none";         // MLP-prior: what the router-input drift reads: none, current, previous
    bool correction = true;             // MLP-prior: an MLP correction is added to the prior (false: prior alone)
    nlohmann::json notes;               // evidence recorded at training (group measurement, losses)

    int32_t n_groups() const { return int32_t(group_start.size()); }
    int32_t group_of(int32_t layer) const;
    bool has_prior() const { return kind == "llapor-mlp-prior"; }
    /// The MLP trunk and read-out exist (llapor-mlp, or llapor-mlp-prior with its correction).
    bool has_mlp() const { return kind == "llapor-mlp" || (has_prior() && correction); }
    /// MLP-prior: inputs of the drift map with the previous token: [x_l, prev x_{l+d}, prev x_l, 1].
    int64_t drift_prev_inputs() const { return 3 * dim + 1; }
    /// MLP: the group gets the deeper form with the gated residual block (the middle group, or the only one).
    bool deep(int32_t group) const { return n_groups() == 1 || group == 1; }
    /// LSTM: sparse input features per (token, layer): the layer's k experts, the previous token's experts at
    /// layers l+1..l+window, and the layer's one-hot.
    int64_t lstm_inputs() const { return int64_t(shape.n_experts) * (1 + window) + shape.n_layers; }
    /// LSTM: rows of the skip map: the layer's experts per layer, then the previous token's and the one-hot.
    int64_t skip_inputs() const { return lstm_inputs() + int64_t(shape.n_layers - 1) * shape.n_experts; }
    nlohmann::json to_json() const;
    /// Throws prescope::Error (naming `what`) on missing or inconsistent fields.
    static LlaporConfig from_json(const nlohmann::json &j, const std::string &what);
};

/// LLaPor-LSTM: for each token, an LSTM steps through the layers; at layer l it reads the sparse features
/// above, and its state h_l plus a sparse linear skip from the same features give logits for the experts of
/// layers l+1..l+window. Group g's cell and head weights serve the layers of group g; the skip has per-layer rows
/// for the layer's own experts (first-order co-occurrence differs per layer). Parameters per group:
/// g{g}.wx [n_in][4H] (gate order i, f, g, o), g{g}.wh [4H][H], g{g}.b [4H], g{g}.wo [wE][H], g{g}.bo [wE];
/// then ws [skip_inputs()][wE].
class LlaporLstmNet {
  public:
    LlaporLstmNet(LlaporConfig cfg, uint64_t seed, int64_t max_values = -1);  // random initialisation
    LlaporLstmNet(LlaporConfig cfg, nn::ParamSet params); // loaded (shapes checked)
    const LlaporConfig &config() const { return cfg_; }
    nn::ParamSet &params() { return ps_; }
    const nn::ParamSet &params() const { return ps_; }
    int32_t max_features() const { return shape().top_k * (1 + cfg_.window) + 1; }
    /// Feature indices of one token at `layer` into idx (size >= max_features()); returns their count.
    /// cur: the token's top_k experts at `layer`; prev: [n_layers][top_k] experts of the previous token, or null.
    int32_t features(int32_t layer, const int32_t *cur, const int32_t *prev, int32_t *idx) const;
    /// One layer for n tokens. idx: [n][max_features()] with nnz[n] used; h_prev, c_prev: [n][H];
    /// gates out: [n][4H] activated (i, f, g, o); c, h out: [n][H]; logits out: [n][window * n_experts].
    void forward_step(int32_t layer, int64_t n, const int32_t *idx, const int32_t *nnz, const float *h_prev,
                      const float *c_prev, float *gates, float *c, float *h, float *logits) const;
    /// Backward of forward_step: accumulates parameter gradients; dh, dc: [n][H] in = gradient w.r.t. h and c
    /// from later layers, out (overwritten) = gradient w.r.t. h_prev and c_prev. scratch: >= n * (4H + H) floats.
    void backward_step(int32_t layer, int64_t n, const int32_t *idx, const int32_t *nnz, const float *h_prev,
                       const float *c_prev, const float *gates, const float *c, const float *h, const float *dlogits,
                       float *dh, float *dc, float *scratch);

  private:
    const PredictorShape &shape() const { return cfg_.shape; }
    void bind();
    // Row of the skip map for feature j (index idx) of a token at `layer`.
    int32_t skip_row(int32_t layer, int32_t j, int32_t idx) const;
    LlaporConfig cfg_;
    nn::ParamSet ps_;
    struct Group { size_t wx, wh, b, wo, bo; };
    std::vector<Group> g_;
    size_t ws_ = 0;
};

/// LLaPor-MLP: the router input x of layer l is centred and projected on the layer's leading principal
/// components (whitened), then Linear-GELU(-Dropout) blocks: one block for the input and output groups; for the
/// middle group one block and a gated residual block u + sigmoid(Wg u) * W3 GELU(W2 u); then a linear head to
/// the logits of layers l+1..l+window (plus a per-layer bias). Parameters: pca.mean [L][D], pca.proj [L][p][D]
/// (not trained), then per group g{g}.w1 [H][p], g{g}.b1 [H], g{g}.wl [L][H] (layer embedding), and for deep
/// groups g{g}.w2, w3, wg [H][H] with b2, b3, bg [H]; g{g}.wo [L][wE][H] (a read-out per layer, as each layer has
/// its own routers; the paper has one predictor per MoE block), g{g}.bo [wE], g{g}.bl [L][wE].
///
/// LLaPor-MLP-prior (docs/decisions/0054): logits of layer l+d = ps[l][d] * prior + (the MLP above, when
/// config().correction), where prior = R_{l+d} (x + A_{l,d} f) is layer l+d's router R applied to the current
/// router input moved by a linear drift map A (Fate, arXiv 2502.12224, is A = 0). f = [x, 1] (drift "current",
/// and "previous" when no previous token is known) or [x, prev x_{l+d}, prev x_l, 1] (drift "previous": the
/// previous token's router inputs at layers l+d and l). The pieces without the MLP tensors are: per group
/// g{g}.ps [L][window] (prior scale, trained; after the group's MLP tensors), then prior.router [L][E][D],
/// prior.drift0 [L][window][D][D+1] and, for drift "previous", prior.drift [L][window][D][3D+1] (fitted by ridge
/// regression at training, not trained), and prior.calib [L][window] (fitted after training: the factor that
/// turns the logits into calibrated scores, see calibrate()). The read-out g{g}.wo starts at zero, so training
/// starts at the prior.
class LlaporMlpNet {
  public:
    LlaporMlpNet(LlaporConfig cfg, uint64_t seed, int64_t max_values = -1);  // random initialisation
    LlaporMlpNet(LlaporConfig cfg, nn::ParamSet params);
    const LlaporConfig &config() const { return cfg_; }
    nn::ParamSet &params() { return ps_; }
    const nn::ParamSet &params() const { return ps_; }
    /// Index range [first, last) of group g's trainable parameters in params().
    std::pair<size_t, size_t> group_params(int32_t g) const;
    /// Activations of one batch (sized by forward()).
    struct Tape {
        std::vector<float> xc, z;                      // [n][D] centred input, [n][p] projected
        std::vector<float> a1, u1, a2, v, s, r, u;     // [n][H] each
        std::vector<uint8_t> mask1;                    // [n][H] dropout keep mask (training)
        std::vector<float> prior;                      // [n][wE] the prior's logits (MLP-prior)
    };
    /// n rows of layer `layer`: x [n][D] -> logits [n][window * n_experts]. drop_seed != 0: dropout (training).
    /// MLP-prior: prior [n][window * n_experts] from prior_logits() (required), else ignored.
    void forward(int32_t layer, int64_t n, const float *x, float *logits, Tape &tape, uint64_t drop_seed = 0,
                 const float *prior = nullptr) const;
    void backward(int32_t layer, int64_t n, const Tape &tape, const float *dlogits, std::vector<float> &scratch);
    /// MLP-prior: the prior's logits of n rows of `layer` into out [n][window * n_experts] (distances past the
    /// last layer: 0). x: [n][D] router inputs; prev: [n][window + 1][D], the previous token's router inputs at
    /// layers layer, layer+1 .. layer+window (rows past the last layer unread), or null when it is not known.
    /// scratch grows as needed.
    void prior_logits(int32_t layer, int64_t n, const float *x, const float *prev, float *out,
                      std::vector<float> &scratch) const;
    /// MLP-prior: multiplies the logits [n][window * n_experts] of `layer` by prior.calib, so that their softmax
    /// is a calibrated probability (the training loss favours very large logits, whose softmax underflows to 0
    /// for most experts); the order within a row is unchanged. Other kinds: no-op.
    void calibrate(int32_t layer, int64_t n, float *logits) const;

  private:
    void bind();
    void forward_mlp(int32_t layer, int64_t n, const float *x, float *logits, Tape &tape, uint64_t drop_seed) const;
    LlaporConfig cfg_;
    nn::ParamSet ps_;
    static constexpr size_t NONE = size_t(-1);
    size_t mean_ = NONE, proj_ = NONE, router_ = NONE, drift0_ = NONE, drift_ = NONE, calib_ = NONE;
    struct Group { size_t w1, b1, wl, w2, b2, w3, b3, wg, bg, wo, bo, bl, ps, first, last; };
    std::vector<Group> g_;
};

/// `--predictor FILE` with an LLaPor-LSTM file: keeps each token's LSTM state through the layers of a step and
/// the previous step's routing of its last token (decode order; docs/predictors.md).
class LlaporLstmPredictor final : public ScoringPredictor {
  public:
    LlaporLstmPredictor(std::shared_ptr<const LlaporLstmNet> net, int32_t max_tokens = 1);
    const char *name() const override { return "llapor-lstm"; }
    void score(const PredictorInput &in, std::span<float> scores) override;
    void reset() override;

  private:
    std::shared_ptr<const LlaporLstmNet> net_;
    int32_t max_tokens_;
    std::vector<float> h_, c_, gates_, logits_;  // [max_tokens][...]
    std::vector<int32_t> cur_, idx_, nnz_, prev_;
    bool has_prev_ = false;
};

/// `--predictor FILE` with an LLaPor-MLP or LLaPor-MLP-prior file; needs the router input
/// (PredictorInput::hidden). MLP-prior keeps the router inputs of the previous step's last token at every layer
/// it was called for, and uses them (drift "previous") when a step carries one token (decode) and the previous
/// step's inputs at this layer and the predicted ones are known; otherwise (prefill, a sequence's first token) it
/// uses the drift map without them. A call for a layer not after the previous call's starts a new step.
class LlaporMlpPredictor final : public ScoringPredictor {
  public:
    LlaporMlpPredictor(std::shared_ptr<const LlaporMlpNet> net, int32_t max_tokens = 1);
    const char *name() const override { return net_->config().kind.c_str(); }
    bool needs_hidden() const override { return true; }
    void score(const PredictorInput &in, std::span<float> scores) override;
    void reset() override { has_prev_ = false, last_layer_ = -1; }

  private:
    std::shared_ptr<const LlaporMlpNet> net_;
    int32_t max_tokens_;
    LlaporMlpNet::Tape tape_;
    std::vector<float> logits_, prior_, scratch_;
    std::vector<float> prev_x_, cur_x_, prev_rows_;  // [L][D] previous / this step's last token; [window+1][D]
    std::vector<uint8_t> prev_seen_, cur_seen_;      // [L] whether prev_x_ / cur_x_ holds the layer
    bool has_prev_ = false;
    int32_t last_layer_ = -1;                        // layer of the previous score() call in this sequence
};

/// Writes softmax(logits[window][E]) of valid distances into scores (layout of ScoringPredictor::score).
void logits_to_scores(const float *logits, int32_t layer, int32_t n_layers, int32_t window, int32_t n_experts,
                      int32_t n_tokens, int32_t token, int32_t window_asked, std::span<float> scores);

/// Saves an LSTM or MLP predictor file (nn::save_params with the config).
void save_llapor(const std::string &path, const LlaporConfig &cfg, const nn::ParamSet &ps);
/// Loads a predictor file and builds its predictor for up to max_tokens tokens per call. Throws
/// prescope::Error naming the file when it is not a LLaPor file or its tensors do not match its config.
std::unique_ptr<ScoringPredictor> load_llapor(const std::string &path, int32_t max_tokens = 1,
                                              LlaporConfig *cfg_out = nullptr);

} // namespace prescope

// Training of the LLaPor predictors on a routing trace (and its hidden-state sidecar for LLaPor-MLP), and the
// measurement that chooses the input / middle / output layer groups. Runs on the CPU (docs/predictors.md).
#pragma once

#include "offload/predictor-llapor.h"
#include "offload/trace.h"

#include <functional>
#include <string>
#include <vector>

namespace prescope {

/// Per-layer routing statistics of a trace and the layer groups they give (docs/predictors.md, "Groups").
struct GroupMeasurement {
    std::vector<double> entropy;     // [n_layers] popularity entropy / log(n_experts)
    std::vector<double> reuse;       // [n_layers] share of a token's experts the previous token also used
    std::vector<double> cooccur;     // [n_layers] recall@k of layer l-1 -> l co-occurrence counts (l=0: layer 1's)
    std::vector<int32_t> group_start;  // chosen first layer of each group
    double cost = 0;                 // within-group sum of squares of the standardised statistics
    nlohmann::json to_json() const;
};

/// Measures the statistics on at most max_tokens tokens of `t` and splits the layers into n_groups contiguous
/// groups of at least max(2, n_layers / 10) layers (fewer layers: as even as possible) that minimise the
/// within-group sum of squares of the standardised statistics (exact, by dynamic programming).
GroupMeasurement measure_groups(const RoutingTrace &t, int32_t n_groups = 3, int64_t max_tokens = 20000);

/// Parses --groups: "auto" (measure_groups), "1" (one group for all layers), or "A,B" (first layers of the
/// middle and output groups). Throws prescope::Error on a malformed list or bounds outside (0, n_layers).
std::vector<int32_t> parse_groups(const std::string &spec, const RoutingTrace &t, GroupMeasurement *measured);

struct TrainOptions {
    std::string kind = "llapor-lstm";  // or "llapor-mlp", "llapor-mlp-prior"
    int32_t window = 3;
    std::string groups = "auto";
    int32_t hidden = 0;        // 0: 64 for the LSTM, 128 for the MLP
    int32_t pca_dim = 64;      // MLP: components per layer (at most the hidden-state size)
    int32_t epochs = 4;
    int32_t batch = 256;       // tokens (LSTM) or rows of one layer (MLP) per step
    float lr = 2e-3f;
    float weight_decay = 1e-4f;
    float dropout = 0.1f;
    int64_t max_tokens = 0;    // use at most this many training tokens (0: all)
    int64_t val_every = 10;    // every val_every-th training sequence is kept aside for model selection
    uint64_t seed = 1;
    // "khot": softmax cross-entropy against the k-hot target; "negatives": each target against the non-targets
    // only (nn::softmax_xent_negatives). Empty: negatives for llapor-mlp-prior, khot otherwise.
    std::string loss;
    // llapor-mlp-prior (docs/decisions/0054):
    std::string drift = "previous";  // what the drift map reads: none (Fate's prior), current, previous
    bool correction = true;          // train the MLP correction; validation may still drop it (prior alone)
    float ridge = 10.0f;             // ridge penalty of the drift fit (on the unscaled router inputs)
    const std::vector<std::vector<float>> *routers = nullptr;  // [n_layers][n_experts * dim], as FatePredictor reads
};

struct TrainResult {
    LlaporConfig config;
    nn::ParamSet params;
    nlohmann::json log;  // per epoch: train loss, validation loss and recall@k at distance 1, seconds
};

/// Trains an LLaPor predictor on `train` (all of its sequences; split held-out data off before). LLaPor-MLP
/// and LLaPor-MLP-prior need `hidden` (the sidecar rows of `train`), the prior also opt.routers. The
/// parameters of the epoch with the lowest validation loss are kept (MLP-prior: the highest validation
/// recall@k averaged over the distances, counting the prior alone as epoch 0; when that wins, the file holds
/// the prior alone). progress, when set, receives one line per epoch. Throws prescope::Error on bad options
/// or data.
TrainResult train_llapor(const RoutingTrace &train, const HiddenTrace *hidden, const TrainOptions &opt,
                         const std::function<void(const std::string &)> &progress = {});

/// Mean softmax cross-entropy of the network over tokens [first, end) of `t` (all distances), for tests and
/// the training log; LSTM only.
double lstm_loss(LlaporLstmNet &net, const RoutingTrace &t, std::span<const int64_t> tokens,
                 std::span<const uint8_t> has_prev, bool accumulate_grad);

} // namespace prescope

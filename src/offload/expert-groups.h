// Expert groups of expert parallelism (issue 16): which GPU holds each expert of each MoE layer, planned from
// routing statistics (co-activated experts on the same GPU, token loads balanced within a tolerance), checked
// for drift against the routing a run sees, saved and loaded as JSON (`prescope expert-groups`, --expert-groups).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace prescope {

struct RoutingTrace;

/// The GPU of every routed expert. Layers are MoE layers numbered from 0, as traces and predictors number them
/// (model layer hp.n_layer_dense + l is layer l). Every GPU holds n_experts / n_gpus experts of each layer (the
/// first n_experts % n_gpus GPUs one more): the same per-GPU expert budget on every GPU.
struct ExpertGroups {
    static constexpr int32_t MAX_GPUS = 8;  // one node; one digit per expert in the JSON form

    int32_t n_gpus = 1;
    int32_t n_layers = 0;
    int32_t n_experts = 0;
    double tolerance = 0.10;   // the largest GPU token load the plan and the drift check accept, as a fraction
                               // above the mean GPU load (0.10: 110% of the mean)
    std::vector<int8_t> gpu;   // [n_layers][n_experts] GPU of each expert, in [0, n_gpus)

    /// Experts in consecutive ranges (GPU g holds the g-th range): the groups without routing statistics.
    /// PRECONDITION: 1 <= n_gpus <= min(MAX_GPUS, n_experts), n_layers >= 1.
    static ExpertGroups contiguous(int32_t n_layers, int32_t n_experts, int32_t n_gpus);

    /// The GPU that holds `expert` of MoE layer `layer` (both 0-based; unchecked).
    int32_t gpu_of(int32_t layer, int32_t expert) const {
        return gpu[size_t(layer) * size_t(n_experts) + size_t(expert)];
    }
    /// MoE layer l's row of `gpu`: [n_experts] GPU of each expert.
    std::span<const int8_t> layer(int32_t l) const {
        return {gpu.data() + size_t(l) * size_t(n_experts), size_t(n_experts)};
    }
    /// Experts each GPU must hold: n_experts / n_gpus, plus one for the first n_experts % n_gpus GPUs.
    int32_t capacity(int32_t g) const { return n_experts / n_gpus + (g < n_experts % n_gpus ? 1 : 0); }

    /// Throws prescope::Error "SOURCE: expert groups for L MoE layers x E experts, the model has ..." unless the
    /// groups fit the model, and "SOURCE: expert groups for N GPUs, --gpus is M" unless n_gpus == gpus.
    void check_shape(int32_t model_moe_layers, int32_t model_experts, int32_t gpus, std::string_view source) const;

    /// {"format": "prescope-expert-groups", "version": 1, "n_gpus", "n_layers", "n_experts", "tolerance", "legend",
    ///  "layers": ["0101...", ...]}: one string of n_experts digits (the GPU) per layer, so groups diff line by line.
    nlohmann::json to_json() const;
    /// Parses to_json()'s form (other keys are ignored); throws prescope::Error naming `source` and the bad field:
    /// a wrong format or version, counts out of range (n_gpus in [1, 8] and <= n_experts), a layer string of the
    /// wrong length, a character that is not a GPU below n_gpus, a GPU holding more or fewer experts than its share.
    static ExpertGroups from_json(const nlohmann::json &j, std::string_view source);
    /// from_json of a file; throws prescope::Error "PATH: ..." when it cannot be read or is not JSON.
    static ExpertGroups load(const std::string &path);
    /// Writes to_json() (2-space indent) under a temporary name, renamed when complete (core/output-file.h).
    void save(const std::string &path) const;
};

/// Routing counts per MoE layer: tokens per expert and tokens per pair of experts (both chosen by one token in
/// one layer). The input of plan_expert_groups and of the drift check. Counts are below 2^32 per entry (the
/// trace format's token count is far below; the runtime halves its window's counts, decay()).
struct RoutingStats {
    int32_t n_layers = 0;
    int32_t n_experts = 0;
    std::vector<uint64_t> tokens;  // [n_layers] tokens counted per layer
    std::vector<uint32_t> load;    // [n_layers][n_experts] tokens that chose each expert
    std::vector<uint32_t> coact;   // [n_layers][n_experts][n_experts] tokens that chose both; symmetric, 0 diagonal

    RoutingStats() = default;
    RoutingStats(int32_t n_layers, int32_t n_experts);
    /// Counts n_tok tokens of one layer: ids [n_tok][k], distinct ids per token in [0, n_experts) (asserted).
    void add(int32_t layer, std::span<const int32_t> ids, int64_t k);
    /// Counts every token of every layer of a trace (its MoE layers, numbered as here).
    static RoutingStats of_trace(const RoutingTrace &t);
    /// Halves every count of `layer` (rounding down): the runtime's window keeps its recent routing.
    void decay(int32_t layer);

    /// Tokens of `layer` that chose both experts a and b (symmetric; 0 when a == b), from `coact`.
    uint32_t coact_at(int32_t layer, int32_t a, int32_t b) const {
        return coact[(size_t(layer) * size_t(n_experts) + size_t(a)) * size_t(n_experts) + size_t(b)];
    }
};

/// How well one layer's groups fit its routing.
struct GroupBalance {
    double imbalance = 1.0;   // largest GPU token load / mean GPU token load (1 = even; 1 without tokens)
    double co_located = 0.0;  // share of co-activated expert pairs (by tokens) whose experts share a GPU
};

/// The balance of layer `layer` of `groups` under the counts of `stats` (same shape, asserted).
GroupBalance group_balance(const ExpertGroups &groups, const RoutingStats &stats, int32_t layer);

/// Expert groups for n_gpus GPUs from routing statistics, each layer on its own: every GPU holds its share of
/// experts (ExpertGroups::capacity); experts are placed by token load, heaviest first, each on the GPU whose
/// experts it was co-activated with most among those whose load stays within (1 + tolerance) x the mean (the
/// least loaded GPU with room when none does); then pairs of experts on different GPUs are swapped while a swap
/// raises the co-activation within GPUs and keeps both GPUs within the bound (or lowers the larger of their loads).
/// Co-activation within a GPU is what spares a token's hidden state a trip to one more GPU (each token is sent
/// once to every GPU holding one of its experts). Deterministic. Throws prescope::Error unless 1 <= n_gpus <=
/// min(8, n_experts) and tolerance is in [0, 10].
ExpertGroups plan_expert_groups(const RoutingStats &stats, int32_t n_gpus, double tolerance);
/// The same for one layer, into groups' row `layer` (groups.n_gpus, tolerance and shape as stats'; asserted).
void plan_layer_groups(const RoutingStats &stats, int32_t layer, ExpertGroups &groups);

/// Dispatch cost of groups on a trace: per layer, the mean number of GPUs a token's hidden state is sent to
/// (distinct GPUs among its top-k experts; 1 means every token's experts share one GPU, top_k the worst).
/// The trace must have groups' shape (throws prescope::Error naming `source` otherwise).
std::vector<double> gpus_per_token(const ExpertGroups &groups, const RoutingTrace &t, std::string_view source);

} // namespace prescope

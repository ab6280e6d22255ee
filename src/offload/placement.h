// Placement as data (docs/style R6): per layer and expert, where its bytes live and where it runs; and the
// per-layer hybrid decision (HIT / FETCH / CPU for each routed expert) that the runtime consumes.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace prescope {

class ExpertCache;

/// Where an expert's bytes live between uses. One character each in the JSON form.
enum class HomeTier : uint8_t {
    GPU,     // 'G': a fixed GPU slot for the whole run (never evicted)
    PINNED,  // 'P': pinned (or registered) host memory; fetched into the hot-expert table when needed
    MMAP,    // 'M': the model file's pageable mapping; read by the CPU, fetched at pageable speed
};

/// Where an expert runs when it is not already in a GPU slot. One character each in the JSON form.
enum class ExecSite : uint8_t {
    GPU,   // 'G': always on the GPU (fetched on a miss)
    CPU,   // 'C': always on the CPU from host memory (never fetched)
    AUTO,  // 'A': per step, by the hybrid rule (decide_layer)
};

struct ExpertPlacement {
    HomeTier home = HomeTier::PINNED;
    ExecSite exec = ExecSite::AUTO;
    bool operator==(const ExpertPlacement &) const = default;
};

/// The placement of every routed expert. CLI flags, planners and the scheduler produce or edit a plan; the
/// runtime only reads it. Printable (summary()), saved and loaded as JSON (--placement plan.json). One row per
/// model layer: the row of a leading dense layer (no experts) is ignored.
struct PlacementPlan {
    int32_t n_layers = 0;
    int32_t n_experts = 0;                // per layer
    std::vector<ExpertPlacement> experts; // [n_layers * n_experts], layer-major

    /// Every expert the same.
    static PlacementPlan uniform(int32_t n_layers, int32_t n_experts, ExpertPlacement p = {});
    /// llama.cpp's `--n-cpu-moe N` (common/arg.cpp): experts of the first N layers stay in the mapped file
    /// and run on the CPU; the others live and run on the GPU.
    static PlacementPlan cpu_layers(int32_t n_layers, int32_t n_experts, int32_t n_cpu_layers);

    ExpertPlacement &at(int32_t layer, int32_t expert) { return experts[index(layer, expert)]; }
    const ExpertPlacement &at(int32_t layer, int32_t expert) const { return experts[index(layer, expert)]; }

    /// Throws prescope::Error unless the plan is for n_layers x n_experts (`source` names the plan).
    void check_shape(int32_t model_layers, int32_t model_experts, std::string_view source) const;
    /// Counts per layer, runs of identical layers merged ("layers 0-17: home G 0 P 128 M 0, exec ...").
    std::string summary() const;

    /// {"format": "prescope-placement", "version": 1, "n_layers", "n_experts", "legend",
    ///  "layers": [{"home": "PPGP...", "exec": "AACA..."}, ...]}: one string of n_experts characters per
    /// layer and field, so plans diff line by line.
    nlohmann::json to_json() const;
    /// Parses to_json()'s form; throws prescope::Error naming `source` and the bad field.
    static PlacementPlan from_json(const nlohmann::json &j, std::string_view source);
    static PlacementPlan load(const std::string &path);
    void save(const std::string &path) const;

  private:
    size_t index(int32_t layer, int32_t expert) const {
        return size_t(layer) * size_t(n_experts) + size_t(expert);
    }
};

// --- hybrid decision ----------------------------------------------------------------------------------------

enum class ExpertAction : uint8_t {
    HIT,    // resident in a GPU slot: run on the GPU
    FETCH,  // load on demand into a slot, then run on the GPU
    CPU,    // run on the CPU from host memory, beside the GPU's work
    STREAM, // no slot free in this step: loaded into a slot that an earlier wave of the same layer frees,
            // then run on the GPU (large batches: PCIe outruns the CPU on the layer's remaining experts)
};
const char *expert_action_name(ExpertAction a);

/// One routed expert of the running layer.
struct RoutedExpert {
    int32_t expert = 0;
    int32_t n_tokens = 0;  // tokens of the batch routed to it (top-k picks)
    ExpertAction action = ExpertAction::CPU;
    int32_t slot = -1;     // GPU slot once acquired (ExpertLoader::begin_layer), else -1
};

/// What the runtime does with each routed expert of one layer in one step: filled by the scheduler
/// (offload/scheduler.h, the default) or by decide_layer() (--cpu-threshold). Sized once by reserve(); no
/// allocation per step.
struct LayerDecision {
    int32_t layer = -1;
    std::vector<RoutedExpert> experts;    // unique routed experts, ascending id
    std::vector<int32_t> tokens;          // [n_experts] scratch: tokens routed to each expert
    std::vector<int32_t> order;           // [n_experts] scratch: fetch candidates by priority
    int32_t n_hit = 0, n_fetch = 0, n_cpu = 0, n_stream = 0;
    int32_t n_demoted = 0;                // AUTO experts sent to the CPU because the layer had no free slot

    void reserve(int32_t n_experts);
    /// "layer 3: hit 5 [1 4 ...] fetch 2 [3:20 ...] cpu 1 [9:1]" (expert:tokens; "stream N [...]" before
    /// "cpu" when there are STREAM entries).
    std::string describe() const;
};

/// The rule of issue 4, now the manual override `--cpu-threshold N`: an expert not resident runs on the CPU when
/// fewer than cpu_threshold tokens were routed to it, else it is fetched. 0 = never on the CPU.
/// In batches of at least stream_min_batch tokens (prefill), fetches that find no free slot are streamed
/// through the layer's slots in waves instead of running on the CPU (docs/decisions/0036); 0 = never.
struct HybridRule {
    int32_t cpu_threshold = 0;
    int32_t stream_min_batch = 32;
};

/// Counts the tokens routed to each expert (out.tokens) and lists the routed experts in ascending id with their
/// token counts (out.experts, action CPU, no slot); counters zero. routed: [n_tokens * top_k] ids in
/// [0, n_experts). PRECONDITION: out.reserve(n_experts) was called.
void count_routed(int32_t layer, std::span<const int32_t> routed, int32_t n_experts, LayerDecision &out);

/// Fills `out` for one layer. routed: [n_tokens * top_k] expert ids from the router's top-k (any order).
/// cache: the hot-expert table (read only), or null when there is no GPU cache (everything runs on CPU).
/// Rules, in order: exec CPU -> CPU; resident -> HIT; exec GPU -> FETCH; exec AUTO -> FETCH if n_tokens >=
/// cpu_threshold, else CPU. Fetches beyond the layer's free capacity (slots - fixed - non-fixed hits) become
/// STREAM when the batch (routed.size() / top_k) has at least stream_min_batch tokens, else go to the CPU,
/// AUTO ones with the fewest tokens first (counted in n_demoted); exec GPU ones are never demoted, so too
/// many of them make ExpertLoader::begin_layer fail loudly.
/// PRECONDITION: out.reserve(plan.n_experts) was called; ids are in [0, n_experts).
void decide_layer(int32_t layer, std::span<const int32_t> routed, const PlacementPlan &plan,
                  const ExpertCache *cache, const HybridRule &rule, LayerDecision &out);

} // namespace prescope

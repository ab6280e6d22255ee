// The offloading runtime's settings in one struct (docs/style R14): defaults here, a YAML config file
// (--config FILE) and command-line flags on top, in that order, through the same key = value setter.
#pragma once

#include "offload/copy-engine.h"
#include "offload/eviction-policy.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace prescope {

struct OffloadConfig {
    bool gpu = false;                  // run on the GPU (set by gpu_cache / --gpu-expert-budget)
    uint64_t gpu_cache_bytes = 0;      // gpu_cache: GPU memory for expert slots; 0 = every expert on the CPU
    EvictionPolicyKind cache_policy = EvictionPolicyKind::LRU;  // cache_policy: lru | lfu | arc
    int32_t cpu_threshold = 0;         // a missed expert runs on the CPU when fewer tokens chose it (0 = never)
    int32_t stream_min_batch = 32;     // batches this large stream what finds no slot through the slots in
                                       // waves instead of the CPU (0 = never; placement.h HybridRule)
    int32_t prefetch_window = 1;       // layers ahead the predictor prefetches for (0 = no prefetch)
    int32_t prefetch_max_per_layer = 0;  // new prefetch loads per predicted layer and step (0 = top_k)
    int64_t predict_max_tokens = 4;    // tokens of a batch the predictor sees (the last ones)
    std::string predictor = "fate";    // none | frequency | recency | fate | oracle | a LLaPor predictor file
    std::string placement;             // placement plan JSON (offload/placement.h); empty = all AUTO, pinned
    std::string routing_trace;         // .pstrace: replay its routing instead of the router's (benchmarks)
    int32_t gpu_device = 0;            // CUDA device index
    CopyEngineConfig copy;             // copy_chunk, copy_queue_depth, copy_bandwidth_cap

    /// The keys set() accepts, in the order describe() prints them.
    static const std::vector<std::string> &keys();
    /// Sets one key from its text form (sizes as parse_byte_size reads them; bandwidth as a size per
    /// second, e.g. "20GB"). Throws prescope::Error "SOURCE: KEY: what was expected" on a bad key or value.
    void set(std::string_view key, std::string_view value, std::string_view source);
    /// Applies every key of a YAML mapping file (scalars only). Throws prescope::Error naming the file and
    /// the key on unknown keys, bad values or unreadable YAML.
    void load_yaml(const std::string &path);
    /// The value of a key in set()'s text form.
    std::string get(std::string_view key) const;
    /// "key: value" lines, every key (the resolved config printed at start-up).
    std::string describe() const;
    nlohmann::json to_json() const;
};

} // namespace prescope

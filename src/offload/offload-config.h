// The offloading runtime's settings in one struct (docs/style R14): defaults here, a YAML config file
// (--config FILE) and command-line flags on top, in that order, through the same key = value setter.
#pragma once

#include "offload/copy-engine.h"
#include "offload/eviction-policy.h"
#include "offload/load-balancer.h"

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace prescope {

struct OffloadConfig {
    bool gpu = false;                  // run on the GPU (set by gpu_cache / --gpu-expert-budget)
    uint64_t gpu_cache_bytes = 0;      // gpu_cache: GPU memory for expert slots; 0 = every expert on the CPU
    EvictionPolicyKind cache_policy = EvictionPolicyKind::LRU;  // cache_policy: lru | lfu | arc
    int32_t cpu_threshold = -1;        // -1 ("auto"): the cost-model scheduler decides; >= 0: the manual override,
                                       // a missed expert runs on the CPU when fewer tokens chose it (0 = never)
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
    std::string cost_profile;          // cost profile JSON (prescope calibrate); empty = the built-in H200 reference
                                       // for the GPU and link terms, the CPU terms measured at start-up
    LoadBalance load_balance = LoadBalance::LINK;  // which cost-model terms are corrected online from measured
                                       // times: off | link (the copy engine's speed; 0146) | on (and CPU, GPU: 0087)
    bool link_price = true;            // prefetches and installs pay for their link time, priced by the link's busy
                                       // share (0147); learned unless load_balance is off
    int32_t prefetch_in_flight = 8;    // prefetch requests outstanding at most (cost rule)
    std::string numa = "gpu";          // gpu | distribute | isolate | numactl (runtime/numa.h)
    std::string dump_layer_states;     // write every layer's scheduler state here (JSON lines; schedule-check)
    bool device_hits = true;           // the device runs the resident experts before the host reads the routing
                                       // (decode-sized batches; runtime/hybrid-moe.h launch_device, issue 14)
    bool device_steps = true;          // with device_hits: a layer whose every expert is resident runs whole on the
                                       // device, the host reading its routing later (HybridMoe::launch_device, 0138)
    bool cuda_graphs = true;           // a decode pass whose every layer runs whole on the device from fixed slots is
                                       // captured once as a CUDA graph and replayed (HybridMoe::device_resident, 0142)
    int32_t gpus = 1;                  // GPUs of expert parallelism, each holding one group of experts (issue 16);
                                       // > 1 runs on the CPU engine only (the GPU runtime refuses it: make_engine)
    std::string expert_groups;         // expert groups JSON (offload/expert-groups.h, `prescope expert-groups`); empty:
                                       // consecutive ranges of experts, re-planned from the routing as it drifts

    /// Keys set through set() (file or flags), in order, with where they came from.
    std::vector<std::pair<std::string, std::string>> given;

    /// The keys set() accepts, in the order describe() prints them.
    static const std::vector<std::string> &keys();
    /// Sets one key from its text form (sizes as parse_byte_size reads them; bandwidth as a size per
    /// second, e.g. "20GB"). Throws prescope::Error "SOURCE: KEY: what was expected" on a bad key or value.
    void set(std::string_view key, std::string_view value, std::string_view source);
    /// Applies every key of a YAML mapping file: flat `key: value` lines, or keys grouped under a section
    /// (`optimization: {prefetch_window: 3, cpu_threshold: 16, gpu_cache: 12GB}`, the seed's form; the section
    /// name is free). Throws prescope::Error naming the file and the key on unknown keys, bad values, nesting
    /// deeper than one section, or unreadable YAML.
    void load_yaml(const std::string &path);
    /// Why a key that was set has no effect in this configuration ("" if it has one): no GPU, no GPU cache,
    /// no predictor, the threshold rule... One line per given key without effect: "SOURCE: KEY has no effect: WHY".
    std::string no_effect(std::string_view key) const;
    std::vector<std::string> no_effect_warnings() const;
    /// The value of a key in set()'s text form.
    std::string get(std::string_view key) const;
    /// "key: value" lines, every key (the resolved config printed at start-up).
    std::string describe() const;
    nlohmann::json to_json() const;
};

} // namespace prescope

// OffloadConfig: key = value setter shared by the YAML config file and the command-line flags.
#include "offload/offload-config.h"

#include "core/error.h"
#include "offload/byte-size.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>

namespace prescope {

namespace {

int64_t parse_int(std::string_view value, int64_t lo, int64_t hi, std::string_view source, std::string_view key) {
    int64_t v = 0;
    const char *end = value.data() + value.size();
    const auto r = std::from_chars(value.data(), end, v);
    if (r.ec != std::errc() || r.ptr != end || v < lo || v > hi) {
        fail("{}: {}: expected an integer in [{}, {}], got '{}'", source, key, lo, hi, value);
    }
    return v;
}

} // namespace

const std::vector<std::string> &OffloadConfig::keys() {
    static const std::vector<std::string> k = {
        "gpu_cache",          "cache_policy",     "cpu_threshold",      "stream_min_batch",  "prefetch_window",
        "prefetch_max_per_layer", "prefetch_in_flight", "predict_max_tokens", "predictor",  "placement",
        "routing_trace",      "gpu_device",       "copy_chunk",         "copy_queue_depth",  "copy_bandwidth_cap",
        "cost_profile",       "load_balance",     "link_price",         "numa",              "dump_layer_states",
        "device_hits",        "device_steps",     "cuda_graphs",        "gpus",              "expert_groups"};
    return k;
}

void OffloadConfig::set(std::string_view key, std::string_view value, std::string_view source) {
    const std::string where = fmt::format("{}: {}", source, key);
    if (std::find(keys().begin(), keys().end(), key) != keys().end()) given.emplace_back(key, source);
    if (key == "gpu_cache") {
        gpu_cache_bytes = parse_byte_size(value, where);
        gpu = true;
    } else if (key == "cache_policy") {
        try {
            cache_policy = parse_eviction_policy(value);
        } catch (const Error &e) {
            fail("{}: {}", where, e.what());
        }
    } else if (key == "cpu_threshold") {
        cpu_threshold = value == "auto" ? -1 : int32_t(parse_int(value, 0, 1 << 30, source, key));
    } else if (key == "stream_min_batch") {
        stream_min_batch = int32_t(parse_int(value, 0, 1 << 30, source, key));
    } else if (key == "prefetch_window") {
        prefetch_window = int32_t(parse_int(value, 0, 64, source, key));
    } else if (key == "prefetch_max_per_layer") {
        prefetch_max_per_layer = int32_t(parse_int(value, 0, 1 << 16, source, key));
    } else if (key == "predict_max_tokens") {
        predict_max_tokens = parse_int(value, 1, 1 << 16, source, key);
    } else if (key == "predictor") {
        if (value.empty()) fail("{}: expected none, frequency, recency, fate, oracle or a predictor file", where);
        predictor = std::string(value);
    } else if (key == "placement") {
        placement = std::string(value);
    } else if (key == "routing_trace") {
        routing_trace = std::string(value);
    } else if (key == "gpu_device") {
        gpu_device = int32_t(parse_int(value, 0, 1023, source, key));
    } else if (key == "copy_chunk") {
        copy.chunk_bytes = size_t(parse_byte_size(value, where));
        if (copy.chunk_bytes == 0) fail("{}: the chunk size must be positive", where);
    } else if (key == "copy_queue_depth") {
        copy.queue_depth = int32_t(parse_int(value, 1, 1024, source, key));
    } else if (key == "copy_bandwidth_cap") {
        copy.bandwidth_cap_bytes_per_s = double(parse_byte_size(value, where));
    } else if (key == "cost_profile") {
        cost_profile = std::string(value);
    } else if (key == "load_balance") {
        load_balance = load_balance_from_name(value, where);
    } else if (key == "link_price" || key == "device_hits" || key == "device_steps" || key == "cuda_graphs") {
        if (value != "on" && value != "off" && value != "true" && value != "false") {
            fail("{}: expected on or off, got '{}'", where, value);
        }
        bool &flag = key == "link_price"     ? link_price
                     : key == "device_hits"  ? device_hits
                     : key == "device_steps" ? device_steps
                                             : cuda_graphs;
        flag = value == "on" || value == "true";
    } else if (key == "prefetch_in_flight") {
        prefetch_in_flight = int32_t(parse_int(value, 1, 1024, source, key));
    } else if (key == "numa") {
        if (value != "gpu" && value != "distribute" && value != "isolate" && value != "numactl") {
            fail("{}: expected gpu, distribute, isolate or numactl, got '{}'", where, value);
        }
        numa = std::string(value);
    } else if (key == "dump_layer_states") {
        dump_layer_states = std::string(value);
    } else if (key == "gpus") {
        gpus = int32_t(parse_int(value, 1, 8, source, key));
    } else if (key == "expert_groups") {
        expert_groups = std::string(value);
    } else {
        fail("{}: unknown key '{}' (known: {})", source, key, fmt::join(keys(), ", "));
    }
}

void OffloadConfig::load_yaml(const std::string &path) {
    YAML::Node root;
    try {
        root = YAML::LoadFile(path);
    } catch (const YAML::Exception &e) {
        fail("{}: cannot read the config: {}", path, e.what());
    }
    if (root.IsNull()) return;
    if (!root.IsMap()) fail("{}: expected a mapping of key: value lines", path);
    for (const auto &kv : root) {
        // Keys and values must be plain scalars (YAML also allows sequences and maps as keys).
        if (!kv.first.IsScalar()) fail("{}: expected a mapping of key: value lines, found a key that is not a name", path);
        const std::string key = kv.first.Scalar();
        if (kv.second.IsMap() && std::find(keys().begin(), keys().end(), key) == keys().end()) {
            // A section of keys (the seed's `optimization: {...}`).
            for (const auto &inner : kv.second) {
                if (!inner.first.IsScalar()) fail("{}: {}: expected key: value lines, found a key that is not a name", path, key);
                const std::string k = inner.first.Scalar();
                if (!inner.second.IsScalar()) fail("{}: {}.{}: expected a single value", path, key, k);
                set(k, inner.second.Scalar(), fmt::format("{} ({})", path, key));
            }
            continue;
        }
        if (!kv.second.IsScalar()) fail("{}: {}: expected a single value", path, key);
        set(key, kv.second.Scalar(), path);
    }
}

std::string OffloadConfig::no_effect(std::string_view key) const {
    if (key == "gpu_cache" || key == "routing_trace" || key == "gpus") return {};
    if (key == "expert_groups") return gpu && gpus == 1 ? "gpus is 1: the GPU runtime runs every expert on one GPU" : "";
    if (!gpu) return "no GPU (gpu_cache / --gpu-expert-budget not set): the CPU engine runs every expert itself";
    if (key == "gpu_device" || key == "numa" || key == "placement") return {};
    if (gpu_cache_bytes == 0) return "gpu_cache is 0: every expert runs on the CPU";
    const bool threshold = cpu_threshold >= 0;
    if (threshold && (key == "cost_profile" || key == "load_balance" || key == "link_price" || key == "prefetch_in_flight")) {
        return "cpu_threshold is set: the threshold rule decides, not the cost model";
    }
    const bool prefetch_keys = key == "prefetch_window" || key == "prefetch_max_per_layer" ||
                               key == "prefetch_in_flight" || key == "predict_max_tokens";
    if (predictor == "none" && prefetch_keys) return "predictor is none: nothing is prefetched";
    if (prefetch_window == 0 && (prefetch_keys || key == "predictor") && key != "prefetch_window") {
        return "prefetch_window is 0: nothing is prefetched";
    }
    return {};
}

std::vector<std::string> OffloadConfig::no_effect_warnings() const {
    std::vector<std::string> out;
    for (const auto &[key, source] : given) {
        const std::string why = no_effect(key);
        const std::string line = fmt::format("{}: {} has no effect: {}", source, key, why);
        if (!why.empty() && std::find(out.begin(), out.end(), line) == out.end()) out.push_back(line);
    }
    return out;
}

std::string OffloadConfig::get(std::string_view key) const {
    if (key == "gpu_cache") return gpu ? format_byte_size(gpu_cache_bytes) : "off (CPU only)";
    if (key == "cache_policy") return eviction_policy_name(cache_policy);
    if (key == "cpu_threshold") return cpu_threshold < 0 ? "auto (cost-model scheduler)" : std::to_string(cpu_threshold);
    if (key == "stream_min_batch") return stream_min_batch ? std::to_string(stream_min_batch) : "0 (never)";
    if (key == "prefetch_window") return std::to_string(prefetch_window);
    if (key == "prefetch_max_per_layer") return prefetch_max_per_layer ? std::to_string(prefetch_max_per_layer) : "top_k";
    if (key == "predict_max_tokens") return std::to_string(predict_max_tokens);
    if (key == "predictor") return predictor;
    if (key == "placement") return placement.empty() ? "all pinned, per-step rule" : placement;
    if (key == "routing_trace") return routing_trace.empty() ? "none (router)" : routing_trace;
    if (key == "gpu_device") return std::to_string(gpu_device);
    if (key == "copy_chunk") return format_byte_size(copy.chunk_bytes);
    if (key == "copy_queue_depth") return std::to_string(copy.queue_depth);
    if (key == "copy_bandwidth_cap") {
        return copy.bandwidth_cap_bytes_per_s > 0 ? fmt::format("{:.2f} GB/s", copy.bandwidth_cap_bytes_per_s / 1e9)
                                                  : "none";
    }
    if (key == "cost_profile") {
        return cost_profile.empty() ? "built-in H200 reference (GPU, link), CPU measured at start-up" : cost_profile;
    }
    if (key == "load_balance") return load_balance_name(load_balance);
    if (key == "device_hits") return device_hits ? "on" : "off";
    if (key == "device_steps") return device_steps ? "on" : "off";
    if (key == "cuda_graphs") return cuda_graphs ? "on" : "off";
    if (key == "link_price") return link_price ? "on" : "off";
    if (key == "prefetch_in_flight") return std::to_string(prefetch_in_flight);
    if (key == "numa") return numa;
    if (key == "dump_layer_states") return dump_layer_states.empty() ? "off" : dump_layer_states;
    if (key == "gpus") return gpus == 1 ? "1" : fmt::format("{} (expert parallelism)", gpus);
    if (key == "expert_groups") {
        return expert_groups.empty() ? "consecutive ranges, re-planned as the routing drifts" : expert_groups;
    }
    PRESCOPE_ASSERT(false && "unknown offload config key");
    return {};
}

std::string OffloadConfig::describe() const {
    std::string out;
    for (const std::string &k : keys()) out += fmt::format("  {:<23} {}\n", k + ":", get(k));
    return out;
}

nlohmann::json OffloadConfig::to_json() const {
    nlohmann::json j;
    j["gpu"] = gpu;
    j["gpu_cache_bytes"] = gpu_cache_bytes;
    j["cache_policy"] = eviction_policy_name(cache_policy);
    j["cpu_threshold"] = cpu_threshold;
    j["stream_min_batch"] = stream_min_batch;
    j["prefetch_window"] = prefetch_window;
    j["prefetch_max_per_layer"] = prefetch_max_per_layer;
    j["predict_max_tokens"] = predict_max_tokens;
    j["predictor"] = predictor;
    j["placement"] = placement;
    j["routing_trace"] = routing_trace;
    j["gpu_device"] = gpu_device;
    j["copy_chunk_bytes"] = copy.chunk_bytes;
    j["copy_queue_depth"] = copy.queue_depth;
    j["copy_bandwidth_cap_bytes_per_s"] = copy.bandwidth_cap_bytes_per_s;
    j["cost_profile"] = cost_profile;
    j["load_balance"] = load_balance_name(load_balance);
    j["device_hits"] = device_hits;
    j["device_steps"] = device_steps;
    j["cuda_graphs"] = cuda_graphs;
    j["link_price"] = link_price;
    j["prefetch_in_flight"] = prefetch_in_flight;
    j["numa"] = numa;
    j["dump_layer_states"] = dump_layer_states;
    j["gpus"] = gpus;
    j["expert_groups"] = expert_groups;
    return j;
}

} // namespace prescope

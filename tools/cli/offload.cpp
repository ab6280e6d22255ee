// Offloading flags and reports of the prescope CLI.
#include "offload.h"

#include "core/log.h"

#include <array>
#include <cstdio>

namespace prescope::cli {

namespace {

struct FlagSpec {
    const char *flag;
    const char *key;  // OffloadConfig key (and YAML key)
    const char *help;
};

// One row per setting; the YAML config file uses the key column.
constexpr std::array kFlags = {
    FlagSpec{"--gpu-expert-budget", "gpu_cache",
             "GPU memory for expert slots, e.g. 12GiB, 512MiB (0: every expert on the CPU); runs on the GPU"},
    FlagSpec{"--cache-policy", "cache_policy", "hot-expert table eviction: lru, lfu or arc"},
    FlagSpec{"--cpu-threshold", "cpu_threshold",
             "manual override of the cost-model scheduler: a missed expert runs on the CPU when fewer tokens chose "
             "it (0: always fetch; auto: the scheduler)"},
    FlagSpec{"--stream-min-batch", "stream_min_batch",
             "batches of at least this many tokens stream the experts that find no free slot through the slots "
             "in waves, instead of running them on the CPU (0: never)"},
    FlagSpec{"--prefetch-window", "prefetch_window", "layers ahead to prefetch for (0: no prefetch)"},
    FlagSpec{"--prefetch-max", "prefetch_max_per_layer", "new prefetch loads per predicted layer and step (0: top-k)"},
    FlagSpec{"--predict-max-tokens", "predict_max_tokens", "last tokens of a batch the predictor sees"},
    FlagSpec{"--predictor", "predictor", "none, frequency, recency, fate, oracle (needs --routing-trace) or a LLaPor file"},
    FlagSpec{"--placement", "placement", "placement plan JSON (home tier and execution site per expert)"},
    FlagSpec{"--routing-trace", "routing_trace", "replay routing from a .pstrace instead of the router (benchmarks)"},
    FlagSpec{"--gpu-device", "gpu_device", "CUDA device index"},
    FlagSpec{"--copy-chunk", "copy_chunk", "copy engine chunk size"},
    FlagSpec{"--copy-depth", "copy_queue_depth", "copy engine chunks in flight"},
    FlagSpec{"--copy-bandwidth-cap", "copy_bandwidth_cap", "copy engine bandwidth cap per second, e.g. 20GB (0: none)"},
    FlagSpec{"--cost-profile", "cost_profile", "cost profile JSON written by `prescope calibrate`"},
    FlagSpec{"--load-balance", "load_balance",
             "which cost-model terms are learned online from measured times: off (the profile as it is, the link "
             "free), link (the copy speed and the link's busy share) or on (and the CPU and GPU expert times)"},
    FlagSpec{"--link-price", "link_price",
             "on or off: prefetches and installs pay for their link time at the square of the link's busy share "
             "(needs --load-balance link or on)"},
    FlagSpec{"--prefetch-in-flight", "prefetch_in_flight", "prefetch requests outstanding at most"},
    FlagSpec{"--numa", "numa",
             "expert store and CPU expert threads: gpu (the GPU's node), distribute, isolate or numactl (as llama.cpp)"},
    FlagSpec{"--dump-layer-states", "dump_layer_states",
             "write every layer's scheduler state to FILE (JSON lines, for prescope schedule-check)"},
    FlagSpec{"--device-hits", "device_hits",
             "on or off: the GPU runs the routed experts it holds before the host reads the routing (decode)"},
    FlagSpec{"--device-steps", "device_steps",
             "on or off: with --device-hits, a layer whose every expert is resident runs whole on the GPU, the host "
             "reading its routing later"},
    FlagSpec{"--cuda-graphs", "cuda_graphs",
             "on or off: a decode pass whose every expert has its home on the GPU is captured once as a CUDA graph "
             "and replayed"},
    FlagSpec{"--gpus", "gpus",
             "GPUs of expert parallelism, each holding one group of experts (1-8); more than 1 runs the groups on the "
             "CPU, one after another (the GPU runtime refuses it for now)"},
    FlagSpec{"--expert-groups", "expert_groups",
             "expert groups JSON for --gpus N, written by `prescope expert-groups` (default: consecutive ranges, "
             "re-planned from the routing as it drifts)"},
};

} // namespace

void add_offload_flags(CLI::App &cmd, OffloadArgs &args) {
    std::string keys;
    for (const FlagSpec &f : kFlags) keys += (keys.empty() ? "" : ", ") + std::string(f.key);
    cmd.add_option("--config", args.config_file, "YAML config file (keys: " + keys + "); flags override it")
        ->check(CLI::ExistingFile);
    const OffloadConfig defaults;
    args.values.resize(kFlags.size());
    args.given.clear();
    for (size_t i = 0; i < kFlags.size(); ++i) {
        const FlagSpec &f = kFlags[i];
        CLI::Option *o = cmd.add_option(f.flag, args.values[i], std::string(f.help) + " [" + f.key + ", default: " +
                                                                    defaults.get(f.key) + "]");
        args.given.emplace_back(f.key, o);
    }
}

OffloadConfig resolve_offload(const OffloadArgs &args) {
    OffloadConfig c;
    if (!args.config_file.empty()) c.load_yaml(args.config_file);
    for (size_t i = 0; i < args.given.size(); ++i) {
        const auto &[key, opt] = args.given[i];
        if (opt->count() == 0) continue;
        c.set(key, args.values[i], opt->get_name());
    }
    // A key set in the file or on the command line that this run ignores says so (the last setting wins).
    for (const std::string &w : c.no_effect_warnings()) spdlog::warn("{}", w);
    return c;
}

void print_startup(const OffloadConfig &config, const Engine &engine) {
    if (config.gpu) std::fprintf(stderr, "offload config:\n%s", config.describe().c_str());
    const std::string s = engine.startup_text();
    if (!s.empty()) std::fputs(s.c_str(), stderr);
}

void print_counters(const Engine &engine) {
    const std::string s = engine.stats_text();
    if (!s.empty()) std::fputs(s.c_str(), stderr);
}

} // namespace prescope::cli

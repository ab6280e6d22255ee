// LayerStats: the field table and what it drives (sum, text table, JSON).
#include "offload/layer-stats.h"

#include "core/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <array>
#include <numeric>

namespace prescope {

namespace {

using S = LayerStats;
constexpr double kMiB = 1.0 / double(1 << 20), kMs = 1e-3;

constexpr std::array kFields = {
    LayerStatsField{"hits", "hits", &S::hits, nullptr, 1},
    LayerStatsField{"demand_misses", "d.misses", &S::demand_misses, nullptr, 1},
    LayerStatsField{"cpu_runs", "cpu", &S::cpu_runs, nullptr, 1},
    LayerStatsField{"prefetch_hits", "pf.hits", &S::prefetch_hits, nullptr, 1},
    LayerStatsField{"prefetch_loads", "pf.loads", &S::prefetch_loads, nullptr, 1},
    LayerStatsField{"wasted_prefetch_bytes", "wasted MiB", &S::wasted_prefetch_bytes, nullptr, kMiB},
    LayerStatsField{"bytes_loaded", "loaded MiB", &S::bytes_loaded, nullptr, kMiB},
    LayerStatsField{"evictions", nullptr, &S::evictions, nullptr, 1},
    LayerStatsField{"stall_us", "stall ms", nullptr, &S::stall_us, kMs},
    LayerStatsField{"steps", nullptr, &S::steps, nullptr, 1},
    LayerStatsField{"streamed", "stream", &S::streamed, nullptr, 1},
    LayerStatsField{"stream_waves", nullptr, &S::stream_waves, nullptr, 1},
    LayerStatsField{"device_hits", "dev.hits", &S::device_hits, nullptr, 1},
    LayerStatsField{"device_layers", "dev.steps", &S::device_layers, nullptr, 1},
    LayerStatsField{"split_steps", "split", &S::split_steps, nullptr, 1},
    LayerStatsField{"cpu_expert_us", "cpu ms", nullptr, &S::cpu_expert_us, kMs},
    LayerStatsField{"predict_us", nullptr, nullptr, &S::predict_us, kMs},
    LayerStatsField{"wait_issue_us", nullptr, nullptr, &S::wait_issue_us, kMs},
    LayerStatsField{"device_stall_us", nullptr, nullptr, &S::device_stall_us, kMs},
    LayerStatsField{"host_us", "host ms", nullptr, &S::host_us, kMs},
    LayerStatsField{"gpu_idle_us", "idle ms", nullptr, &S::gpu_idle_us, kMs},
    LayerStatsField{"prefetch_planned", nullptr, &S::prefetch_planned, nullptr, 1},
    LayerStatsField{"corrections", "corr", &S::corrections, nullptr, 1},
    LayerStatsField{"predicted_us", nullptr, nullptr, &S::predicted_us, kMs},
    LayerStatsField{"finish_gap_us", "gap ms", nullptr, &S::finish_gap_us, kMs},
    LayerStatsField{"finish_gap_abs_us", nullptr, nullptr, &S::finish_gap_abs_us, kMs},
};

nlohmann::json to_json(const LayerStats &s) {
    nlohmann::json j;
    for (const LayerStatsField &f : kFields) {
        if (f.count) j[f.name] = s.*f.count;
        else j[f.name] = s.*f.time;
    }
    j["hit_rate"] = s.hit_rate();
    return j;
}

} // namespace

std::span<const LayerStatsField> layer_stats_fields() { return kFields; }

LayerStats &LayerStats::operator+=(const LayerStats &o) {
    for (const LayerStatsField &f : kFields) {
        if (f.count) this->*f.count += o.*f.count;
        else this->*f.time += o.*f.time;
    }
    return *this;
}

LayerStatsTable::LayerStatsTable(std::vector<int32_t> slots_per_layer, std::vector<uint8_t> no_experts)
    : layers_(slots_per_layer.size()), slots_(std::move(slots_per_layer)), no_experts_(std::move(no_experts)) {
    PRESCOPE_ASSERT(no_experts_.empty() || no_experts_.size() == layers_.size());
}

bool LayerStatsTable::shown(size_t layer) const { return no_experts_.empty() || !no_experts_[layer]; }

LayerStats LayerStatsTable::total() const {
    LayerStats t;
    for (const LayerStats &s : layers_) t += s;
    return t;
}

void LayerStatsTable::reset() { std::fill(layers_.begin(), layers_.end(), LayerStats{}); }

std::string LayerStatsTable::text() const {
    std::string out = fmt::format("{:>5} {:>5}", "layer", "slots");
    for (const LayerStatsField &f : kFields) {
        if (f.header) out += fmt::format(" {:>10}", f.header);
    }
    out += fmt::format(" {:>7}\n", "hit %");
    auto row = [&](const std::string &name, int32_t slots, const LayerStats &s) {
        out += fmt::format("{:>5} {:>5}", name, slots);
        for (const LayerStatsField &f : kFields) {
            if (!f.header) continue;
            if (f.count && f.scale == 1) out += fmt::format(" {:>10}", s.*f.count);
            else out += fmt::format(" {:>10.2f}", (f.count ? double(s.*f.count) : s.*f.time) * f.scale);
        }
        out += fmt::format(" {:>7.1f}\n", 100.0 * s.hit_rate());
    };
    for (size_t l = 0; l < layers_.size(); ++l) {
        if (shown(l)) row(std::to_string(l), slots_[l], layers_[l]);
    }
    row("all", std::accumulate(slots_.begin(), slots_.end(), 0), total());
    return out;
}

nlohmann::json LayerStatsTable::json() const {
    nlohmann::json layers = nlohmann::json::array();
    for (size_t l = 0; l < layers_.size(); ++l) {
        if (!shown(l)) continue;
        nlohmann::json j = to_json(layers_[l]);
        j["layer"] = l;
        j["slots"] = slots_[l];
        layers.push_back(std::move(j));
    }
    return {{"layers", std::move(layers)}, {"total", to_json(total())}};
}

} // namespace prescope

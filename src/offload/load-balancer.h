// Dynamic load balancing: online corrections of the cost model from what each layer measured (CPU expert
// time on the host, GPU expert time on the device, copy time from the copy engine), the CPU/GPU finish gap
// and the layer time the planner's deadlines use. The scheduler then moves experts between the CPU and the
// link on its own, because it plans with the corrected costs. Decision: docs/decisions/0082.
#pragma once

#include "offload/cost-model.h"

#include <cstdint>
#include <string_view>

namespace prescope {

struct LayerStats;

/// Which corrections the balancer learns (the config key load_balance, decision 0146). The copy engine's
/// achieved speed is event-timed busy time, right in prefill and decode alike; the CPU and GPU times mix
/// batch sizes and waits (decision 0087), so they are learned only when asked for.
enum class LoadBalance : uint8_t {
    OFF,   // the profile's times as they are
    LINK,  // the link from the copy engine's achieved speed (the default)
    ON,    // the link, the CPU and the GPU
};

/// "off", "link" or "on".
const char *load_balance_name(LoadBalance mode);
/// The mode a name gives: "off", "link" or "on" ("false" and "true" as YAML spells the two ends). Throws
/// prescope::Error "WHERE: expected off, link or on, got 'NAME'" on another name.
LoadBalance load_balance_from_name(std::string_view name, std::string_view where);

struct LoadBalancerConfig {
    double rate = 0.25;        // weight of a new measurement (exponential moving average of log ratios)
    double min_factor = 0.25;  // corrections stay in [min_factor, max_factor]
    double max_factor = 4.0;
    double count_change = 0.02;  // a correction counts (LayerStats::corrections) when it moves by more than this
};

/// One layer's measurements against the plan's predictions. Negative = not measured (e.g. no CPU experts, or a
/// backend that cannot time events). Times in microseconds from the layer's start unless named *_work_us.
struct LayerMeasurement {
    double cpu_work_us = -1, cpu_predicted_us = -1;    // the CPU experts' host time and its prediction
    double gpu_work_us = -1, gpu_predicted_us = -1;    // the GPU experts' device time and its prediction
    double link_work_us = -1, link_predicted_us = -1;  // copy time of bytes moved and its prediction
    double link_busy_us = -1, link_wall_us = -1;       // the link's busy time over a window of wall time
    double cpu_end_us = -1, gpu_end_us = -1;           // when each side finished (the finish gap)
    double layer_us = -1;                              // the layer's expert part, measured or predicted
};

/// The link's part of a LayerMeasurement, from a copy counter read now and then (the copy engine's CopyStats,
/// the simulator's link): its busy share over windows of at least `min_window_us` of wall time (link_busy_us,
/// link_wall_us), and its busy time since bytes last landed against CostModel::link_us of those bytes and
/// requests (link_work_us, link_predicted_us; a window can close before a chunk's bytes land, and its busy time
/// then waits for them). The runtime and the simulator measure the link alike through it (decisions 0146, 0147).
class LinkMeter {
  public:
    /// The counter: busy time (us), bytes and requests completed, read at `at_us` (any clock, us).
    struct Reading {
        double busy_us = 0;
        uint64_t bytes = 0, requests = 0;
        double at_us = 0;
    };
    /// Windows of any length, the counter from 0 at time 0 (the simulator's link).
    LinkMeter() = default;
    /// Windows of at least min_window_us, the counter from `start`.
    LinkMeter(double min_window_us, const Reading &start)
        : min_window_us_(min_window_us), window_(start), landed_(start) {}
    /// Fills m's link fields from `now` when at least min_window_us passed since the last window (the speed
    /// fields only when bytes landed since they were last filled) and returns true; else leaves m and returns false.
    bool measure(const Reading &now, const CostModel &cost, LayerMeasurement &m);

  private:
    double min_window_us_ = 0;
    Reading window_;  // the counter at the last window
    Reading landed_;  // the counter when bytes last landed
};

class LoadBalancer {
  public:
    explicit LoadBalancer(LoadBalancerConfig config = {}) : config_(config) {}
    /// Folds one layer's measurements into the corrections `mode` learns (the predictions must have been made
    /// with the current corrections; the others stay 1); adds the finish gap, and the corrections made, to `stats`.
    void observe(const LayerMeasurement &m, LayerStats &stats, LoadBalance mode);
    const CostCorrections &corrections() const { return corrections_; }
    /// Recent expert-part time of a layer (moving average of layer_us), 0 before the first.
    double layer_estimate_us() const { return layer_estimate_us_; }
    /// Recent share of the time the link was busy, in [0, 1] (moving average of link_busy_us / link_wall_us; 0
    /// before the first and under LoadBalance::OFF): the scheduler prices link time by it (LayerState::link_price,
    /// decision 0147).
    double link_busy_share() const { return link_busy_share_; }

  private:
    bool update(double &factor, double work_us, double predicted_us);

    LoadBalancerConfig config_;
    CostCorrections corrections_;
    double layer_estimate_us_ = 0;
    double link_busy_share_ = 0;
};

} // namespace prescope

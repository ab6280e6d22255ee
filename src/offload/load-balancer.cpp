// LoadBalancer: moving averages of measured / predicted time, per resource.
#include "offload/load-balancer.h"

#include "core/error.h"
#include "offload/layer-stats.h"

#include <algorithm>
#include <cmath>

namespace prescope {

bool LoadBalancer::update(double &factor, double work_us, double predicted_us) {
    // Too short to time reliably (a few us of host jitter) or nothing predicted: skip.
    if (!(work_us > 1.0) || !(predicted_us > 1.0)) return false;
    const double before = factor;
    // The prediction already includes the factor: the ratio is what is left to correct.
    const double ratio = work_us / predicted_us;
    factor = std::clamp(factor * std::pow(ratio, config_.rate), config_.min_factor, config_.max_factor);
    return std::abs(factor / before - 1.0) > config_.count_change;
}

const char *load_balance_name(LoadBalance mode) {
    switch (mode) {
    case LoadBalance::OFF: return "off";
    case LoadBalance::LINK: return "link";
    case LoadBalance::ON: return "on";
    }
    return "?";
}

LoadBalance load_balance_from_name(std::string_view name, std::string_view where) {
    if (name == "link") return LoadBalance::LINK;
    if (name == "on" || name == "true") return LoadBalance::ON;
    if (name == "off" || name == "false") return LoadBalance::OFF;
    fail("{}: expected off, link or on, got '{}'", where, name);
}

bool LinkMeter::measure(const Reading &now, const CostModel &cost, LayerMeasurement &m) {
    if (now.at_us - window_.at_us < min_window_us_) return false;
    m.link_busy_us = now.busy_us - window_.busy_us;
    m.link_wall_us = now.at_us - window_.at_us;
    window_ = now;
    if (now.bytes > landed_.bytes) {
        m.link_work_us = now.busy_us - landed_.busy_us;
        m.link_predicted_us = cost.link_us(now.bytes - landed_.bytes, now.requests - landed_.requests);
        landed_ = now;
    }
    return true;
}

void LoadBalancer::observe(const LayerMeasurement &m, LayerStats &stats, LoadBalance mode) {
    int changed = 0;
    if (mode == LoadBalance::ON) {
        changed += update(corrections_.cpu, m.cpu_work_us, m.cpu_predicted_us);
        changed += update(corrections_.gpu, m.gpu_work_us, m.gpu_predicted_us);
    }
    if (mode != LoadBalance::OFF) {
        changed += update(corrections_.link, m.link_work_us, m.link_predicted_us);
        if (m.link_wall_us > 0 && m.link_busy_us >= 0) {
            const double share = std::min(m.link_busy_us / m.link_wall_us, 1.0);
            link_busy_share_ += config_.rate * (share - link_busy_share_);
        }
    }
    stats.corrections += uint64_t(changed);
    if (m.cpu_end_us >= 0 && m.gpu_end_us >= 0) {
        stats.finish_gap_us += m.cpu_end_us - m.gpu_end_us;
        stats.finish_gap_abs_us += std::abs(m.cpu_end_us - m.gpu_end_us);
    }
    if (m.layer_us >= 0) {
        layer_estimate_us_ = layer_estimate_us_ > 0 ? layer_estimate_us_ + config_.rate * (m.layer_us - layer_estimate_us_)
                                                    : m.layer_us;
    }
}

} // namespace prescope

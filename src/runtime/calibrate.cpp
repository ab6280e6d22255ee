// CPU-side calibration (host bandwidth, CPU expert time) and the runtime's cost model.
#include "runtime/calibrate.h"

#include "arch/arch.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "offload/expert-store.h"
#include "runtime/moe.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <fstream>
#include <map>
#include <mutex>
#include <numeric>

namespace prescope {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string today() {
    const std::time_t t = std::time(nullptr);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%d", std::gmtime(&t));
    return buf;
}

} // namespace

std::string cpu_model_name() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const size_t colon = line.find(':');
            if (colon != std::string::npos) {
                std::string name = line.substr(colon + 1);
                name.erase(0, name.find_first_not_of(' '));
                return name;
            }
        }
    }
    return "unknown CPU";
}

std::vector<CostPoint> measure_host_read(int32_t threads, double budget_s) {
    // 256 MiB: well past any last-level cache; each thread sums its part (the compiler cannot drop the loads).
    const size_t n = (size_t(256) << 20) / sizeof(uint64_t);
    std::vector<uint64_t> buf(n);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; ++i) buf[i] = i;
    std::vector<CostPoint> out;
    const auto start = Clock::now();
    for (int32_t t = 1; t <= std::max(threads, 1); t = t * 2 > threads && t < threads ? threads : t * 2) {
        double best = 0;
        for (int rep = 0; rep < 3; ++rep) {
            uint64_t sum = 0;
            const auto t0 = Clock::now();
#pragma omp parallel for num_threads(t) reduction(+ : sum) schedule(static)
            for (size_t i = 0; i < n; ++i) sum += buf[i];
            const double s = seconds_since(t0);
            if (sum == 1) std::abort();  // keeps the sum
            best = std::max(best, double(n * sizeof(uint64_t)) / s / 1e9);
        }
        out.push_back({double(t), best});
        if (seconds_since(start) > budget_s) break;
    }
    return out;
}

CpuExpertTimings measure_cpu_expert(const Model &model, int32_t layer, int32_t threads, double budget_s) {
    const HParams &hp = model.hp();
    const int64_t max_tokens = 512;
    const auto n_many = int32_t(std::min<int64_t>(8, hp.n_expert));
    const ExpertStore store(model, nullptr, ExpertStoreConfig::cpu_only(model));  // read in place, as the CPU engine does
    const int64_t n_ff = store.layout(layer).n_ff;
    CpuExpertRunner runner(hp.n_embd, n_ff, std::max<int64_t>(max_tokens, n_many), hp.expert_act);
    std::vector<float> x(size_t(max_tokens * hp.n_embd)), y(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 17) - 8) * 0.01f;
    std::vector<int32_t> rows(static_cast<size_t>(max_tokens));
    std::iota(rows.begin(), rows.end(), 0);
    const int saved = cpu::get_threads();
    cpu::set_threads(threads);
    // Best of 3 runs of experts 0 .. n - 1, each with m tokens (rows 0 .. m - 1).
    const auto best_of_3 = [&](int32_t n, int64_t m) {
        std::vector<int32_t> experts(static_cast<size_t>(n)), offsets(size_t(n) + 1);
        std::iota(experts.begin(), experts.end(), 0);
        for (int32_t i = 0; i <= n; ++i) offsets[size_t(i)] = int32_t(i * m);
        std::vector<int32_t> pair_rows(size_t(n * m));
        for (size_t p = 0; p < pair_rows.size(); ++p) pair_rows[p] = int32_t(int64_t(p) % m);
        double best = 1e30;
        for (int rep = 0; rep < 3; ++rep) {
            const auto t0 = Clock::now();
            runner.run(store, layer, n, experts.data(), offsets.data(), pair_rows.data(), x.data(), y.data());
            best = std::min(best, seconds_since(t0) * 1e6);
        }
        return best;
    };
    CpuExpertTimings out;
    const auto start = Clock::now();
    for (int64_t m = 1; m <= max_tokens; m *= 2) {
        out.us_by_tokens.push_back({double(m), best_of_3(1, m)});
        if (seconds_since(start) > budget_s) break;
    }
    if (n_many > 1) {
        // One expert's time is the layer's fixed part plus the expert's own; n of them at one token each split
        // the two: the marginal expert is (T_n - T_1) / (n - 1), the fixed part what is left of T_1.
        const double one = out.us_by_tokens[0].value, many = best_of_3(n_many, 1);
        const double marginal = std::max(many - one, 0.0) / double(n_many - 1);
        out.layer_us = std::max(one - marginal, 0.0);
        for (CostPoint &p : out.us_by_tokens) p.value = std::max(p.value - out.layer_us, 1.0);
    }
    cpu::set_threads(saved);
    return out;
}

void calibrate_cpu(CostProfile &p, const Model &model, int32_t threads, double budget_s) {
    const auto t0 = Clock::now();
    p.cpu = cpu_model_name();
    p.cpu_threads = threads;
    p.host_read_gb_s = measure_host_read(threads, budget_s * 0.3);
    const auto first = int32_t(model.hp().n_layer_dense);  // the first layer with experts
    const ExpertShape shape = ExpertShape::of(ExpertLayout::of(model, first));
    ShapeTimings &t = p.shape_entry(shape.key());
    CpuExpertTimings m = measure_cpu_expert(model, first, threads, std::max(budget_s - seconds_since(t0), 0.1));
    t.cpu_us = std::move(m.us_by_tokens);
    t.cpu_layer_us = m.layer_us;
    t.cpu_source = fmt::format("measured {} on {} with {} threads ({} token counts and 8 experts at once, {:.2f} s)",
                               today(), p.cpu, threads, t.cpu_us.size(), seconds_since(t0));
    p.cpu_source = fmt::format("measured {} on {}: host read at {} thread counts; fixed and FLOP terms of shapes "
                               "without measured points are the reference's",
                               today(), p.cpu, p.host_read_gb_s.size());
}

#ifndef PRESCOPE_USE_CUDA
bool calibrate_gpu(CostProfile &, const Model &, int32_t, std::string *why) {
    if (why) *why = "this prescope was built without CUDA";
    return false;
}
#endif

CostModel runtime_cost_model(const Model &model, const OffloadConfig &config, int32_t threads, double budget_s,
                             std::string *notes) {
    CostProfile p = config.cost_profile.empty() ? CostProfile::h200_reference() : CostProfile::load(config.cost_profile);
    const ExpertShape shape = ExpertShape::of(ExpertLayout::of(model, model.hp().n_layer_dense));
    const ShapeTimings *t = p.find_shape(shape.key());
    const bool have_cpu = t && !t->cpu_us.empty() && p.cpu == cpu_model_name() && p.cpu_threads == threads;
    std::string where = config.cost_profile.empty() ? "built-in H200 reference" : config.cost_profile;
    if (!have_cpu) {
        // Once per process, shape and thread count: every engine of a process runs on the same CPU.
        static std::mutex mutex;
        static std::map<std::pair<std::string, int32_t>, CostProfile> measured;
        std::lock_guard lock(mutex);
        const auto key = std::pair{shape.key(), threads};
        auto it = measured.find(key);
        if (it == measured.end()) {
            const auto t0 = Clock::now();
            CostProfile m = p;
            calibrate_cpu(m, model, threads, budget_s);
            m.cpu_source += fmt::format(" (at start-up, {:.0f} ms)", seconds_since(t0) * 1e3);
            it = measured.emplace(key, std::move(m)).first;
        }
        const CostProfile &m = it->second;
        p.cpu = m.cpu;
        p.cpu_threads = m.cpu_threads;
        p.host_read_gb_s = m.host_read_gb_s;
        p.cpu_source = m.cpu_source;
        ShapeTimings &mine = p.shape_entry(shape.key());
        const ShapeTimings *theirs = m.find_shape(shape.key());
        mine.cpu_us = theirs->cpu_us;
        mine.cpu_layer_us = theirs->cpu_layer_us;
        mine.cpu_source = theirs->cpu_source;
        where += "; CPU terms measured at start-up";
    } else {
        where += "; CPU terms from the profile";
    }
    if (notes) *notes = where;
    return CostModel(p, shape, threads, config.copy.chunk_bytes);
}

} // namespace prescope

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

std::vector<CostPoint> measure_cpu_expert(const Model &model, int32_t layer, int32_t threads, double budget_s) {
    const HParams &hp = model.hp();
    const int64_t max_tokens = 512;
    ExpertStoreConfig sc;
    sc.fetchable.assign(size_t(hp.n_layer * hp.n_expert), 0);  // read in place, as the CPU engine does
    const ExpertStore store(model, nullptr, sc);
    const int64_t n_ff = store.layout(layer).n_ff;
    CpuExpertRunner runner(hp.n_embd, n_ff, max_tokens, hp.expert_act);
    std::vector<float> x(size_t(max_tokens * hp.n_embd)), y(x.size());
    for (size_t i = 0; i < x.size(); ++i) x[i] = float(int(i % 17) - 8) * 0.01f;
    std::vector<int32_t> rows(static_cast<size_t>(max_tokens));
    std::iota(rows.begin(), rows.end(), 0);
    const int saved = cpu::get_threads();
    cpu::set_threads(threads);
    std::vector<CostPoint> out;
    const auto start = Clock::now();
    const int32_t expert = 0;
    for (int64_t m = 1; m <= max_tokens; m *= 2) {
        const int32_t offsets[2] = {0, int32_t(m)};
        double best = 1e30;
        for (int rep = 0; rep < 3; ++rep) {
            const auto t0 = Clock::now();
            runner.run(store, layer, 1, &expert, offsets, rows.data(), x.data(), y.data());
            best = std::min(best, seconds_since(t0) * 1e6);
        }
        out.push_back({double(m), best});
        if (seconds_since(start) > budget_s) break;
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
    t.cpu_us = measure_cpu_expert(model, first, threads, std::max(budget_s - seconds_since(t0), 0.1));
    t.cpu_source = fmt::format("measured {} on {} with {} threads ({} token counts, {:.2f} s)", today(), p.cpu, threads,
                               t.cpu_us.size(), seconds_since(t0));
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
        mine.cpu_source = theirs->cpu_source;
        where += "; CPU terms measured at start-up";
    } else {
        where += "; CPU terms from the profile";
    }
    if (notes) *notes = where;
    return CostModel(p, shape, threads, config.copy.chunk_bytes);
}

} // namespace prescope

// prescope bench: prefill (pp N) and decode (tg N) throughput with repetitions, as llama-bench
// measures them (tools/llama-bench: pp = one batch of N random tokens into an empty cache; tg = N
// single-token steps from an empty cache), printed as a table and JSON lines.
#include "cli.h"
#include "offload.h"

#include "arch/arch.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "runtime/engine.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

namespace prescope::cli {

namespace {

struct BenchArgs {
    CommonArgs common;
    int64_t n_prompt = 512;  // -p
    int64_t n_gen = 128;     // -n
    int reps = 5;            // -r
    std::string output = "md";
    OffloadArgs offload;  // the same offloading flags as generate (offload.h)
};

struct Stat {
    double mean = 0, stdev = 0;
};

Stat stats(const std::vector<double> &v) {
    Stat s;
    for (double x : v) s.mean += x;
    s.mean /= double(v.size());
    for (double x : v) s.stdev += (x - s.mean) * (x - s.mean);
    s.stdev = v.size() > 1 ? std::sqrt(s.stdev / double(v.size() - 1)) : 0.0;
    return s;
}

void run_bench(const BenchArgs &a) {
    apply_common(a.common);
    const auto model = Model::load(a.common.model);
    const HParams &hp = model->hp();
    const OffloadConfig offload = resolve_offload(a.offload);
    // As llama-bench, each test starts from an empty cache: the context only has to hold the longer test,
    // within -c (0: the model's context length).
    const int64_t need = std::max<int64_t>(a.n_prompt, a.n_gen) + 1;
    const int64_t limit = a.common.n_ctx > 0 ? a.common.n_ctx : hp.n_ctx_train;
    if (a.n_prompt == 0 && a.n_gen == 0) fail("bench: nothing to run: -p and -n are both 0");
    if (limit > 0 && need > limit) {
        fail("bench: the tests need a context of {} tokens (-p {}, -n {}), more than {} tokens", need, a.n_prompt,
             a.n_gen, a.common.n_ctx > 0 ? fmt::format("-c {}", limit) : fmt::format("the model's {}", limit));
    }
    const std::unique_ptr<Engine> engine = make_engine(*model, {need, a.common.n_batch, 1, a.common.deterministic}, offload);
    Engine &ctx = *engine;
    print_startup(offload, ctx);
    std::mt19937 rng(1234);
    std::uniform_int_distribution<int32_t> tok(0, int32_t(hp.n_vocab - 1));
    using Clock = std::chrono::steady_clock;

    auto time_prefill = [&]() {
        std::vector<int32_t> ids(size_t(a.n_prompt));
        for (auto &t : ids) t = tok(rng);
        ctx.clear();
        const auto t0 = Clock::now();
        ctx.eval(ids);
        return double(a.n_prompt) / std::chrono::duration<double>(Clock::now() - t0).count();
    };
    auto time_decode = [&]() {
        ctx.clear();
        int32_t next = tok(rng);
        const auto t0 = Clock::now();
        for (int64_t i = 0; i < a.n_gen; ++i) {
            ctx.eval({&next, 1});
            next = tok(rng);
        }
        return double(a.n_gen) / std::chrono::duration<double>(Clock::now() - t0).count();
    };

    struct Row {
        std::string test;
        std::vector<double> samples;
        nlohmann::json counters;  // the engine's offload counters over the repetitions
        std::string counters_text;
    };
    std::vector<Row> rows;
    if (a.n_prompt > 0) {
        time_prefill();  // warm-up: page in the weights, start the threads
        Row r{fmt::format("pp{}", a.n_prompt), {}, {}, {}};
        ctx.reset_stats();
        for (int i = 0; i < a.reps; ++i) r.samples.push_back(time_prefill());
        r.counters = ctx.stats_json();
        r.counters_text = ctx.stats_text();
        rows.push_back(r);
    }
    if (a.n_gen > 0) {
        time_decode();
        Row r{fmt::format("tg{}", a.n_gen), {}, {}, {}};
        ctx.reset_stats();
        for (int i = 0; i < a.reps; ++i) r.samples.push_back(time_decode());
        r.counters = ctx.stats_json();
        r.counters_text = ctx.stats_text();
        rows.push_back(r);
    }
    const double size_gib = double(model->file().file_size()) / double(1ull << 30);
    if (a.output == "json") {
        for (const auto &r : rows) {
            const Stat s = stats(r.samples);
            nlohmann::json j = {{"model", a.common.model}, {"arch", hp.arch}, {"size_gib", size_gib},
                                {"threads", cpu::get_threads()}, {"test", r.test}, {"avg_ts", s.mean},
                                {"stddev_ts", s.stdev}, {"samples_ts", r.samples}, {"backend", ctx.backend_name()}};
            j.update(r.counters);
            j["offload"] = offload.to_json();
            fmt::print("{}\n", j.dump());
        }
        return;
    }
    fmt::print("| model | size | backend | threads | test | t/s |\n| --- | ---: | --- | ---: | ---: | ---: |\n");
    for (const auto &r : rows) {
        const Stat s = stats(r.samples);
        fmt::print("| {} {} | {:.2f} GiB | {} | {} | {} | {:.2f} ± {:.2f} |\n", hp.arch, hp.n_layer, size_gib,
                   ctx.backend_name(), cpu::get_threads(), r.test, s.mean, s.stdev);
    }
    for (const auto &r : rows) {
        if (!r.counters_text.empty()) fmt::print(stderr, "{}:\n{}", r.test, r.counters_text);
    }
}

} // namespace

void register_bench(CLI::App &app) {
    auto a = std::make_shared<BenchArgs>();
    auto *cmd = app.add_subcommand("bench", "prefill and decode tokens/s (llama-bench's pp/tg tests)");
    add_common_flags(*cmd, a->common);
    cmd->add_option("-p,--n-prompt", a->n_prompt, "prompt tokens of the prefill test (0: skip)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    cmd->add_option("-n,--n-gen", a->n_gen, "tokens of the decode test (0: skip)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    cmd->add_option("-r,--repetitions", a->reps, "repetitions of each test")
        ->capture_default_str()
        ->check(CLI::Range(1, 1000000));
    cmd->add_option("-o,--output", a->output, "output format")->check(CLI::IsMember({"md", "json"}))->capture_default_str();
    add_offload_flags(*cmd, a->offload);
    cmd->callback([a]() { run_bench(*a); });
}

} // namespace prescope::cli

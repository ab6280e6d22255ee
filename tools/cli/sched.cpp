// The scheduler's tools: `prescope calibrate` (writes a cost profile), `prescope simulate` (a trace through
// cache + predictor + scheduler with a profile's timings) and `prescope schedule-check` (dumped layer states:
// the heuristic against the GLPK optimum).
#include "cli.h"

#include "arch/arch.h"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "core/log.h"
#include "core/output-file.h"
#include "offload/byte-size.h"
#include "offload/cost-model.h"
#include "offload/expert-store.h"
#include "offload/schedule-ilp.h"
#include "offload/scheduler.h"
#include "offload/simulator.h"
#include "offload/trace.h"
#include "runtime/calibrate.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>

namespace prescope::cli {

namespace {

std::string command_line(const CLI::App *cmd, const char *name) {
    std::string s = fmt::format("prescope {}", name);
    for (const auto &opt : cmd->get_options()) {
        for (const auto &r : opt->results()) {
            if (!opt->nonpositional()) {
                s += fmt::format(" {}", r);
            } else if (opt->get_expected_max() == 0) {  // a flag: its name alone ("--no-balance true" does not parse)
                s += fmt::format(" {}", opt->get_name());
            } else {
                s += fmt::format(" {} {}", opt->get_name(), r);
            }
        }
    }
    return s;
}

// ---------------------------------------------------------------------------------------------------------------
// calibrate

struct CalibrateArgs {
    CommonArgs common;
    std::string output = "prescope-profile.json";
    std::string from;  // base profile; default the H200 reference
    double budget_s = 2.0;
    int gpu_device = 0;
    std::string command;
};

void run_calibrate(const CalibrateArgs &a) {
    apply_common(a.common);
    const auto model = Model::load(a.common.model);
    CostProfile p = a.from.empty() ? CostProfile::h200_reference() : CostProfile::load(a.from);
    const int32_t threads = cpu::get_threads();
    std::fprintf(stderr, "calibrate: CPU terms on %s with %d threads (about %.1f s)\n", cpu_model_name().c_str(),
                 threads, a.budget_s);
    calibrate_cpu(p, *model, threads, a.budget_s);
    std::string why;
    const bool gpu = calibrate_gpu(p, *model, a.gpu_device, &why);
    if (!gpu) {
        std::fprintf(stderr,
                     "calibrate: no GPU measurement (%s): the GPU and link terms stay those of %s, not measured here\n",
                     why.c_str(), a.from.empty() ? "the built-in H200 reference" : a.from.c_str());
    }
    p.source = fmt::format("{}; CPU terms measured; GPU and link terms {}", a.command,
                           gpu ? std::string("measured")
                               : fmt::format("not measured ({}), from {}", why,
                                             a.from.empty() ? std::string("the H200 reference") : a.from));
    p.save(a.output);
    const ExpertShape shape = ExpertShape::of(ExpertLayout::of(*model, model->hp().n_layer_dense));
    std::fprintf(stderr, "%s", CostModel(p, shape, threads, uint64_t(4) << 20).describe().c_str());
    std::fprintf(stderr, "calibrate: wrote %s\n", a.output.c_str());
}

// ---------------------------------------------------------------------------------------------------------------
// simulate

struct SimulateArgs {
    std::string trace, shape = "qwen3-30b-a3b", model, profile, budget = "12GiB", cpu_threshold = "auto",
                policy = "lru", truth, dump, format = "json", label;
    SimConfig config;
    std::string load_balance = "link", link_price = "on";
    bool no_balance = false;  // the old spelling of --load-balance off (commands in committed results use it)
    std::string command;
};

CostCorrections parse_truth(const std::string &text) {
    CostCorrections c;
    if (text.empty()) return c;
    size_t pos = 0;
    while (pos < text.size()) {
        const size_t end = std::min(text.find(',', pos), text.size());
        const std::string item = text.substr(pos, end - pos);
        const size_t eq = item.find('=');
        double v = 0;
        try {
            v = eq == std::string::npos ? 0 : std::stod(item.substr(eq + 1));
        } catch (const std::exception &) {
            v = 0;
        }
        const std::string key = item.substr(0, eq);
        if (!(v > 0) || !std::isfinite(v) || (key != "cpu" && key != "gpu" && key != "link")) {
            fail("--truth: expected cpu=X,gpu=Y,link=Z with positive factors, got '{}'", item);
        }
        (key == "cpu" ? c.cpu : key == "gpu" ? c.gpu : c.link) = v;
        pos = end + 1;
    }
    return c;
}

void run_simulate(SimulateArgs a) {
    log_init(0);
    const RoutingTrace trace = read_trace(a.trace);
    ExpertShape shape;
    std::string shape_name = a.shape;
    if (!a.model.empty()) {
        const auto model = Model::load(a.model);
        shape = ExpertShape::of(ExpertLayout::of(*model, model->hp().n_layer_dense));
        shape_name = a.model;
    } else {
        shape = ExpertShape::named(a.shape);
    }
    const CostProfile profile = a.profile.empty() ? CostProfile::h200_reference() : CostProfile::load(a.profile);
    SimConfig &c = a.config;
    c.budget_bytes = parse_byte_size(a.budget, "--budget");
    c.cpu_threshold = a.cpu_threshold == "auto" ? -1 : [&] {
        try {
            const int v = std::stoi(a.cpu_threshold);
            if (v >= 0) return v;
        } catch (const std::exception &) {
        }
        fail("--cpu-threshold: expected auto or an integer >= 0, got '{}'", a.cpu_threshold);
    }();
    c.policy = parse_eviction_policy(a.policy);
    c.truth = parse_truth(a.truth);
    c.balance = a.no_balance ? LoadBalance::OFF : load_balance_from_name(a.load_balance, "--load-balance");
    c.link_price = a.link_price == "on";
    c.dump_path = a.dump;
    if (c.threads <= 0) c.threads = profile.cpu_threads;
    const auto t0 = std::chrono::steady_clock::now();
    const SimResult r = simulate(trace, shape, profile, c);
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fprintf(stderr, "%s", r.cost_model.c_str());
    std::fprintf(stderr, "simulate: %s, %s routing (%d layers, %d experts, top-%d), budget %s, %s: decode %.2f tok/s "
                         "(bound %.2f), prefill %.1f tok/s, in %.1f s\n",
                 shape.key().c_str(), a.trace.c_str(), trace.n_layer, trace.n_expert, trace.top_k, a.budget.c_str(),
                 c.cpu_threshold < 0 ? "cost-model scheduler" : ("cpu_threshold " + a.cpu_threshold).c_str(),
                 r.decode.tok_s(), r.decode.bound_tok_s(), r.prefill.tok_s(), wall);
    nlohmann::json j = r.to_json();
    j["simulated"] = true;
    j["label"] = a.label;
    j["trace"] = a.trace;
    j["shape"] = shape_name;
    j["expert_bytes"] = shape.bytes;
    j["budget"] = a.budget;
    j["rule"] = c.cpu_threshold < 0 ? "cost" : "threshold " + a.cpu_threshold;
    j["predictor"] = c.predictor;
    j["prefetch_window"] = c.prefetch_window;
    j["profile"] = profile.source;
    j["truth"] = {{"cpu", c.truth.cpu}, {"gpu", c.truth.gpu}, {"link", c.truth.link}};
    j["command"] = a.command;
    if (a.format == "json") {
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("| %s | %s | %s | %s | %.2f | %.2f | %.2f | %.1f | %.3f | %.1f | %.2f |\n", a.label.c_str(),
                    shape_name.c_str(), a.budget.c_str(), j["rule"].get<std::string>().c_str(), r.decode.tok_s(),
                    r.decode.bound_tok_s(), j["decode"]["share_of_bound"].get<double>(), r.prefill.tok_s(),
                    r.decode.totals.hit_rate(), j["decode"]["pcie_bytes_per_token"].get<double>() / 1e6,
                    j["decode"]["cpu_experts_per_token"].get<double>());
    }
}

// ---------------------------------------------------------------------------------------------------------------
// schedule-check

struct CheckArgs {
    std::vector<std::string> inputs;
    int64_t max_states = 0;   // 0: all
    int64_t every = 1;        // take every n-th state
    int32_t time_limit_ms = 10000;
    double target = 0.05;
    std::string json_out;
    std::string command;
};

double percentile(std::vector<double> v, double q) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const double pos = q * double(v.size() - 1);
    const size_t lo = size_t(std::floor(pos)), hi = std::min(lo + 1, v.size() - 1);
    return v[lo] + (v[hi] - v[lo]) * (pos - double(lo));
}

void run_check(const CheckArgs &a) {
    log_init(0);
    struct Row {
        bool decode;
        bool choice;  // a routed expert is missing (CPU or GPU to decide) or a prefetch candidate exists
        double heuristic, optimum, heuristic_critical, optimum_critical, gap;
        bool proven, no_incumbent;
        int32_t binaries;
        std::string where;
    };
    std::vector<Row> rows;
    Scheduler sched;
    sched.reserve(256, 4096);
    LayerPlan plan;
    plan.reserve(256, 4096);
    int64_t seen = 0;
    double ilp_s = 0;
    for (const std::string &path : a.inputs) {
        std::ifstream in(path);
        if (!in) fail("{}: cannot open the layer states", path);
        std::string line;
        int64_t line_no = 0;
        while (std::getline(in, line)) {
            ++line_no;
            if (line.empty()) continue;
            if (seen++ % a.every != 0) continue;
            if (a.max_states > 0 && int64_t(rows.size()) >= a.max_states) break;
            const std::string where = fmt::format("{}:{}", path, line_no);
            nlohmann::json j;
            try {
                j = nlohmann::json::parse(line);
            } catch (const nlohmann::json::exception &e) {
                fail("{}: not valid JSON: {}", where, e.what());
            }
            const LayerState s = LayerState::from_json(j, where);
            sched.plan(s, plan);
            const auto t0 = std::chrono::steady_clock::now();
            IlpOptions o;
            o.time_limit_ms = a.time_limit_ms;
            const IlpResult r = solve_layer_ilp(s, o);
            ilp_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            // No incumbent within the time limit (a large prefill state on a busy machine): the heuristic's plan,
            // which is feasible, is the best known; counted apart so the summary says how often this happened.
            if (!r.feasible && !r.timed_out) fail("{}: the ILP found no solution ({})", where, r.status);
            Row row;
            row.decode = s.n_tokens == 1;
            row.choice = !s.candidates.empty() || std::any_of(s.routed.begin(), s.routed.end(), [](const SchedExpert &x) {
                return x.where == SchedResidency::MISSING && x.site == ExecSite::AUTO;
            });
            row.heuristic = plan.predicted.objective();
            // A proven optimum is the timing model's value of its plan: anything else is a modelling error. A
            // time-limited incumbent is an upper bound (its times need not be tight): its plan's evaluation and
            // the heuristic's are the best known.
            const double scale = std::max({1.0, std::abs(r.objective_us), std::abs(row.heuristic)});
            if (r.optimal && std::abs(r.objective_us - r.plan.predicted.objective()) > 1e-6 * scale) {
                fail("{}: the ILP's objective {:.6f} differs from its plan's evaluation {:.6f} (a modelling error)", where,
                     r.objective_us, r.plan.predicted.objective());
            }
            row.no_incumbent = !r.feasible;
            const LayerPlan &best = r.feasible ? r.plan : plan;
            row.optimum = r.optimal ? r.objective_us : std::min(best.predicted.objective(), row.heuristic);
            row.heuristic_critical = plan.predicted.critical_us;
            row.optimum_critical = best.predicted.critical_us;
            // Relative to the layer's critical path: the objective subtracts residency credit and can be near 0.
            row.gap = (row.heuristic - row.optimum) / std::max(best.predicted.critical_us, 1.0);
            row.proven = r.optimal;
            row.binaries = r.n_binaries;
            row.where = where;
            rows.push_back(row);
        }
    }
    if (rows.empty()) fail("no layer states in {}", fmt::join(a.inputs, ", "));

    nlohmann::json out;
    out["command"] = a.command;
    out["target"] = {{"gap", a.target}, {"share", 0.95}};
    std::string text;
    for (const char *kind : {"all", "with a choice", "decode", "prefill"}) {
        std::vector<double> gaps, crit;
        int64_t within = 0, proven = 0, no_incumbent = 0;
        for (const Row &r : rows) {
            const std::string k = kind;
            if ((k == "decode" && !r.decode) || (k == "prefill" && r.decode) || (k == "with a choice" && !r.choice)) continue;
            gaps.push_back(r.gap);
            crit.push_back(r.optimum_critical > 0 ? (r.heuristic_critical - r.optimum_critical) / r.optimum_critical : 0);
            within += r.gap <= a.target + 1e-12;
            proven += r.proven;
            no_incumbent += r.no_incumbent;
        }
        if (gaps.empty()) continue;
        const double share = double(within) / double(gaps.size());
        out[kind] = {{"states", gaps.size()},
                     {"proven_optimal", proven},
                     {"no_incumbent_at_time_limit", no_incumbent},
                     {"within_target", within},
                     {"share_within_target", share},
                     {"gap_p50", percentile(gaps, 0.5)},
                     {"gap_p90", percentile(gaps, 0.9)},
                     {"gap_p95", percentile(gaps, 0.95)},
                     {"gap_p99", percentile(gaps, 0.99)},
                     {"gap_max", *std::max_element(gaps.begin(), gaps.end())},
                     {"gap_mean", std::accumulate(gaps.begin(), gaps.end(), 0.0) / double(gaps.size())},
                     {"zero_gap_share", double(std::count_if(gaps.begin(), gaps.end(), [](double g) { return g <= 1e-9; })) /
                                            double(gaps.size())},
                     {"critical_path_diff_p50", percentile(crit, 0.5)},
                     {"critical_path_diff_p95", percentile(crit, 0.95)}};
        text += fmt::format("{:>13}: {} states ({} proven optimal, {} without an ILP solution in time): within {:.0f}% of the optimum {:.1f}% | gap p50 {:.4f} "
                            "p95 {:.4f} p99 {:.4f} max {:.4f} | exact {:.1f}%\n",
                            kind, gaps.size(), proven, no_incumbent, a.target * 100, share * 100, percentile(gaps, 0.5),
                            percentile(gaps, 0.95), percentile(gaps, 0.99), out[kind]["gap_max"].get<double>(),
                            out[kind]["zero_gap_share"].get<double>() * 100);
    }
    // The distribution as a histogram of the objective gap (heuristic / optimum - 1).
    const std::vector<double> edges = {-1e9, 1e-9, 0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 1e9};  // first: at the optimum
    nlohmann::json hist = nlohmann::json::array();
    for (size_t b = 0; b + 1 < edges.size(); ++b) {
        int64_t n = 0;
        for (const Row &r : rows) n += r.gap >= edges[b] && r.gap < edges[b + 1];
        hist.push_back({{"from", b == 0 ? 0.0 : edges[b]}, {"to", edges[b + 1] >= 1e9 ? -1.0 : edges[b + 1]}, {"states", n}});
    }
    out["histogram"] = hist;
    const Row &worst = *std::max_element(rows.begin(), rows.end(), [](const Row &x, const Row &y) { return x.gap < y.gap; });
    out["worst"] = {{"state", worst.where}, {"gap", worst.gap}, {"heuristic_us", worst.heuristic}, {"optimum_us", worst.optimum}};
    out["ilp_seconds"] = ilp_s;
    std::printf("schedule-check: the heuristic's objective (critical path + expected stall - residency) against the GLPK "
                "optimum; gap = difference / the optimal plan's critical path\n%s",
                text.c_str());
    std::printf("ILP time %.1f s for %zu states; largest gap %.4f at %s\n", ilp_s, rows.size(), worst.gap,
                worst.where.c_str());
    if (!a.json_out.empty()) {
        write_file_atomic(a.json_out, out.dump(1) + "\n");
    }
}

} // namespace

void register_calibrate(CLI::App &app) {
    auto a = std::make_shared<CalibrateArgs>();
    auto *cmd = app.add_subcommand("calibrate", "measure this machine's cost model for a model and write a profile");
    add_common_flags(*cmd, a->common);
    cmd->add_option("-o,--output", a->output, "profile to write (JSON)")->capture_default_str();
    cmd->add_option("--from", a->from, "start from this profile (default: the built-in H200 reference)")
        ->check(CLI::ExistingFile);
    cmd->add_option("--budget-s", a->budget_s, "seconds for the CPU measurements")->check(finite_range(0.1, 600));
    cmd->add_option("--gpu-device", a->gpu_device, "CUDA device")->check(CLI::Range(0, 1023));
    cmd->callback([a, cmd] {
        a->command = command_line(cmd, "calibrate");
        run_calibrate(*a);
    });
}

void register_simulate(CLI::App &app) {
    auto a = std::make_shared<SimulateArgs>();
    auto *cmd = app.add_subcommand("simulate", "replay a routing trace through cache, predictor and scheduler with a "
                                               "cost profile's timings (simulated, not measured)");
    cmd->add_option("--trace", a->trace, "routing trace (.pstrace)")->required()->check(CLI::ExistingFile);
    cmd->add_option("--shape", a->shape, "expert shape: qwen3-30b-a3b or mixtral-8x7b (Q8_0)")->capture_default_str();
    cmd->add_option("-m,--model", a->model, "take the expert shape from this GGUF instead")->check(CLI::ExistingFile);
    cmd->add_option("--profile", a->profile, "cost profile (default: the built-in H200 reference)")
        ->check(CLI::ExistingFile);
    cmd->add_option("--gpu-expert-budget,--budget", a->budget, "GPU memory for expert slots")->capture_default_str();
    cmd->add_option("--cpu-threshold", a->cpu_threshold, "auto (the scheduler) or the threshold rule's N")
        ->capture_default_str();
    cmd->add_option("--cache-policy", a->policy, "lru, lfu or arc")->capture_default_str();
    cmd->add_option("--predictor", a->config.predictor, "none, frequency, recency or oracle")->capture_default_str();
    cmd->add_option("--prefetch-window", a->config.prefetch_window, "layers ahead")->check(CLI::Range(0, 64));
    cmd->add_option("--prefetch-max", a->config.prefetch_max_per_layer, "prefetches per predicted layer (0: top-k)");
    cmd->add_option("--prefetch-in-flight", a->config.prefetch_in_flight, "prefetch requests outstanding")
        ->check(CLI::Range(1, 1024));
    cmd->add_option("--stream-min-batch", a->config.stream_min_batch, "batches that stream")->check(CLI::Range(0, 1 << 20));
    cmd->add_option("--residency-horizon", a->config.residency_horizon, "steps over which residency is valued")
        ->check(CLI::Range(0, 4096));
    cmd->add_option("-p,--prefill", a->config.prefill_tokens, "prefill batch (tokens, 0: none)")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 16));
    cmd->add_option("-n,--decode", a->config.decode_tokens, "decode steps")->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    cmd->add_option("--first-token", a->config.first_token, "trace token to start at")
        ->check(CLI::Range(int64_t(0), int64_t(1) << 40));
    cmd->add_option("-t,--threads", a->config.threads, "CPU threads of the cost model (default: the profile's)")
        ->check(CLI::Range(1, 1024));
    cmd->add_option("--copy-chunk", a->config.chunk_bytes, "copy chunk bytes")->check(CLI::Range(uint64_t(4096), uint64_t(1) << 30));
    cmd->add_option("--truth", a->truth, "the machine against the profile, e.g. cpu=1.3,link=0.9 (the load balancer "
                                         "corrects toward it)");
    cmd->add_option("--load-balance", a->load_balance,
                    "which terms are learned online (toward --truth): off (the profile as it is, the link free), "
                    "link (the copy speed and the link's busy share) or on (and the CPU and GPU expert times)")
        ->check(CLI::IsMember({"off", "link", "on"}))
        ->capture_default_str();
    cmd->add_option("--link-price", a->link_price,
                    "on or off: prefetches and installs pay for their link time at the square of the link's busy share")
        ->check(CLI::IsMember({"on", "off"}))
        ->capture_default_str();
    cmd->add_flag("--no-balance", a->no_balance, "the same as --load-balance off (its old spelling)");
    cmd->add_option("--dump-layer-states", a->dump, "write every planned layer's state here (JSON lines)");
    cmd->add_option("-o,--output-format", a->format, "json or md")->check(CLI::IsMember({"json", "md"}));
    cmd->add_option("--label", a->label, "free text carried into the output row");
    a->config.threads = 0;
    cmd->callback([a, cmd] {
        a->command = command_line(cmd, "simulate");
        run_simulate(*a);
    });
}

void register_schedule_check(CLI::App &app) {
    auto a = std::make_shared<CheckArgs>();
    auto *cmd = app.add_subcommand("schedule-check", "replay dumped layer states: the scheduler's heuristic against "
                                                     "the ILP optimum (GLPK)");
    cmd->add_option("states", a->inputs, "layer-state files (JSON lines, --dump-layer-states)")
        ->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--max-states", a->max_states, "check at most this many (0: all)")->check(CLI::NonNegativeNumber);
    cmd->add_option("--every", a->every, "take every n-th state")->check(CLI::PositiveNumber);
    cmd->add_option("--time-limit-ms", a->time_limit_ms, "GLPK limit per state")->check(CLI::Range(1, 3600000));
    cmd->add_option("--target", a->target, "gap target")->check(finite_range(0, 10));
    cmd->add_option("--json", a->json_out, "write the distribution here");
    cmd->callback([a, cmd] {
        a->command = command_line(cmd, "schedule-check");
        run_check(*a);
    });
}

} // namespace prescope::cli

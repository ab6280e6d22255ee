// `prescope expert-groups`: expert groups for --gpus N from a routing trace (offload/expert-groups.h), written as
// JSON for --expert-groups, with their balance and dispatch cost on the trace next to consecutive ranges'; or, with
// --check, the same report for a groups file on another trace (held-out routing).
#include "cli.h"

#include "core/error.h"
#include "offload/expert-groups.h"
#include "offload/trace.h"

#include <algorithm>
#include <cstdio>
#include <memory>

namespace prescope::cli {

namespace {

struct ExpertGroupsArgs {
    std::string trace;
    int gpus = 0;
    double tolerance = 0.10;
    std::string output = "expert-groups.json";
    std::string check;
};

// Means over the trace's MoE layers, and the worst layer's load balance.
struct GroupsReport {
    double gpus_per_token = 0, imbalance = 0, worst = 0, co_located = 0;
    int32_t worst_layer = 0;
};

GroupsReport measure(const ExpertGroups &g, const RoutingTrace &t, const RoutingStats &s, const std::string &path) {
    GroupsReport r;
    const std::vector<double> per_token = gpus_per_token(g, t, path);
    for (int32_t l = 0; l < t.n_layer; ++l) {
        const GroupBalance b = group_balance(g, s, l);
        r.gpus_per_token += per_token[size_t(l)] / t.n_layer;
        r.imbalance += b.imbalance / t.n_layer;
        r.co_located += b.co_located / t.n_layer;
        if (b.imbalance > r.worst) r.worst = b.imbalance, r.worst_layer = l;
    }
    return r;
}

void print_report(const char *what, const GroupsReport &r, int32_t top_k) {
    std::fprintf(stderr,
                 "  %-19s GPUs per token and layer %.2f (of top-%d), GPU load max/mean %.3f (worst: MoE layer %d, "
                 "%.3f), co-activated pairs on one GPU %.1f%%\n",
                 what, r.gpus_per_token, top_k, r.imbalance, r.worst_layer, r.worst, 100.0 * r.co_located);
}

void run_expert_groups(const ExpertGroupsArgs &a) {
    const RoutingTrace t = read_trace(a.trace);
    const RoutingStats s = RoutingStats::of_trace(t);
    ExpertGroups g;
    if (!a.check.empty()) {
        g = ExpertGroups::load(a.check);
        g.check_shape(t.n_layer, t.n_expert, a.gpus > 0 ? a.gpus : g.n_gpus, a.check);
    } else {
        if (a.gpus > t.n_expert) {
            fail("--gpus {}: {} has {} experts a layer, fewer than the GPUs that would hold them", a.gpus, a.trace,
                 t.n_expert);
        }
        g = plan_expert_groups(s, a.gpus, a.tolerance);
    }
    std::fprintf(stderr, "expert groups for %d GPUs on %s (%lld tokens, %d MoE layers x %d experts, top-%d):\n",
                 g.n_gpus, a.trace.c_str(), static_cast<long long>(t.n_tokens()), t.n_layer, t.n_expert, t.top_k);
    print_report(a.check.empty() ? "planned:" : "groups of --check:", measure(g, t, s, a.trace), t.top_k);
    const ExpertGroups ranges = ExpertGroups::contiguous(t.n_layer, t.n_expert, g.n_gpus);
    print_report("consecutive ranges:", measure(ranges, t, s, a.trace), t.top_k);
    if (a.check.empty()) {
        g.save(a.output);
        std::fprintf(stderr,
                     "wrote %s (tolerance %.2f: a GPU's load at most %.0f%% of the mean where the shares allow)\n",
                     a.output.c_str(), g.tolerance, 100.0 * (1.0 + g.tolerance));
    }
}

} // namespace

void register_expert_groups(CLI::App &app) {
    auto a = std::make_shared<ExpertGroupsArgs>();
    auto *cmd = app.add_subcommand("expert-groups", "expert groups for --gpus N from a routing trace (co-activated "
                                                    "experts on one GPU, loads balanced), written for --expert-groups");
    cmd->add_option("--trace", a->trace, "routing trace (.pstrace) of the model the groups are for")
        ->required()
        ->check(CLI::ExistingFile);
    cmd->add_option("--gpus", a->gpus, "GPUs (1-8; with --check: must match the file)")->check(CLI::Range(1, 8));
    cmd->add_option("--tolerance", a->tolerance,
                    "a GPU's token load may exceed the mean by this fraction (also the run's drift check)")
        ->check(finite_range(0, 10))
        ->capture_default_str();
    cmd->add_option("-o,--output", a->output, "the groups JSON to write")->capture_default_str();
    cmd->add_option("--check", a->check, "report this groups file on the trace instead of planning")
        ->check(CLI::ExistingFile);
    cmd->callback([a] {
        if (a->check.empty() && a->gpus == 0) fail("--gpus N is required to plan expert groups (or --check FILE)");
        run_expert_groups(*a);
    });
}

} // namespace prescope::cli

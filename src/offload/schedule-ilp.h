// The exact form of PreSched's per-layer problem: evaluate_plan's timing model (offload/scheduler.h) as a
// mixed-integer linear program, solved with GLPK. Used offline (`prescope schedule-check`) to measure how far
// the online heuristic is from the optimum; never on the decode path. Decision: docs/decisions/0081.
#pragma once

#include "offload/scheduler.h"

#include <string>

namespace prescope {

struct IlpOptions {
    int32_t time_limit_ms = 10000;       // GLPK branch-and-bound limit per state
    int32_t max_prefetch_in_flight = 8;  // as SchedulerConfig
};

struct IlpResult {
    bool feasible = false;  // a solution was found (optimal or at the time limit)
    bool optimal = false;   // proven optimal
    double objective_us = 0;  // the ILP's objective (critical path + expected stall)
    LayerPlan plan;           // the solution as a plan; plan.predicted = evaluate_plan of it
    int32_t n_binaries = 0, n_rows = 0;
    std::string status;       // GLPK's outcome in words
};

/// Variables: for each missed expert that may run either way, x = 1 (GPU) or 0 (CPU); its wave (0, or a
/// streamed wave) from its position among the GPU ones in ascending id; one binary per prefetch candidate.
/// Constraints: evaluate_plan's recurrences (host block, split mode, waves, CPU chain) as linear bounds with
/// big-M terms for the indicator cases; prefetches land before their deadline, at most prefetch_room and
/// next_free[d] of them. Objective: critical path + sum of prob x miss_us of the candidates not prefetched.
/// The fetch order (ascending id) and the prefetch order (candidate_priority_order) are fixed, as in the
/// executor and the heuristic; everything else is free.
IlpResult solve_layer_ilp(const LayerState &s, const IlpOptions &options = {});

} // namespace prescope

// Expert parallelism on the host (issue 16): the MoE block over the GPUs of an AllToAll, each GPU holding one
// group of experts (offload/expert-groups.h). Per layer: the dispatch plan (offload/expert-dispatch.h), the
// tokens' hidden states sent to the GPUs that hold their experts, each GPU's experts run, their outputs sent back
// to the tokens' home GPUs and combined in top-k order. On the CPU every GPU's share runs on the host, one GPU
// after another, over FakeAllToAll: the data path of the multi-GPU layer step, testable here (docs/expert-parallel.md).
#pragma once

#include "offload/all-to-all.h"
#include "offload/expert-dispatch.h"
#include "offload/expert-groups.h"
#include "offload/expert-store.h"
#include "runtime/moe.h"

#include <cstdint>
#include <string>
#include <vector>

namespace prescope {

struct ExpertParallelConfig {
    /// Tokens of a layer between two drift checks: when the GPUs' token loads over the recent routing (counts
    /// halved after each check) exceed (1 + groups.tolerance) x their mean, the layer's groups are planned again
    /// from that routing (plan_layer_groups) and kept when they balance it better. 0: the groups never change.
    int64_t drift_window = 4096;
    std::string groups_source = "contiguous ranges";  // where the groups came from (a file), for describe()
};

/// Counters since construction.
struct ExpertParallelStats {
    int64_t steps = 0;           // layer steps
    int64_t token_layers = 0;    // tokens summed over steps
    int64_t dispatch_rows = 0;   // hidden-state rows sent (one per token and GPU holding one of its experts)
    int64_t remote_rows = 0;     // rows of both all-to-alls between two different GPUs
    int64_t replans = 0;         // layers whose groups the drift check replaced
    std::vector<int64_t> gpu_pairs;  // [n_moe_layers][n_gpus] (token, expert) pairs each GPU ran
};

/// PRECONDITIONS: one thread; model and a2a outlive it; groups fit the model (ExpertGroups::check_shape) and
/// a2a.world() == groups.n_gpus. Allocates only in the constructor (and the drift check's re-plan).
class ExpertParallelExecutor final : public ExpertExecutor {
  public:
    /// max_tokens: the most tokens of one run() (Context's n_batch). Throws prescope::Error when the buffers do
    /// not fit the host memory left.
    ExpertParallelExecutor(const Model &model, ExpertGroups groups, AllToAll &a2a, int64_t max_tokens,
                           ExpertParallelConfig config = {});
    /// ExpertExecutor::run: the same out as CpuExpertExecutor, bit for bit, for any groups and number of GPUs.
    void run(int64_t layer, const float *x, const Routing &r, float *out) override;

    const ExpertGroups &groups() const { return groups_; }
    const DispatchPlan &last_plan() const { return plan_; }
    const ExpertParallelStats &stats() const { return stats_; }
    /// One line for the start-up banner: GPUs, transport, where the groups come from.
    std::string describe() const;
    /// Lines printed at exit: GPUs per token and layer, rows between GPUs, the GPUs' load balance, re-plans.
    std::string stats_text() const;

  private:
    const Model &model_;
    ExpertGroups groups_;
    AllToAll &a2a_;
    ExpertParallelConfig config_;
    ExpertStore store_;  // the experts read in place from the mapping, as the CPU engine reads them
    CpuExpertRunner runner_;
    DispatchPlan plan_;
    RoutingStats window_;     // the recent routing of each layer (drift check); empty when drift_window is 0
    ExpertGroups replanned_;  // scratch of the drift check
    ExpertParallelStats stats_;
    std::vector<int32_t> home_;  // [max_tokens]
    size_t row_bytes_;
    // Every GPU's buffers of one step, back to back (GPU g's after GPU g-1's), [rows][n_embd] F32 each.
    std::vector<float> dispatch_send_, dispatch_recv_, pair_out_, combine_send_, combine_recv_;
    std::vector<const void *> send_ptr_;  // [n_gpus]
    std::vector<void *> recv_ptr_;        // [n_gpus]
};

} // namespace prescope

// The dispatch and combine of one MoE layer over several GPUs, as plain data (issue 16): which hidden-state rows
// each GPU sends each other GPU, which experts each GPU runs on which received rows, and where each expert output
// lands when it comes back to the token's home GPU for the combine. Built on the host from the routing and the
// expert groups (offload/expert-groups.h); run by the expert-parallel executor (runtime/expert-parallel.h) over
// two all-to-alls (offload/all-to-all.h).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace prescope {

/// The experts one GPU runs in a layer step: the layout CpuExpertRunner::run and the GPU's grouped products read.
struct GpuWork {
    std::vector<int32_t> experts;  // [n] routed experts the GPU holds, ascending id
    std::vector<int32_t> offsets;  // [n + 1] pairs of experts[i]: [offsets[i], offsets[i + 1]), in token order
    std::vector<int32_t> rows;     // [pairs] row of the GPU's dispatch receive buffer that each pair reads
    std::vector<int32_t> send;     // [pairs] the combine's send order: the pair (index above) of each output row the
                                   // GPU returns, by home GPU, then token, then top-k slot
    int32_t n() const { return int32_t(experts.size()); }
    int64_t pairs() const { return offsets.empty() ? 0 : offsets.back(); }
};

/// One layer step of expert parallelism over n_gpus GPUs. Row counts are [sender][receiver] matrices; a sender's
/// buffer holds its segments in receiver order and a receiver's buffer its segments in sender order (the layout of
/// AllToAll::exchange). Sized by reserve(); build_dispatch_plan allocates nothing within those sizes.
///
/// Per expert, the pairs are those of the one-GPU MoE block (runtime/hybrid-moe.h: every pair of the expert, in
/// token order), and the combine adds each token's k outputs in top-k order: the result is the one-GPU result.
struct DispatchPlan {
    int32_t n_gpus = 1;
    int64_t n_tok = 0, k = 0;
    std::vector<int32_t> home;             // [n_tok] GPU that holds token t's hidden state and gets its output back
    std::vector<int64_t> dispatch_rows;    // [n_gpus][n_gpus] hidden-state rows GPU s sends GPU d: one for each
                                           // token of s with at least one routed expert on d
    std::vector<int32_t> dispatch_tokens;  // [sum of dispatch_rows] the token of each row, by sender, receiver, token
    std::vector<GpuWork> work;             // [n_gpus]
    std::vector<int64_t> combine_rows;     // [n_gpus][n_gpus] expert-output rows GPU d returns GPU s: d's pairs of
                                           // tokens whose home is s
    std::vector<int32_t> pair_row;         // [n_tok][k] row of pair (t, j)'s output in home[t]'s combine receive buffer

    /// Sizes every array for up to max_tokens tokens of top-k routing over n_experts experts.
    void reserve(int32_t n_gpus, int64_t max_tokens, int64_t k, int32_t n_experts);
    /// Rows GPU g sends / receives in the dispatch (first all-to-all) and the combine (second).
    int64_t dispatch_sent(int32_t g) const { return row_sum(dispatch_rows, g, true); }
    int64_t dispatch_received(int32_t g) const { return row_sum(dispatch_rows, g, false); }
    int64_t combine_sent(int32_t g) const { return row_sum(combine_rows, g, true); }
    int64_t combine_received(int32_t g) const { return row_sum(combine_rows, g, false); }

    // Scratch of build_dispatch_plan.
    std::vector<uint8_t> gpu_mask;     // [n_tok] bit g: the token has a routed expert on GPU g
    std::vector<int32_t> by_home;      // [n_tok] tokens ordered by home GPU, then token
    std::vector<int32_t> recv_row;     // [n_tok][n_gpus] row of token t in GPU g's dispatch receive buffer
    std::vector<int32_t> pair_index;   // [n_tok][k] pair of (t, j) in its GPU's GpuWork
    std::vector<int32_t> fill;         // [n_experts] next pair of each expert
    std::vector<int32_t> at;           // [n_gpus][n_gpus] running row of each segment

  private:
    int64_t row_sum(const std::vector<int64_t> &m, int32_t g, bool sender) const;
};

/// Token t's home is GPU t * n_gpus / n_tok: consecutive ranges of nearly equal size, in token order (the CPU
/// executor's choice; on GPUs it is the GPU that ran the token's attention). home.size() is n_tok.
void contiguous_homes(int32_t n_gpus, std::span<int32_t> home);

/// Fills `plan` for one layer. ids: [n_tok][k] routed experts (distinct per token, in [0, gpu_of_expert.size()));
/// gpu_of_expert: the layer's row of the expert groups; home: [n_tok] home GPU of each token, in [0, n_gpus).
/// PRECONDITION: plan.reserve(n_gpus, >= n_tok, k, gpu_of_expert.size()) was called.
void build_dispatch_plan(std::span<const int32_t> ids, int64_t k, std::span<const int8_t> gpu_of_expert,
                         std::span<const int32_t> home, DispatchPlan &plan);

} // namespace prescope

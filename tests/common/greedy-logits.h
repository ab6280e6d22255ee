// Every logit of a fixed prompt and a few greedy steps through a Context: the runs that executor tests compare bit
// for bit.
#pragma once

#include "runtime/context.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace prescope::test {

/// Prefill of n_prompt fixed tokens ((i * 37 + 5) % n_vocab) in passes of n_batch with all logits, then n_decode
/// greedy steps; every logit of every step, in order. executor: the MoE executor (nullptr: the CPU engine's own).
inline std::vector<float> greedy_logits(const Model &model, ExpertExecutor *executor, int64_t n_ctx, int64_t n_batch,
                                        int n_prompt, int n_decode) {
    Context ctx(model, {n_ctx, n_batch}, executor);
    std::vector<int32_t> prompt;
    for (int i = 0; i < n_prompt; ++i) prompt.push_back(int32_t((i * 37 + 5) % model.hp().n_vocab));
    ctx.eval(prompt, /*all_logits=*/true);
    std::vector<float> all = ctx.logits();
    for (int i = 0; i < n_decode; ++i) {
        const float *l = ctx.logits().data() + ctx.logits().size() - size_t(model.hp().n_vocab);
        const auto next = int32_t(std::max_element(l, l + model.hp().n_vocab) - l);
        ctx.eval({&next, 1});
        all.insert(all.end(), ctx.logits().begin(), ctx.logits().end());
    }
    return all;
}

} // namespace prescope::test

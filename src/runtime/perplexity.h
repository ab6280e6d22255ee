// Perplexity with llama.cpp's protocol (tools/perplexity/perplexity.cpp, perplexity()): the token
// stream is cut into chunks of n_ctx tokens; each chunk starts from an empty KV cache, its first
// token replaced by BOS when the model adds BOS; only the second half of each chunk is scored
// (the logit at position i predicts token i+1 for i in [n_ctx/2, n_ctx-2]).
#pragma once

#include "runtime/context.h"

#include <cstdint>
#include <functional>
#include <vector>

namespace prescope {

struct PerplexityResult {
    double ppl = 0.0;       // exp(mean negative log-likelihood)
    double ppl_error = 0.0; // standard error of ppl, as llama.cpp reports "+/-"
    int64_t n_chunks = 0;
    int64_t n_scored = 0;   // tokens whose log-likelihood was counted
};

/// tokens: the tokenized text (with BOS first if the model adds one). ctx must have n_ctx() >=
/// n_ctx. bos < 0: no BOS substitution. progress(chunk, running ppl) is called after each chunk.
/// Throws prescope::Error when there are fewer than 2 * n_ctx tokens (llama.cpp's requirement).
PerplexityResult perplexity(Context &ctx, std::vector<int32_t> tokens, int64_t n_ctx, int32_t bos,
                            const std::function<void(int64_t, double)> &progress = {});

} // namespace prescope

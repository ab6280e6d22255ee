#include "runtime/perplexity.h"

#include "core/error.h"

#include <cmath>

namespace prescope {

PerplexityResult perplexity(Context &ctx, std::vector<int32_t> tokens, int64_t n_ctx, int32_t bos,
                            const std::function<void(int64_t, double)> &progress) {
    if (n_ctx < 3) {
        fail("perplexity scores the second half of each chunk: it needs a context of at least 3 tokens, got {}", n_ctx);
    }
    if (int64_t(tokens.size()) < 2 * n_ctx) {
        fail("perplexity needs at least {} tokens (2 x context {}), the text has {}", 2 * n_ctx, n_ctx, tokens.size());
    }
    if (ctx.n_ctx() < n_ctx) fail("perplexity: context {} is smaller than the chunk size {}", ctx.n_ctx(), n_ctx);
    const int64_t n_vocab = ctx.model().hp().n_vocab;
    const int64_t n_chunks = int64_t(tokens.size()) / n_ctx, first = n_ctx / 2;
    double nll = 0.0, nll2 = 0.0;
    int64_t count = 0;
    for (int64_t c = 0; c < n_chunks; ++c) {
        std::vector<int32_t> chunk(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx);
        if (bos >= 0) chunk[0] = bos;
        ctx.clear();
        ctx.eval(chunk, /*all_logits=*/true);
        const float *logits = ctx.logits().data();
        for (int64_t i = first; i < n_ctx - 1; ++i) {
            // log_softmax of the next token, in double as llama.cpp's log_softmax().
            const float *row = logits + i * n_vocab;
            float max_l = row[0];
            for (int64_t v = 1; v < n_vocab; ++v) max_l = std::max(max_l, row[v]);
            double sum = 0.0;
            for (int64_t v = 0; v < n_vocab; ++v) sum += std::exp(double(row[v] - max_l));
            const double lp = double(row[chunk[size_t(i + 1)]] - max_l) - std::log(sum);
            nll -= lp;
            nll2 += lp * lp;
            ++count;
        }
        if (!std::isfinite(nll)) {
            fail("perplexity: chunk {} gives a non-finite log-likelihood: the model produced NaN or infinite logits",
                 c);
        }
        if (progress) progress(c, std::exp(nll / double(count)));
    }
    PerplexityResult r;
    r.n_chunks = n_chunks;
    r.n_scored = count;
    const double mean = nll / double(count);
    r.ppl = std::exp(mean);
    const double var = nll2 / double(count) - mean * mean;
    r.ppl_error = var > 0 && count > 1 ? std::sqrt(var / double(count - 1)) * r.ppl : 0.0;
    return r;
}

} // namespace prescope

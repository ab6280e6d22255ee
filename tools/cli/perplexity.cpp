// prescope perplexity: llama.cpp's llama-perplexity protocol on a text file (see runtime/perplexity.h).
#include "cli.h"

#include "arch/arch.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/perplexity.h"
#include "runtime/tokenizer.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace prescope::cli {

void register_perplexity(CLI::App &app) {
    struct Args {
        CommonArgs common;
        std::string text_file;
    };
    auto a = std::make_shared<Args>();
    a->common.n_ctx = 512;  // llama-perplexity's default chunk size
    auto *cmd = app.add_subcommand("perplexity", "perplexity of a text file (llama-perplexity protocol)");
    add_common_flags(*cmd, a->common);
    cmd->add_option("-f,--file", a->text_file, "text file")->required();
    cmd->callback([a]() {
        apply_common(a->common);
        const auto model = Model::load(a->common.model);
        const Tokenizer tok = Tokenizer::from_gguf(model->file());
        std::ifstream in(a->text_file, std::ios::binary);
        if (!in) fail("{}: cannot read the text file", a->text_file);
        std::stringstream ss;
        ss << in.rdbuf();
        const std::vector<int32_t> tokens = tok.encode(ss.str(), /*add_special=*/true, /*parse_special=*/false);
        const int64_t n_ctx = a->common.n_ctx;
        // Before the Context: -c 0 would otherwise mean "the model's context" there and a batch of 0 tokens.
        if (n_ctx < 3) {
            fail("perplexity needs a context of at least 3 tokens (it scores each chunk's second half), got -c {}",
                 n_ctx);
        }
        Context ctx(*model, {n_ctx, std::min(a->common.n_batch, n_ctx), 1, a->common.deterministic});
        const auto t0 = std::chrono::steady_clock::now();
        const PerplexityResult r = perplexity(ctx, tokens, n_ctx, tok.add_bos() ? tok.bos() : -1,
                                              [](int64_t chunk, double ppl) {
                                                  std::fprintf(stderr, "[%lld]%.4f,", (long long)chunk + 1, ppl);
                                              });
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "\n%lld tokens in %lld chunks of %lld, %.1f tok/s\n", (long long)tokens.size(),
                     (long long)r.n_chunks, (long long)n_ctx, double(r.n_chunks * n_ctx) / s);
        std::printf("Final estimate: PPL = %.4f +/- %.5f\n", r.ppl, r.ppl_error);
    });
}

} // namespace prescope::cli

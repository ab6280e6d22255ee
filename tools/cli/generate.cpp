// prescope generate: prompt -> streamed completion on stdout; logs and one stats line on stderr.
#include "cli.h"
#include "offload.h"

#include "arch/arch.h"
#include "core/error.h"
#include "core/log.h"
#include "runtime/chat-template.h"
#include "runtime/engine.h"
#include "runtime/sampler.h"
#include "runtime/tokenizer.h"

#include <fmt/ranges.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <limits>
#include <span>
#include <sstream>

namespace prescope::cli {

namespace {

struct GenerateArgs {
    CommonArgs common;
    std::string prompt;       // -p
    std::string prompt_file;  // -f
    int64_t n_predict = -1;   // -n; -1: until end of generation or a full context
    bool chat = false;        // --chat: wrap the prompt as a user turn in the model's chat template
    bool chat_special = false;  // --chat-special: special-token text in the --chat prompt is control tokens
    bool verbose_prompt = false;  // --verbose-prompt: print the prompt's and the output's token ids
    SamplerParams sampling;
    OffloadArgs offload;      // --gpu-expert-budget, --config, ... (offload.h)
};

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
}

std::string read_file(const std::string &path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) fail("{}: cannot read the prompt file", path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
}

void run_generate(const GenerateArgs &a) {
    apply_common(a.common);
    const auto model = Model::load(a.common.model);
    const Tokenizer tok = Tokenizer::from_gguf(model->file());
    std::string prompt = a.prompt_file.empty() ? a.prompt : read_file(a.prompt_file);
    std::vector<int32_t> prompt_ids;
    if (a.chat) {
        // The user's text stays text: a literal "<|im_end|>" in it must not close the turn (decision 0104).
        const ChatPrompt chat = render_chat(model->file(), {{"user", prompt}}, /*add_generation_prompt=*/true);
        prompt = chat.text;
        prompt_ids = tok.encode(chat.text, /*add_special=*/true, /*parse_special=*/true,
                                a.chat_special ? std::span<const TextSpan>() : std::span<const TextSpan>(chat.content));
    } else {
        // A raw prompt is the user's own template: special-token text in it is meant (llama.cpp does the same).
        prompt_ids = tok.encode(prompt, /*add_special=*/true, /*parse_special=*/true);
    }
    if (prompt_ids.empty()) fail("the prompt is empty: pass -p TEXT or -f FILE");
    if (a.verbose_prompt) {
        // llama.cpp's --verbose-prompt lines.
        std::fprintf(stderr, "prompt: '%s'\nnumber of tokens in prompt = %zu\n", prompt.c_str(), prompt_ids.size());
        for (int32_t t : prompt_ids) std::fprintf(stderr, "%6d -> '%s'\n", t, tok.token_to_piece(t).c_str());
    }

    const OffloadConfig offload = resolve_offload(a.offload);
    const std::unique_ptr<Engine> engine = make_engine(*model, {a.common.n_ctx, a.common.n_batch, 1, a.common.deterministic}, offload);
    Engine &ctx = *engine;
    print_startup(offload, ctx);
    if (int64_t(prompt_ids.size()) >= ctx.n_ctx()) {
        fail("the prompt is {} tokens; the context of {} tokens must also hold the generated ones (use a larger -c)",
             prompt_ids.size(), ctx.n_ctx());
    }
    SamplerParams sampling = a.sampling;
    if (sampling.repeat_last_n < 0) sampling.repeat_last_n = int32_t(std::min<int64_t>(ctx.n_ctx(), INT32_MAX));
    Sampler sampler(sampling);
    spdlog::info("{}: {} | seed {} | prompt {} tokens", model->file().path(), model->hp().arch, sampler.seed(),
                 prompt_ids.size());
    for (int32_t t : prompt_ids) sampler.accept(t);

    const auto t_start = Clock::now();
    ctx.eval(prompt_ids);
    const double prefill_s = seconds_since(t_start);
    double ttft_s = 0.0;
    int64_t n_decoded = 0;  // forward passes of single generated tokens
    const auto t_decode = Clock::now();
    TokenTextStream stream(tok);
    std::vector<int32_t> output_ids;
    // Models may pad the embedding past the tokenizer's vocabulary; padded ids are never sampled.
    const int64_t n_sample = std::min<int64_t>(model->hp().n_vocab, tok.n_vocab());
    bool context_full = false;
    for (int64_t i = 0; a.n_predict < 0 || i < a.n_predict; ++i) {
        const int32_t next = sampler.sample(ctx.logits().data(), n_sample);
        if (i == 0) ttft_s = seconds_since(t_start);
        if (tok.is_eog(next)) break;
        sampler.accept(next);
        output_ids.push_back(next);
        std::fputs(stream.push(next).c_str(), stdout);
        std::fflush(stdout);
        if (ctx.n_past() >= ctx.n_ctx()) {
            context_full = a.n_predict < 0 || i + 1 < a.n_predict;
            break;
        }
        if (a.n_predict >= 0 && i + 1 == a.n_predict) break;  // no forward pass for a token never sampled
        ctx.eval({&next, 1});
        ++n_decoded;
    }
    std::fputs(stream.flush().c_str(), stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    if (context_full) {
        // Said whatever the log level: output that ends mid-sentence needs a reason.
        std::fprintf(stderr, "generation stopped after %zu tokens: the context of %lld tokens is full (use a larger -c)\n",
                     output_ids.size(), (long long)ctx.n_ctx());
    }
    if (a.verbose_prompt) {
        std::fprintf(stderr, "output tokens = %zu: [%s]\n", output_ids.size(),
                     fmt::format("{}", fmt::join(output_ids, ", ")).c_str());
    }
    const double decode_s = seconds_since(t_decode);
    const std::vector<float> &logits = ctx.logits();
    std::fprintf(stderr,
                 "stats: prompt tokens %zu | prefill %.1f tok/s | decode %.1f tok/s (%lld tokens) | "
                 "ttft %.1f ms | peak RSS %.1f MiB | last logits hash %016llx\n",
                 prompt_ids.size(), double(prompt_ids.size()) / prefill_s,
                 n_decoded > 0 ? double(n_decoded) / decode_s : 0.0, (long long)n_decoded, ttft_s * 1e3,
                 peak_rss_mib(), (unsigned long long)hash_floats(logits.data(), logits.size()));
    print_counters(ctx);
}

} // namespace

void register_generate(CLI::App &app) {
    auto a = std::make_shared<GenerateArgs>();
    auto *cmd = app.add_subcommand("generate", "generate text from a prompt");
    add_common_flags(*cmd, a->common);
    auto *p = cmd->add_option("-p,--prompt", a->prompt, "prompt text");
    cmd->add_option("-f,--file", a->prompt_file, "read the prompt from a file")->excludes(p);
    cmd->add_option("-n,--n-predict", a->n_predict, "tokens to generate (-1: until end of text)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(-1), int64_t(1) << 24));
    cmd->add_flag("--chat", a->chat,
                  "wrap the prompt in the model's chat template (ChatML, Qwen3, Mistral [INST], gpt-oss harmony)");
    cmd->add_flag("--chat-special", a->chat_special,
                  "with --chat: special-token text in the prompt (e.g. <|im_end|>) becomes control tokens "
                  "(default: it stays plain text)");
    cmd->add_flag("--verbose-prompt", a->verbose_prompt,
                  "print the prompt's token ids and pieces before generating, and the output's ids after");
    SamplerParams &s = a->sampling;
    cmd->add_option("--temp", s.temp, "temperature (0: greedy)")->capture_default_str()->check(finite_range(0, 1e3));
    // llama.cpp switches top-k off with 0 or a negative value; -1 is what its users write.
    cmd->add_option("--top-k", s.top_k, "top-k sampling (0 or -1: off)")
        ->capture_default_str()
        ->check(CLI::Range(-1, std::numeric_limits<int32_t>::max()));
    cmd->add_option("--top-p", s.top_p, "top-p sampling (1: off)")->capture_default_str()->check(finite_range(0, 1));
    cmd->add_option("--min-p", s.min_p, "min-p sampling (0: off)")->capture_default_str()->check(finite_range(0, 1));
    cmd->add_option("--repeat-penalty", s.repeat_penalty, "repetition penalty (1: off)")
        ->capture_default_str()
        ->check(finite_range(1e-3, 1e3));
    cmd->add_option("--repeat-last-n", s.repeat_last_n, "tokens the penalty looks back over (0: off, -1: the context)")
        ->capture_default_str()
        ->check(CLI::Range(-1, std::numeric_limits<int32_t>::max()));
    // llama.cpp's -1 (and no --seed) draw a random seed.
    cmd->add_option_function<int64_t>(
           "-s,--seed", [&s](int64_t v) { s.seed = v < 0 ? 0xFFFFFFFFu : uint32_t(v); }, "RNG seed (-1 or none: random)")
        ->check(CLI::Range(int64_t(-1), int64_t(0xFFFFFFFE)));
    add_offload_flags(*cmd, a->offload);
    cmd->callback([a]() { run_generate(*a); });
}

} // namespace prescope::cli

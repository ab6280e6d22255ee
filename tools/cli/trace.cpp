// prescope trace: runs a model over prompts and records routing (and optionally router inputs) in the trace
// format of docs/trace-format.md; a progress bar on stderr.
#include "cli.h"

#include "arch/arch.h"
#include "core/error.h"
#include "core/log.h"
#include "core/output-file.h"
#include "offload/trace.h"
#include "runtime/context.h"
#include "runtime/tokenizer.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <limits>

namespace prescope::cli {

namespace {

struct TraceArgs {
    CommonArgs common;
    std::string input, output, hidden;
    int64_t n_generate = 0;    // -n: greedy tokens generated (and recorded) after each prompt
    int64_t max_prompts = 0;   // 0: all
    std::string source = "prompts";
    std::string model_name;    // default: the GGUF file's stem
    int level = 12;
    std::string command_line;
};

// A one-line progress bar: redrawn in place on a terminal, one line per 10% otherwise.
class Progress {
  public:
    explicit Progress(int64_t total) : total_(std::max<int64_t>(total, 1)), tty_(isatty(2) != 0) {}
    void update(int64_t done) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
        const double frac = std::min(1.0, double(done) / double(total_));
        const double rate = s > 0 ? double(done) / s : 0.0;
        const double eta = rate > 0 ? double(total_ - done) / rate : 0.0;
        const int width = 30, filled = int(frac * width);
        if (tty_) {
            std::fprintf(stderr, "\r[%s%s] %3.0f%% %lld/%lld tokens %.1f tok/s ETA %.0fs ", std::string(size_t(filled), '#').c_str(),
                         std::string(size_t(width - filled), '.').c_str(), frac * 100, (long long)done,
                         (long long)total_, rate, eta);
        } else if (int(frac * 10) > last_decile_) {
            last_decile_ = int(frac * 10);
            std::fprintf(stderr, "trace: %3.0f%% %lld/%lld tokens %.1f tok/s ETA %.0fs\n", frac * 100,
                         (long long)done, (long long)total_, rate, eta);
        }
    }
    void finish() {
        if (tty_) std::fputc('\n', stderr);
    }

  private:
    int64_t total_;
    bool tty_;
    int last_decile_ = -1;
    std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

void run_trace(const TraceArgs &a) {
    apply_common(a.common);
    const auto model = Model::load(a.common.model);
    const Tokenizer tok = Tokenizer::from_gguf(model->file());
    std::vector<TracePrompt> prompts = read_prompt_file(a.input, a.source);
    if (a.max_prompts > 0 && int64_t(prompts.size()) > a.max_prompts) prompts.resize(size_t(a.max_prompts));
    if (prompts.empty()) fail("{}: no prompts", a.input);
    // The outputs are created under temporary names now (failing before recording, not after) and renamed
    // together once both are complete: an error or a full disk leaves neither behind.
    OutputFile trace_out(a.output);
    std::optional<OutputFile> hidden_out;
    if (!a.hidden.empty()) hidden_out.emplace(a.hidden);

    Context ctx(*model, {a.common.n_ctx, a.common.n_batch, 1, a.common.deterministic});
    if (a.n_generate >= ctx.n_ctx()) fail("-n {} leaves no room for a prompt in a context of {}", a.n_generate, ctx.n_ctx());
    const std::string name = a.model_name.empty() ? std::filesystem::path(a.common.model).stem().string() : a.model_name;
    TraceRecorder rec(ctx, name, a.command_line, !a.hidden.empty());

    std::vector<std::vector<int32_t>> ids;
    int64_t total = 0;
    for (const auto &p : prompts) {
        ids.push_back(tok.encode(p.text, /*add_special=*/true, /*parse_special=*/false));
        auto &v = ids.back();
        const auto room = size_t(ctx.n_ctx() - a.n_generate);
        if (v.size() > room) {
            spdlog::warn("{}: prompt of {} tokens cut to {} to fit the context", p.name, v.size(), room);
            v.resize(room);
        }
        total += int64_t(v.size()) + a.n_generate;
    }
    Progress bar(total);
    int64_t done = 0;
    const int64_t n_vocab = model->hp().n_vocab;
    for (size_t i = 0; i < prompts.size(); ++i) {
        if (ids[i].empty()) continue;
        ctx.clear();
        rec.begin_sequence(prompts[i].name, prompts[i].source);
        for (size_t off = 0; off < ids[i].size(); off += size_t(a.common.n_batch)) {
            const std::span<const int32_t> chunk(ids[i].data() + off, std::min(ids[i].size() - off, size_t(a.common.n_batch)));
            ctx.eval(chunk);
            rec.add_tokens(chunk);
            done += int64_t(chunk.size());
            bar.update(done);
        }
        for (int64_t g = 0; g < a.n_generate; ++g) {
            const std::vector<float> &logits = ctx.logits();
            const int32_t next = int32_t(std::max_element(logits.begin(), logits.begin() + n_vocab) - logits.begin());
            if (tok.is_eog(next)) break;  // greedy; the sequence ends early
            ctx.eval({&next, 1});
            rec.add_tokens({&next, 1});
            bar.update(++done);
        }
    }
    bar.finish();
    trace_out.write(encode_trace(a.output, rec.trace(), a.level));
    if (hidden_out) {
        HiddenTrace h = rec.hidden();
        h.trace = std::filesystem::path(a.output).filename().string();
        hidden_out->write(encode_hidden(a.hidden, h, a.level));
        hidden_out->commit();
    }
    trace_out.commit();
    std::fprintf(stderr, "%s: %lld tokens in %zu sequences, %d MoE layers (from model layer %d), %d experts, top-%d\n",
                 a.output.c_str(), (long long)rec.trace().n_tokens(), rec.trace().sequences.size(),
                 rec.trace().n_layer, rec.trace().first_moe_layer, rec.trace().n_expert, rec.trace().top_k);
    if (hidden_out) {
        std::fprintf(stderr, "%s: router inputs of %lld tokens, dim %lld\n", a.hidden.c_str(),
                     (long long)rec.hidden().n_tokens(), (long long)rec.hidden().dim);
    }
}

} // namespace

void register_trace(CLI::App &app) {
    auto a = std::make_shared<TraceArgs>();
    auto *cmd = app.add_subcommand("trace", "record routing traces (docs/trace-format.md) over a prompt file");
    add_common_flags(*cmd, a->common);
    cmd->add_option("-i,--input", a->input,
                    "prompts: JSONL lines with a \"text\" or \"prompt\" field (optional \"name\", \"source\"), "
                    "or plain text lines")->required()->check(CLI::ExistingFile);
    cmd->add_option("-o,--output", a->output, "trace file to write (.pstrace)")->required();
    cmd->add_option("--hidden", a->hidden, "also write the router inputs to this sidecar (NAME.hidden.zst)");
    cmd->add_option("-n,--n-predict", a->n_generate, "greedy tokens to generate and record after each prompt")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    cmd->add_option("--max-prompts", a->max_prompts, "use at most this many prompts (0: all)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), std::numeric_limits<int64_t>::max()));
    cmd->add_option("--source", a->source, "source of prompts without a \"source\" field")->capture_default_str();
    cmd->add_option("--model-name", a->model_name, "model name in the trace header (default: the GGUF file name)");
    cmd->add_option("--zstd-level", a->level, "zstd compression level (1-19)")->capture_default_str()->check(CLI::Range(1, 19));
    cmd->callback([a, cmd]() {
        a->command_line = "prescope trace";
        for (const auto &opt : cmd->get_options()) {
            for (const auto &r : opt->results()) a->command_line += fmt::format(" {} {}", opt->get_name(), r);
        }
        run_trace(*a);
    });
}

} // namespace prescope::cli

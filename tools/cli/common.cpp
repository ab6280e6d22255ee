#include "cli.h"

#include "backend/cpu/ops.h"
#include "core/log.h"

#include <sys/resource.h>

#include <cmath>
#include <exception>
#include <string>

namespace prescope::cli {

void add_common_flags(CLI::App &app, CommonArgs &args) {
    app.add_option("-m,--model", args.model, "model file (GGUF)")->required()->check(CLI::ExistingFile);
    app.add_option("-t,--threads", args.threads, "CPU threads (default: physical cores)")->check(CLI::Range(1, 1024));
    app.add_option("-c,--ctx-size", args.n_ctx, "context size in tokens (0: the model's)")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(0), int64_t(1) << 24));
    app.add_option("-b,--batch-size", args.n_batch, "tokens per forward pass")
        ->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(1) << 24));
    app.add_flag("--deterministic", args.deterministic,
                 "batch-invariant kernels: a sequence's logits bit-identical whatever else is in the batch and "
                 "however its prompt is split (slower decode on the CPU; docs/decisions/0111-batch-invariance.md)");
    app.add_flag("-v,--verbose", args.verbosity, "more logging (repeat for debug)");
}

CLI::Validator finite_range(double lo, double hi, bool hi_open) {
    const char close = hi_open ? ')' : ']';
    return CLI::Validator(
        [lo, hi, hi_open, close](std::string &text) -> std::string {
            double v = 0;
            size_t used = 0;
            try {
                v = std::stod(text, &used);
            } catch (const std::exception &) {
                used = 0;
            }
            if (used != text.size() || !std::isfinite(v) || v < lo || v > hi || (hi_open && v == hi)) {
                return fmt::format("expected a number in [{}, {}{}, got '{}'", lo, hi, close, text);
            }
            return {};
        },
        fmt::format("NUMBER in [{}, {}{}", lo, hi, close));
}

void apply_common(const CommonArgs &args) {
    log_init(args.verbosity);
    cpu::set_threads(args.threads);
    spdlog::info("threads: {}", cpu::get_threads());
}

double peak_rss_mib() {
    struct rusage ru {};
    getrusage(RUSAGE_SELF, &ru);
    return double(ru.ru_maxrss) / 1024.0;
}

uint64_t hash_floats(const float *x, size_t n) {
    const auto *p = reinterpret_cast<const unsigned char *>(x);
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n * sizeof(float); ++i) {
        h ^= p[i];
        h *= 1099511628211ull;
    }
    return h;
}

} // namespace prescope::cli

// Shared pieces of the prescope subcommands: common flags and run statistics.
#pragma once

#include "runtime/sampler.h"

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>

namespace prescope::cli {

/// Flags every model-running subcommand takes (llama.cpp spelling where the meaning is the same).
struct CommonArgs {
    std::string model;       // -m
    int threads = 0;         // -t; 0: physical cores
    int64_t n_ctx = 4096;    // -c; 0: the model's training context
    int64_t n_batch = 512;   // -b
    bool deterministic = false;  // --deterministic: batch-invariant kernels (ContextParams::deterministic)
    int verbosity = 0;       // -v (repeatable)
};
void add_common_flags(CLI::App &app, CommonArgs &args);
/// CLI11 check for a floating-point flag: a finite number in [lo, hi], or [lo, hi) with hi_open (CLI::Range
/// lets NaN through).
CLI::Validator finite_range(double lo, double hi, bool hi_open = false);
/// Applies -t and -v; call first in every subcommand.
void apply_common(const CommonArgs &args);

/// Peak resident set size of this process in MiB (getrusage ru_maxrss).
double peak_rss_mib();
/// FNV-1a 64-bit hash of a float buffer's bytes, to compare runs (calm prints the same).
uint64_t hash_floats(const float *x, size_t n);

void register_generate(CLI::App &app);
void register_perplexity(CLI::App &app);
void register_inspect(CLI::App &app);
void register_bench(CLI::App &app);
void register_tokenize(CLI::App &app);
void register_trace(CLI::App &app);
void register_train_predictor(CLI::App &app);
void register_eval_predictor(CLI::App &app);
void register_calibrate(CLI::App &app);
void register_simulate(CLI::App &app);
void register_schedule_check(CLI::App &app);
void register_serve(CLI::App &app);
void register_expert_groups(CLI::App &app);

} // namespace prescope::cli

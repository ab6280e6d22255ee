// The offloading flags shared by `prescope generate` and `prescope bench` (docs/style R14: one table of
// flags, each the twin of a config-file key), and the start-up and exit reports of the engine they pick.
#pragma once

#include "offload/offload-config.h"
#include "runtime/engine.h"

#include <CLI/CLI.hpp>

#include <string>
#include <utility>
#include <vector>

namespace prescope::cli {

struct OffloadArgs {
    std::string config_file;                                 // --config FILE (YAML)
    std::vector<std::pair<std::string, CLI::Option *>> given;  // config key -> its flag
    std::vector<std::string> values;                         // the flags' text, same order
};

/// Adds --config and one flag per OffloadConfig key (--gpu-expert-budget for gpu_cache, ...).
void add_offload_flags(CLI::App &cmd, OffloadArgs &args);
/// Defaults, then the --config file, then the flags given on the command line.
OffloadConfig resolve_offload(const OffloadArgs &args);
/// Prints to stderr, when the run offloads or replays routing: the resolved config and the engine's
/// start-up facts (device, expert store, cache, placement, routing source).
void print_startup(const OffloadConfig &config, const Engine &engine);
/// Prints the engine's counters to stderr (nothing for a plain CPU run).
void print_counters(const Engine &engine);

} // namespace prescope::cli

// Logging goes to stderr through spdlog; generated text alone goes to stdout.
#pragma once

#include <spdlog/spdlog.h>

namespace prescope {

/// Sets up the stderr logger. verbosity: 0 = warnings and errors, 1 = info, 2 = debug.
void log_init(int verbosity);

} // namespace prescope

#include "core/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

namespace prescope {

void log_init(int verbosity) {
    auto logger = spdlog::get("prescope");
    if (!logger) {
        logger = spdlog::stderr_color_mt("prescope");
        logger->set_pattern("%^%l%$: %v");
        spdlog::set_default_logger(logger);
    }
    logger->set_level(verbosity >= 2 ? spdlog::level::debug
                      : verbosity == 1 ? spdlog::level::info
                                       : spdlog::level::warn);
}

} // namespace prescope

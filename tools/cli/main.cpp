// prescope: command line entry point. Subcommands: generate, perplexity, inspect, bench, trace,
// train-predictor, eval-predictor, calibrate, simulate, schedule-check.
// Bad input ends with one "error: ..." line on stderr and exit code 1.
#include "cli.h"

#include "core/error.h"
#include "core/log.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>

int main(int argc, char **argv) {
    CLI::App app{"PreScope: Mixture-of-Experts inference with expert offloading"};
    app.require_subcommand(1);
    prescope::cli::register_generate(app);
    prescope::cli::register_perplexity(app);
    prescope::cli::register_inspect(app);
    prescope::cli::register_bench(app);
    prescope::cli::register_tokenize(app);
    prescope::cli::register_trace(app);
    prescope::cli::register_train_predictor(app);
    prescope::cli::register_eval_predictor(app);
    prescope::cli::register_calibrate(app);
    prescope::cli::register_simulate(app);
    prescope::cli::register_schedule_check(app);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError &e) {
        return app.exit(e);
    } catch (const prescope::Error &e) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    } catch (const std::bad_alloc &) {
        std::fflush(stdout);
        std::fprintf(stderr, "error: out of memory\n");
        return 1;
    } catch (const std::exception &e) {  // e.g. std::system_error from printing to a full device
        std::fflush(stdout);
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    // Output lost to a full disk or a closed pipe must not look like success.
    if (std::fflush(stdout) != 0 || std::ferror(stdout)) {
        std::fprintf(stderr, "error: writing the output failed: %s\n", std::strerror(errno));
        return 1;
    }
    return 0;
}

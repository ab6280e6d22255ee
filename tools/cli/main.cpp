// prescope: command line entry point. Subcommands: generate, perplexity, inspect, bench, trace,
// train-predictor, eval-predictor, calibrate, simulate, schedule-check, serve, expert-groups; --version.
// Bad input ends with one "error: ..." line on stderr and exit code 1.
#include "cli.h"

#include "backend/cpu/ops.h"
#include "core/build-info.h"
#include "core/error.h"
#include "core/log.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>

namespace {

// libgomp reads its waiting policy once, before main. Its default spins up to ~300k rounds after each
// parallel region, which is fast on an idle machine and a collapse beside other CPU work (demo decode at
// 0.8 tok/s against 535 with passive waiting, decision 0102). So unless the user chose (OMP_WAIT_POLICY or
// GOMP_SPINCOUNT set), run again with passive waiting; if the exec fails, carry on as we are.
void prefer_passive_waiting(char **argv) {
    if (std::getenv("OMP_WAIT_POLICY") || std::getenv("GOMP_SPINCOUNT")) return;
    if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
    execv("/proc/self/exe", argv);
}

std::string version_text() {
    const prescope::BuildInfo &b = prescope::build_info();
    const prescope::cpu::CpuIsa isa = prescope::cpu::cpu_isa_supported();
    std::string cpu = "CPU kernels: ";
    for (auto i : {prescope::cpu::CpuIsa::AVX2, prescope::cpu::CpuIsa::AVX512}) {
        if (isa >= i) cpu += fmt::format("{} ", prescope::cpu::cpu_isa_name(i));
    }
    cpu += fmt::format("(using {}), {} threads by default", prescope::cpu::cpu_isa_name(prescope::cpu::get_cpu_isa()),
                       prescope::cpu::physical_cores());
    // The waiting policy this process runs with (after prefer_passive_waiting), as libgomp read it.
    const char *policy = std::getenv("OMP_WAIT_POLICY"), *spin = std::getenv("GOMP_SPINCOUNT");
    const std::string waiting =
        policy ? fmt::format("OpenMP waiting: OMP_WAIT_POLICY={}{}", policy, spin ? fmt::format(", GOMP_SPINCOUNT={}", spin) : "")
        : spin ? fmt::format("OpenMP waiting: GOMP_SPINCOUNT={}", spin)
               : std::string("OpenMP waiting: the runtime's default (libgomp: spin up to 300000 rounds, then sleep)");
    return fmt::format("prescope commit {}{}\nbuilt with {}, {} build, {}\n{}\n{}", b.commit,
                       *b.commit_date ? fmt::format(" ({})", b.commit_date) : "", b.compiler, b.build_type,
                       *b.cuda ? b.cuda : "without CUDA", cpu, waiting);
}

// llama.cpp's multi-letter short flags, which CLI11 cannot declare (a single dash takes one letter): the long
// name they stand for.
void expand_short_flags(int argc, char **argv) {
    static char parallel[] = "--parallel";
    for (int i = 1; i < argc; ++i) {
        if (std::strcmp(argv[i], "-np") == 0) argv[i] = parallel;
    }
}

} // namespace

int main(int argc, char **argv) {
    prefer_passive_waiting(argv);
    CLI::App app{"PreScope: Mixture-of-Experts inference with expert offloading"};
    app.require_subcommand(1);
    app.set_version_flag("--version", version_text, "print the build's commit, compiler, CUDA and CPU features");
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
    prescope::cli::register_serve(app);
    prescope::cli::register_expert_groups(app);
    // CLI11 would answer "A subcommand is required" to `prescope foo`: name the word instead.
    if (argc > 1 && argv[1][0] != '-') {
        std::string names;
        bool known = false;
        for (const CLI::App *sub : app.get_subcommands([](const CLI::App *) { return true; })) {
            names += (names.empty() ? "" : ", ") + sub->get_name();
            known |= sub->get_name() == argv[1];
        }
        if (!known) {
            std::fprintf(stderr, "error: unknown command '%s' (commands: %s)\n", argv[1], names.c_str());
            return 1;
        }
    }
    expand_short_flags(argc, argv);
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError &e) {
        if (e.get_exit_code() == 0) return app.exit(e);  // --help, --version
        // A bad flag is bad input like any other: one error line and exit code 1.
        std::fprintf(stderr, "error: %s (see %s --help)\n", e.what(), argv[0]);
        return 1;
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

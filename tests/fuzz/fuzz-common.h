// Shared pieces of the libFuzzer targets (scripts/fuzz.sh, docs/fuzzing.md). Each target feeds its input to
// a reader as a file and accepts exactly one outcome besides success: prescope::Error (one clear line).
// Anything else (a crash, a sanitizer report, another exception, a leak, a hang) is a finding.
#pragma once

#include "backend/cpu/ops.h"
#include "core/error.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace prescope::fuzz {

/// The input as a file the readers can open and map: an in-memory file (memfd), named /proc/self/fd/N.
class MemFile {
  public:
    MemFile(const uint8_t *data, size_t size) {
        fd_ = memfd_create("prescope-fuzz", MFD_CLOEXEC);
        if (fd_ < 0) std::abort();
        for (size_t done = 0; done < size;) {
            const ssize_t n = ::write(fd_, data + done, size - done);
            if (n <= 0) std::abort();
            done += size_t(n);
        }
        path_ = "/proc/self/fd/" + std::to_string(fd_);
    }
    ~MemFile() { ::close(fd_); }
    MemFile(const MemFile &) = delete;
    MemFile &operator=(const MemFile &) = delete;
    const std::string &path() const { return path_; }

  private:
    int fd_ = -1;
    std::string path_;
};

/// One-time set-up: no log lines (they would drown the fuzzer's), one thread (deterministic, fast).
inline void init() {
    spdlog::set_level(spdlog::level::off);
    cpu::set_threads(1);
}

/// Runs f and swallows prescope::Error, the one failure a reader may report.
template <typename F>
void expect_clean(F &&f) {
    try {
        f();
    } catch (const Error &) {
    }
}

/// The directory of the committed test data (tests/data), compiled in.
inline std::string data_dir() { return std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/"; }

} // namespace prescope::fuzz

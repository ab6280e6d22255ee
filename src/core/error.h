// Errors: bad input throws prescope::Error (caught once at the CLI boundary); broken invariants abort.
// Decision: docs/decisions/0001-errors.md.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace prescope {

/// Bad input or environment (corrupt file, missing tensor, wrong shape, out of memory, bad request).
/// The message is one line that names the file, the tensor and what was expected.
class Error : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

/// Throws prescope::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args &&...args) {
    throw Error(fmt::format(format, std::forward<Args>(args)...));
}

[[noreturn]] inline void abort_with(const char *file, int line, const char *what) {
    std::fprintf(stderr, "%s:%d: PRESCOPE_ASSERT(%s) failed\n", file, line, what);
    std::fflush(stderr);
    std::abort();
}

} // namespace prescope

/// A bug or broken invariant: abort at once with file:line and the failed expression.
#define PRESCOPE_ASSERT(x)                                          \
    do {                                                            \
        if (!(x)) ::prescope::abort_with(__FILE__, __LINE__, #x);   \
    } while (0)

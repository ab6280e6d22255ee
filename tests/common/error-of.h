// What a call throws, for tests that check an error message's content.
#pragma once

#include "core/error.h"

#include <functional>
#include <string>

namespace prescope::test {

/// The message of the prescope::Error that f throws, or "" when it throws none.
inline std::string error_of(const std::function<void()> &f) {
    try {
        f();
    } catch (const prescope::Error &e) {
        return e.what();
    }
    return "";
}

} // namespace prescope::test

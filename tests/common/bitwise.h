// Helpers of the tests that compare runs bit for bit and name parameterised cases.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

namespace prescope::test {

/// F32 values of a and b whose bits differ, plus the length difference (a run of another length never counts 0).
inline size_t bits_differing(const std::vector<float> &a, const std::vector<float> &b) {
    const size_t n = std::min(a.size(), b.size());
    size_t diff = std::max(a.size(), b.size()) - n;
    for (size_t i = 0; i < n; ++i) diff += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
    return diff;
}

/// A gtest case name from free text: every character but letters and digits as '_'.
inline std::string case_name(std::string s) {
    for (char &c : s) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
    return s;
}

/// The case name of a string parameter (a model directory, an architecture).
inline std::string string_param_name(const ::testing::TestParamInfo<std::string> &info) { return case_name(info.param); }

} // namespace prescope::test

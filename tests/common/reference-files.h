// The HF reference files of the tiny test models (tests/data/models/<arch>/*.ref.json and their raw logits,
// docs/references.md), shared by the CPU model tests and the GPU tests.
#pragma once

#include "bitwise.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace prescope::test {

/// Every tests/data/models/*/*.ref.json, sorted (one parameter per reference of a parameterised test).
inline std::vector<std::filesystem::path> reference_files() {
    std::vector<std::filesystem::path> out;
    for (const auto &e :
         std::filesystem::recursive_directory_iterator(std::filesystem::path(PRESCOPE_SOURCE_DIR) / "tests/data/models")) {
        const std::string name = e.path().filename().string();
        if (name.size() > 9 && name.ends_with(".ref.json")) out.push_back(e.path());
    }
    std::sort(out.begin(), out.end());
    return out;
}

/// Test name of a reference file: "<arch>_<file>" with every non-alphanumeric character as '_'.
inline std::string reference_name(const ::testing::TestParamInfo<std::filesystem::path> &info) {
    return case_name(info.param.parent_path().filename().string() + "_" + info.param.filename().string());
}

inline nlohmann::json read_json(const std::filesystem::path &p) {
    std::ifstream in(p);
    return nlohmann::json::parse(in);
}

/// A raw little-endian float32 file (the reference logits, [n_pos][n_vocab] row-major).
inline std::vector<float> read_f32(const std::filesystem::path &p) {
    std::ifstream in(p, std::ios::binary);
    std::vector<float> v(std::filesystem::file_size(p) / 4);
    in.read(reinterpret_cast<char *>(v.data()), std::streamsize(v.size() * 4));
    return v;
}

} // namespace prescope::test

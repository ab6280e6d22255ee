// GGUF reader: every metadata type, nested arrays, alignment, tensor table; and every kind of
// malformed file gives prescope::Error (never a crash), naming the file and the item.
#include "format/gguf.h"

#include "core/error.h"
#include "../common/gguf-writer.h"

#include <unistd.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

using prescope::Error;
using prescope::GgufFile;
using prescope::GgufType;
using prescope::test::GgufWriter;

namespace {

std::string tmp_path(const std::string &name) {
    return (std::filesystem::temp_directory_path() / ("prescope-test-" + std::to_string(getpid()) + "-" + name)).string();
}

std::vector<uint8_t> f32_bytes(const std::vector<float> &v) {
    std::vector<uint8_t> b(v.size() * 4);
    std::memcpy(b.data(), v.data(), b.size());
    return b;
}

GgufWriter valid_writer(uint32_t version = 3) {
    GgufWriter w(version);
    w.kv_str("general.architecture", "test");
    w.kv_u8("u8", 200);
    w.kv_i8("i8", -100);
    w.kv_u16("u16", 60000);
    w.kv_i16("i16", -30000);
    w.kv_u32("u32", 4000000000u);
    w.kv_i32("i32", -2000000000);
    w.kv_f32("f32", 1.5f);
    w.kv_bool("bool", true);
    w.kv_u64("u64", 1ull << 40);
    w.kv_i64("i64", -(1ll << 40));
    w.kv_f64("f64", 0.25);
    w.kv_str_array("strs", {"a", "", "héllo"});
    w.kv_array<float>("floats", 6, {1.0f, -2.0f});
    w.kv_array<int32_t>("ints", 5, {1, -2, 3});
    // Array of two arrays of uint16: [[1, 2], [3]].
    std::vector<uint8_t> nested;
    GgufWriter::pod(nested, uint32_t(9));
    GgufWriter::pod(nested, uint64_t(2));
    GgufWriter::pod(nested, uint32_t(2));
    GgufWriter::pod(nested, uint64_t(2));
    GgufWriter::pod(nested, uint16_t(1));
    GgufWriter::pod(nested, uint16_t(2));
    GgufWriter::pod(nested, uint32_t(2));
    GgufWriter::pod(nested, uint64_t(1));
    GgufWriter::pod(nested, uint16_t(3));
    w.kv_raw("nested", 9, nested);
    w.tensor("a", 0, {4, 2}, f32_bytes({0, 1, 2, 3, 4, 5, 6, 7}));
    w.tensor("b", 0, {3}, f32_bytes({9, 8, 7}));
    return w;
}

void expect_error(const std::vector<uint8_t> &bytes, const std::string &name, const std::string &needle) {
    const std::string p = tmp_path(name);
    GgufWriter::write_bytes(p, bytes);
    try {
        GgufFile f(p);
        FAIL() << name << ": expected an error containing '" << needle << "'";
    } catch (const Error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(p), std::string::npos) << msg;
        EXPECT_NE(msg.find(needle), std::string::npos) << msg;
    }
}

} // namespace

TEST(Gguf, ReadsEveryMetadataTypeInV2AndV3) {
    for (uint32_t version : {2u, 3u}) {
        const std::string p = tmp_path("valid-v" + std::to_string(version));
        valid_writer(version).write(p);
        GgufFile f(p);
        EXPECT_EQ(f.version(), version);
        EXPECT_EQ(f.get_str("general.architecture"), "test");
        EXPECT_EQ(f.get_u64("u8"), 200u);
        EXPECT_EQ(f.get_i64("i8"), -100);
        EXPECT_EQ(f.get_u64("u16"), 60000u);
        EXPECT_EQ(f.get_i64("i16"), -30000);
        EXPECT_EQ(f.get_u32("u32"), 4000000000u);
        EXPECT_EQ(f.get_i64("i32"), -2000000000);
        EXPECT_FLOAT_EQ(float(f.get_f64("f32")), 1.5f);
        EXPECT_TRUE(f.get_bool("bool"));
        EXPECT_EQ(f.get_u64("u64"), 1ull << 40);
        EXPECT_EQ(f.get_i64("i64"), -(1ll << 40));
        EXPECT_DOUBLE_EQ(f.get_f64("f64"), 0.25);
        EXPECT_EQ(f.get_str_array("strs"), (std::vector<std::string>{"a", "", "héllo"}));
        EXPECT_EQ(f.get_f32_array("floats"), (std::vector<float>{1.0f, -2.0f}));
        EXPECT_EQ(f.get_i32_array("ints"), (std::vector<int32_t>{1, -2, 3}));
        const auto *nested = f.find("nested");
        ASSERT_NE(nested, nullptr);
        ASSERT_EQ(nested->elem_type, GgufType::ARRAY);
        const auto &outer = std::get<std::vector<prescope::GgufValue>>(nested->v);
        ASSERT_EQ(outer.size(), 2u);
        EXPECT_EQ(std::get<std::vector<prescope::GgufValue>>(outer[0].v).size(), 2u);
        EXPECT_EQ(std::get<uint64_t>(std::get<std::vector<prescope::GgufValue>>(outer[1].v)[0].v), 3u);
        const auto a = f.tensor_view("a");
        EXPECT_EQ(a.ne[0], 4);
        EXPECT_EQ(a.ne[1], 2);
        EXPECT_EQ(static_cast<const float *>(a.data)[5], 5.0f);
        EXPECT_EQ(static_cast<const float *>(f.tensor_view("b").data)[2], 7.0f);
        EXPECT_EQ(f.data_offset() % 32, 0u);
    }
}

TEST(Gguf, HonoursGeneralAlignment) {
    GgufWriter w(3, 64);
    w.kv_u32("general.alignment", 64);
    w.tensor("x", 0, {3}, f32_bytes({1, 2, 3}));
    w.tensor("y", 0, {2}, f32_bytes({4, 5}));
    const std::string p = tmp_path("align64");
    w.write(p);
    GgufFile f(p);
    EXPECT_EQ(f.alignment(), 64u);
    EXPECT_EQ(f.data_offset() % 64, 0u);
    EXPECT_EQ(f.find_tensor("y")->offset, 64u);
    EXPECT_EQ(static_cast<const float *>(f.tensor_view("y").data)[1], 5.0f);
}

TEST(Gguf, TypedGettersNameKeyAndExpectation) {
    const std::string p = tmp_path("getters");
    valid_writer().write(p);
    GgufFile f(p);
    EXPECT_THROW(f.get_str("missing.key"), Error);
    try {
        f.get_u32("strs");
        FAIL();
    } catch (const Error &e) {
        EXPECT_NE(std::string(e.what()).find("'strs'"), std::string::npos);
    }
    EXPECT_THROW(f.get_u32("i8"), Error);  // negative value for an unsigned getter
    EXPECT_THROW(f.get_str_array("floats"), Error);
    EXPECT_EQ(f.get_u32_or("missing.key", 7), 7u);
    EXPECT_THROW(f.tensor_view("missing"), Error);
}

TEST(Gguf, RejectsBadMagicAndVersion) {
    auto b = valid_writer().bytes();
    b[0] = 'X';
    expect_error(b, "magic", "bad magic");
    for (uint32_t v : {1u, 4u}) {
        auto c = valid_writer().bytes();
        std::memcpy(c.data() + 4, &v, 4);
        expect_error(c, "version" + std::to_string(v), "unsupported GGUF version");
    }
    expect_error({}, "empty", "bad magic");
}

// gguf-py --bigendian files (for s390x) read as version 0x03000000: name the byte order, not a version.
TEST(Gguf, NamesBigEndianFiles) {
    for (uint32_t v : {2u, 3u}) {
        auto c = valid_writer().bytes();
        const uint32_t swapped = __builtin_bswap32(v);
        std::memcpy(c.data() + 4, &swapped, 4);
        expect_error(c, "big-endian" + std::to_string(v), "a big-endian GGUF file (version " + std::to_string(v));
    }
}

TEST(Gguf, RejectsOverlappingTensorData) {
    GgufWriter w;
    w.tensor("first", 0, {8}, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
    w.tensor("second", 0, {4}, f32_bytes({1, 2, 3, 4}), /*offset=*/0);  // the bytes of "first"
    expect_error(w.bytes(), "overlap", "tensors 'first' (data bytes [");
    expect_error(w.bytes(), "overlap2", "and 'second'");
    GgufWriter ok;  // touching but not overlapping is fine
    ok.tensor("a", 0, {8}, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
    ok.tensor("b", 0, {8}, f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
    const std::string p = tmp_path("adjacent");
    GgufWriter::write_bytes(p, ok.bytes());
    EXPECT_NO_THROW(GgufFile f(p));
}

TEST(Gguf, EveryTruncationIsAnError) {
    const auto full = valid_writer().bytes();
    for (size_t n = 0; n < full.size(); ++n) {
        const std::string p = tmp_path("trunc");
        GgufWriter::write_bytes(p, std::vector<uint8_t>(full.begin(), full.begin() + long(n)));
        EXPECT_THROW(GgufFile f(p), Error) << "cut at " << n << " of " << full.size();
    }
}

TEST(Gguf, RejectsTensorDataPastTheEnd) {
    GgufWriter w;
    w.tensor("big", 0, {1000}, f32_bytes({1, 2, 3, 4}));  // claims 4000 bytes, holds 16
    expect_error(w.bytes(), "past-end", "tensor 'big' data");
}

TEST(Gguf, RejectsMalformedHeaders) {
    {  // metadata count far beyond the file
        auto b = valid_writer().bytes();
        const uint64_t n = 1ull << 40;
        std::memcpy(b.data() + 16, &n, 8);
        expect_error(b, "kv-count", "metadata count");
    }
    {  // tensor count far beyond the file
        auto b = valid_writer().bytes();
        const uint64_t n = 1ull << 40;
        std::memcpy(b.data() + 8, &n, 8);
        expect_error(b, "tensor-count", "tensor count");
    }
    {  // array claiming more elements than bytes remain
        GgufWriter w;
        std::vector<uint8_t> arr;
        GgufWriter::pod(arr, uint32_t(4));
        GgufWriter::pod(arr, uint64_t(1) << 50);
        w.kv_raw("huge", 9, arr);
        expect_error(w.bytes(), "array-count", "'huge' claims");
    }
    {  // unknown value type
        GgufWriter w;
        w.kv_raw("odd", 77, {0, 0, 0, 0});
        expect_error(w.bytes(), "value-type", "unknown value type 77");
    }
    {  // bool other than 0/1
        GgufWriter w;
        w.kv_raw("flag", 7, {2});
        expect_error(w.bytes(), "bool", "expected 0 or 1");
    }
    {  // unknown ggml type id
        GgufWriter w;
        w.tensor("t", 99, {4}, std::vector<uint8_t>(16));
        expect_error(w.bytes(), "ggml-type", "unknown ggml type id 99");
    }
    {  // misaligned data offset
        GgufWriter w;
        w.tensor("t", 0, {4}, f32_bytes({1, 2, 3, 4}), 4);
        expect_error(w.bytes(), "misaligned", "not a multiple of the alignment");
    }
    {  // five dimensions
        GgufWriter w;
        w.tensor("t", 0, {1, 1, 1, 1, 4}, f32_bytes({1, 2, 3, 4}));
        expect_error(w.bytes(), "dims", "5 dimensions");
    }
    {  // dimensions whose product overflows 64 bits
        GgufWriter w;
        w.tensor("t", 0, {int64_t(1) << 62, 8192}, f32_bytes({1, 2, 3, 4}));
        expect_error(w.bytes(), "ne-overflow", "'t' has too many elements: dimensions 0..1 multiply past 2^64");
    }
    {  // Q8_0 row not a whole number of blocks
        GgufWriter w;
        w.tensor("q", 8, {16}, std::vector<uint8_t>(34));
        expect_error(w.bytes(), "q8-row", "not a multiple of the q8_0 block size");
    }
    {  // duplicate key
        GgufWriter w;
        w.kv_u32("k", 1);
        w.kv_u32("k", 2);
        expect_error(w.bytes(), "dup-key", "duplicate metadata key 'k'");
    }
    {  // alignment not a power of two
        GgufWriter w;
        w.kv_u32("general.alignment", 48);
        expect_error(w.bytes(), "align", "power of two");
    }
}

TEST(Gguf, RandomCorruptionNeverCrashes) {
    const auto full = valid_writer().bytes();
    std::mt19937 rng(1234);
    int errors = 0;
    for (int i = 0; i < 1000; ++i) {
        auto b = full;
        const int flips = 1 + int(rng() % 4);
        for (int j = 0; j < flips; ++j) b[rng() % b.size()] = uint8_t(rng());
        const std::string p = tmp_path("fuzz");
        GgufWriter::write_bytes(p, b);
        try {
            GgufFile f(p);
            // Whatever parses must keep every tensor inside the file.
            for (const auto &t : f.tensors()) EXPECT_LE(f.data_offset() + t.offset + t.n_bytes, f.file_size());
        } catch (const Error &) {
            ++errors;
        }
    }
    EXPECT_GT(errors, 50);  // most corruptions of header bytes are detected
}

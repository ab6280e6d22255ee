// Pre-tokenizer families (runtime/pre-tokenizer.h): token-exact against HF tokenizers on the fixtures of
// tools/py/make_pretokenizer_fixtures.py (one small BPE per tokenizer.ggml.pre value, trained with that family's
// real tokenizer.json rules), the Oniguruma class rewrite, and the error for an unknown value.
#include "runtime/pre-tokenizer.h"
#include "runtime/tokenizer.h"

#include "core/error.h"
#include "format/gguf.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <zstd.h>

#include <fstream>
#include <iterator>
#include <set>

namespace prescope {
namespace {

const std::string kDir = std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/tokenizers/pre/";

// cases.json.zst: one zstd frame with the JSON document described in the fixture script.
const nlohmann::json &cases() {
    static const nlohmann::json doc = [] {
        const std::string path = kDir + "cases.json.zst";
        std::ifstream in(path, std::ios::binary);
        if (!in) throw std::runtime_error("cannot open " + path);
        const std::string packed((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        const unsigned long long size = ZSTD_getFrameContentSize(packed.data(), packed.size());
        if (size == ZSTD_CONTENTSIZE_ERROR || size == ZSTD_CONTENTSIZE_UNKNOWN)
            throw std::runtime_error(path + ": not a zstd frame with a content size");
        std::string raw(size, '\0');
        const size_t n = ZSTD_decompress(raw.data(), raw.size(), packed.data(), packed.size());
        if (ZSTD_isError(n) || n != raw.size()) throw std::runtime_error(path + ": corrupt zstd frame");
        return nlohmann::json::parse(raw);
    }();
    return doc;
}

const nlohmann::json &family(const std::string &pre) {
    for (const auto &f : cases().at("families"))
        if (f.at("pre") == pre) return f;
    throw std::runtime_error("no fixture family " + pre);
}

std::vector<int32_t> ids_of(const nlohmann::json &j) { return j.get<std::vector<int32_t>>(); }

// The value for string `index` in a sparse map ("ids_special", "ids_raw", "decoded"), or `dflt`.
template <typename T>
T sparse(const nlohmann::json &fam, const char *key, size_t index, T dflt) {
    const auto &m = fam.at(key);
    const auto it = m.find(std::to_string(index));
    return it == m.end() ? dflt : it->template get<T>();
}

std::string show(const std::string &s) {
    std::string out;
    for (unsigned char c : s) out += c < 0x20 ? fmt::format("\\x{:02x}", c) : std::string(1, char(c));
    return out.size() > 100 ? out.substr(0, 100) + "..." : out;
}

class PreTokenizerFamily : public ::testing::TestWithParam<std::string> {};

// Every fixture string three ways (add_special, parse_special), and decode, against HF tokenizers.
TEST_P(PreTokenizerFamily, MatchesHfTokenizers) {
    const nlohmann::json &fam = family(GetParam());
    const GgufFile gguf(kDir + fam.at("gguf").get<std::string>());
    const Tokenizer tok = Tokenizer::from_gguf(gguf);
    const auto &strings = cases().at("strings");
    const auto &indices = fam.at("cases");
    ASSERT_GE(indices.size(), 200u);
    size_t mismatches = 0;
    for (size_t k = 0; k < indices.size(); ++k) {
        const size_t i = indices[k].get<size_t>();
        const std::string text = strings.at(i).get<std::string>();
        const std::vector<int32_t> ids = ids_of(fam.at("ids").at(k));
        const auto got = tok.encode(text, false, true);
        mismatches += got != ids;
        EXPECT_EQ(got, ids) << GetParam() << " on '" << show(text) << "'";
        EXPECT_EQ(tok.encode(text, true, true), sparse(fam, "ids_special", i, ids)) << "add_special '" << show(text) << "'";
        EXPECT_EQ(tok.encode(text, false, false), sparse(fam, "ids_raw", i, ids)) << "raw '" << show(text) << "'";
        EXPECT_EQ(tok.decode(ids), sparse(fam, "decoded", i, text)) << "decode '" << show(text) << "'";
    }
    EXPECT_EQ(mismatches, 0u) << "of " << indices.size() << " strings";
}

// The fixture can tell the families apart: on this family's vocabulary, each other family's rules change the
// HF ids of some strings (so a tokenizer applying them would fail the test above).
TEST_P(PreTokenizerFamily, FixtureSeparatesFamilies) {
    for (const auto &[other, n] : family(GetParam()).at("wrong_pre_changes").items())
        EXPECT_GT(n.get<int>(), 0) << "rules of '" << other << "' give the same ids";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PreTokenizerFamily,
                         ::testing::Values("default", "gpt-2", "olmo", "deepseek-llm", "deepseek-v3", "gpt-4o",
                                           "qwen35"),
                         [](const auto &info) {
                             std::string n = info.param;
                             for (char &c : n)
                                 if (c == '-') c = '_';
                             return n;
                         });

// Every tokenizer.ggml.pre value resolves and its regexes compile; aliases share the rules of their family.
TEST(PreTokenizer, EveryNameCompiles) {
    const std::string list = supported_pre_tokenizers();
    for (const char *name : {"default", "gpt-2", "olmo", "qwen2", "deepseek-r1-qwen", "qwen35", "llama-bpe", "llama3",
                             "llama-v3", "deepseek-llm", "deepseek-v3", "gpt-4o", "llama4", "minimax-m2"}) {
        const PreTokenizerSpec *spec = find_pre_tokenizer(name);
        ASSERT_NE(spec, nullptr) << name;
        EXPECT_NE(list.find(fmt::format("'{}'", name)), std::string::npos) << list;
        EXPECT_NO_THROW(PreTokenizer(*spec, "test")) << name;
    }
    EXPECT_EQ(find_pre_tokenizer("llama3"), find_pre_tokenizer("llama-bpe"));
    EXPECT_EQ(find_pre_tokenizer("chameleon"), nullptr);
    EXPECT_EQ(find_pre_tokenizer(""), nullptr);
}

std::vector<std::string> pieces(const std::string &pre, const std::string &text) {
    const PreTokenizer p(*find_pre_tokenizer(pre), "test");
    PreTokenizer::Scratch scratch;
    std::vector<PreTokenizer::Range> ranges;
    p.split(text, ranges, scratch);
    std::vector<std::string> out;
    for (const auto &r : ranges) out.push_back(text.substr(r.begin, r.end - r.begin));
    return out;
}

// Hand-checked splits: each step of a Sequence sees only the pieces of the step before.
TEST(PreTokenizer, SplitsInTurn) {
    using V = std::vector<std::string>;
    // default: punctuation runs first, then GPT-2's regex, then digit runs, then three-digit groups.
    EXPECT_EQ(pieces("default", "a+b=12345"), (V{"a", "+", "b", "=", "123", "45"}));
    EXPECT_EQ(pieces("default", "x 1234567"), (V{"x", " ", "123", "456", "7"}));  // \p{N}+ drops GPT-2's space
    // deepseek-v3: numbers of up to three digits, then CJK, then punctuation-aware words.
    EXPECT_EQ(pieces("deepseek-v3", "ab12345.com"), (V{"ab", "123", "45", ".com"}));
    EXPECT_EQ(pieces("deepseek-v3", "\xE4\xB8\xAD\xE6\x96\x87x"), (V{"\xE4\xB8\xAD\xE6\x96\x87", "x"}));
    // deepseek-llm: single digits (HF Digits), \s+$ only at a piece's end.
    EXPECT_EQ(pieces("deepseek-llm", "a 12"), (V{"a", " ", "1", "2"}));
    EXPECT_EQ(pieces("deepseek-llm", "ab  \ncd"), (V{"ab", "  ", "\n", "cd"}));
    // gpt-4o: case-aware words, contractions inside the word, digits by three, slashes after punctuation.
    EXPECT_EQ(pieces("gpt-4o", "HTTPSConnection don't"), (V{"HTTPSConnection", " don't"}));
    EXPECT_EQ(pieces("gpt-4o", "camelCase"), (V{"camel", "Case"}));
    EXPECT_EQ(pieces("gpt-4o", "1234 a//b"), (V{"123", "4", " a", "//", "b"}));
}

// The rewrite keeps syntax and spells the classes out as Oniguruma has them (decision 0021).
TEST(PreTokenizer, ClassesFollowOniguruma) {
    EXPECT_EQ(pcre2_pattern("a|b(?!c)"), "a|b(?!c)");
    EXPECT_EQ(pcre2_pattern(R"(\$\[)"), R"(\$\[)");
    EXPECT_EQ(pcre2_pattern(R"([\p{Lt}])"), R"([\p{Lt}])");
    EXPECT_NE(pcre2_pattern(R"(\p{L})").find(R"([\p{L}\x{1C89})"), std::string::npos);
    EXPECT_NE(pcre2_pattern(R"([^\s\p{N}])").find(R"([^\t\n)"), std::string::npos);
    EXPECT_EQ(pcre2_pattern(R"(\S)").substr(0, 6), R"([^\t\n)");
    // U+1C89 (Unicode 16, Lu) starts a cased word in gpt-4o; U+180E is not \s; U+0897 (Unicode 16, Mn) joins a
    // qwen35 letter run; U+1B4E (Unicode 16, Po) is punctuation for deepseek-v3.
    using V = std::vector<std::string>;
    EXPECT_EQ(pieces("gpt-4o", "\xE1\xB2\x89" "abc"), (V{"\xE1\xB2\x89" "abc"}));
    EXPECT_EQ(pieces("qwen2", "a\xE1\xA0\x8E" "b"), (V{"a", "\xE1\xA0\x8E" "b"}));
    EXPECT_EQ(pieces("qwen35", "a\xE0\xA2\x97" "b"), (V{"a\xE0\xA2\x97" "b"}));
    EXPECT_EQ(pieces("deepseek-v3", "x \xE1\xAD\x8E\xE1\xAD\x8F"), (V{"x", " \xE1\xAD\x8E\xE1\xAD\x8F"}));
}

// gpt-oss: <|return|> and <|call|> end generation, <|end|> (end of one message) does not (llama.cpp).
TEST(PreTokenizer, HarmonyEndOfGeneration) {
    const GgufFile gguf(kDir + "gpt-4o.gguf");
    const Tokenizer tok = Tokenizer::from_gguf(gguf);
    EXPECT_TRUE(tok.is_eog(tok.find_token("<|return|>")));
    EXPECT_TRUE(tok.is_eog(tok.find_token("<|call|>")));
    EXPECT_FALSE(tok.is_eog(tok.find_token("<|end|>")));
    EXPECT_FALSE(tok.add_bos());
}

// A value PreScope does not know is a one-line error naming the file, the key, the value and the supported list.
TEST(PreTokenizer, UnknownValueIsAClearError) {
    const std::string path = std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/tokenizers/bad/pre-unknown.gguf";
    try {
        const GgufFile f(path);
        (void)Tokenizer::from_gguf(f);
        ADD_FAILURE() << "no error";
    } catch (const Error &e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(path), std::string::npos) << msg;
        EXPECT_NE(msg.find("'tokenizer.ggml.pre' is 'chameleon'"), std::string::npos) << msg;
        EXPECT_NE(msg.find(supported_pre_tokenizers()), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
}

} // namespace
} // namespace prescope

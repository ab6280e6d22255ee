// Tokenizer tests: token-exact against HF tokenizers / sentencepiece on the fixtures of
// tools/py/make_tokenizer_fixtures.py, decode round trips, UTF-8 streaming, special tokens, bad metadata.
#include "runtime/tokenizer.h"

#include "core/error.h"
#include "format/gguf.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>

namespace prescope {
namespace {

const std::string kDir = std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/tokenizers/";

nlohmann::json read_json(const std::string &path) {
    std::ifstream in(path);
    if (!in) throw std::runtime_error("cannot open " + path);
    return nlohmann::json::parse(in);
}

std::vector<int32_t> ids_of(const nlohmann::json &j) { return j.get<std::vector<int32_t>>(); }

struct Loaded {
    std::unique_ptr<GgufFile> gguf;
    std::unique_ptr<Tokenizer> tok;
    nlohmann::json cases;
    std::string reference;
};

Loaded load(const std::string &name) {
    const nlohmann::json doc = read_json(kDir + name + ".json");
    Loaded l;
    l.gguf = std::make_unique<GgufFile>(kDir + doc.at("gguf").get<std::string>());
    l.tok = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*l.gguf));
    l.cases = doc.at("cases");
    l.reference = doc.at("reference").get<std::string>();
    return l;
}

std::string show(const std::string &s) {
    std::string out;
    for (unsigned char c : s) {
        if (c == '\n')
            out += "\\n";
        else if (c < 0x20)
            out += fmt::format("\\x{:02x}", c);
        else
            out += char(c);
    }
    return out.size() > 120 ? out.substr(0, 120) + "..." : out;
}

class TokenizerReference : public ::testing::TestWithParam<std::string> {
  protected:
    void SetUp() override { fx_ = load(GetParam()); }
    Loaded fx_;
};

// Every fixture string, three ways (add_special, parse_special), token for token against the reference.
TEST_P(TokenizerReference, EncodeMatchesReference) {
    ASSERT_GE(fx_.cases.size(), 200u) << "the issue asks for at least 200 strings per tokenizer";
    size_t mismatches = 0;
    for (const auto &c : fx_.cases) {
        const std::string text = c.at("text").get<std::string>();
        const std::vector<int32_t> ids = ids_of(c.at("ids"));
        const std::vector<int32_t> with_special = c.contains("ids_special") ? ids_of(c.at("ids_special")) : ids;
        const std::vector<int32_t> raw = c.contains("ids_raw") ? ids_of(c.at("ids_raw")) : ids;
        const auto got = fx_.tok->encode(text, false, true);
        if (got != ids) ++mismatches;
        EXPECT_EQ(got, ids) << fx_.reference << " on '" << show(text) << "'";
        EXPECT_EQ(fx_.tok->encode(text, true, true), with_special) << "add_special on '" << show(text) << "'";
        EXPECT_EQ(fx_.tok->encode(text, false, false), raw) << "parse_special=false on '" << show(text) << "'";
    }
    EXPECT_EQ(mismatches, 0u) << "of " << fx_.cases.size() << " strings";
}

// decode() against the reference decoder, and decode(encode(text)) giving the text back.
TEST_P(TokenizerReference, DecodeRoundTrip) {
    for (const auto &c : fx_.cases) {
        const std::string text = c.at("text").get<std::string>();
        const std::string decoded = c.at("decoded").get<std::string>();
        EXPECT_EQ(fx_.tok->decode(ids_of(c.at("ids"))), decoded) << "'" << show(text) << "'";
        EXPECT_EQ(fx_.tok->decode(fx_.tok->encode(text, false, true)), decoded) << "'" << show(text) << "'";
        if (fx_.tok->add_bos())
            EXPECT_EQ(fx_.tok->decode(fx_.tok->encode(text, true, true)),
                      fx_.tok->token_to_piece(fx_.tok->bos()) + decoded);
    }
}

// Streaming one token at a time never emits broken UTF-8 and loses nothing.
TEST_P(TokenizerReference, StreamingIsValidUtf8) {
    for (const auto &c : fx_.cases) {
        const std::vector<int32_t> ids = ids_of(c.at("ids"));
        TokenTextStream stream(*fx_.tok);
        std::string streamed, pieces;
        for (int32_t id : ids) {
            const std::string chunk = stream.push(id);
            EXPECT_EQ(sanitize_utf8(chunk), chunk) << "broken UTF-8 after token " << id;
            streamed += chunk;
            pieces += fx_.tok->token_to_piece(id);
        }
        streamed += stream.flush();
        EXPECT_EQ(streamed, sanitize_utf8(pieces)) << "'" << show(c.at("text").get<std::string>()) << "'";
    }
}

// Tokenizing 1 MB: prints the time (no timing assertion, brief rule 4) and checks the round trip.
TEST_P(TokenizerReference, OneMegabyte) {
    std::string text, expected;
    const bool spm = GetParam() == "llama-spm";
    while (text.size() < (1u << 20)) {
        for (const auto &c : fx_.cases) {
            const std::string t = c.at("text").get<std::string>();
            text += t + "\n";
            // sentencepiece decodes a literal U+2581 as a space; the BPE references NFC-normalise (qwen2).
            std::string e = spm ? t : c.at("decoded").get<std::string>();
            if (spm)
                for (size_t p; (p = e.find("\xE2\x96\x81")) != std::string::npos;) e.replace(p, 3, " ");
            expected += e + "\n";
        }
    }
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    const std::vector<int32_t> ids = fx_.tok->encode(text, false, true);
    const double cpu_ms = 1000.0 * double(std::clock() - c0) / CLOCKS_PER_SEC;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const double mb = text.size() / 1048576.0;
    std::printf("[ perf     ] %s: %.2f MB -> %zu tokens in %.1f ms wall, %.1f ms CPU (%.1f ms CPU per MB)\n",
                GetParam().c_str(), mb, ids.size(), ms, cpu_ms, cpu_ms / mb);
    RecordProperty("encode_cpu_ms", std::to_string(cpu_ms));
    EXPECT_EQ(fx_.tok->decode(ids), expected);
}

// The same on real text: the first MiB of the file named by PRESCOPE_TOKENIZER_TEXT (skipped when unset),
// e.g. /work/shared/realdata/text/olmoe-routing-text/c4_texts.txt; docs/tokenizer.md lists the numbers.
TEST_P(TokenizerReference, OneMegabyteOfFileText) {
    const char *path = std::getenv("PRESCOPE_TOKENIZER_TEXT");
    if (!path) GTEST_SKIP() << "set PRESCOPE_TOKENIZER_TEXT to a text file";
    std::ifstream in(path, std::ios::binary);
    ASSERT_TRUE(in) << path;
    std::string text(1u << 20, '\0');
    in.read(text.data(), std::streamsize(text.size()));
    text.resize(size_t(in.gcount()));
    while (!text.empty() && (text.back() & 0xC0) == 0x80) text.pop_back();  // whole characters only
    if (!text.empty() && (unsigned char)text.back() >= 0xC0) text.pop_back();
    const std::clock_t c0 = std::clock();
    const std::vector<int32_t> ids = fx_.tok->encode(text, false, true);
    const double cpu_ms = 1000.0 * double(std::clock() - c0) / CLOCKS_PER_SEC;
    std::printf("[ perf     ] %s on %s: %.2f MB -> %zu tokens in %.1f ms CPU\n", GetParam().c_str(), path,
                text.size() / 1048576.0, ids.size(), cpu_ms);
    if (GetParam() == "llama-bpe") EXPECT_EQ(fx_.tok->decode(ids), sanitize_utf8(text));  // no normaliser
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TokenizerReference, ::testing::Values("qwen2-bpe", "llama-bpe", "llama-spm"),
                         [](const auto &info) {
                             std::string n = info.param;
                             std::replace(n.begin(), n.end(), '-', '_');
                             return n;
                         });

TEST(Tokenizer, SpecialTokensQwen2) {
    const Loaded fx = load("qwen2-bpe");
    const Tokenizer &t = *fx.tok;
    const int32_t im_start = t.find_token("<|im_start|>"), im_end = t.find_token("<|im_end|>");
    const int32_t eot = t.find_token("<|endoftext|>"), tool = t.find_token("<tool_call>");
    ASSERT_GE(im_start, 0);
    ASSERT_GE(tool, 0);
    EXPECT_EQ(t.token_type(im_start), TokenType::CONTROL);
    EXPECT_EQ(t.token_type(tool), TokenType::USER_DEFINED);
    EXPECT_FALSE(t.add_bos());
    EXPECT_EQ(t.bos(), -1);
    EXPECT_EQ(t.eos(), im_end);
    EXPECT_TRUE(t.is_eog(im_end));
    EXPECT_TRUE(t.is_eog(eot));
    EXPECT_FALSE(t.is_eog(im_start));
    EXPECT_FALSE(t.is_eog(-1));
    EXPECT_FALSE(t.is_eog(t.n_vocab()));
    EXPECT_EQ(t.encode("<|im_start|>", false, true), std::vector<int32_t>{im_start});
    EXPECT_NE(t.encode("<|im_start|>", false, false), std::vector<int32_t>{im_start});
    // user-defined tokens are split out even when control tokens are not
    EXPECT_EQ(t.encode("<tool_call>", false, false), std::vector<int32_t>{tool});
    EXPECT_EQ(t.token_to_piece(im_end), "<|im_end|>");
    EXPECT_EQ(t.encode("", true, true), std::vector<int32_t>{});
}

TEST(Tokenizer, SpecialTokensLlama) {
    const Loaded bpe = load("llama-bpe");
    EXPECT_TRUE(bpe.tok->add_bos());
    EXPECT_EQ(bpe.tok->bos(), bpe.tok->find_token("<|begin_of_text|>"));
    EXPECT_TRUE(bpe.tok->is_eog(bpe.tok->find_token("<|eot_id|>")));
    EXPECT_TRUE(bpe.tok->is_eog(bpe.tok->find_token("<|end_of_text|>")));
    EXPECT_EQ(bpe.tok->encode("", true, true), std::vector<int32_t>{bpe.tok->bos()});

    const Loaded spm = load("llama-spm");
    const Tokenizer &t = *spm.tok;
    EXPECT_TRUE(t.add_bos());
    EXPECT_EQ(t.bos(), 1);
    EXPECT_EQ(t.eos(), 2);
    EXPECT_TRUE(t.is_eog(2));
    EXPECT_EQ(t.token_type(0), TokenType::UNKNOWN);
    EXPECT_EQ(t.token_to_piece(t.find_token("<0x41>")), "A");
    EXPECT_EQ(t.encode("", true, true), std::vector<int32_t>{1});
}

TEST(Tokenizer, BadIdsAreErrors) {
    const Loaded fx = load("qwen2-bpe");
    EXPECT_THROW(fx.tok->token_to_piece(-1), Error);
    EXPECT_THROW(fx.tok->token_to_piece(fx.tok->n_vocab()), Error);
    EXPECT_THROW(fx.tok->decode({0, fx.tok->n_vocab() + 5}), Error);
    EXPECT_THROW(fx.tok->token_text(-3), Error);
}

// Invalid UTF-8 input is tokenized as if each maximal invalid subpart were U+FFFD (as Python's
// errors="replace"); the fixtures hold the reference ids for U+FFFD itself.
TEST(Tokenizer, InvalidUtf8BecomesReplacementCharacter) {
    EXPECT_EQ(sanitize_utf8("ok"), "ok");
    EXPECT_EQ(sanitize_utf8("a\xFF" "b"), "a\uFFFD" "b");
    EXPECT_EQ(sanitize_utf8("\xC0\xAF"), "\uFFFD\uFFFD");                  // overlong
    EXPECT_EQ(sanitize_utf8("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");        // surrogate
    EXPECT_EQ(sanitize_utf8("\xF0\x9F\x98"), "\uFFFD");                    // truncated 4-byte sequence
    EXPECT_EQ(sanitize_utf8("\xF4\x90\x80\x80"), "\uFFFD\uFFFD\uFFFD\uFFFD");  // above U+10FFFF
    EXPECT_EQ(sanitize_utf8(std::string("a\0b", 3)), std::string("a\0b", 3));
    for (const char *name : {"qwen2-bpe", "llama-bpe", "llama-spm"}) {
        const Loaded fx = load(name);
        EXPECT_EQ(fx.tok->encode("a\xFF" "b", false, true), fx.tok->encode("a\uFFFD" "b", false, true)) << name;
        EXPECT_EQ(fx.tok->encode("\xE4\xBD", false, true), fx.tok->encode("\uFFFD", false, true)) << name;
    }
}

// A character whose bytes arrive in separate tokens is held back until complete.
TEST(Tokenizer, StreamHoldsBackPartialCharacters) {
    const Loaded fx = load("llama-spm");
    const Tokenizer &t = *fx.tok;
    std::vector<int32_t> bytes;
    for (const char *b : {"<0xF0>", "<0x9F>", "<0x98>", "<0x80>"}) bytes.push_back(t.find_token(b));
    TokenTextStream stream(t);
    EXPECT_EQ(stream.push(bytes[0]), "");
    EXPECT_EQ(stream.push(bytes[1]), "");
    EXPECT_EQ(stream.push(bytes[2]), "");
    EXPECT_EQ(stream.push(bytes[3]), "\xF0\x9F\x98\x80");
    EXPECT_EQ(stream.flush(), "");
    // an incomplete character at the end is flushed as U+FFFD; a byte that can never start one at once
    EXPECT_EQ(stream.push(bytes[0]), "");
    EXPECT_EQ(stream.push(t.find_token("<0x41>")), "\uFFFD" "A");
    EXPECT_EQ(stream.push(bytes[0]), "");
    EXPECT_EQ(stream.flush(), "\uFFFD");
    EXPECT_EQ(stream.push(t.find_token("<0xFF>")), "\uFFFD");
}

// Malformed tokenizer metadata: one-line Error naming the file and the key (tests/data/tokenizers/bad/).
TEST(Tokenizer, BadMetadataIsAClearError) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"model-unknown", "'tokenizer.ggml.model' is 'wordpiece', expected 'gpt2'"},
        {"model-missing", "missing metadata 'tokenizer.ggml.model'"},
        {"pre-unknown", "'tokenizer.ggml.pre' is 'chameleon', expected a supported pre-tokenizer ('default', "},
        {"pre-missing", "missing metadata 'tokenizer.ggml.pre'"},
        {"tokens-missing", "missing metadata 'tokenizer.ggml.tokens'"},
        {"scores-short", "'tokenizer.ggml.scores' has 2 entries, expected 3"},
        {"types-long", "'tokenizer.ggml.token_type' has 4 entries, expected 3"},
        {"merge-unknown-token", "'tokenizer.ggml.merges'[1] 'Ġ zz' names 'zz', which is not in"},
        {"merge-unknown-result", "'tokenizer.ggml.merges'[1] 'a b' merges into 'ab', which is not in"},
        {"merge-malformed", "'tokenizer.ggml.merges'[0] is 'ĠĠ', expected two tokens"},
        {"byte-missing", "'tokenizer.ggml.tokens' has no token for byte 0x61"},
        {"bos-out-of-range", "'tokenizer.ggml.bos_token_id' = 9999 lies outside the vocabulary"},
        {"add-bos-without-bos", "'tokenizer.ggml.add_bos_token' is true but 'tokenizer.ggml.bos_token_id' is missing"},
        {"tokens-duplicate", "'tokenizer.ggml.tokens' holds 'ĠĠ' twice"},
        {"merges-wrong-type", "'tokenizer.ggml.merges' is an array of"},
    };
    for (const auto &[name, expected] : cases) {
        const std::string path = kDir + "bad/" + name + ".gguf";
        try {
            const GgufFile f(path);
            (void)Tokenizer::from_gguf(f);
            ADD_FAILURE() << name << ": no error";
        } catch (const Error &e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find(path), std::string::npos) << msg;
            EXPECT_NE(msg.find(expected), std::string::npos) << name << ": " << msg;
            EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
        }
    }
}

} // namespace
} // namespace prescope

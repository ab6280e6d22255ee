// Chat-template tests: every conversation of tests/data/tokenizers/chat_templates.json against the text
// transformers' Jinja renderer made from the real templates, plus recognition and refusal cases.
#include "runtime/chat-template.h"
#include "runtime/tokenizer.h"

#include "core/error.h"
#include "format/gguf.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <fstream>

namespace prescope {
namespace {

const std::string kDir = std::string(PRESCOPE_SOURCE_DIR) + "/tests/data/tokenizers/";

std::vector<ChatMessage> messages_of(const nlohmann::json &j) {
    std::vector<ChatMessage> out;
    for (const auto &m : j) out.push_back({m.at(0).get<std::string>(), m.at(1).get<std::string>()});
    return out;
}

TEST(ChatTemplate, MatchesHfRenderer) {
    std::ifstream in(kDir + "chat_templates.json");
    ASSERT_TRUE(in);
    const nlohmann::json doc = nlohmann::json::parse(in);
    size_t rendered = 0, refused = 0;
    for (const auto &c : doc.at("cases")) {
        const std::string path = kDir + c.at("gguf").get<std::string>();
        const GgufFile f(path);
        const auto msgs = messages_of(c.at("messages"));
        const bool gen = c.at("add_generation_prompt").get<bool>();
        SCOPED_TRACE(c.dump());
        if (c.at("expected").is_null()) {
            try {
                (void)apply_chat_template(f, msgs, gen);
                ADD_FAILURE() << "the reference template refuses this conversation; we rendered it";
            } catch (const Error &e) {
                EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
            }
            ++refused;
        } else {
            EXPECT_EQ(apply_chat_template(f, msgs, gen), c.at("expected").get<std::string>());
            ++rendered;
        }
    }
    EXPECT_GT(rendered, 100u);
    EXPECT_GT(refused, 10u);
}

TEST(ChatTemplate, RecognisesFamilies) {
    const std::vector<std::pair<std::string, std::string>> cases = {
        {"chat-qwen3", "qwen3"},           {"chat-qwen2.5", "chatml"},           {"chat-qwen2", "chatml"},
        {"chat-chatml", "chatml"},         {"chat-mistral-v0", "mistral-v0"},    {"chat-mistral-v1", "mistral-v1"},
        {"chat-none-qwen3moe", "chatml"},  {"chat-none-mixtral", "mistral-v1"},
    };
    for (const auto &[name, family] : cases) EXPECT_EQ(chat_template_name(GgufFile(kDir + name + ".gguf")), family);
    for (const char *name : {"chat-bad-unknown", "chat-bad-none-olmoe", "chat-bad-none-qwen-no-im"}) {
        const std::string path = kDir + name + ".gguf";
        try {
            (void)chat_template_name(GgufFile(path));
            ADD_FAILURE() << name;
        } catch (const Error &e) {
            const std::string msg = e.what();
            EXPECT_NE(msg.find(path), std::string::npos) << msg;
            EXPECT_NE(msg.find("tokenizer.chat_template"), std::string::npos) << msg;
        }
    }
}

TEST(ChatTemplate, RefusesEmptyConversationsAndUnknownRoles) {
    const GgufFile f(kDir + "chat-qwen3.gguf");
    EXPECT_THROW(apply_chat_template(f, {}, true), Error);
    EXPECT_THROW(apply_chat_template(f, {{"tool", "{}"}}, true), Error);
    EXPECT_THROW(apply_chat_template(GgufFile(kDir + "chat-mistral-v1.gguf"), {{"user", "a"}, {"system", "b"}}, true),
                 Error);
}

// The rendered ChatML prompt tokenizes with the control tokens as single ids (parse_special).
TEST(ChatTemplate, RenderedPromptTokenizes) {
    const GgufFile f(kDir + "qwen2-bpe.gguf");
    const Tokenizer tok = Tokenizer::from_gguf(f);
    const std::string prompt = apply_chat_template(GgufFile(kDir + "chat-qwen3.gguf"), {{"user", "Hello!"}}, true);
    const std::vector<int32_t> ids = tok.encode(prompt, true, true);
    const int32_t im_start = tok.find_token("<|im_start|>");
    ASSERT_FALSE(ids.empty());
    EXPECT_EQ(ids.front(), im_start);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), im_start), 2);
    EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.find_token("<|im_end|>")), 1);
    EXPECT_EQ(tok.decode(ids), prompt);
}

} // namespace
} // namespace prescope

// Chat templates (chat-template.h): recognise the family of tokenizer.chat_template, then render it in C++.
// Each renderer follows one real template line by line (the Jinja sources are in tests/data/tokenizers/chat/), but
// harmony, which follows llama.cpp's own rendering of it.
#include "runtime/chat-template.h"

#include "core/error.h"
#include "format/gguf.h"

#include <algorithm>

namespace prescope {
namespace {

constexpr const char *kKeyTemplate = "tokenizer.chat_template";

enum class Family { CHATML, QWEN3, MISTRAL_V0, MISTRAL_V1, HARMONY };

struct Template {
    Family family = Family::CHATML;
    std::string default_system;  // chatml: system prompt the template adds when the first turn is not "system"
    std::string eos;             // mistral: text of the EOS token, closing each assistant turn
};

bool contains(const std::string &s, std::string_view part) { return s.find(part) != std::string::npos; }

// The literal default system prompt of a ChatML template ('<|im_start|>system\nYou are ...<|im_end|>' inside
// one Jinja string, as in Qwen2 and Qwen2.5), with Jinja string escapes undone; "" when there is none.
std::string find_default_system(const std::string &tmpl) {
    static constexpr std::string_view kHead = "<|im_start|>system";
    static constexpr std::string_view kEnd = "<|im_end|>";
    for (size_t pos = tmpl.find(kHead); pos != std::string::npos; pos = tmpl.find(kHead, pos + 1)) {
        size_t start = pos + kHead.size();
        if (tmpl.compare(start, 2, "\\n") == 0)
            start += 2;
        else if (tmpl.compare(start, 1, "\n") == 0)
            start += 1;
        else
            continue;
        const size_t end = tmpl.find(kEnd, start);
        if (end == std::string::npos || end == start) continue;
        const std::string_view body = std::string_view(tmpl).substr(start, end - start);
        if (body.find_first_of("'\"+{}") != std::string_view::npos) continue;  // not one literal
        std::string out;
        for (size_t i = 0; i < body.size(); ++i) {
            if (body[i] == '\\' && i + 1 < body.size()) {
                const char c = body[++i];
                out += c == 'n' ? '\n' : c == 't' ? '\t' : c;
            } else {
                out += body[i];
            }
        }
        return out;
    }
    return "";
}

std::string token_text(const GgufFile &f, const char *id_key) {
    const uint32_t id = f.get_u32(id_key);
    const std::vector<std::string> tokens = f.get_str_array("tokenizer.ggml.tokens");
    if (id >= tokens.size())
        fail("{}: metadata '{}' = {} lies outside the vocabulary of {} tokens", f.path(), id_key, id, tokens.size());
    return tokens[id];
}

Template recognise(const GgufFile &f) {
    const std::string tmpl = f.get_str_or(kKeyTemplate, "");
    if (!tmpl.empty()) {
        // llama.cpp llm_chat_detect_template's test for gpt-oss's harmony template.
        if (contains(tmpl, "<|start|>") && contains(tmpl, "<|channel|>")) return {Family::HARMONY, "", ""};
        if (contains(tmpl, "<|im_start|>")) {
            if (contains(tmpl, "<think>")) return {Family::QWEN3, "", ""};
            return {Family::CHATML, find_default_system(tmpl), ""};
        }
        if (contains(tmpl, "[INST]")) {
            if (contains(tmpl, "' [INST] '") && contains(tmpl, "system_message"))
                return {Family::MISTRAL_V1, "", token_text(f, "tokenizer.ggml.eos_token_id")};
            if (contains(tmpl, "'[INST] '") && contains(tmpl, "' [/INST]'") && !contains(tmpl, "system"))
                return {Family::MISTRAL_V0, "", token_text(f, "tokenizer.ggml.eos_token_id")};
            fail("{}: metadata '{}' uses [INST] but is not a Mistral template PreScope knows (expected "
                 "Mixtral-8x7B-Instruct's original or updated template)",
                 f.path(), kKeyTemplate);
        }
        fail("{}: metadata '{}' is not a chat template PreScope knows (expected ChatML with <|im_start|> as "
             "in Qwen models, Mistral [INST] as in Mixtral, or gpt-oss's harmony with <|start|> and <|channel|>)",
             f.path(), kKeyTemplate);
    }
    // No template: choose by architecture and tokenizer (decision 0022).
    const std::string arch = f.get_str_or("general.architecture", "");
    const std::string model = f.get_str_or("tokenizer.ggml.model", "");
    if (arch.rfind("qwen", 0) == 0) {
        const std::vector<std::string> tokens = f.get_str_array("tokenizer.ggml.tokens");
        if (std::find(tokens.begin(), tokens.end(), "<|im_start|>") == tokens.end())
            fail("{}: missing metadata '{}', and the vocabulary has no <|im_start|> token for the ChatML default of "
                 "architecture '{}'",
                 f.path(), kKeyTemplate, arch);
        return {Family::CHATML, "", ""};
    }
    if (arch == "llama" && model == "llama")
        return {Family::MISTRAL_V1, "", token_text(f, "tokenizer.ggml.eos_token_id")};
    if (arch == "gpt-oss") return {Family::HARMONY, "", ""};
    fail("{}: missing metadata '{}', and architecture '{}' with tokenizer '{}' has no default chat template "
         "(expected a qwen* or gpt-oss architecture or a llama-architecture SentencePiece model such as Mixtral)",
         f.path(), kKeyTemplate, arch, model);
}

std::string_view lstrip_newlines(std::string_view s) {
    const size_t i = s.find_first_not_of('\n');
    return i == std::string_view::npos ? std::string_view() : s.substr(i);
}

std::string_view rstrip_newlines(std::string_view s) {
    const size_t i = s.find_last_not_of('\n');
    return i == std::string_view::npos ? std::string_view() : s.substr(0, i + 1);
}

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
bool ends_with(std::string_view s, std::string_view p) {
    return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

// Builds the prompt text, recording which bytes came from message contents (the rest is template text).
class PromptBuilder {
  public:
    PromptBuilder &tmpl(std::string_view s) {
        p_.text += s;
        return *this;
    }
    PromptBuilder &content(std::string_view s) {
        if (s.empty()) return *this;
        const size_t begin = p_.text.size();
        p_.text += s;
        if (!p_.content.empty() && p_.content.back().end == begin) {
            p_.content.back().end = p_.text.size();  // adjacent pieces of content: one span
        } else {
            p_.content.push_back({begin, p_.text.size()});
        }
        return *this;
    }
    ChatPrompt take() { return std::move(p_); }

  private:
    ChatPrompt p_;
};

void turn(PromptBuilder &b, std::string_view role, std::string_view content) {
    b.tmpl("<|im_start|>").tmpl(role).tmpl("\n").content(content).tmpl("<|im_end|>\n");
}

// Qwen2 / Qwen2.5 / plain ChatML (tests/data/tokenizers/chat/{qwen2,qwen2.5,chatml}.jinja without tools). The
// template's own default system prompt is template text.
ChatPrompt render_chatml(const Template &t, const std::vector<ChatMessage> &msgs, bool gen) {
    PromptBuilder b;
    if (!t.default_system.empty() && msgs[0].role != "system") {
        b.tmpl("<|im_start|>system\n").tmpl(t.default_system).tmpl("<|im_end|>\n");
    }
    for (const ChatMessage &m : msgs) turn(b, m.role, m.content);
    if (gen) b.tmpl("<|im_start|>assistant\n");
    return b.take();
}

// Qwen3 (chat/qwen3.jinja without tools): reasoning in assistant turns after the last real user query is
// kept in <think> tags (always for the final turn), earlier reasoning is dropped.
ChatPrompt render_qwen3(const std::vector<ChatMessage> &msgs, bool gen) {
    const size_t n = msgs.size();
    PromptBuilder b;
    if (msgs[0].role == "system") turn(b, "system", msgs[0].content);
    size_t last_query = n - 1;
    for (size_t k = n; k-- > 0;) {
        const std::string &c = msgs[k].content;
        if (msgs[k].role == "user" && !(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) {
            last_query = k;
            break;
        }
    }
    for (size_t i = 0; i < n; ++i) {
        const ChatMessage &m = msgs[i];
        if (m.role == "user" || (m.role == "system" && i > 0)) {
            turn(b, m.role, m.content);
        } else if (m.role == "assistant") {
            std::string_view content = m.content, reasoning;
            if (const size_t close = m.content.rfind("</think>"); close != std::string::npos) {
                content = lstrip_newlines(std::string_view(m.content).substr(close + 8));
                const std::string_view before = rstrip_newlines(std::string_view(m.content).substr(0, m.content.find("</think>")));
                const size_t open = before.rfind("<think>");
                reasoning = lstrip_newlines(open == std::string_view::npos ? before : before.substr(open + 7));
            }
            b.tmpl("<|im_start|>assistant\n");
            if (i > last_query && (i == n - 1 || !reasoning.empty())) {
                b.tmpl("<think>\n").content(rstrip_newlines(lstrip_newlines(reasoning))).tmpl("\n</think>\n\n");
                b.content(lstrip_newlines(content));
            } else {
                b.content(content);
            }
            b.tmpl("<|im_end|>\n");
        }
    }
    if (gen) b.tmpl("<|im_start|>assistant\n");
    return b.take();
}

// Mixtral-8x7B-Instruct (chat/mistral-v0.jinja, chat/mistral-v1.jinja); the templates' leading bos_token is
// left to the tokenizer. Neither template has a generation prompt: the text already ends with [/INST].
ChatPrompt render_mistral(const GgufFile &f, const Template &t, const std::vector<ChatMessage> &msgs) {
    const bool v1 = t.family == Family::MISTRAL_V1;
    size_t first = 0;
    std::string_view system;
    if (v1 && msgs[0].role == "system") {
        system = msgs[0].content;
        first = 1;
    }
    PromptBuilder b;
    for (size_t i = first; i < msgs.size(); ++i) {
        const ChatMessage &m = msgs[i];
        if ((m.role == "user") != ((i - first) % 2 == 0))
            fail("{}: chat template {} needs turns alternating user/assistant{}; turn {} is '{}'", f.path(),
                 v1 ? "mistral-v1" : "mistral-v0", v1 ? " after an optional system message" : "", i, m.role);
        if (m.role == "user") {
            b.tmpl(v1 ? " [INST] " : "[INST] ");
            if (i == first && !system.empty()) b.content(system).tmpl("\n\n");
            b.content(m.content).tmpl(" [/INST]");
        } else if (m.role == "assistant") {
            b.tmpl(v1 ? " " : "").content(m.content).tmpl(t.eos);
        } else {
            fail("{}: chat template {} accepts a system message only {}; turn {} is 'system'", f.path(),
                 v1 ? "mistral-v1" : "mistral-v0", v1 ? "as the first turn" : "nowhere", i);
        }
    }
    return b.take();
}

// gpt-oss's harmony format as llama.cpp renders it without Jinja (llama-chat.cpp LLM_CHAT_TEMPLATE_OPENAI_MOE):
// <|start|>role<|message|>content, closed by <|return|> after an assistant turn and <|end|> after the others,
// then <|start|>assistant as the generation prompt. Not the full Jinja template (no system preamble with the date,
// developer role or channels; decision 0140).
ChatPrompt render_harmony(const std::vector<ChatMessage> &msgs, bool gen) {
    PromptBuilder b;
    for (const ChatMessage &m : msgs) {
        b.tmpl("<|start|>").tmpl(m.role).tmpl("<|message|>").content(m.content);
        b.tmpl(m.role == "assistant" ? "<|return|>" : "<|end|>");
    }
    if (gen) b.tmpl("<|start|>assistant");
    return b.take();
}

} // namespace

std::string chat_template_name(const GgufFile &file) {
    switch (recognise(file).family) {
    case Family::QWEN3: return "qwen3";
    case Family::CHATML: return "chatml";
    case Family::MISTRAL_V0: return "mistral-v0";
    case Family::MISTRAL_V1: return "mistral-v1";
    case Family::HARMONY: return "harmony";
    }
    return "";
}

bool known_chat_role(const std::string &role) {
    return role == "system" || role == "user" || role == "assistant";
}

ChatPrompt render_chat(const GgufFile &file, const std::vector<ChatMessage> &messages, bool add_generation_prompt) {
    const Template t = recognise(file);
    if (messages.empty()) fail("{}: cannot apply the chat template to an empty conversation", file.path());
    for (size_t i = 0; i < messages.size(); ++i) {
        const std::string &r = messages[i].role;
        if (!known_chat_role(r))
            fail("{}: chat message {} has role '{}', expected system, user or assistant", file.path(), i, r);
    }
    switch (t.family) {
    case Family::CHATML: return render_chatml(t, messages, add_generation_prompt);
    case Family::QWEN3: return render_qwen3(messages, add_generation_prompt);
    case Family::MISTRAL_V0:
    case Family::MISTRAL_V1: return render_mistral(file, t, messages);
    case Family::HARMONY: return render_harmony(messages, add_generation_prompt);
    }
    return {};
}

std::string apply_chat_template(const GgufFile &file, const std::vector<ChatMessage> &messages,
                                bool add_generation_prompt) {
    return render_chat(file, messages, add_generation_prompt).text;
}

} // namespace prescope

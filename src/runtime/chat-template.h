// Chat templates chosen from a GGUF's tokenizer.chat_template: ChatML (Qwen), Mistral [INST] (Mixtral) and
// gpt-oss's harmony, re-implemented in C++ (no Jinja at runtime) and checked against HF's renderer (harmony:
// against llama.cpp's built-in rendering; docs/tokenizer.md).
#pragma once

#include "runtime/tokenizer.h"

#include <string>
#include <vector>

namespace prescope {

class GgufFile;

/// One turn of a conversation. role: "system", "user" or "assistant"; content: UTF-8 text.
struct ChatMessage {
    std::string role;
    std::string content;
};

/// Whether render_chat takes messages of this role: system, user or assistant.
bool known_chat_role(const std::string &role);

/// The template family PreScope recognised in the file, for logs: "qwen3" (ChatML with Qwen3's <think>
/// handling), "chatml" (ChatML, with the template's default system prompt if it has one: Qwen2, Qwen2.5),
/// "mistral-v0" (Mixtral-8x7B-Instruct's original [INST] template, no system role), "mistral-v1" (its
/// updated template, system message folded into the first user turn) or "harmony" (gpt-oss, as llama.cpp's
/// llama_chat_apply_template renders it: decision 0140).
/// Recognised by markers in tokenizer.chat_template (<|start|> with <|channel|>, <|im_start|>, <think>, [INST],
/// ' [INST] '); without a template, qwen* architectures whose vocabulary has <|im_start|> get "chatml",
/// llama-architecture SentencePiece models "mistral-v1" and gpt-oss "harmony" (decision 0022). Throws
/// prescope::Error naming the file and 'tokenizer.chat_template' when no family fits.
std::string chat_template_name(const GgufFile &file);

/// A rendered conversation: the prompt text and the byte ranges of it that hold message contents (sorted,
/// disjoint); everything else is template text.
struct ChatPrompt {
    std::string text;
    std::vector<TextSpan> content;
};

/// The prompt the model's chat template renders for `messages` (HF apply_chat_template with
/// add_generation_prompt), except for the BOS text Mistral templates start with, which is left to the
/// tokenizer. Tokenize it with Tokenizer::encode(p.text, /*add_special=*/true, /*parse_special=*/true,
/// p.content): control tokens come from the template only, and special-token text a user writes (a literal
/// "<|im_end|>") stays text (decision 0104). Throws prescope::Error (naming the file) when no template fits,
/// `messages` is empty, a role is not system/user/assistant, or the template itself would refuse the
/// conversation (Mistral: roles must alternate user/assistant after an optional leading system message; v0
/// has no system role).
ChatPrompt render_chat(const GgufFile &file, const std::vector<ChatMessage> &messages, bool add_generation_prompt);

/// render_chat's text alone (what HF's Jinja renderer gives; the tests compare the two).
std::string apply_chat_template(const GgufFile &file, const std::vector<ChatMessage> &messages,
                                bool add_generation_prompt);

} // namespace prescope

#include "openai-api.h"

#include "core/error.h"
#include "runtime/chat-template.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace prescope::cli {

ApiError::ApiError(int status_, std::string message, std::string type_, std::string param_, std::string code_)
    : std::runtime_error(std::move(message)), status(status_), type(std::move(type_)), param(std::move(param_)),
      code(std::move(code_)) {}

nlohmann::json ApiError::body() const {
    const auto or_null = [](const std::string &s) { return s.empty() ? nlohmann::json(nullptr) : nlohmann::json(s); };
    return {{"error", {{"message", what()}, {"type", type}, {"param", or_null(param)}, {"code", or_null(code)}}}};
}

void bad_request(std::string param, std::string code, std::string message) {
    throw ApiError(400, std::move(message), "invalid_request_error", std::move(param), std::move(code));
}

namespace {

using nlohmann::json;

// "a string", "an array", ... as OpenAI's "expected an integer, but got a string instead".
std::string a_type(const json &v) {
    if (v.is_number_integer()) return "an integer";
    if (v.is_number()) return "a number";
    const std::string t = v.type_name();
    return (t == "array" || t == "object" ? "an " : "a ") + t;
}

[[noreturn]] void wrong_type(const std::string &name, const char *expected, const json &v) {
    bad_request(name, "invalid_type", fmt::format("Invalid type for '{}': expected {}, but got {} instead.", name,
                                                  expected, a_type(v)));
}

[[noreturn]] void wrong_value(const std::string &name, const std::string &what) {
    bad_request(name, "invalid_value", fmt::format("Invalid value for '{}': {}.", name, what));
}

// The field, or nullptr when it is absent or null (OpenAI treats null as "not given").
const json *field(const json &body, const char *name) {
    const auto it = body.find(name);
    return it == body.end() || it->is_null() ? nullptr : &*it;
}

double number(const json &body, const char *name, double def, double lo, double hi) {
    const json *v = field(body, name);
    if (!v) return def;
    if (!v->is_number()) wrong_type(name, "a number", *v);
    const double x = v->get<double>();
    if (!std::isfinite(x) || x < lo || x > hi) wrong_value(name, fmt::format("expected a number in [{}, {}], got {}", lo, hi, x));
    return x;
}

int64_t integer(const json &body, const char *name, int64_t def, int64_t lo, int64_t hi) {
    const json *v = field(body, name);
    if (!v) return def;
    if (!v->is_number_integer()) wrong_type(name, "an integer", *v);
    // A uint64 beyond int64 reads as negative through get<int64_t>: check it as unsigned first.
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
        wrong_value(name, fmt::format("expected an integer in [{}, {}], got {}", lo, hi, v->get<uint64_t>()));
    }
    const int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) wrong_value(name, fmt::format("expected an integer in [{}, {}], got {}", lo, hi, x));
    return x;
}

bool boolean(const json &body, const char *name, bool def) {
    const json *v = field(body, name);
    if (!v) return def;
    if (!v->is_boolean()) wrong_type(name, "a boolean", *v);
    return v->get<bool>();
}

// OpenAI features this server does not implement: accepted with their "off" value, refused otherwise.
void require_off(const json &body) {
    if (integer(body, "n", 1, 1, 128) != 1) wrong_value("n", "only n = 1 is supported");
    if (integer(body, "best_of", 1, 1, 128) != 1) wrong_value("best_of", "only best_of = 1 is supported");
    if (boolean(body, "echo", false)) wrong_value("echo", "echo is not supported");
    if (const json *v = field(body, "logprobs")) {
        if (!(v->is_boolean() || v->is_number_integer())) wrong_type("logprobs", "a boolean or an integer", *v);
        if (v->is_boolean() ? v->get<bool>() : v->get<int64_t>() != 0) wrong_value("logprobs", "logprobs are not supported");
    }
    for (const char *name : {"presence_penalty", "frequency_penalty"}) {
        if (number(body, name, 0.0, -2.0, 2.0) != 0.0) {
            wrong_value(name, "not supported (use repeat_penalty, as llama-server names it)");
        }
    }
    if (const json *v = field(body, "logit_bias")) {
        if (!v->is_object()) wrong_type("logit_bias", "an object", *v);
        if (!v->empty()) wrong_value("logit_bias", "logit_bias is not supported");
    }
    if (const json *v = field(body, "suffix")) {
        if (!v->is_string()) wrong_type("suffix", "a string", *v);
        if (!v->get<std::string>().empty()) wrong_value("suffix", "suffix is not supported");
    }
    if (const json *v = field(body, "tools")) {
        if (!v->is_array()) wrong_type("tools", "an array", *v);
        if (!v->empty()) wrong_value("tools", "tools are not supported");
    }
    if (const json *v = field(body, "response_format")) {
        if (!v->is_object()) wrong_type("response_format", "an object", *v);
        const json *t = field(*v, "type");
        if (t && !(t->is_string() && t->get<std::string>() == "text")) {
            wrong_value("response_format", "only {\"type\": \"text\"} is supported");
        }
    }
    if (const json *v = field(body, "user"); v && !v->is_string()) wrong_type("user", "a string", *v);
}

SamplerParams sampling(const json &body) {
    SamplerParams s;  // llama-server's defaults (docs/serve.md)
    s.temp = float(number(body, "temperature", s.temp, 0.0, 1e3));
    s.top_p = float(number(body, "top_p", s.top_p, 0.0, 1.0));
    s.top_k = int32_t(integer(body, "top_k", s.top_k, -1, std::numeric_limits<int32_t>::max()));
    s.min_p = float(number(body, "min_p", s.min_p, 0.0, 1.0));
    s.repeat_penalty = float(number(body, "repeat_penalty", s.repeat_penalty, 1e-3, 1e3));
    s.repeat_last_n = int32_t(integer(body, "repeat_last_n", s.repeat_last_n, -1, std::numeric_limits<int32_t>::max()));
    const int64_t seed = integer(body, "seed", -1, -1, int64_t(0xFFFFFFFE));
    s.seed = seed < 0 ? 0xFFFFFFFFu : uint32_t(seed);
    return s;
}

std::vector<std::string> stop_strings(const json &body) {
    const json *v = field(body, "stop");
    if (!v) return {};
    std::vector<std::string> out;
    if (v->is_string()) {
        out.push_back(v->get<std::string>());
    } else if (v->is_array()) {
        for (const json &s : *v) {
            if (!s.is_string()) wrong_type("stop", "a string or an array of strings", s);
            out.push_back(s.get<std::string>());
        }
    } else {
        wrong_type("stop", "a string or an array of strings", *v);
    }
    for (const std::string &s : out) {
        if (s.empty()) wrong_value("stop", "a stop string is empty");
    }
    return out;
}

// Completions: a string, one string in an array, an array of token ids, or one such array in an array.
std::vector<int32_t> completion_prompt(const json &body, const ApiContext &ctx) {
    const json *v = field(body, "prompt");
    if (!v) bad_request("prompt", "missing_required_parameter", "Missing required parameter: 'prompt'.");
    const char *expected = "a string, an array of token ids, or one of them in an array";
    const json *p = v;
    if (v->is_array() && v->size() == 1 && ((*v)[0].is_string() || (*v)[0].is_array())) p = &(*v)[0];
    else if (v->is_array() && !v->empty() && !(*v)[0].is_number_integer()) {
        wrong_value("prompt", "only one prompt per request is supported");
    }
    if (p->is_string()) {
        // A raw prompt is the user's own template: special-token text in it is meant (as `generate -p` and llama.cpp).
        return ctx.tokenizer.encode(p->get<std::string>(), /*add_special=*/true, /*parse_special=*/true);
    }
    if (!p->is_array()) wrong_type("prompt", expected, *p);
    std::vector<int32_t> ids;
    for (const json &t : *p) {
        if (!t.is_number_integer()) wrong_type("prompt", expected, t);
        const int64_t id = t.get<int64_t>();
        if (id < 0 || id >= ctx.tokenizer.n_vocab()) {
            wrong_value("prompt", fmt::format("token id {} is outside the vocabulary [0, {})", id, ctx.tokenizer.n_vocab()));
        }
        ids.push_back(int32_t(id));
    }
    return ids;
}

// Chat: messages [{role, content}], content a string or an array of {"type": "text", "text": ...} parts (joined
// with newlines, as vLLM does). Contents stay text (decision 0104).
std::vector<int32_t> chat_prompt(const json &body, const ApiContext &ctx) {
    const json *v = field(body, "messages");
    if (!v) bad_request("messages", "missing_required_parameter", "Missing required parameter: 'messages'.");
    if (!v->is_array()) wrong_type("messages", "an array", *v);
    if (v->empty()) wrong_value("messages", "expected at least one message");
    std::vector<ChatMessage> messages;
    for (size_t i = 0; i < v->size(); ++i) {
        const json &m = (*v)[i];
        const std::string at = fmt::format("messages[{}]", i);
        if (!m.is_object()) wrong_type(at, "an object", m);
        const json *role = field(m, "role");
        if (!role || !role->is_string()) {
            bad_request(at + ".role", "invalid_type", fmt::format("'{}.role' must be a string", at));
        }
        // Checked here, not only by the template: its error names the model file, which a client is not told.
        // OpenAI's "developer" messages take the place of "system" ones (its API reference): rendered as system.
        std::string r = role->get<std::string>();
        if (r == "developer") r = "system";
        if (!known_chat_role(r)) {
            wrong_value(at + ".role", fmt::format("expected system, developer, user or assistant, got '{}'", r));
        }
        const json *content = field(m, "content");
        if (!content) bad_request(at + ".content", "invalid_type", fmt::format("'{}.content' is missing", at));
        std::string text;
        if (content->is_string()) {
            text = content->get<std::string>();
        } else if (content->is_array()) {
            for (const json &part : *content) {
                const json *type = part.is_object() ? field(part, "type") : nullptr;
                const json *t = part.is_object() ? field(part, "text") : nullptr;
                if (!type || !type->is_string() || type->get<std::string>() != "text" || !t || !t->is_string()) {
                    wrong_value(at + ".content", "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported");
                }
                if (!text.empty()) text += '\n';
                text += t->get<std::string>();
            }
        } else {
            wrong_type(at + ".content", "a string or an array of text parts", *content);
        }
        messages.push_back({std::move(r), std::move(text)});
    }
    ChatPrompt p;
    try {
        p = render_chat(ctx.model_file, messages, /*add_generation_prompt=*/true);
    } catch (const Error &e) {
        wrong_value("messages", e.what());
    }
    return ctx.tokenizer.encode(p.text, /*add_special=*/true, /*parse_special=*/true, p.content);
}

} // namespace

ApiRequest parse_request(Endpoint endpoint, std::string_view text, const ApiContext &ctx) {
    json body;
    try {
        body = json::parse(text);
    } catch (const json::exception &e) {  // parse_error, and out_of_range for a number like 1e999
        bad_request("", "invalid_json", fmt::format("The body is not valid JSON: {}", e.what()));
    }
    if (!body.is_object()) bad_request("", "invalid_json", fmt::format("The body must be a JSON object, got {}.", a_type(body)));

    if (const json *m = field(body, "model")) {
        if (!m->is_string()) wrong_type("model", "a string", *m);
        if (m->get<std::string>() != ctx.model_id) {
            bad_request("model", "model_not_found",
                        fmt::format("The model '{}' does not exist; this server serves '{}'.", m->get<std::string>(), ctx.model_id));
        }
    }
    require_off(body);
    ApiRequest r;
    r.stream = boolean(body, "stream", false);
    if (const json *o = field(body, "stream_options")) {
        if (!o->is_object()) wrong_type("stream_options", "an object", *o);
        r.include_usage = boolean(*o, "include_usage", false);
    }
    GenerationRequest &g = r.generation;
    g.sampling = sampling(body);
    g.stop = stop_strings(body);
    g.ignore_eos = boolean(body, "ignore_eos", false);
    // max_completion_tokens is the chat API's newer name; -1 is llama-server's "no limit".
    const int64_t max_ctx = std::max<int64_t>(ctx.slot_ctx, 1);
    g.max_tokens = integer(body, "max_tokens", -1, -1, std::numeric_limits<int64_t>::max());
    const char *max_name = "max_tokens";
    if (endpoint == Endpoint::chat_completions && field(body, "max_completion_tokens")) {
        g.max_tokens = integer(body, "max_completion_tokens", -1, -1, std::numeric_limits<int64_t>::max());
        max_name = "max_completion_tokens";
    }
    if (g.max_tokens == 0) wrong_value(max_name, "expected -1 (no limit) or at least 1, got 0");

    const char *prompt_name = endpoint == Endpoint::chat_completions ? "messages" : "prompt";
    g.prompt = endpoint == Endpoint::chat_completions ? chat_prompt(body, ctx) : completion_prompt(body, ctx);
    const int64_t n_prompt = int64_t(g.prompt.size());
    if (n_prompt == 0) wrong_value(prompt_name, "the prompt is empty");
    if (n_prompt >= max_ctx) {
        bad_request(prompt_name, "context_length_exceeded",
                    fmt::format("The prompt is {} tokens; a slot's context is {} tokens and must also hold the "
                                "generated ones (prescope serve -c total context / -np slots).",
                                n_prompt, ctx.slot_ctx));
    }
    if (g.max_tokens > 0 && n_prompt + g.max_tokens > max_ctx) {
        bad_request(max_name, "context_length_exceeded",
                    fmt::format("A slot's context is {} tokens; the request asks for {} ({} in the prompt, {} for '{}').",
                                ctx.slot_ctx, n_prompt + g.max_tokens, n_prompt, g.max_tokens, max_name));
    }
    return r;
}

} // namespace prescope::cli

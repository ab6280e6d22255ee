// The OpenAI request side of `prescope serve`: a POST body of /v1/completions or /v1/chat/completions checked
// field by field and turned into a GenerationRequest, and the errors OpenAI's API answers with. Which fields
// are read, their defaults (llama-server's) and ranges: docs/serve.md, decisions 0115-0119.
#pragma once

#include "runtime/batch-scheduler.h"
#include "runtime/tokenizer.h"

#include <nlohmann/json.hpp>

#include <stdexcept>
#include <string>
#include <string_view>

namespace prescope {
class GgufFile;
}

namespace prescope::cli {

/// A request the server refuses, as OpenAI's API does: HTTP status and the body
/// {"error": {"message", "type", "param", "code"}} (param: the field at fault or null).
class ApiError : public std::runtime_error {
  public:
    ApiError(int status, std::string message, std::string type, std::string param = {}, std::string code = {});
    int status;
    std::string type, param, code;
    nlohmann::json body() const;
};

/// 400 invalid_request_error naming `param`.
[[noreturn]] void bad_request(std::string param, std::string code, std::string message);

enum class Endpoint { completions, chat_completions };

/// What the server needs to read a request.
struct ApiContext {
    const GgufFile &model_file;  // chat template
    const Tokenizer &tokenizer;
    std::string model_id;  // the one name /v1/models lists; a request naming another model is refused
    int64_t slot_ctx = 0;  // tokens per slot (prompt + generated)
};

/// A checked request.
struct ApiRequest {
    GenerationRequest generation;
    bool stream = false;
    bool include_usage = false;  // stream_options.include_usage: a last chunk with usage and no choices
};

/// Parses and checks a request body. Throws ApiError (400) for malformed JSON, a body that is not an object, a
/// field of the wrong type or out of range, an unknown model, a prompt that does not fit a slot's context
/// (code context_length_exceeded), prompt + max_tokens beyond it, and OpenAI features this server does not
/// implement when asked for (n > 1, echo, logprobs, presence/frequency penalties, logit_bias, tools, non-text
/// response formats or content parts). Fields OpenAI does not define are ignored.
ApiRequest parse_request(Endpoint endpoint, std::string_view body, const ApiContext &ctx);

} // namespace prescope::cli

// prescope tokenize: token ids of a text with the model's tokenizer (llama.cpp llama-tokenize in spirit);
// --jsonl tokenizes each line's "text" field separately and prints one JSON array of ids per line.
#include "cli.h"

#include "core/error.h"
#include "format/gguf.h"
#include "runtime/tokenizer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace prescope::cli {

void register_tokenize(CLI::App &app) {
    struct Args {
        std::string model, prompt, file;
        bool jsonl = false, no_special = false, parse_special = false;
    };
    auto a = std::make_shared<Args>();
    auto *cmd = app.add_subcommand("tokenize", "print the token ids of a text");
    cmd->add_option("-m,--model", a->model, "model or vocabulary file (GGUF)")->required()->check(CLI::ExistingFile);
    auto *p = cmd->add_option("-p,--prompt", a->prompt, "text");
    cmd->add_option("-f,--file", a->file, "read the text from a file")->excludes(p);
    cmd->add_flag("--jsonl", a->jsonl, "the file is JSON lines; tokenize each line's \"text\" field");
    cmd->add_flag("--no-bos", a->no_special, "do not add BOS/EOS even if the model asks for them");
    cmd->add_flag("--parse-special", a->parse_special, "turn special-token text (e.g. <|im_start|>) into its id");
    cmd->callback([a]() {
        const GgufFile f(a->model);
        const Tokenizer tok = Tokenizer::from_gguf(f);
        auto encode = [&](const std::string &text) { return tok.encode(text, !a->no_special, a->parse_special); };
        if (a->file.empty()) {
            fmt::print("[{}]\n", fmt::join(encode(a->prompt), ", "));
            return;
        }
        std::ifstream in(a->file, std::ios::binary);
        if (!in) fail("{}: cannot read", a->file);
        if (!a->jsonl) {
            std::stringstream ss;
            ss << in.rdbuf();
            fmt::print("[{}]\n", fmt::join(encode(ss.str()), ", "));
            return;
        }
        std::string line;
        for (int64_t n = 1; std::getline(in, line); ++n) {
            if (line.empty()) continue;
            nlohmann::json j;
            try {
                j = nlohmann::json::parse(line);
            } catch (const nlohmann::json::exception &e) {
                fail("{}:{}: not JSON: {}", a->file, n, e.what());
            }
            if (!j.contains("text") || !j["text"].is_string()) fail("{}:{}: no string field \"text\"", a->file, n);
            fmt::print("[{}]\n", fmt::join(encode(j["text"].get<std::string>()), ", "));
        }
    });
}

} // namespace prescope::cli

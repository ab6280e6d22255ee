// Chat templates (runtime/chat-template.h) with hostile conversations: every committed template family, roles
// and contents from the input. Besides "no crash", the promise of decision 0104 is checked: the prompt holds
// exactly the control tokens of its template text, whatever special-token strings the contents carry.
#include "fuzz-common.h"

#include "format/gguf.h"
#include "runtime/chat-template.h"
#include "runtime/tokenizer.h"

#include <algorithm>
#include <optional>

using namespace prescope;

namespace {

struct Family {
    GgufFile templ;
    const Tokenizer *tok;
};

struct Setup {
    Tokenizer bpe, spm;
    std::vector<Family> families;
};

Setup &setup() {
    static Setup s = [] {
        const std::string dir = fuzz::data_dir() + "tokenizers/";
        Setup out{Tokenizer::from_gguf(GgufFile(dir + "qwen2-bpe.gguf")),
                  Tokenizer::from_gguf(GgufFile(dir + "llama-spm.gguf")), {}};
        for (const char *name : {"chat-qwen3", "chat-qwen2.5", "chat-qwen2", "chat-chatml", "chat-none-qwen3moe"}) {
            out.families.push_back({GgufFile(dir + name + ".gguf"), nullptr});
        }
        for (const char *name : {"chat-mistral-v0", "chat-mistral-v1", "chat-none-mixtral"}) {
            out.families.push_back({GgufFile(dir + name + ".gguf"), nullptr});
        }
        return out;
    }();
    for (size_t i = 0; i < s.families.size(); ++i) s.families[i].tok = i < 5 ? &s.bpe : &s.spm;
    return s;
}

// Control tokens (<|im_start|>, </s>, ...) in ids.
size_t n_control(const Tokenizer &tok, const std::vector<int32_t> &ids) {
    return size_t(std::count_if(ids.begin(), ids.end(), [&](int32_t id) { return tok.token_type(id) == TokenType::CONTROL; }));
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    (void)setup();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const Family &f = setup().families[data[0] % setup().families.size()];
    // Messages separated by NUL bytes; the first byte of each picks the role.
    std::vector<ChatMessage> msgs;
    static const char *roles[] = {"user", "assistant", "system"};
    const std::string_view rest(reinterpret_cast<const char *>(data + 1), size - 1);
    for (size_t pos = 0; pos <= rest.size() && msgs.size() < 16;) {
        const size_t end = std::min(rest.find('\0', pos), rest.size());
        const std::string_view m = rest.substr(pos, end - pos);
        if (!m.empty()) msgs.push_back({roles[uint8_t(m[0]) % 3], std::string(m.substr(1))});
        pos = end + 1;
    }
    std::optional<ChatPrompt> p;
    fuzz::expect_clean([&] { p = render_chat(f.templ, msgs, true); });
    if (!p) return 0;
    const Tokenizer &tok = *f.tok;
    const std::vector<int32_t> ids = tok.encode(p->text, true, true, p->content);
    // The template text alone, contents cut out.
    std::string templ;
    size_t pos = 0;
    for (const TextSpan &s : p->content) {
        if (s.begin < pos || s.end > p->text.size()) std::abort();
        templ += p->text.substr(pos, s.begin - pos);
        pos = s.end;
    }
    templ += p->text.substr(pos);
    if (n_control(tok, ids) != n_control(tok, tok.encode(templ, true, true))) std::abort();
    return 0;
}

// Tokenizers (runtime/tokenizer.h) on arbitrary text: each committed vocabulary (byte-level BPE of every
// pre-tokenizer family, SentencePiece BPE), both parse_special settings, decode, and the streamed decoder.
// Round trips are checked where tokenizer.h promises them: decode(encode(t)) == t with invalid UTF-8 replaced
// (and U+2581 read as a space by SentencePiece), and for the NFC families (qwen2, qwen35, olmo)
// decode(encode(x)) == x once x is normalised.
#include "fuzz-common.h"

#include "format/gguf.h"
#include "runtime/tokenizer.h"

#include <filesystem>

using namespace prescope;

namespace {

struct Vocab {
    Tokenizer tok;
    bool nfc;
    bool spm;  // SentencePiece: a U+2581 in the text decodes as the space it stands for
};

std::string spm_spaces(std::string s) {
    for (size_t p = s.find("\u2581"); p != std::string::npos; p = s.find("\u2581", p + 1)) s.replace(p, 3, " ");
    return s;
}

std::vector<Vocab> &vocabs() {
    static std::vector<Vocab> v = [] {
        std::vector<Vocab> out;
        const std::string dir = fuzz::data_dir() + "tokenizers/";
        std::vector<std::string> files = {dir + "qwen2-bpe.gguf", dir + "llama-bpe.gguf", dir + "llama-spm.gguf"};
        for (const auto &e : std::filesystem::directory_iterator(dir + "pre")) {
            if (e.path().extension() == ".gguf") files.push_back(e.path().string());
        }
        std::sort(files.begin() + 3, files.end());
        for (const std::string &f : files) {
            const GgufFile g(f);
            const std::string pre = g.get_str_or("tokenizer.ggml.pre", "");
            out.push_back({Tokenizer::from_gguf(g), pre == "qwen2" || pre == "qwen35" || pre == "olmo",
                           g.get_str("tokenizer.ggml.model") == "llama"});
        }
        return out;
    }();
    return v;
}

} // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
    fuzz::init();
    (void)vocabs();
    return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    const Vocab &v = vocabs()[data[0] % vocabs().size()];
    const std::string_view text(reinterpret_cast<const char *>(data + 1), size - 1);
    const std::vector<int32_t> special = v.tok.encode(text, true, true);
    const std::vector<int32_t> plain = v.tok.encode(text, false, false);
    (void)v.tok.decode(special);
    const std::string once = v.tok.decode(plain);
    const std::string expected = v.spm ? spm_spaces(sanitize_utf8(text)) : sanitize_utf8(text);
    if (!v.nfc && once != expected) std::abort();
    if (v.nfc && v.tok.decode(v.tok.encode(once, false, false)) != once) std::abort();
    TokenTextStream stream(v.tok);
    std::string streamed;
    for (int32_t id : special) streamed += stream.push(id);
    streamed += stream.flush();
    for (int32_t id : plain) (void)v.tok.token_to_piece(id);
    return 0;
}

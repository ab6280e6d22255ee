// Pre-tokenizer families (pre-tokenizer.h): the table of tokenizer.json rules per tokenizer.ggml.pre value,
// the Oniguruma -> PCRE2 class rewrite and the Split(Isolated) sequence.
#include "runtime/pre-tokenizer.h"

#include "core/error.h"

#include <array>
#include <utility>

namespace prescope {
namespace {

// Regexes as the families' tokenizer.json files hold them (llama.cpp llama-vocab.cpp quotes them, sometimes
// adapted for std::regex; we keep the originals, decision 0021). Sources and checks: decision 0070.
constexpr std::string_view kGpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kLlama3 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen35 =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kO200k =
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|)"
    R"(\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kDeepseekV3Punct =
    R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|)"
    R"(\s*[\r\n]+|\s+(?!\S)|\s+)";
// DeepSeek-LLM's letter run: its tokenizer.json spells the letter ranges out (written here as \x{} escapes).
constexpr std::string_view kDeepseekLlmLetters =
    R"(\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF})"
    R"(\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5})"
    R"(\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA})"
    R"(\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D})"
    R"(\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4})"
    R"(\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC})"
    R"(\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126})"
    R"(\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184})"
    R"(\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B})"
    R"(\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17})"
    R"(\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2})"
    R"(\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+)";
// HF Digits(individual_digits=true) isolates each char::is_numeric() code point: \p{N}, plus the digits that
// Rust's Unicode 17 tables (tokenizers 0.23) have beyond Oniguruma's Unicode 16.
constexpr std::string_view kDigitsIndividual = R"(\p{N}|[\x{11DE0}-\x{11DE9}\x{16FF4}-\x{16FF6}])";

const std::array<PreTokenizerSpec, 9> &specs() {
    static const std::array<PreTokenizerSpec, 9> table = {{
        // llama.cpp's own fallback (LLAMA_VOCAB_PRE_TYPE_DEFAULT); no tokenizer.json has it. Its second regex is
        // GPT-2's without the final \s+ alternative, which splits identically (a lone space left unmatched is a
        // piece of its own either way).
        {{"default"},
         {R"([\p{P}\$\+<=>\^~\|]+)", R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))",
          R"(\p{N}+)", R"([0-9][0-9][0-9])"}},
        // GPT-2: ByteLevel(use_regex=true), no normaliser.
        {{"gpt-2"}, {kGpt2}},
        // OLMo 1.7 / OLMoE (GPT-NeoX vocabulary with PII tokens): NFC, then GPT-2's ByteLevel regex.
        {{"olmo"}, {kGpt2}, true},
        // Qwen2, Qwen2.5, Qwen3 (incl. MoE), DeepSeek-R1 distills of Qwen2.5: NFC, Qwen2 split.
        {{"qwen2", "deepseek-r1-qwen"}, {kQwen2}, true},
        // Qwen3.5: NFC; letters take combining marks.
        {{"qwen35"}, {kQwen35}, true},
        // Llama 3: no normaliser, \p{N}{1,3}, whole-word lookup first, BOS by default.
        {{"llama-bpe", "llama3", "llama-v3"}, {kLlama3}, false, true, true},
        // DeepSeek-LLM, DeepSeek-MoE, DeepSeek-V2(-Lite): five splits, then single digits.
        {{"deepseek-llm"},
         {R"([\r\n])", kDeepseekLlmLetters, R"(\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+)",
          R"(\s+$)", R"([\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+)", kDigitsIndividual}},
        // DeepSeek-V3 / R1: numbers of up to three digits, CJK runs, then the punctuation-aware split.
        {{"deepseek-v3"}, {R"(\p{N}{1,3})", R"([\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+)", kDeepseekV3Punct}},
        // gpt-oss (o200k_harmony); llama.cpp maps Llama 4 and MiniMax-M2 to the same rules.
        {{"gpt-4o", "llama4", "minimax-m2"}, {kO200k}},
    }};
    return table;
}

// Oniguruma's (HF tokenizers, Unicode 16) classes where they differ from PCRE2 10.42 (Unicode 14): found by
// matching every code point with both engines; only additions were found (decision 0021), and for \s one
// removal (U+180E), so \s is spelled out as the White_Space list.
constexpr std::string_view kClassSpace =
    R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
constexpr std::array<std::pair<std::string_view, std::string_view>, 9> kClassAdditions = {{
    {"L", R"(\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D4A}-\x{10D65})"
          R"(\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{1123F}-\x{11240}\x{11380}-\x{11389}\x{1138B}\x{1138E})"
          R"(\x{11390}-\x{113B5}\x{113B7}\x{113D1}\x{113D3}\x{11BC0}-\x{11BE0}\x{11F02}\x{11F04}-\x{11F10})"
          R"(\x{11F12}-\x{11F33}\x{1342F}\x{13441}-\x{13446}\x{13460}-\x{143FA}\x{16100}-\x{1611D})"
          R"(\x{16D40}-\x{16D6C}\x{18CFF}\x{1B132}\x{1B155}\x{1DF25}-\x{1DF2A}\x{1E030}-\x{1E06D})"
          R"(\x{1E4D0}-\x{1E4EB}\x{1E5D0}-\x{1E5ED}\x{1E5F0}\x{2B739}\x{2EBF0}-\x{2EE5D}\x{31350}-\x{323AF})"},
    {"N", R"(\x{10D40}-\x{10D49}\x{116D0}-\x{116E3}\x{11BF0}-\x{11BF9}\x{11F50}-\x{11F59}\x{16130}-\x{16139})"
          R"(\x{16D70}-\x{16D79}\x{1CCF0}-\x{1CCF9}\x{1D2C0}-\x{1D2D3}\x{1E4F0}-\x{1E4F9}\x{1E5F1}-\x{1E5FA})"},
    {"P", R"(\x{1B4E}-\x{1B4F}\x{1B7F}\x{10D6E}\x{113D4}-\x{113D5}\x{113D7}-\x{113D8}\x{11B00}-\x{11B09}\x{11BE1})"
          R"(\x{11F43}-\x{11F4F}\x{16D6D}-\x{16D6F}\x{1E5FF})"},
    {"S", R"(\x{2427}-\x{2429}\x{2FFC}-\x{2FFF}\x{31E4}-\x{31E5}\x{31EF}\x{10D8E}-\x{10D8F}\x{1CC00}-\x{1CCEF})"
          R"(\x{1CD00}-\x{1CEB3}\x{1F6DC}\x{1F774}-\x{1F776}\x{1F77B}-\x{1F77F}\x{1F7D9}\x{1F8B2}-\x{1F8BB})"
          R"(\x{1F8C0}-\x{1F8C1}\x{1FA75}-\x{1FA77}\x{1FA87}-\x{1FA89}\x{1FA8F}\x{1FAAD}-\x{1FAAF}\x{1FABB}-\x{1FABF})"
          R"(\x{1FAC6}\x{1FACE}-\x{1FACF}\x{1FADA}-\x{1FADC}\x{1FADF}\x{1FAE8}-\x{1FAE9}\x{1FAF7}-\x{1FAF8})"
          R"(\x{1FBCB}-\x{1FBEF})"},
    {"M", R"(\x{897}\x{CF3}\x{ECE}\x{10D69}-\x{10D6D}\x{10EFC}-\x{10EFF}\x{11241}\x{113B8}-\x{113C0}\x{113C2})"
          R"(\x{113C5}\x{113C7}-\x{113CA}\x{113CC}-\x{113D0}\x{113D2}\x{113E1}-\x{113E2}\x{11F00}-\x{11F01}\x{11F03})"
          R"(\x{11F34}-\x{11F3A}\x{11F3E}-\x{11F42}\x{11F5A}\x{13440}\x{13447}-\x{13455}\x{1611E}-\x{1612F}\x{1E08F})"
          R"(\x{1E4EC}-\x{1E4EF}\x{1E5EE}-\x{1E5EF})"},
    {"Lu", R"(\x{1C89}\x{A7CB}-\x{A7CC}\x{A7DA}\x{A7DC}\x{10D50}-\x{10D65})"},
    {"Ll", R"(\x{1C8A}\x{A7CD}\x{A7DB}\x{10D70}-\x{10D85}\x{1DF25}-\x{1DF2A})"},
    {"Lm", R"(\x{10D4E}\x{10D6F}\x{16D40}-\x{16D42}\x{16D6B}-\x{16D6C}\x{1E030}-\x{1E06D}\x{1E4EB})"},
    {"Lo", R"(\x{105C0}-\x{105F3}\x{10D4A}-\x{10D4D}\x{10D4F}\x{10EC2}-\x{10EC4}\x{1123F}-\x{11240}\x{11380}-\x{11389})"
           R"(\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}\x{113D1}\x{113D3}\x{11BC0}-\x{11BE0}\x{11F02})"
           R"(\x{11F04}-\x{11F10}\x{11F12}-\x{11F33}\x{1342F}\x{13441}-\x{13446}\x{13460}-\x{143FA}\x{16100}-\x{1611D})"
           R"(\x{16D43}-\x{16D6A}\x{18CFF}\x{1B132}\x{1B155}\x{1E4D0}-\x{1E4EA}\x{1E5D0}-\x{1E5ED}\x{1E5F0}\x{2B739})"
           R"(\x{2EBF0}-\x{2EE5D}\x{31350}-\x{323AF})"},
}};
// \p{Lt} is the same in both engines.

std::string_view class_additions(std::string_view name) {
    for (const auto &[n, adds] : kClassAdditions)
        if (n == name) return adds;
    return {};
}

void free_match_data(pcre2_match_data *m) { pcre2_match_data_free(m); }

std::string pcre2_error(int code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(code, msg, sizeof msg);
    return reinterpret_cast<const char *>(msg);
}

} // namespace

const PreTokenizerSpec *find_pre_tokenizer(std::string_view name) {
    for (const PreTokenizerSpec &s : specs())
        for (std::string_view n : s.names)
            if (n == name) return &s;
    return nullptr;
}

std::string supported_pre_tokenizers() {
    std::string out;
    for (const PreTokenizerSpec &s : specs())
        for (std::string_view n : s.names) out += fmt::format("{}'{}'", out.empty() ? "" : ", ", n);
    return out;
}

std::string pcre2_pattern(std::string_view rx) {
    std::string out;
    bool in_class = false;
    for (size_t i = 0; i < rx.size(); ++i) {
        const char c = rx[i];
        if (c == '\\' && i + 1 < rx.size()) {
            const char e = rx[i + 1];
            if (e == 's' || e == 'S') {
                PRESCOPE_ASSERT(!(in_class && e == 'S'));  // no table regex negates \S inside a class
                out += in_class ? std::string(kClassSpace) : fmt::format("[{}{}]", e == 'S' ? "^" : "", kClassSpace);
                ++i;
                continue;
            }
            if (e == 'p' && i + 2 < rx.size() && rx[i + 2] == '{') {
                const size_t close = rx.find('}', i + 3);
                PRESCOPE_ASSERT(close != std::string_view::npos);
                const std::string_view name = rx.substr(i + 3, close - i - 3);
                const std::string cls = fmt::format("\\p{{{}}}{}", name, class_additions(name));
                out += in_class ? cls : "[" + cls + "]";
                i = close;
                continue;
            }
            out += c;
            out += e;
            ++i;
            continue;
        }
        if (c == '[' && !in_class)
            in_class = true;
        else if (c == ']' && in_class)
            in_class = false;
        out += c;
    }
    return out;
}

PreTokenizer::PreTokenizer(const PreTokenizerSpec &spec, const std::string &path) : spec_(&spec), path_(path) {
    for (std::string_view rx : spec.regexes) {
        const std::string pattern = pcre2_pattern(rx);
        int err = 0;
        PCRE2_SIZE err_off = 0;
        pcre2_code *code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                         PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &err_off, nullptr);
        if (!code)
            fail("{}: cannot compile the '{}' pre-tokenizer regex '{}': {} at offset {}", path, spec.names[0], rx,
                 pcre2_error(err), err_off);
        codes_.emplace_back(code);
        pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // on failure pcre2_match interprets instead
    }
}

void PreTokenizer::split(std::string_view text, std::vector<Range> &out, Scratch &scratch) const {
    while (scratch.match.size() < codes_.size())
        scratch.match.emplace_back(pcre2_match_data_create_from_pattern(codes_[scratch.match.size()].get(), nullptr),
                                   free_match_data);
    out.assign(1, Range{0, text.size()});
    const auto *bytes = reinterpret_cast<PCRE2_SPTR>(text.data());
    for (size_t k = 0; k < codes_.size(); ++k) {
        pcre2_code *code = codes_[k].get();
        pcre2_match_data *md = scratch.match[k].get();
        std::vector<Range> &next = scratch.next;
        next.clear();
        for (const Range piece : out) {
            // The piece alone is the subject, as HF splits each piece of the previous step on its own.
            const PCRE2_SPTR subject = bytes + piece.begin;
            const size_t n = piece.end - piece.begin;
            size_t gap = 0, search = 0;
            while (search < n) {
                const int rc = pcre2_match(code, subject, n, search, PCRE2_NO_UTF_CHECK, md, nullptr);
                if (rc == PCRE2_ERROR_NOMATCH) break;
                if (rc < 0)
                    fail("{}: pre-tokenizer regex '{}' failed at byte {}: {}", path_, spec_->regexes[k],
                         piece.begin + search, pcre2_error(rc));
                const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
                if (ov[1] == ov[0]) {  // empty match (none of the table's regexes has one): step over a character
                    search = ov[0] + 1;
                    while (search < n && (subject[search] & 0xC0) == 0x80) ++search;
                    continue;
                }
                if (ov[0] > gap) next.push_back({piece.begin + gap, piece.begin + ov[0]});
                next.push_back({piece.begin + ov[0], piece.begin + ov[1]});
                gap = search = ov[1];
            }
            if (n > gap) next.push_back({piece.begin + gap, piece.end});
        }
        out.swap(next);
    }
}

} // namespace prescope

// Tokenizer from GGUF metadata (tokenizer.h): GPT-2 byte-level BPE and SentencePiece BPE, special-token
// partitioning, NFC (utf8proc) and the pre-tokenizers of pre-tokenizer.h.
#include "runtime/tokenizer.h"

#include "core/error.h"
#include "format/gguf.h"
#include "runtime/pre-tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <limits>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace prescope {
namespace {

constexpr const char *kKeyModel = "tokenizer.ggml.model";
constexpr const char *kKeyPre = "tokenizer.ggml.pre";
constexpr const char *kKeyTokens = "tokenizer.ggml.tokens";
constexpr const char *kKeyScores = "tokenizer.ggml.scores";
constexpr const char *kKeyTypes = "tokenizer.ggml.token_type";
constexpr const char *kKeyMerges = "tokenizer.ggml.merges";
constexpr const char *kKeyBos = "tokenizer.ggml.bos_token_id";
constexpr const char *kKeyEos = "tokenizer.ggml.eos_token_id";
constexpr const char *kKeyEot = "tokenizer.ggml.eot_token_id";
constexpr const char *kKeyEom = "tokenizer.ggml.eom_token_id";
constexpr const char *kKeyUnk = "tokenizer.ggml.unknown_token_id";
constexpr const char *kKeyAddBos = "tokenizer.ggml.add_bos_token";
constexpr const char *kKeyAddEos = "tokenizer.ggml.add_eos_token";
constexpr const char *kKeyAddSpacePrefix = "tokenizer.ggml.add_space_prefix";
constexpr const char *kKeyRemoveExtraWs = "tokenizer.ggml.remove_extra_whitespaces";

constexpr std::string_view kSpmSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// Texts llama.cpp marks as end of generation whatever their id (llama_vocab::impl::load, special_eog_ids),
// restricted to the families PreScope tokenizes (Qwen, Llama 3, Mistral, OLMo, DeepSeek, gpt-oss).
constexpr std::array<std::string_view, 13> kEogTexts = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>", "<|eom_id|>", "<|end_of_text|>", "</s>",
    "<end_of_turn>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|return|>", "<|call|>",
};

// ---- UTF-8 ------------------------------------------------------------------------------------------

struct Utf8Step {
    size_t len;      // bytes of the character, or of the maximal invalid subpart
    bool valid;      // a whole well-formed character
    bool truncated;  // invalid only because the input ended inside a well-formed prefix
};

// Unicode 15 table 3-7 (well-formed byte sequences): no overlongs, no surrogates, nothing above U+10FFFF.
Utf8Step utf8_step(const unsigned char *s, size_t n) {
    const unsigned c = s[0];
    if (c < 0x80) return {1, true, false};
    size_t need;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        need = 1;
    } else if (c == 0xE0) {
        need = 2, lo = 0xA0;
    } else if ((c >= 0xE1 && c <= 0xEC) || c == 0xEE || c == 0xEF) {
        need = 2;
    } else if (c == 0xED) {
        need = 2, hi = 0x9F;
    } else if (c == 0xF0) {
        need = 3, lo = 0x90;
    } else if (c >= 0xF1 && c <= 0xF3) {
        need = 3;
    } else if (c == 0xF4) {
        need = 3, hi = 0x8F;
    } else {
        return {1, false, false};
    }
    for (size_t k = 1; k <= need; ++k) {
        if (k >= n) return {k, false, true};
        const unsigned b = s[k];
        if (b < lo || b > hi) return {k, false, false};
        lo = 0x80, hi = 0xBF;
    }
    return {need + 1, true, false};
}

void append_utf8(std::string &out, uint32_t cp) {
    if (cp < 0x80) {
        out += char(cp);
    } else if (cp < 0x800) {
        out += char(0xC0 | (cp >> 6));
        out += char(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += char(0xE0 | (cp >> 12));
        out += char(0x80 | ((cp >> 6) & 0x3F));
        out += char(0x80 | (cp & 0x3F));
    } else {
        out += char(0xF0 | (cp >> 18));
        out += char(0x80 | ((cp >> 12) & 0x3F));
        out += char(0x80 | ((cp >> 6) & 0x3F));
        out += char(0x80 | (cp & 0x3F));
    }
}

// Code point of the well-formed character at s (length len from utf8_step).
uint32_t utf8_decode(const unsigned char *s, size_t len) {
    if (len == 1) return s[0];
    uint32_t cp = s[0] & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (s[k] & 0x3F);
    return cp;
}

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// NFC with utf8proc (STABLE | COMPOSE is utf8proc_NFC without NUL termination). Input is valid UTF-8.
std::string nfc(std::string_view s, const std::string &path) {
    if (std::all_of(s.begin(), s.end(), [](char c) { return (unsigned char)c < 0x80; })) return std::string(s);
    utf8proc_uint8_t *out = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t *>(s.data()),
                                            utf8proc_ssize_t(s.size()), &out,
                                            utf8proc_option_t(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (n < 0) fail("{}: NFC normalisation failed: {}", path, utf8proc_errmsg(n));
    std::string r(reinterpret_cast<const char *>(out), size_t(n));
    std::free(out);
    return r;
}

// GPT-2 bytes_to_unicode (openai/gpt-2 encoder.py): printable Latin-1 bytes map to themselves, the other
// 68 bytes to U+0100.. in byte order.
std::array<uint32_t, 256> gpt2_byte_to_codepoint() {
    std::array<uint32_t, 256> cp{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
        const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
        cp[b] = printable ? b : next++;
    }
    return cp;
}

// Heterogeneous lookup so that encode() can look up string_views without allocating.
struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

// Special tokens, matched leftmost-longest as HF tokenizers' AddedVocabulary does.
class SpecialTrie {
  public:
    void insert(std::string_view text, int32_t id) {
        int32_t node = 0;
        for (unsigned char c : text) {
            int32_t child = find_child(node, c);
            if (child < 0) {
                child = int32_t(nodes_.size());
                nodes_[size_t(node)].next.emplace_back(c, child);
                nodes_.emplace_back();
            }
            node = child;
        }
        nodes_[size_t(node)].token = id;
    }

    /// Longest token at s[pos..] for which allow(id) holds: {id, length}, or {-1, 0}.
    template <typename Allow>
    std::pair<int32_t, size_t> longest(std::string_view s, size_t pos, Allow &&allow) const {
        std::pair<int32_t, size_t> best{-1, 0};
        int32_t node = 0;
        for (size_t i = pos; i < s.size(); ++i) {
            node = find_child(node, (unsigned char)s[i]);
            if (node < 0) break;
            const int32_t tok = nodes_[size_t(node)].token;
            if (tok >= 0 && allow(tok)) best = {tok, i + 1 - pos};
        }
        return best;
    }

  private:
    struct Node {
        std::vector<std::pair<unsigned char, int32_t>> next;
        int32_t token = -1;
    };

    int32_t find_child(int32_t node, unsigned char c) const {
        for (const auto &[byte, child] : nodes_[size_t(node)].next)
            if (byte == c) return child;
        return -1;
    }

    std::vector<Node> nodes_{1};
};

// Merge table keyed by (left id, right id): open addressing with linear probing, because the BPE inner loop
// is mostly these lookups and std::unordered_map's node chasing doubled the time of encode().
class MergeTable {
  public:
    struct Merge {
        int32_t rank;
        int32_t result;
    };

    void reserve(size_t n) {
        size_t cap = 16;
        while (cap < 2 * n) cap *= 2;
        slots_.assign(cap, Slot{kEmpty, {0, 0}});
    }
    /// Keeps the first (lowest-rank) entry of a pair, as llama.cpp's bpe_ranks.emplace does.
    void insert(int32_t left, int32_t right, Merge m) {
        const uint64_t key = pack(left, right);
        for (size_t i = mix(key) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
            if (slots_[i].key == key) return;
            if (slots_[i].key == kEmpty) {
                slots_[i] = {key, m};
                return;
            }
        }
    }
    const Merge *find(int32_t left, int32_t right) const {
        const uint64_t key = pack(left, right);
        for (size_t i = mix(key) & (slots_.size() - 1);; i = (i + 1) & (slots_.size() - 1)) {
            if (slots_[i].key == key) return &slots_[i].merge;
            if (slots_[i].key == kEmpty) return nullptr;
        }
    }

  private:
    static constexpr uint64_t kEmpty = ~uint64_t(0);  // ids are non-negative int32, so never a key
    struct Slot {
        uint64_t key;
        Merge merge;
    };
    static uint64_t pack(int32_t l, int32_t r) { return (uint64_t(uint32_t(l)) << 32) | uint32_t(r); }
    static size_t mix(uint64_t x) {  // splitmix64 finaliser
        x ^= x >> 30;
        x *= 0xbf58476d1ce4e5b9ULL;
        x ^= x >> 27;
        x *= 0x94d049bb133111ebULL;
        return size_t(x ^ (x >> 31));
    }
    std::vector<Slot> slots_;
};

bool is_special_type(TokenType t) {
    return t == TokenType::CONTROL || t == TokenType::USER_DEFINED || t == TokenType::UNKNOWN;
}

} // namespace

struct Tokenizer::Impl {
    enum class Model { BPE, SPM };

    std::string path;
    Model model = Model::BPE;
    std::vector<std::string> tokens;
    std::vector<float> scores;
    std::vector<TokenType> types;
    std::vector<std::string> pieces;  // token_to_piece of every id
    TokenMap token_to_id;
    SpecialTrie specials;
    std::vector<bool> eog;

    int32_t bos = -1, eos = -1, eot = -1, eom = -1, unk = -1;
    bool add_bos = false, add_eos = false;

    // gpt2
    MergeTable merges;
    std::array<int32_t, 256> byte_token{};  // gpt2: byte-level character token; llama: <0xXX> token or -1
    std::array<uint32_t, 256> byte_cp{};
    std::unique_ptr<PreTokenizer> pre_tokenizer;
    bool normalize_nfc = false;
    bool ignore_merges = false;

    // llama
    bool add_space_prefix = true;
    // No mergeable piece has U+2581 after its first non-U+2581 character (true for vocabularies trained
    // with split_by_whitespace), so merges never cross the start of a space-prefixed word.
    bool spm_words_independent = false;

    int32_t lookup(std::string_view text) const {
        const auto it = token_to_id.find(text);
        return it == token_to_id.end() ? -1 : it->second;
    }
    void check_id(int32_t id) const {
        if (id < 0 || size_t(id) >= tokens.size())
            fail("{}: token id {} is outside the vocabulary [0, {})", path, id, tokens.size());
    }

    // Buffers reused across the words of one encode() call.
    struct Symbol {
        int32_t id;         // gpt2: token id (-1 once merged away)
        uint32_t off, len;  // llama: bytes of the piece in the word (len 0 once merged away)
        int32_t prev, next;
    };
    struct Candidate {
        float score;  // llama: piece score; gpt2: -rank (exact: ranks stay far below 2^24)
        int32_t left, right;
        int32_t left_id, right_id, result;  // gpt2
        uint32_t len;                       // llama
        bool operator<(const Candidate &o) const {  // the heap pops the highest score, then the leftmost
            return score != o.score ? score < o.score : left > o.left;
        }
    };
    struct Scratch {
        std::vector<Symbol> symbols;
        std::vector<Candidate> heap;
        std::string chars;
        std::unordered_map<std::string_view, std::pair<std::string_view, std::string_view>> rev_merge;
        std::unordered_map<std::string_view, std::pair<size_t, size_t>> seen;  // word -> ids at out[first, +n)
        PreTokenizer::Scratch pre;
        std::vector<PreTokenizer::Range> words;
    };

    void encode_run(std::string_view text, bool after_special, Scratch &scratch, std::vector<int32_t> &out) const;
    void cached_word(std::string_view word, Scratch &scratch, std::vector<int32_t> &out) const;
    void bpe_word(std::string_view word, Scratch &scratch, std::vector<int32_t> &out) const;
    void spm_word(std::string_view word, Scratch &scratch, std::vector<int32_t> &out) const;
};

namespace {

// Reads an optional special-token id key; -1 when absent. An id outside the vocabulary is an error.
int32_t read_token_id(const GgufFile &f, const char *key, int32_t dflt, size_t n_vocab) {
    if (!f.has(key)) return dflt;
    const uint32_t id = f.get_u32(key);
    if (id >= n_vocab)
        fail("{}: metadata '{}' = {} lies outside the vocabulary (expected an id below {})", f.path(), key, id,
             n_vocab);
    return int32_t(id);
}

// "<0xAB>" -> 0xAB, or -1 when the text is not a byte token.
int parse_byte_token(std::string_view s) {
    auto hex = [](char c) -> int {
        if (c >= '0' && c <= '9') return c - '0';
        if (c >= 'A' && c <= 'F') return c - 'A' + 10;
        if (c >= 'a' && c <= 'f') return c - 'a' + 10;
        return -1;
    };
    if (s.size() != 6 || s.substr(0, 3) != "<0x" || s[5] != '>') return -1;
    const int hi = hex(s[3]), lo = hex(s[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

} // namespace

Tokenizer Tokenizer::from_gguf(const GgufFile &f) {
    auto impl = std::make_shared<Impl>();
    Impl &t = *impl;
    t.path = f.path();

    const std::string &model = f.get_str(kKeyModel);
    if (model == "gpt2") {
        t.model = Impl::Model::BPE;
    } else if (model == "llama") {
        t.model = Impl::Model::SPM;
    } else {
        fail("{}: metadata '{}' is '{}', expected 'gpt2' (byte-level BPE) or 'llama' (SentencePiece)", t.path,
             kKeyModel, model);
    }

    t.tokens = f.get_str_array(kKeyTokens);
    const size_t n = t.tokens.size();
    if (n == 0) fail("{}: metadata '{}' is empty, expected the vocabulary", t.path, kKeyTokens);
    if (n > size_t(std::numeric_limits<int32_t>::max()))
        fail("{}: metadata '{}' has {} tokens, more than int32 ids can address", t.path, kKeyTokens, n);

    if (f.has(kKeyScores)) {
        t.scores = f.get_f32_array(kKeyScores);
        if (t.scores.size() != n)
            fail("{}: metadata '{}' has {} entries, expected {} (one per token in '{}')", t.path, kKeyScores,
                 t.scores.size(), n, kKeyTokens);
    } else if (t.model == Impl::Model::SPM) {
        fail("{}: missing metadata '{}' (a 'llama' tokenizer merges by score; expected {} floats)", t.path,
             kKeyScores, n);
    }

    t.types.assign(n, TokenType::NORMAL);
    if (f.has(kKeyTypes)) {
        const std::vector<int32_t> raw = f.get_i32_array(kKeyTypes);
        if (raw.size() != n)
            fail("{}: metadata '{}' has {} entries, expected {} (one per token in '{}')", t.path, kKeyTypes,
                 raw.size(), n, kKeyTokens);
        for (size_t i = 0; i < n; ++i) {
            if (raw[i] < 0 || raw[i] > int32_t(TokenType::BYTE))
                fail("{}: metadata '{}'[{}] is {}, expected a token type 0..6", t.path, kKeyTypes, i, raw[i]);
            t.types[i] = TokenType(raw[i]);
        }
    }

    t.token_to_id.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        if (t.tokens[i].empty()) continue;  // never matched; llama.cpp renames these "[EMPTY_i]"
        const auto [it, fresh] = t.token_to_id.emplace(t.tokens[i], int32_t(i));
        if (!fresh)
            fail("{}: metadata '{}' holds '{}' twice (ids {} and {}), expected unique tokens", t.path, kKeyTokens,
                 t.tokens[i], it->second, i);
    }

    const bool spm = t.model == Impl::Model::SPM;
    if (!spm) {
        const std::string pre = f.get_str(kKeyPre);
        const PreTokenizerSpec *spec = find_pre_tokenizer(pre);
        if (!spec)
            fail("{}: metadata '{}' is '{}', expected a supported pre-tokenizer ({})", t.path, kKeyPre, pre,
                 supported_pre_tokenizers());
        t.pre_tokenizer = std::make_unique<PreTokenizer>(*spec, t.path);
        // The normaliser of the family's tokenizer.json (NFC or none; decisions 0020, 0070).
        t.normalize_nfc = spec->nfc;
        t.ignore_merges = spec->ignore_merges;

        t.byte_cp = gpt2_byte_to_codepoint();
        for (int b = 0; b < 256; ++b) {
            std::string s;
            append_utf8(s, t.byte_cp[size_t(b)]);
            t.byte_token[size_t(b)] = t.lookup(s);
            if (t.byte_token[size_t(b)] < 0)
                fail("{}: metadata '{}' has no token for byte 0x{:02X} ('{}'), which byte-level BPE needs", t.path,
                     kKeyTokens, b, s);
        }

        const std::vector<std::string> merges = f.get_str_array(kKeyMerges);
        t.merges.reserve(merges.size());
        for (size_t i = 0; i < merges.size(); ++i) {
            const std::string &m = merges[i];
            const size_t sp = m.find(' ', 1);
            if (sp == std::string::npos || sp + 1 >= m.size())
                fail("{}: metadata '{}'[{}] is '{}', expected two tokens separated by a space", t.path, kKeyMerges,
                     i, m);
            const std::string_view left = std::string_view(m).substr(0, sp), right = std::string_view(m).substr(sp + 1);
            const int32_t l = t.lookup(left), r = t.lookup(right);
            if (l < 0 || r < 0)
                fail("{}: metadata '{}'[{}] '{}' names '{}', which is not in '{}'", t.path, kKeyMerges, i, m,
                     l < 0 ? left : right, kKeyTokens);
            const int32_t merged = t.lookup(std::string(left) + std::string(right));
            if (merged < 0)
                fail("{}: metadata '{}'[{}] '{}' merges into '{}{}', which is not in '{}'", t.path, kKeyMerges, i, m,
                     left, right, kKeyTokens);
            t.merges.insert(l, r, {int32_t(i), merged});
        }

    } else {
        t.byte_token.fill(-1);
        for (size_t i = 0; i < n; ++i) {
            if (t.types[i] != TokenType::BYTE) continue;
            const int b = parse_byte_token(t.tokens[i]);
            if (b < 0)
                fail("{}: token {} '{}' has type BYTE in '{}', expected the form <0xXX>", t.path, i, t.tokens[i],
                     kKeyTypes);
            t.byte_token[size_t(b)] = int32_t(i);
        }
        t.spm_words_independent = true;
        for (size_t i = 0; i < n && t.spm_words_independent; ++i) {
            const TokenType ty = t.types[i];
            if (ty != TokenType::NORMAL && ty != TokenType::USER_DEFINED && ty != TokenType::UNUSED &&
                ty != TokenType::UNDEFINED)
                continue;
            std::string_view text = t.tokens[i];
            while (text.substr(0, kSpmSpace.size()) == kSpmSpace) text.remove_prefix(kSpmSpace.size());
            t.spm_words_independent = text.find(kSpmSpace) == std::string_view::npos;
        }
        t.add_space_prefix = f.get_bool_or(kKeyAddSpacePrefix, true);
        if (f.get_bool_or(kKeyRemoveExtraWs, false))
            fail("{}: metadata '{}' is true, which PreScope does not implement for 'llama' tokenizers (expected false)",
                 t.path, kKeyRemoveExtraWs);
    }

    // Special ids; llama models default to SentencePiece's unk 0, bos 1, eos 2 (llama.cpp load()).
    t.bos = read_token_id(f, kKeyBos, spm && n > 1 ? 1 : -1, n);
    t.eos = read_token_id(f, kKeyEos, spm && n > 2 ? 2 : -1, n);
    t.eot = read_token_id(f, kKeyEot, -1, n);
    t.eom = read_token_id(f, kKeyEom, -1, n);
    t.unk = read_token_id(f, kKeyUnk, spm ? 0 : -1, n);
    t.add_bos = f.get_bool_or(kKeyAddBos, spm || t.pre_tokenizer->spec().add_bos);
    t.add_eos = f.get_bool_or(kKeyAddEos, false);
    if (t.add_bos && t.bos < 0)
        fail("{}: metadata '{}' is true but '{}' is missing, expected a BOS id", t.path, kKeyAddBos, kKeyBos);
    if (t.add_eos && t.eos < 0)
        fail("{}: metadata '{}' is true but '{}' is missing, expected an EOS id", t.path, kKeyAddEos, kKeyEos);

    t.eog.assign(n, false);
    for (int32_t id : {t.eos, t.eot, t.eom})
        if (id >= 0) t.eog[size_t(id)] = true;
    for (std::string_view text : kEogTexts)
        if (const int32_t id = t.lookup(text); id >= 0) t.eog[size_t(id)] = true;
    // o200k_harmony (gpt-oss) ends a reply with <|return|> or <|call|>; its <|end|> closes one message of a
    // reply, so it is no end of generation there (llama.cpp's workaround in llama_vocab::impl::load).
    if (const int32_t end = t.lookup("<|end|>"); end >= 0 && t.lookup("<|return|>") >= 0 && t.lookup("<|call|>") >= 0)
        t.eog[size_t(end)] = false;

    std::array<int16_t, 256 + 68> cp_byte;  // inverse of byte_cp (gpt2): code point -> byte, or -1
    cp_byte.fill(-1);
    if (!spm)
        for (int b = 0; b < 256; ++b) cp_byte[t.byte_cp[size_t(b)]] = int16_t(b);
    t.pieces.resize(n);
    for (size_t i = 0; i < n; ++i) {
        const std::string &text = t.tokens[i];
        std::string &piece = t.pieces[i];
        if (is_special_type(t.types[i])) {
            piece = text;
            if (!text.empty()) t.specials.insert(text, int32_t(i));
        } else if (t.types[i] == TokenType::BYTE) {
            const int b = parse_byte_token(text);
            if (b < 0)
                fail("{}: token {} '{}' has type BYTE in '{}', expected the form <0xXX>", t.path, i, text, kKeyTypes);
            piece = std::string(1, char(b));
        } else if (t.types[i] == TokenType::NORMAL || t.types[i] == TokenType::UNDEFINED) {
            if (spm) {
                for (size_t pos = 0; pos < text.size();) {
                    if (text.compare(pos, kSpmSpace.size(), kSpmSpace) == 0) {
                        piece += ' ';
                        pos += kSpmSpace.size();
                    } else {
                        piece += text[pos++];
                    }
                }
            } else {
                // Characters outside the byte alphabet (never in a well-formed vocab) are kept as UTF-8.
                const auto *s = reinterpret_cast<const unsigned char *>(text.data());
                for (size_t pos = 0; pos < text.size();) {
                    const Utf8Step st = utf8_step(s + pos, text.size() - pos);
                    if (!st.valid) {
                        piece.append(text, pos, st.len);
                        pos += st.len;
                        continue;
                    }
                    const uint32_t cp = utf8_decode(s + pos, st.len);
                    if (cp < cp_byte.size() && cp_byte[cp] >= 0)
                        piece += char(cp_byte[cp]);
                    else
                        piece.append(text, pos, st.len);
                    pos += st.len;
                }
            }
        }
        // UNUSED tokens decode to nothing (llama.cpp token_to_piece).
    }
    return Tokenizer(std::move(impl));
}

// ---- encoding -----------------------------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view raw, bool add_special, bool parse_special) const {
    return encode(raw, add_special, parse_special, {});
}

std::vector<int32_t> Tokenizer::encode(std::string_view raw, bool add_special, bool parse_special,
                                       std::span<const TextSpan> literal) const {
    const Impl &t = *impl_;
    // Invalid UTF-8 is replaced piece by piece, so that the literal spans keep pointing at their text.
    std::string text;
    std::vector<TextSpan> spans;
    if (literal.empty()) {
        text = sanitize_utf8(raw);
    } else {
        size_t pos = 0;
        for (const TextSpan &sp : literal) {
            if (sp.begin < pos || sp.end < sp.begin || sp.end > raw.size()) {
                fail("tokenizer: literal span [{}, {}) is out of order or outside the text of {} bytes", sp.begin,
                     sp.end, raw.size());
            }
            text += sanitize_utf8(raw.substr(pos, sp.begin - pos));
            const size_t begin = text.size();
            text += sanitize_utf8(raw.substr(sp.begin, sp.end - sp.begin));
            spans.push_back({begin, text.size()});
            pos = sp.end;
        }
        text += sanitize_utf8(raw.substr(pos));
    }
    std::vector<int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_special && t.add_bos) out.push_back(t.bos);

    const auto user_defined = [&](int32_t id) { return t.types[size_t(id)] == TokenType::USER_DEFINED; };
    const auto allow = [&](int32_t id) { return parse_special || user_defined(id); };
    // Whether [a, b) overlaps a literal span; `next` walks the sorted spans along with the text position.
    size_t next = 0;
    const auto overlaps_literal = [&](size_t a, size_t b) {
        while (next < spans.size() && spans[next].end <= a) ++next;
        for (size_t k = next; k < spans.size() && spans[k].begin < b; ++k) {
            if (spans[k].end > a && spans[k].begin < spans[k].end) return true;
        }
        return false;
    };
    Impl::Scratch scratch;
    bool after_special = true;  // SentencePiece prefixes a space at the start and after each special token
    size_t run_start = 0;
    for (size_t i = 0; i < text.size();) {
        auto [id, len] = t.specials.longest(text, i, allow);
        // Inside literal text only user-defined tokens match (as parse_special = false would).
        if (id >= 0 && !user_defined(id) && !spans.empty() && overlaps_literal(i, i + len)) {
            std::tie(id, len) = t.specials.longest(text, i, user_defined);
        }
        if (id < 0) {
            ++i;
            continue;
        }
        if (i > run_start)
            t.encode_run(std::string_view(text).substr(run_start, i - run_start), after_special, scratch, out);
        out.push_back(id);
        after_special = true;
        i += len;
        run_start = i;
    }
    if (text.size() > run_start) t.encode_run(std::string_view(text).substr(run_start), after_special, scratch, out);

    if (add_special && t.add_eos) out.push_back(t.eos);
    return out;
}

void Tokenizer::Impl::encode_run(std::string_view text, bool after_special, Scratch &scratch,
                                 std::vector<int32_t> &out) const {
    scratch.seen.clear();  // its keys point into this run's text
    if (model == Model::SPM) {
        std::string s;
        s.reserve(text.size() + 8);
        if (add_space_prefix && after_special) s += kSpmSpace;
        for (char c : text) {
            if (c == ' ')
                s += kSpmSpace;
            else
                s += c;
        }
        if (!spm_words_independent) {
            spm_word(s, scratch, out);
            return;
        }
        // Cut before every U+2581 that follows another character than U+2581.
        size_t start = 0;
        for (size_t pos = s.find(kSpmSpace, 1); pos != std::string::npos; pos = s.find(kSpmSpace, pos + 3)) {
            if (s.compare(pos - 3, 3, kSpmSpace) == 0) continue;
            cached_word(std::string_view(s).substr(start, pos - start), scratch, out);
            start = pos;
        }
        cached_word(std::string_view(s).substr(start), scratch, out);
        return;
    }

    const std::string norm = normalize_nfc ? nfc(text, path) : std::string(text);
    pre_tokenizer->split(norm, scratch.words, scratch.pre);
    for (const PreTokenizer::Range w : scratch.words)
        cached_word(std::string_view(norm).substr(w.begin, w.end - w.begin), scratch, out);
}

// Repeated words of one run reuse the ids of their first occurrence (HF tokenizers keeps a similar cache).
void Tokenizer::Impl::cached_word(std::string_view w, Scratch &scratch, std::vector<int32_t> &out) const {
    if (const auto it = scratch.seen.find(w); it != scratch.seen.end()) {
        for (size_t k = 0; k < it->second.second; ++k) {
            const int32_t id = out[it->second.first + k];
            out.push_back(id);
        }
        return;
    }
    const size_t before = out.size();
    if (model == Model::SPM)
        spm_word(w, scratch, out);
    else
        bpe_word(w, scratch, out);
    scratch.seen.emplace(w, std::make_pair(before, out.size() - before));
}

// One pre-token through byte-level BPE: merges by lowest rank, leftmost first (HF tokenizers
// models/bpe/word.rs merge_all; llama.cpp llm_tokenizer_bpe_session), on token ids.
void Tokenizer::Impl::bpe_word(std::string_view word, Scratch &scratch, std::vector<int32_t> &out) const {
    if (ignore_merges) {
        std::string &chars = scratch.chars;
        chars.clear();
        for (unsigned char c : word) append_utf8(chars, byte_cp[c]);
        if (const int32_t id = lookup(chars); id >= 0) {
            out.push_back(id);
            return;
        }
    }
    if (word.size() == 1) {
        out.push_back(byte_token[(unsigned char)word[0]]);
        return;
    }

    const int32_t n = int32_t(word.size());
    std::vector<Symbol> &sym = scratch.symbols;
    sym.resize(size_t(n));
    for (int32_t i = 0; i < n; ++i)
        sym[size_t(i)] = {byte_token[(unsigned char)word[size_t(i)]], 0, 0, i - 1, i + 1 < n ? i + 1 : -1};

    std::vector<Candidate> &heap = scratch.heap;
    heap.clear();
    const auto try_pair = [&](int32_t left) {
        if (left < 0) return;
        const int32_t right = sym[size_t(left)].next;
        if (right < 0) return;
        const int32_t l = sym[size_t(left)].id, r = sym[size_t(right)].id;
        const MergeTable::Merge *m = merges.find(l, r);
        if (!m) return;
        heap.push_back({-float(m->rank), left, right, l, r, m->result, 0});
        std::push_heap(heap.begin(), heap.end());
    };
    for (int32_t i = 0; i + 1 < n; ++i) try_pair(i);

    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end());
        const Candidate c = heap.back();
        heap.pop_back();
        Symbol &left = sym[size_t(c.left)];
        if (left.id != c.left_id || left.next < 0) continue;  // stale: left was merged since
        Symbol &right = sym[size_t(left.next)];
        if (right.id != c.right_id) continue;
        left.id = c.result;
        right.id = -1;
        left.next = right.next;
        if (right.next >= 0) sym[size_t(right.next)].prev = c.left;
        try_pair(left.prev);
        try_pair(c.left);
    }
    for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) out.push_back(sym[size_t(i)].id);
}

// SentencePiece BPE on one word (spaces already U+2581; sentencepiece bpe_model.cc Model::Encode): merge
// the adjacent pair whose concatenation is the highest-scoring piece, repeatedly; pieces are NORMAL,
// USER_DEFINED or UNUSED tokens; UNUSED results are split back; what is no piece falls back to bytes or unk.
void Tokenizer::Impl::spm_word(std::string_view s, Scratch &scratch, std::vector<int32_t> &out) const {
    const auto *bytes = reinterpret_cast<const unsigned char *>(s.data());
    std::vector<Symbol> &sym = scratch.symbols;
    sym.clear();
    for (size_t off = 0; off < s.size();) {
        const size_t len = utf8_step(bytes + off, s.size() - off).len;
        const int32_t idx = int32_t(sym.size());
        sym.push_back({0, uint32_t(off), uint32_t(len), idx - 1, off + len < s.size() ? idx + 1 : -1});
        off += len;
    }
    if (sym.empty()) return;

    std::vector<Candidate> &heap = scratch.heap;
    heap.clear();
    auto &rev_merge = scratch.rev_merge;
    rev_merge.clear();
    const auto try_pair = [&](int32_t left, int32_t right) {
        if (left < 0 || right < 0) return;
        const Symbol &l = sym[size_t(left)], &r = sym[size_t(right)];
        const std::string_view text = s.substr(l.off, l.len + r.len);
        const int32_t id = lookup(text);
        if (id < 0) return;
        const TokenType ty = types[size_t(id)];
        if (ty != TokenType::NORMAL && ty != TokenType::USER_DEFINED && ty != TokenType::UNUSED &&
            ty != TokenType::UNDEFINED)
            return;
        heap.push_back({scores[size_t(id)], left, right, 0, 0, 0, l.len + r.len});
        std::push_heap(heap.begin(), heap.end());
        if (ty == TokenType::UNUSED) rev_merge[text] = {s.substr(l.off, l.len), s.substr(r.off, r.len)};
    };
    for (int32_t i = 0; i + 1 < int32_t(sym.size()); ++i) try_pair(i, i + 1);

    while (!heap.empty()) {
        std::pop_heap(heap.begin(), heap.end());
        const Candidate c = heap.back();
        heap.pop_back();
        Symbol &l = sym[size_t(c.left)];
        Symbol &r = sym[size_t(c.right)];
        if (l.len == 0 || r.len == 0 || l.len + r.len != c.len) continue;  // stale
        l.len += r.len;
        r.len = 0;
        l.next = r.next;
        if (r.next >= 0) sym[size_t(r.next)].prev = c.left;
        try_pair(l.prev, c.left);
        try_pair(c.left, l.next);
    }

    const auto emit = [&](auto &&self, std::string_view piece) -> void {
        const int32_t id = lookup(piece);
        if (id >= 0 && types[size_t(id)] == TokenType::UNUSED) {
            if (const auto it = rev_merge.find(piece); it != rev_merge.end()) {
                self(self, it->second.first);
                self(self, it->second.second);
                return;
            }
        }
        if (id >= 0) {
            out.push_back(id);
            return;
        }
        const bool have_bytes = std::all_of(piece.begin(), piece.end(),
                                            [&](char c) { return byte_token[(unsigned char)c] >= 0; });
        if (have_bytes) {
            for (char c : piece) out.push_back(byte_token[(unsigned char)c]);
        } else {
            out.push_back(unk);
        }
    };
    for (int32_t i = 0; i >= 0; i = sym[size_t(i)].next) emit(emit, s.substr(sym[size_t(i)].off, sym[size_t(i)].len));
}

// ---- decoding and queries -----------------------------------------------------------------------------

std::string Tokenizer::token_to_piece(int32_t id) const {
    impl_->check_id(id);
    return impl_->pieces[size_t(id)];
}

std::string Tokenizer::decode(const std::vector<int32_t> &ids) const {
    const Impl &t = *impl_;
    const bool strip_prefix = t.model == Impl::Model::SPM && t.add_space_prefix;
    std::string out;
    bool run_start = true;
    for (int32_t id : ids) {
        t.check_id(id);
        const std::string &piece = t.pieces[size_t(id)];
        if (is_special_type(t.types[size_t(id)])) {
            out += piece;
            run_start = true;
            continue;
        }
        if (strip_prefix && run_start && !piece.empty() && piece[0] == ' ')
            out.append(piece, 1, std::string::npos);
        else
            out += piece;
        run_start = false;
    }
    return out;
}

int32_t Tokenizer::n_vocab() const { return int32_t(impl_->tokens.size()); }
int32_t Tokenizer::bos() const { return impl_->bos; }
int32_t Tokenizer::eos() const { return impl_->eos; }
bool Tokenizer::add_bos() const { return impl_->add_bos; }

bool Tokenizer::is_eog(int32_t id) const {
    return id >= 0 && size_t(id) < impl_->eog.size() && impl_->eog[size_t(id)];
}

int32_t Tokenizer::find_token(std::string_view text) const { return impl_->lookup(text); }

const std::string &Tokenizer::token_text(int32_t id) const {
    impl_->check_id(id);
    return impl_->tokens[size_t(id)];
}

TokenType Tokenizer::token_type(int32_t id) const {
    impl_->check_id(id);
    return impl_->types[size_t(id)];
}

// ---- UTF-8 streaming ----------------------------------------------------------------------------------

std::string sanitize_utf8(std::string_view text) {
    const auto *s = reinterpret_cast<const unsigned char *>(text.data());
    std::string out;
    out.reserve(text.size());
    for (size_t i = 0; i < text.size();) {
        const Utf8Step st = utf8_step(s + i, text.size() - i);
        if (st.valid)
            out.append(text.data() + i, st.len);
        else
            out += kReplacement;
        i += st.len;
    }
    return out;
}

std::string TokenTextStream::push(int32_t id) {
    pending_ += tokenizer_.token_to_piece(id);
    const auto *s = reinterpret_cast<const unsigned char *>(pending_.data());
    std::string out;
    size_t i = 0;
    while (i < pending_.size()) {
        const Utf8Step st = utf8_step(s + i, pending_.size() - i);
        if (st.truncated) break;  // may complete with the next token
        if (st.valid)
            out.append(pending_, i, st.len);
        else
            out += kReplacement;
        i += st.len;
    }
    pending_.erase(0, i);
    return out;
}

std::string TokenTextStream::flush() {
    std::string out = sanitize_utf8(pending_);
    pending_.clear();
    return out;
}

} // namespace prescope

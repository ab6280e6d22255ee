// Pre-tokenizers of byte-level BPE tokenizers, chosen by tokenizer.ggml.pre: each family's tokenizer.json
// normaliser and Split regexes as data, compiled with PCRE2 (decision 0070; classes as decision 0021).
#pragma once

#ifndef PCRE2_CODE_UNIT_WIDTH
#define PCRE2_CODE_UNIT_WIDTH 8
#endif
#include <pcre2.h>

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace prescope {

/// The rules of one pre-tokenizer family.
struct PreTokenizerSpec {
    std::vector<std::string_view> names;    // tokenizer.ggml.pre values (llama.cpp llama-vocab.cpp names)
    std::vector<std::string_view> regexes;  // HF Split(Isolated) regexes in Oniguruma syntax, applied in turn
    bool nfc = false;            // the tokenizer.json normaliser is NFC
    bool ignore_merges = false;  // a pre-token that is a vocabulary token is that token (llama.cpp ignore_merges)
    bool add_bos = false;        // llama.cpp's default when tokenizer.ggml.add_bos_token is absent
};

/// The family a tokenizer.ggml.pre value names, or nullptr when PreScope does not support it.
const PreTokenizerSpec *find_pre_tokenizer(std::string_view name);

/// Every supported tokenizer.ggml.pre value, quoted and comma-separated, for error messages.
std::string supported_pre_tokenizers();

/// An HF (Oniguruma) regex rewritten for PCRE2 with UTF | UCP: \s, \S and \p{L,N,P,S,M,Lu,Ll,Lt,Lm,Lo} become
/// the classes of Oniguruma's Unicode 16 tables (White_Space for \s; code points assigned after PCRE2 10.42's
/// Unicode 14 added), inside and outside character classes. Other syntax is passed through unchanged.
std::string pcre2_pattern(std::string_view hf_regex);

/// A compiled pre-tokenizer. Immutable after construction and safe to share between threads; split() takes
/// its per-call buffers from a Scratch.
class PreTokenizer {
  public:
    struct Range {
        size_t begin, end;  // bytes [begin, end) of the split text
    };
    /// Buffers reused across split() calls of one thread.
    struct Scratch {
        std::vector<std::unique_ptr<pcre2_match_data, void (*)(pcre2_match_data *)>> match;
        std::vector<Range> next;
    };

    /// Compiles the spec's regexes (pcre2_pattern, then PCRE2 JIT when available). Throws prescope::Error
    /// naming `path` if PCRE2 rejects one (an unsupported PCRE2 build).
    PreTokenizer(const PreTokenizerSpec &spec, const std::string &path);

    /// Pre-tokens of `text` (valid UTF-8) in order, replacing `out`: each regex in turn splits every piece
    /// of the previous step into its matches and the text between them (HF Sequence of Split, behaviour
    /// Isolated; a regex sees only its piece, so look-arounds and $ stop at the piece's ends).
    void split(std::string_view text, std::vector<Range> &out, Scratch &scratch) const;

    const PreTokenizerSpec &spec() const { return *spec_; }

  private:
    struct CodeDeleter {
        void operator()(pcre2_code *c) const { pcre2_code_free(c); }
    };
    const PreTokenizerSpec *spec_;
    std::string path_;
    std::vector<std::unique_ptr<pcre2_code, CodeDeleter>> codes_;
};

} // namespace prescope

// Tokenizer built from a GGUF file's tokenizer.ggml.* metadata: byte-level BPE ("gpt2", with the pre-tokenizers
// of pre-tokenizer.h) and SentencePiece-style BPE ("llama"). Behaviour and references: docs/tokenizer.md.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace prescope {

class GgufFile;

/// A byte range [begin, end) of a text.
struct TextSpan {
    size_t begin = 0;
    size_t end = 0;
};

/// Token kinds stored in tokenizer.ggml.token_type (llama.cpp enum llama_token_type, gguf-py TokenType).
enum class TokenType : int32_t {
    UNDEFINED = 0, NORMAL = 1, UNKNOWN = 2, CONTROL = 3, USER_DEFINED = 4, UNUSED = 5, BYTE = 6,
};

/// An immutable tokenizer; cheap to copy (shared state) and safe to use from several threads at once.
///
/// gpt2 model: the text is split on special tokens, NFC-normalised where the family's tokenizer.json does
/// (qwen2, qwen35, olmo), split by the family's pre-tokenizer regexes (pre-tokenizer.h: the regexes of HF
/// tokenizer.json, as llama.cpp llama-vocab.cpp names them), mapped to GPT-2 byte-level characters and merged
/// by merge rank (lowest first, leftmost on ties; HF tokenizers BPE::merge_word). llama-bpe looks a whole
/// pre-token up first (ignore_merges).
/// llama model: SentencePiece BPE as in sentencepiece bpe_model.cc and llama.cpp llm_tokenizer_spm: spaces
/// become U+2581, a space is prepended to each text run (add_space_prefix), adjacent pieces are merged by
/// highest score (leftmost on ties), pieces that are no token fall back to <0xXX> byte tokens, else unk.
/// Invalid UTF-8 in the input is replaced by U+FFFD (one per maximal invalid subpart) before all of this.
class Tokenizer {
  public:
    /// Reads tokenizer.ggml.{model, pre, tokens, token_type, scores, merges, *_token_id, add_bos_token,
    /// add_eos_token, add_space_prefix}. Throws prescope::Error naming the file and the key when a key is
    /// missing or of the wrong type, the model or pre-tokenizer is not supported, array lengths disagree,
    /// a merge names an unknown token, a special-token id lies outside the vocabulary, or a required
    /// token (GPT-2 byte alphabet, unk) is absent.
    static Tokenizer from_gguf(const GgufFile &file);

    /// Token ids of `text` (UTF-8, any bytes accepted). add_special: prepend BOS / append EOS when the
    /// model asks for it (add_bos() / tokenizer.ggml.add_eos_token). parse_special: control and unknown
    /// tokens written in the text (e.g. "<|im_start|>") become their ids; user-defined tokens always do
    /// (llama.cpp tokenizer_st_partition; matching is leftmost-longest like HF added tokens).
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const;
    /// The same, except that special tokens overlapping a `literal` span are not recognised: there the text is
    /// tokenised as with parse_special = false (user-defined tokens still match). For chat prompts, whose
    /// message contents must stay text (chat-template.h, render_chat). Spans: byte ranges of `text`, sorted and
    /// disjoint; throws prescope::Error otherwise. Without spans, identical to the overload above.
    std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special,
                                std::span<const TextSpan> literal) const;

    /// The bytes one token stands for: byte-level decoded (gpt2), U+2581 -> space and <0xXX> -> byte
    /// (llama); control, unknown and user-defined tokens give their text, unused tokens "". A piece may be
    /// part of a UTF-8 character; use TokenTextStream to print. Throws Error for an id outside [0, n_vocab).
    std::string token_to_piece(int32_t id) const;

    /// Concatenated pieces. For llama models the space that encode() prepends to each text run (at the
    /// start and after each special token) is removed again, so decode(encode(t, ...)) == t (NFC(t) for
    /// qwen2, U+FFFD for invalid input bytes; for llama models a U+2581 in t comes back as a space, since
    /// SentencePiece writes spaces as U+2581). Throws Error for ids outside the vocabulary.
    std::string decode(const std::vector<int32_t> &ids) const;

    int32_t n_vocab() const;
    int32_t bos() const;  // -1 when the model has none
    int32_t eos() const;  // -1 when the model has none
    /// End of generation: eos, eot, eom, and tokens llama.cpp treats so by their text (<|im_end|>,
    /// <|endoftext|>, <|eot_id|>, </s>, <|return|>, ...; llama_vocab::impl::load; with gpt-oss's <|return|> and
    /// <|call|> present, <|end|> is not one). False for ids outside the vocabulary.
    bool is_eog(int32_t id) const;
    /// Whether encode(text, add_special=true, ...) starts with BOS (tokenizer.ggml.add_bos_token; default
    /// true for llama and llama-bpe, false for the other pre-tokenizers, as llama.cpp).
    bool add_bos() const;

    /// Id of the token whose text is exactly `text`, or -1.
    int32_t find_token(std::string_view text) const;
    /// Text of a token as stored in tokenizer.ggml.tokens (byte-level characters for gpt2). Throws for bad ids.
    const std::string &token_text(int32_t id) const;
    TokenType token_type(int32_t id) const;

    struct Impl;

  private:
    explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
    std::shared_ptr<const Impl> impl_;
};

/// Turns generated tokens into printable text one token at a time: bytes of a UTF-8 character split
/// across tokens are held back until the character is complete; bytes that can never become valid
/// UTF-8 are replaced by U+FFFD. Concatenating every push() and the final flush() gives decode()'s text
/// except for llama models' leading-space removal (a streamed reply continues a prompt, so its first
/// space is real).
class TokenTextStream {
  public:
    explicit TokenTextStream(const Tokenizer &tokenizer) : tokenizer_(tokenizer) {}
    /// Valid UTF-8 text that became complete with this token (possibly empty).
    std::string push(int32_t id);
    /// Whatever is still held back, with incomplete characters replaced by U+FFFD; resets the stream.
    std::string flush();

  private:
    Tokenizer tokenizer_;
    std::string pending_;
};

/// Replaces invalid UTF-8 in `text` by U+FFFD, one per maximal invalid subpart (Unicode 15 §3.9,
/// "U+FFFD substitution of maximal subparts", as Python's errors="replace").
std::string sanitize_utf8(std::string_view text);

} // namespace prescope

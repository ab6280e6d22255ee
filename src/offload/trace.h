// Routing traces (.pstrace) and their hidden-state sidecars (.hidden.zst): reader, writer and the recorder
// that fills them from a running Context. Format: docs/trace-format.md (version 1, fixed); the Python twin
// is tools/data/pstrace.py.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace prescope {

class Context;

struct TraceSequence {
    std::string name;
    std::string source;    // "test-split", "sharegpt", "mt-bench", "gsm8k", "humaneval", "prompts", ...
    int64_t n_tokens = 0;
    int64_t n_prompt = -1; // tokens before the model's own decoded continuation; -1: all given (no decode part)
};

/// A decoded routing trace. Per token (sequences in order, prompt then generated tokens) and per MoE layer: the
/// router's top-k expert ids (descending gate weight) and the gate weights quantised as q = round(w * 255).
/// Layers are the recording model's MoE layers numbered from 0: its leading dense layers (no router) are not in
/// the trace, and trace layer l is that model's layer first_moe_layer + l (docs/decisions/0134).
struct RoutingTrace {
    static constexpr int32_t GATE_WEIGHT_SCALE = 255;

    std::string model;       // free text: which model produced it
    std::string arch;        // general.architecture of that model
    std::string created_by;  // tool and arguments
    int32_t n_layer = 0;          // MoE layers
    int32_t first_moe_layer = 0;  // the recording model's leading dense layers (header field, absent = 0)
    int32_t n_expert = 0;    // <= 256 (ids are uint8)
    int32_t top_k = 0;
    std::vector<TraceSequence> sequences;
    std::vector<uint32_t> token_ids;  // [n_tokens]
    std::vector<uint8_t> expert_ids;  // [n_tokens][n_layer][top_k]
    std::vector<uint8_t> gate_q;      // [n_tokens][n_layer][top_k]

    int64_t n_tokens() const { return int64_t(token_ids.size()); }
    /// The top_k expert ids of `token` (flat index over all sequences) at `layer`.
    const uint8_t *ids(int64_t token, int32_t layer) const {
        return expert_ids.data() + (size_t(token) * size_t(n_layer) + size_t(layer)) * size_t(top_k);
    }
    const uint8_t *gates(int64_t token, int32_t layer) const {
        return gate_q.data() + (size_t(token) * size_t(n_layer) + size_t(layer)) * size_t(top_k);
    }
    /// [first_token, end_token) of each sequence on the flat token axis.
    std::vector<std::array<int64_t, 2>> sequence_bounds() const;
    /// Appends one token's record: ids and F32 gate weights, each [n_layer][top_k]; weights are quantised
    /// with round(w * 255) clamped to [0, 255]. The caller adds the sequence entry (n_tokens) itself.
    void append_token(uint32_t token, std::span<const int32_t> ids, std::span<const float> weights);
};

/// Reads and validates a .pstrace file: one zstd frame (nothing after it), magic "PSTRACE1", format_version 1,
/// header fields and their ranges (n_expert <= 256, top_k <= n_expert, gate_weight_scale 255, the optional
/// first_moe_layer in [0, 4096)), sequence token counts summing to n_tokens, body length = n_tokens x (4 +
/// n_layer x 2 x top_k), every id < n_expert.
/// Throws prescope::Error "PATH: what is wrong" on any violation or I/O error.
RoutingTrace read_trace(const std::string &path);
/// Writes `t` as one zstd frame (compression level 1..19) under a temporary name, renamed to `path` when
/// complete (core/output-file.h); the header has first_moe_layer only when it is not 0. Throws prescope::Error
/// naming the file when the arrays disagree with the header fields, an id is >= n_expert, or the file cannot be
/// written (nothing is left behind then).
void write_trace(const std::string &path, const RoutingTrace &t, int level = 12);
/// The bytes write_trace writes; `path` only names the file in errors. For writers of several files that
/// commit them together (prescope trace: the trace and its sidecar).
std::string encode_trace(const std::string &path, const RoutingTrace &t, int level = 12);

/// A decoded hidden-state sidecar: for each covered token (in token_ranges order) and MoE layer (the trace's
/// numbering), the input of the layer's router (post-attention RMSNorm output) as int8 with one F32 absmax
/// scale: x = q * scale.
struct HiddenTrace {
    std::string trace;    // file name of the trace it belongs to (NAME.pstrace)
    int32_t n_layer = 0;
    int64_t dim = 0;      // n_embd of the model
    std::vector<std::array<int64_t, 3>> token_ranges;  // [seq_index, first_token, n_tokens]
    std::vector<float> scale;  // [n_tokens][n_layer]
    std::vector<int8_t> q;     // [n_tokens][n_layer][dim]

    int64_t n_tokens() const { return int64_t(scale.size()) / (n_layer ? n_layer : 1); }
    /// x of covered token i (sidecar order) at `layer`, dequantised into out[dim].
    void dequantize(int64_t i, int32_t layer, float *out) const;
    /// Appends one token's router inputs x [n_layer][dim], quantised per layer (quantize_int8_absmax).
    void append_token(const float *x);
    /// Index into the trace's flat token axis of each covered token, in sidecar order.
    std::vector<int64_t> flat_token_indices(const RoutingTrace &t) const;
};

/// scale = max|x| / 127, q = round(x / scale) clamped to [-127, 127] (all zero when x is zero), as pstrace.py.
void quantize_int8_absmax(const float *x, int64_t dim, float *scale, int8_t *q);

/// Reads and validates a sidecar (magic "PSHIDDN1", version, encoding "int8_absmax", token_ranges covering
/// n_tokens, body length). With `trace`, also checks n_layer and that each range lies inside its sequence;
/// with `trace_path`, that the sidecar was recorded for that trace file (its "trace" field, which `prescope
/// trace` sets to the trace's file name, equals trace_path's file name): a sidecar of another trace with the
/// same shape would otherwise pair hidden states with the wrong tokens. Throws prescope::Error naming the file.
HiddenTrace read_hidden(const std::string &path, const RoutingTrace *trace = nullptr,
                        const std::string &trace_path = {});
/// Writes a sidecar as write_trace writes a trace (temporary name, then rename).
void write_hidden(const std::string &path, const HiddenTrace &h, int level = 12);
/// The bytes write_hidden writes.
std::string encode_hidden(const std::string &path, const HiddenTrace &h, int level = 12);

/// The sidecar path that belongs to a trace path: NAME.pstrace -> NAME.hidden.zst.
std::string hidden_path_for(const std::string &trace_path);

/// The sequences of `t` with the given indices (in that order), and the matching sidecar rows when `h` is
/// given (ranges renumbered; tokens of sequences not covered by `h` are dropped from the sidecar only).
RoutingTrace select_sequences(const RoutingTrace &t, std::span<const int64_t> seq_indices);
HiddenTrace select_hidden(const HiddenTrace &h, std::span<const int64_t> seq_indices);

/// Held-out split by sequence: sequence i is held out (test) when i % holdout_every == holdout_every - 1.
/// split: "train", "test" or "all"; returns the sequence indices in order. Throws on a bad split name or
/// holdout_every < 2.
std::vector<int64_t> split_sequences(const RoutingTrace &t, const std::string &split, int64_t holdout_every);

/// One prompt of a `prescope trace` input file.
struct TracePrompt {
    std::string name;    // "name" field, else FILE:LINE
    std::string source;  // "source" field, else default_source
    std::string text;
};

/// Reads prompts, one per non-empty line: a line starting with '{' is a JSON object with a "text" or "prompt"
/// string (and optional "name", "source" strings); any other line is the prompt text itself. Throws
/// prescope::Error "FILE:LINE: ..." for malformed JSON or a JSON line without text.
std::vector<TracePrompt> read_prompt_file(const std::string &path, const std::string &default_source);

/// Records routing (and optionally router inputs) from a Context through its on_routing / on_router_input
/// hooks (which it sets in its constructor and clears in its destructor): the model's MoE layers, trace layer
/// il - hp.n_layer_dense for model layer il (first_moe_layer = hp.n_layer_dense). Usage: begin_sequence(name, source),
/// then ctx.eval(chunk) followed by add_tokens(chunk) for each chunk of the sequence. Holds everything in memory (one record
/// is 4 + n_layer x 2 x top_k bytes; a sidecar token n_layer x (4 + dim) bytes).
class TraceRecorder {
  public:
    /// The trace header fields are taken from the model behind ctx; with_hidden records the sidecar too.
    TraceRecorder(Context &ctx, std::string model_name, std::string created_by, bool with_hidden);
    ~TraceRecorder();
    void begin_sequence(std::string name, std::string source);
    /// Moves the routing captured since the last call into the trace as the records of `tokens` (the ids
    /// just evaluated, in order). Throws prescope::Error when the hooks saw a different number of tokens.
    void add_tokens(std::span<const int32_t> tokens);
    const RoutingTrace &trace() const { return trace_; }
    const HiddenTrace &hidden() const { return hidden_; }

  private:
    Context &ctx_;
    bool with_hidden_;
    RoutingTrace trace_;
    HiddenTrace hidden_;
    std::vector<std::vector<int32_t>> ids_;   // [n_layer] (trace layers) captured [n_tok][top_k] of the pending tokens
    std::vector<std::vector<float>> w_;       // [n_layer] captured gate weights
    std::vector<std::vector<float>> x_;       // [n_layer] captured router inputs [n_tok][dim]
    std::vector<int32_t> tok_ids_;            // scratch [n_layer * top_k]
    std::vector<float> tok_w_, tok_x_;        // scratch
};

} // namespace prescope

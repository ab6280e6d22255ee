// Inference context: KV cache, activation buffers and the forward pass of a MoE transformer
// (embeddings -> blocks of attention + MoE FFN -> output norm -> logits), on the CPU backend.
#pragma once

#include "arch/arch.h"
#include "runtime/moe.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace prescope {

struct ContextParams {
    int64_t n_ctx = 4096;   // KV cache length PER SEQUENCE in tokens (0: the model's training context)
    int64_t n_batch = 512;  // tokens per forward pass (all sequences together); longer inputs are split
    int64_t n_seq = 1;      // sequences with their own KV cache (server slots)
    /// Batch-invariant kernels (cpu::BatchInvariantScope): every token's logits bit-identical to a run of its
    /// sequence alone, whatever else is in the batch and however it is split; the default may differ in the
    /// last bits (docs/decisions/0111-batch-invariance.md).
    bool deterministic = false;
};

/// One sequence's tokens inside a batch: they continue sequence `seq` at its n_past(seq). With `logits`, the
/// logits of the last of them are returned.
struct SeqTokens {
    int32_t seq = 0;
    std::span<const int32_t> tokens;
    bool logits = true;
};

/// A run of one sequence's tokens inside a forward pass, at KV cache positions [pos0, pos0 + n).
struct SeqRun {
    int32_t seq = 0;
    int64_t n = 0, pos0 = 0;
};

/// The reused buffers of split_batch(): one pass's tokens, runs and logits rows.
struct BatchScratch {
    std::vector<int32_t> tokens;
    std::vector<SeqRun> runs;
    std::vector<int64_t> out_rows;
};

/// Splits eval_batch()'s entries (already checked by check_batch_input) into forward passes of at most n_batch
/// tokens, filled in entry order (an entry that does not fit the rest of a pass goes on in the next), and calls
/// pass(tokens, runs, out_rows, first_row) for each: the pass's tokens, its runs (positions from n_past[seq] as
/// it was when the entry's first run was made), the pass-local rows whose logits are wanted (each entry with
/// logits: its last token) and the index of the first of them among the batch's logits rows. Both engines run
/// their passes through it, so they split a batch the same way. Allocates only when `s` lacks capacity.
template <typename Pass>
void split_batch(std::span<const SeqTokens> batch, std::span<const int64_t> n_past, int64_t n_batch,
                 BatchScratch &s, Pass &&pass) {
    int64_t row = 0;
    s.tokens.clear();
    s.runs.clear();
    s.out_rows.clear();
    const auto flush = [&] {
        pass(std::span<const int32_t>(s.tokens), std::span<const SeqRun>(s.runs),
             std::span<const int64_t>(s.out_rows), row);
        row += int64_t(s.out_rows.size());
        s.tokens.clear();
        s.runs.clear();
        s.out_rows.clear();
    };
    for (const SeqTokens &e : batch) {
        const int64_t start = n_past[size_t(e.seq)], n = int64_t(e.tokens.size());
        for (int64_t done = 0; done < n;) {
            const int64_t m = std::min(n_batch - int64_t(s.tokens.size()), n - done);
            s.tokens.insert(s.tokens.end(), e.tokens.begin() + done, e.tokens.begin() + done + m);
            s.runs.push_back({e.seq, m, start + done});
            done += m;
            if (e.logits && done == n) s.out_rows.push_back(int64_t(s.tokens.size()) - 1);
            if (int64_t(s.tokens.size()) == n_batch) flush();
        }
    }
    if (!s.tokens.empty()) flush();
}

/// The checks every engine's eval() makes before it runs: tokens not empty, each inside the vocabulary, and
/// fitting the context (n_past + tokens.size() <= n_ctx). Throws prescope::Error saying which failed.
void check_eval_input(const HParams &hp, std::span<const int32_t> tokens, int64_t n_past, int64_t n_ctx);

/// The checks of eval_batch(): at least one entry; each entry's seq in [0, n_past.size()) and listed once; its
/// tokens pass check_eval_input at n_past[seq]. Throws prescope::Error naming the entry and its sequence.
void check_batch_input(const HParams &hp, std::span<const SeqTokens> batch, std::span<const int64_t> n_past,
                       int64_t n_ctx);

/// Warns (llama.cpp does the same) when n_ctx exceeds the model's training context (hp.n_ctx_train).
void warn_beyond_training_context(const HParams &hp, int64_t n_ctx);

/// The context size a run uses: n_ctx, or the model's training context (`{arch}.context_length`) when n_ctx <= 0.
/// Throws Error naming the file and the key when that is needed and is 0 (the user must pass -c N).
int64_t resolve_n_ctx(const Model &model, int64_t n_ctx);

/// The state of n_seq sequences: one KV cache each, one forward pass over the tokens of all of them. Buffers
/// are allocated once here; eval() and eval_batch() allocate nothing per token.
class Context {
  public:
    /// executor: runs the routed experts; nullptr uses a CpuExpertExecutor owned by the context. Throws
    /// prescope::Error "out of memory: the KV cache and activations for -c N -b M need ... bytes, ... available"
    /// before allocating when they do not fit the host memory left (core/memory.h), and on n_seq < 1.
    Context(const Model &model, ContextParams params, ExpertExecutor *executor = nullptr);

    /// Evaluates tokens of sequence 0 at positions n_past() .. n_past() + n - 1 and appends them to its KV
    /// cache. Throws prescope::Error when a token id is outside the vocabulary or the tokens do not fit the
    /// context (n_past() + n > n_ctx()). logits(): [n][n_vocab] when all_logits, else the last token's.
    void eval(std::span<const int32_t> tokens, bool all_logits = false);
    /// One forward pass over every entry's tokens together (split into passes of at most n_batch tokens, an
    /// entry across two when needed): projections, router and MoE block on all tokens, attention per entry
    /// against its sequence's cache. logits(): [entries with logits][n_vocab], in entry order, each the
    /// logits after the entry's last token. Throws prescope::Error (check_batch_input) before running.
    void eval_batch(std::span<const SeqTokens> batch);
    const std::vector<float> &logits() const { return logits_; }

    int64_t n_seq() const { return params_.n_seq; }
    /// Tokens cached for sequence 0 / for `seq` (throws prescope::Error when seq is outside [0, n_seq)).
    int64_t n_past() const { return n_past_[0]; }
    int64_t n_past(int32_t seq) const;
    int64_t n_ctx() const { return params_.n_ctx; }
    const Model &model() const { return model_; }
    /// Forgets every cached position of every sequence / of `seq` (throws as n_past(seq)).
    void clear();
    void clear(int32_t seq);

    /// Called with each layer's routing after the router ran (trace recording, statistics). With several
    /// sequences in a forward pass it sees the routing of all the pass's tokens (entry order), as the experts do.
    std::function<void(int64_t layer, const Routing &)> on_routing;
    /// When set, may replace each layer's routing before the experts run (trace replay); the whole pass's.
    std::function<void(int64_t layer, Routing &)> routing_override;
    /// Called with each layer's router input x: [n_tok][n_embd] F32 (the ffn-norm output the gate reads),
    /// before routing (hidden-state traces and predictors, docs/predictors.md); the whole pass's tokens.
    std::function<void(int64_t layer, const float *x, int64_t n_tok)> on_router_input;

  private:
    /// One forward pass over tokens[0, n) made of `runs` (in order); logits_out receives [out_rows][n_vocab],
    /// the logits of the given rows of the pass (none: no output head).
    void forward_pass(const int32_t *tokens, int64_t n, std::span<const SeqRun> runs,
                      std::span<const int64_t> out_rows, float *logits_out);
    void attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs);
    /// hp.mla (deepseek2): multi-head latent attention from each run's cached latent (decision 0120).
    void mla_attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs);
    void moe_block(int64_t il, int64_t n);
    /// Layers il < hp.n_layer_dense: x += down(silu(gate(h)) * up(h)), h = rmsnorm(x).
    void dense_ffn_block(int64_t il, int64_t n);
    void check_seq(int32_t seq) const;

    const Model &model_;
    ContextParams params_;
    std::unique_ptr<CpuExpertExecutor> own_executor_;
    ExpertExecutor *executor_;
    std::vector<int64_t> n_past_;  // [n_seq]

    std::vector<float> k_cache_, v_cache_;  // [n_layer][n_seq][n_ctx][n_head_kv * head_dim]; MLA: the latent in k_cache_ only
    // Activations for up to n_batch tokens.
    std::vector<float> x_;       // [n_batch][n_embd] residual stream
    std::vector<float> h_;       // [n_batch][n_embd] normed input of a sub-block
    std::vector<float> q_;       // [n_batch][n_head * head_dim]
    std::vector<float> k_, v_;   // [n_batch][n_head_kv * head_dim]
    std::vector<float> attn_;    // [n_batch][n_head * head_dim]
    std::vector<float> ffn_;     // [n_batch][n_embd] sub-block output
    std::vector<float> shexp_;   // [n_batch][2 * max(n_ff_shexp, n_ff) + n_embd] shared-expert / dense FFN scratch
    std::vector<float> mla_;     // MLA scratch (mla_attention_block)
    std::vector<float> probs_;   // [n_batch][n_expert] router softmax
    std::vector<int32_t> pos_;   // [n_batch] positions
    BatchScratch scratch_;       // eval/eval_batch: one pass's tokens, runs and logits rows
    Routing routing_;
    std::vector<float> logits_;
};

} // namespace prescope

// Inference context: KV cache, activation buffers and the forward pass of a MoE transformer
// (embeddings -> blocks of attention + MoE FFN -> output norm -> logits), on the CPU backend.
#pragma once

#include "arch/arch.h"
#include "runtime/moe.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace prescope {

struct ContextParams {
    int64_t n_ctx = 4096;   // KV cache length in tokens (0: the model's training context)
    int64_t n_batch = 512;  // tokens per forward pass; longer inputs are split
};

/// The checks every engine's eval() makes before it runs: tokens not empty, each inside the vocabulary, and
/// fitting the context (n_past + tokens.size() <= n_ctx). Throws prescope::Error saying which failed.
void check_eval_input(const HParams &hp, std::span<const int32_t> tokens, int64_t n_past, int64_t n_ctx);

/// Warns (llama.cpp does the same) when n_ctx exceeds the model's training context (hp.n_ctx_train).
void warn_beyond_training_context(const HParams &hp, int64_t n_ctx);

/// One sequence's state. Buffers are allocated once here; eval() allocates nothing per token.
class Context {
  public:
    /// executor: runs the routed experts; nullptr uses a CpuExpertExecutor owned by the context. Throws
    /// prescope::Error "out of memory: the KV cache and activations for -c N -b M need ... bytes, ... available"
    /// before allocating when they do not fit the host memory left (core/memory.h).
    Context(const Model &model, ContextParams params, ExpertExecutor *executor = nullptr);

    /// Evaluates tokens at positions n_past() .. n_past() + n - 1 and appends them to the KV cache.
    /// Throws prescope::Error when a token id is outside the vocabulary or the tokens do not fit the
    /// context (n_past() + n > n_ctx()). logits(): [n][n_vocab] when all_logits, else the last token's.
    void eval(std::span<const int32_t> tokens, bool all_logits = false);
    const std::vector<float> &logits() const { return logits_; }

    int64_t n_past() const { return n_past_; }
    int64_t n_ctx() const { return params_.n_ctx; }
    const Model &model() const { return model_; }
    /// Forgets every cached position.
    void clear() { n_past_ = 0; }

    /// Called with each layer's routing after the router ran (trace recording, statistics).
    std::function<void(int64_t layer, const Routing &)> on_routing;
    /// When set, may replace each layer's routing before the experts run (trace replay).
    std::function<void(int64_t layer, Routing &)> routing_override;
    /// Called with each layer's router input x: [n_tok][n_embd] F32 (the ffn-norm output the gate reads),
    /// before routing (hidden-state traces and predictors, docs/predictors.md).
    std::function<void(int64_t layer, const float *x, int64_t n_tok)> on_router_input;

  private:
    void forward_batch(const int32_t *tokens, int64_t n, bool all_logits, float *logits_out);
    void attention_block(int64_t il, int64_t n);
    /// hp.mla (deepseek2): multi-head latent attention from the cached latent (decision 0120).
    void mla_attention_block(int64_t il, int64_t n);
    void moe_block(int64_t il, int64_t n);
    /// Layers il < hp.n_layer_dense: x += down(silu(gate(h)) * up(h)), h = rmsnorm(x).
    void dense_ffn_block(int64_t il, int64_t n);

    const Model &model_;
    ContextParams params_;
    std::unique_ptr<CpuExpertExecutor> own_executor_;
    ExpertExecutor *executor_;
    int64_t n_past_ = 0;

    std::vector<float> k_cache_, v_cache_;  // [n_layer][n_ctx][n_head_kv * head_dim]; MLA: the latent in k_cache_ only
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
    Routing routing_;
    std::vector<float> logits_;
};

} // namespace prescope

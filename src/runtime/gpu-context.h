// The GPU forward pass with expert offloading (built only with CUDA): non-expert weights, KV cache and
// activations on the GPU; per layer attention and router on the GPU, one device-to-host copy of the routing
// and router input, then the hybrid MoE block (runtime/hybrid-moe.h) runs GPU experts from the hot-expert
// table and CPU experts from host memory side by side, and prefetches for the next layers.
#pragma once

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda-backend.h"
#include "backend/cuda/graph.h"
#include "offload/copy-engine.h"
#include "offload/expert-cache.h"
#include "offload/expert-loader.h"
#include "offload/expert-store.h"
#include "offload/placement.h"
#include "runtime/engine.h"
#include "runtime/gpu-moe-device.h"
#include "runtime/hybrid-moe.h"
#include "runtime/routing-replay.h"

#include <functional>
#include <memory>

namespace prescope {

/// PRECONDITIONS: one thread uses it (the one that constructed it); the model outlives it.
/// Allocates device and pinned memory only in the constructor; eval() allocates nothing on the host beyond
/// growing logits() to the size asked for, and synchronizes the compute stream once per layer (routing)
/// and once per batch that returns logits.
class GpuContext final : public Engine {
  public:
    /// Throws prescope::Error: deterministic (batch-invariant kernels are CPU-only, decision 0130); no CUDA
    /// device; unsupported shapes (router over 1024 experts, top-k over 32, head sizes the attention kernel lacks); not enough device memory (with the sizes of each part);
    /// an expert budget below one layer's top-k (with the minimum); a bad placement or routing trace file.
    GpuContext(const Model &model, ContextParams params, const OffloadConfig &config);
    ~GpuContext() override;

    void eval(std::span<const int32_t> tokens, bool all_logits = false) override;
    /// As Context::eval_batch: projections, router and MoE block (with its offloading plan) over every entry's
    /// tokens together; attention per run of one sequence against that sequence's KV cache.
    void eval_batch(std::span<const SeqTokens> batch) override;
    const std::vector<float> &logits() const override { return logits_; }
    int64_t n_seq() const override { return params_.n_seq; }
    int64_t n_past() const override { return n_past_[0]; }
    int64_t n_past(int32_t seq) const override;
    int64_t n_ctx() const override { return params_.n_ctx; }
    void clear() override;
    void clear(int32_t seq) override;
    const char *backend_name() const override { return "cuda"; }
    std::string startup_text() const override;
    std::string stats_text() const override;
    nlohmann::json stats_json() const override;
    void reset_stats() override;

    const ExpertCache &cache() const { return *cache_; }
    const CopyEngine &copy_engine() const { return *engine_; }

    /// As on Context: each layer's routing after the router (trace recording), and a hook that may replace
    /// it before the experts run (set by --routing-trace; a user hook runs after the replay).
    std::function<void(int64_t layer, const Routing &)> on_routing;
    std::function<void(int64_t layer, Routing &)> routing_override;

  private:
    using DevMatrix = GpuMatrix;
    struct DevLayer {
        const float *attn_norm = nullptr, *ffn_norm = nullptr;
        const float *bq = nullptr, *bk = nullptr, *bv = nullptr, *q_norm = nullptr, *k_norm = nullptr;
        DevMatrix wq, wk, wv, wo, gate_inp;
        DevMatrix gate_shexp, up_shexp, down_shexp, gate_inp_shexp;  // shared expert (qwen2moe, deepseek2)
        const float *gate_inp_b = nullptr, *exp_probs_b = nullptr;  // router logit / selection biases
        const float *bo = nullptr, *attn_sinks = nullptr;            // gpt-oss: output bias, sink logit per head
        // MLA (deepseek2): wk_b and wv_b hold one matrix per head (n_in x n_out each, n_head of them).
        DevMatrix wq_a, wq_b, wkv_a, wk_b, wv_b;
        const float *q_a_norm = nullptr, *kv_a_norm = nullptr;
        DevMatrix ffn_gate, ffn_up, ffn_down;  // dense layers (il < n_layer_dense)
    };
    /// Byte offsets inside the routing block copied to the host each layer, for n_tok tokens.
    struct RoutingBlock {
        size_t h = 0, ids = 0, weights = 0, shared_gate = 0, bytes = 0;
    };

    void init();
    void release() noexcept;
    RoutingBlock routing_block(int64_t n_tok) const;
    /// Offset in tok_dev_ / tok_host_ (4-byte elements) of the replayed experts of `layer` for a pass of n_tok,
    /// and of their F32 weights.
    int64_t replay_ids(int64_t layer, int64_t n_tok) const;
    int64_t replay_weights(int64_t layer, int64_t n_tok) const;
    /// The host's part of the MoE steps the device ran whole (HybridMoe::launch_device), in layer order: each
    /// one's routing, copied to its own host block, goes through the replay and the hooks to
    /// HybridMoe::account_device_layer. wait: block for each copy; else stop at the first not yet done.
    void account_device_steps(bool wait);
    /// routing_ from a routing block on the host (n tokens), then the replay and the hooks.
    void read_routing(int64_t il, int64_t n, const uint8_t *block);
    /// A pass of n_tok tokens replays a trace and takes the device-resolved hit path: the trace's experts go up
    /// with the tokens (replay_ids) and the device resolves those.
    bool replay_on_device(int64_t n_tok) const { return replay_ && n_tok <= device_hits_tokens_; }
    void upload_weights();
    /// One forward pass over tokens[0, n) made of `runs`; logits_out receives [out_rows][n_vocab].
    void forward_pass(const int32_t *tokens, int64_t n, std::span<const SeqRun> runs,
                      std::span<const int64_t> out_rows, float *logits_out);
    /// The pass's work on the compute stream up to the head: the upload of n_ints ints of tok_host_, the layers.
    /// The host interleaves its MoE steps (waiting for routing), except while capturing_ (every step whole).
    void queue_layers(int64_t n, std::span<const SeqRun> runs, size_t n_ints);
    /// A pass of every MoE layer whole on the device from fixed slots (HybridMoe::device_resident, the caller's
    /// check) may run as the decode graph (decision 0142): one token of one run, one logits row, no MLA,
    /// page-locked mirrors, a runtime that captures graphs.
    bool graph_pass(int64_t n, std::span<const SeqRun> runs, int64_t n_rows) const;
    void attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs);
    /// DeepSeek's MLA as runtime/context.cpp computes it (absorbed weights, latent cache), the per-head products
    /// as grouped matmuls over the heads (mla_heads).
    void mla_attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs);
    /// y (head-major [n_head][n][n_out]) = per-head matrix m (wk_b or wv_b of il) x (head-major [n_head][n][n_in]).
    void mla_heads(int64_t il, int which, const DevMatrix &m, const float *x, int64_t n, float *y);
    void dense_ffn_block(int64_t il, int64_t n);
    void moe_block(int64_t il, int64_t n);
    /// Makes the compute stream wait for the last routing copy, if one is pending.
    void join_routing_copy();
    /// Queues the logits of pass rows [r0, r0 + m) of those in tok_dev_ (m <= kLogitRows) and their copy to
    /// logits_host_.
    void queue_head(int64_t r0, int64_t m);
    /// After queue_head(r0, m): the pending whole steps' accounting while the head runs, then its m rows of logits
    /// into logits_out.
    void read_logits(int64_t m, float *logits_out);
    /// y = W x ([n_tok] rows, cuda::matmul_parts on the compute stream), plus residual when given (may be y: the
    /// sum in place, one launch on the GEMV path).
    void matmul(const DevMatrix &w, const float *x, int64_t n_tok, float *y, const float *residual = nullptr);
    cudaStream_t stream() const { return CudaBackend::cuda_stream(compute_); }

    const Model &model_;
    ContextParams params_;
    OffloadConfig config_;
    std::vector<int64_t> n_past_;  // [n_seq] tokens in each sequence's KV cache
    BatchScratch scratch_;         // eval/eval_batch: one pass's tokens, runs and logits rows
    std::vector<float> logits_;

    std::unique_ptr<CudaBackend> backend_;
    Stream compute_ = nullptr;
    Event routing_ready_ = nullptr;  // recorded after each layer's routing copy to the host
    // The routing copies run on a side stream forked from compute_ after each router, off the chain of the layer's
    // kernels (0148: in a replayed decode graph the copy node and the gaps around it cost ~12 us a layer); the next
    // router of a pass larger than a decode step waits for the copy (join_routing_copy: that pass reuses one device
    // block; a decode step's layers have their own), and so does the end of every pass.
    Stream routing_side_ = nullptr;
    Event routing_fork_ = nullptr, routing_join_ = nullptr;
    bool routing_join_pending_ = false;
    Event logits_ready_ = nullptr;
    std::vector<Event> step_ready_;  // [n_layer] recorded after a whole device step's routing copy

    // Device memory: one block for the non-expert weights, one for everything else.
    void *weights_dev_ = nullptr;
    uint64_t weights_bytes_ = 0;
    void *arena_dev_ = nullptr;
    uint64_t arena_bytes_ = 0;
    DevMatrix tok_embd_, output_;
    const float *output_norm_ = nullptr;
    std::vector<DevLayer> layers_;
    // Activations and caches (inside the arena), for up to n_batch tokens.
    float *x_ = nullptr;         // [n_batch][n_embd] residual stream
    float *hb_ = nullptr;        // [n_batch][n_embd] normed attention input
    float *q_ = nullptr;         // [n_batch][n_head * head_dim]
    float *attn_ = nullptr;      // [n_batch][n_head * head_dim]
    float *tmp_ = nullptr;       // [n_batch][n_embd] block output before the residual add
    float *k_cache_ = nullptr;   // [n_layer][n_seq][n_ctx][n_head_kv * head_dim] (MLA: the latent rows)
    float *v_cache_ = nullptr;   // (MLA: none, the values are the latent rows)
    float *rope_freq_ = nullptr;  // [rope dims / 2] cpu::rope_inv_freq's table
    // MLA (deepseek2), for up to n_batch tokens: full queries [n][n_head][nope + rope], the q-LoRA latent, head-major
    // inputs and outputs of the per-head products, the values before Wo [n][n_head][head_dim_v].
    float *mla_q_ = nullptr, *mla_qa_ = nullptr, *mla_in_ = nullptr, *mla_out_ = nullptr, *mla_v_ = nullptr;
    const void **mla_w_ = nullptr;  // device [n_layer][2][n_head] the wk_b / wv_b matrix of each head
    std::vector<const void *> mla_w_host_;
    int32_t *mla_offsets_ = nullptr;      // device [n_batch][n_head + 1]: row n-1 = the heads' pairs for n tokens
    std::vector<int32_t> mla_offsets_host_;
    float *ffn_g_ = nullptr, *ffn_u_ = nullptr;  // dense layers: [n_batch][n_ff]
    float *router_logits_ = nullptr;  // [n_batch][n_expert]
    unsigned *router_counter_ = nullptr;  // cuda::moe_router's block tickets
    uint8_t *routing_dev_ = nullptr;  // RoutingBlock for n_batch tokens: h, ids, weights, shared gate logits
    uint8_t *step_routing_dev_ = nullptr;  // [n_layer] RoutingBlocks of device_hits_tokens_ (step_routing_host_'s
                                           // sources): a decode step's layers need not wait for each other's copies
    float *k_new_ = nullptr;     // [n_batch][n_head_kv * head_dim] new keys of a pass of several runs or of a
    float *v_new_ = nullptr;     //   captured one (decision 0142), before the scatter into their sequences' cache
                                 //   rows (one run writes its rows directly)
    int32_t *tok_dev_ = nullptr;   // [4][n_batch]: token ids, positions, KV cache rows, rows whose logits are wanted;
                                   // then, replaying a trace, [n_layer][n][top_k] its experts (replay_ids)
                                   // and their weights (F32, replay_weights)
    float *logits_dev_ = nullptr;  // [kLogitRows][n_vocab]
    cuda::Workspace ws_;
    // Pinned host mirrors.
    void *pinned_ = nullptr;                 // one cudaHostAlloc, or null when page-locking was refused:
    std::unique_ptr<uint8_t[]> pageable_;    // then the mirrors live here
    uint64_t pinned_bytes_ = 0;
    uint8_t *routing_host_ = nullptr;
    uint8_t *step_routing_host_ = nullptr;  // [n_layer] RoutingBlocks of device_hits_tokens_: whole device steps
    size_t step_routing_bytes_ = 0;         // one of them
    // Whole device steps whose accounting is pending, in layer order: (layer, tokens). Empty between passes.
    std::vector<std::pair<int32_t, int64_t>> device_steps_;
    size_t device_steps_done_ = 0;          // of device_steps_, accounted
    // The decode graph (decision 0142): captured from a pass of sequence graph_seq_ (-1: none valid), replayed.
    cuda::StreamGraph graph_;
    int32_t graph_seq_ = -1;
    bool capturing_ = false;   // queue_layers is being captured: nothing runs, the host must not wait
    int64_t graph_captures_ = 0, graph_replays_ = 0;  // passes since reset_stats()
    int32_t *tok_host_ = nullptr;
    float *logits_host_ = nullptr;   // [kLogitRows][n_vocab]
    Routing routing_;

    // Offloading.
    std::unique_ptr<RoutingReplay> replay_;
    int64_t device_hits_tokens_ = 0;  // most tokens of a pass the device-resolved hit path takes (0: off)
    std::unique_ptr<ExpertStore> store_;
    PlacementPlan plan_;
    std::unique_ptr<ExpertCache> cache_;
    std::unique_ptr<CopyEngine> engine_;
    std::unique_ptr<ExpertLoader> loader_;
    std::unique_ptr<Predictor> predictor_;
    OraclePredictor *oracle_ = nullptr;
    std::unique_ptr<CudaMoeDevice> moe_device_;  // the MoE block's device half, owning its buffers
    std::unique_ptr<HybridMoe> moe_;

    // Counters since reset_stats().
    int64_t tokens_prefill_ = 0, tokens_decode_ = 0;
    CopyStats copy_base_;  // engine counters at the last reset
    std::string cost_notes_;  // where the cost model's terms came from (start-up text)
    std::string numa_text_;   // the NUMA placement line (start-up text)
};

} // namespace prescope

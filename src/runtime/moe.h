// The MoE block: router (gate logits -> softmax -> top-k -> optional renormalisation) and the
// executor interface that runs the routed experts. The CPU executor reads expert weights in place;
// the offloading runtime (src/offload) provides executors that use the GPU hot-expert table.
#pragma once

#include "arch/arch.h"
#include "offload/expert-store.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace prescope {

/// Routing of n_tok tokens through one MoE layer.
struct Routing {
    int64_t n_tok = 0;
    int64_t k = 0;
    std::vector<int32_t> ids;    // [n_tok][k] expert ids, descending gate weight
    std::vector<float> weights;  // [n_tok][k] weights the expert outputs are multiplied by
};

/// The router of hp's layers as data (scores, groups, renormalisation, scale), without the bias pointers, which the
/// caller sets to its copies of LayerWeights::gate_inp_b and exp_probs_b.
cpu::RouterSpec router_spec(const HParams &hp);

/// Router of layer `l` for x: [n_tok][n_embd]: logits = ffn_gate_inp . x (+ ffn_gate_inp.bias when the layer
/// has it) in F32, scores = softmax over all experts, with ExpertGating::SIGMOID a sigmoid per expert, with
/// SOFTMAX_WEIGHT the logits themselves; top-k of the scores (ties: lower id first)
/// with these options: the choice uses scores + exp_probs_b when the layer has that bias, and, with
/// hp.n_expert_group > 1, only the hp.n_expert_group_used groups (of n_expert / n_expert_group consecutive
/// experts) whose two best choosing scores sum highest (llama.cpp build_moe_ffn, HF DeepseekV3TopkRouter);
/// the weights are the unbiased scores of the chosen experts, divided by their sum when hp.norm_topk_prob,
/// then times hp.expert_weights_scale (HF Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock / DeepseekV3MoE);
/// with SOFTMAX_WEIGHT the weights are the softmax of the k chosen logits (HF GptOssTopKRouter).
/// `probs` is scratch of n_tok * n_expert floats and holds the scores afterwards.
void moe_route(const HParams &hp, const LayerWeights &l, const float *x, int64_t n_tok, float *probs, Routing &out);

/// Runs the routed experts of one layer.
class ExpertExecutor {
  public:
    virtual ~ExpertExecutor() = default;
    /// x: [r.n_tok][n_embd], the layer's ffn-norm output. out: [r.n_tok][n_embd], overwritten with
    /// sum_j r.weights[t][j] * expert_{r.ids[t][j]}(x[t]), summed in top-k order; an expert is
    /// down(act(gate(x), up(x))) with act SwiGLU or HParams::expert_act, biases added where the model has them.
    /// Called for the MoE layers only (HParams::has_experts). With adds_shared_expert(), out also holds the
    /// layer's shared expert, added after the routed sum with Context's weight (below).
    virtual void run(int64_t layer, const float *x, const Routing &r, float *out) = 0;
    /// True when run() adds the shared expert (hp.shared_expert) itself, as the device half of the hybrid block
    /// does (HybridMoe's shared_on_device): weighted sigmoid(ffn_gate_inp_shexp . x) with hp.shared_expert_gate,
    /// else 1. Context then does not add it. False (the default): run() sums the routed experts only.
    virtual bool adds_shared_expert() const { return false; }
};

/// The CPU experts of one layer, batched: every expert's gate and up products in one parallel region (one
/// cpu::matmul_batch), SwiGLU over all pairs, then every down product in another (llama.cpp's mul_mat_id does
/// the same). Buffers are sized once for up to max_pairs (token, expert) pairs.
class CpuExpertRunner {
  public:
    CpuExpertRunner() = default;
    /// act: the models' HParams::expert_act.
    CpuExpertRunner(int64_t n_embd, int64_t max_n_ff, int64_t max_pairs, ExpertAct act);
    /// y[p] = expert(x[rows[p]]) for the n experts of `layer`: experts[i] (read from wherever the store keeps
    /// it, ExpertStore::cpu_views) owns pairs [offsets[i], offsets[i+1]). x: [tokens][n_embd] F32;
    /// y: [offsets[n]][n_embd] F32. An expert is down(act(gate x + gate_b, up x + up_b)) + down_b (the biases
    /// where ExpertViews has them); with SWIGLU and no biases the same results as cpu_expert_ffn.
    void run(const ExpertStore &store, int32_t layer, int32_t n, const int32_t *experts, const int32_t *offsets,
             const int32_t *rows, const float *x, float *y);

  private:
    int64_t n_embd_ = 0, max_n_ff_ = 0, max_pairs_ = 0;
    ExpertAct act_ = ExpertAct::SWIGLU;
    std::vector<float> xg_;             // [max_pairs][n_embd] gathered inputs, by expert
    std::vector<float> gate_, up_;      // [max_pairs][max_n_ff]
    std::vector<cpu::MatmulJob> jobs_;  // reused job lists
};

/// The combine of one token: out[0, n_embd) = sum over j = 0 .. k-1, in that order and from 0, of weights[j] *
/// rows[pair_ids[j]] (rows: [pairs][n_embd] F32 expert outputs). HF and llama.cpp add the k expert outputs in top-k
/// order; every executor on the host combines through this one loop, so their sums round alike.
void combine_top_k(int64_t k, const int32_t *pair_ids, const float *weights, const float *rows, int64_t n_embd,
                   float *out);

/// The CPU engine's MoE block: the all-CPU plan through the one MoE executor (runtime/hybrid-moe.h) with the
/// host as its device half, the experts read in place from the mapped weights.
class CpuExpertExecutor final : public ExpertExecutor {
  public:
    CpuExpertExecutor(const Model &model, int64_t max_tokens);
    ~CpuExpertExecutor() override;
    void run(int64_t layer, const float *x, const Routing &r, float *out) override;

  private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

/// Runs one expert on the CPU for m gathered rows: y[m][n_embd] = down(silu(gate(x)) * up(x)).
/// scratch holds at least m * 2 * n_ff floats.
void cpu_expert_ffn(const TensorView &gate, const TensorView &up, const TensorView &down, int64_t expert,
                    const float *x, int64_t m, float *scratch, float *y);

} // namespace prescope

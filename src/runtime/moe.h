// The MoE block: router (gate logits -> softmax -> top-k -> optional renormalisation) and the
// executor interface that runs the routed experts. The CPU executor reads expert weights in place;
// the offloading runtime (src/offload) provides executors that use the GPU hot-expert table.
#pragma once

#include "arch/arch.h"

#include <cstdint>
#include <vector>

namespace prescope {

/// Routing of n_tok tokens through one MoE layer.
struct Routing {
    int64_t n_tok = 0;
    int64_t k = 0;
    std::vector<int32_t> ids;    // [n_tok][k] expert ids, descending gate weight
    std::vector<float> weights;  // [n_tok][k] weights the expert outputs are multiplied by
};

/// Router of layer `l` for x: [n_tok][n_embd]: logits = ffn_gate_inp . x, softmax over all experts
/// in F32, top-k (ties: lower id first), then, when hp.norm_topk_prob, weights divided by their sum
/// (HF Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock; llama.cpp build_moe_ffn). `probs` is scratch
/// of n_tok * n_expert floats and holds the softmax output afterwards.
void moe_route(const HParams &hp, const LayerWeights &l, const float *x, int64_t n_tok, float *probs, Routing &out);

/// Runs the routed experts of one layer.
class ExpertExecutor {
  public:
    virtual ~ExpertExecutor() = default;
    /// x: [r.n_tok][n_embd], the layer's ffn-norm output. out: [r.n_tok][n_embd], overwritten with
    /// sum_j r.weights[t][j] * expert_{r.ids[t][j]}(x[t]), summed in top-k order; an expert is
    /// down(silu(gate(x)) * up(x)) (SwiGLU).
    virtual void run(int64_t layer, const float *x, const Routing &r, float *out) = 0;
};

/// Runs every expert on the CPU from the mapped weights: the (token, slot) pairs are grouped by
/// expert, then each projection of all active experts is one cpu::matmul_batch (one parallel region
/// per projection instead of one per expert). Buffers are sized once for up to max_tokens tokens.
class CpuExpertExecutor final : public ExpertExecutor {
  public:
    CpuExpertExecutor(const Model &model, int64_t max_tokens);
    void run(int64_t layer, const float *x, const Routing &r, float *out) override;

  private:
    const Model &model_;
    int64_t max_tokens_;
    std::vector<int32_t> count_, offset_, fill_;  // per expert: pairs, first sorted row, fill cursor
    std::vector<int32_t> order_;                  // sorted row -> pair index (t * k + j)
    std::vector<int32_t> row_of_;                 // pair index -> sorted row
    std::vector<float> xg_;                       // [max_tokens * k][n_embd] gathered inputs, by expert
    std::vector<float> gate_, up_;                // [max_tokens * k][n_ff]
    std::vector<float> y_;                        // [max_tokens * k][n_embd] expert outputs, by expert
    std::vector<cpu::MatmulJob> jobs_;            // reused job lists
};

/// Runs one expert on the CPU for m gathered rows: y[m][n_embd] = down(silu(gate(x)) * up(x)).
/// scratch holds at least m * 2 * n_ff floats.
void cpu_expert_ffn(const TensorView &gate, const TensorView &up, const TensorView &down, int64_t expert,
                    const float *x, int64_t m, float *scratch, float *y);

} // namespace prescope

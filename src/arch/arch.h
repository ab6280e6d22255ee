// Model architectures: hyper-parameters, weight bindings and the registry of supported GGUF
// architectures (qwen3moe, qwen2moe, llama-with-experts = Mixtral, olmoe, deepseek2, gpt-oss). One file per architecture
// (docs/style R2) fills these structs; the forward pass (runtime/context) reads only the flags.
#pragma once

#include "backend/cpu/ops.h"
#include "core/tensor.h"
#include "format/gguf.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace prescope {

/// Where an architecture applies RMSNorm to queries and keys before RoPE.
enum class QkNorm {
    NONE,
    PER_HEAD,  // Qwen3-MoE: weight [head_dim], applied to each head (HF Qwen3MoeAttention.q_norm)
    FULL,      // OLMoE: weight [n_head * head_dim] / [n_head_kv * head_dim] over the whole projection
};

/// Most routed experts per layer a model may have (Model::load refuses more; routing keeps per-token arrays
/// of this size on the stack). 384: Kimi-K2.
constexpr int64_t kMaxExperts = 384;

/// Function that turns router logits into expert scores ({arch}.expert_gating_func, llama.cpp
/// llama_expert_gating_func_type: 1 softmax, 2 sigmoid, 3 softmax over the chosen).
enum class ExpertGating {
    SOFTMAX,         // softmax over all experts (Qwen, Mixtral, OLMoE, DeepSeek-V2)
    SIGMOID,         // independent sigmoid per expert (DeepSeek-V3, Kimi-K2)
    SOFTMAX_WEIGHT,  // top-k of the raw logits, weights = softmax over those k (gpt-oss, HF GptOssTopKRouter)
};

/// The gated activation of the experts' gate and up rows.
enum class ExpertAct {
    SWIGLU,      // silu(gate) * up (cpu::swiglu)
    SWIGLU_OAI,  // gpt-oss's clamped variant (cpu::swiglu_oai, alpha 1.702, limit 7)
};

struct HParams {
    std::string arch;            // general.architecture
    int64_t n_vocab = 0;
    int64_t n_ctx_train = 0;     // {arch}.context_length
    int64_t n_embd = 0;          // {arch}.embedding_length
    int64_t n_layer = 0;         // {arch}.block_count
    int64_t n_head = 0;          // {arch}.attention.head_count
    int64_t n_head_kv = 0;       // {arch}.attention.head_count_kv
    int64_t head_dim = 0;        // {arch}.attention.key_length, default n_embd / n_head
    int64_t n_expert = 0;        // {arch}.expert_count
    int64_t n_expert_used = 0;   // {arch}.expert_used_count (top-k)
    int64_t n_ff_exp = 0;        // rows of each expert's gate/up matrix
    int64_t n_ff_shexp = 0;      // rows of the shared expert's gate/up matrix (0: none)
    float rms_eps = 1e-6f;       // {arch}.attention.layer_norm_rms_epsilon
    float rope_freq_base = 10000.0f;
    cpu::RopeMode rope_mode = cpu::RopeMode::NEOX;
    QkNorm qk_norm = QkNorm::NONE;
    bool qkv_bias = false;
    bool shared_expert = false;   // a shared expert that every token runs, beside the routed ones
    bool shared_expert_gate = false;  // qwen2moe: the shared expert is scaled by sigmoid(ffn_gate_inp_shexp . x)
    bool norm_topk_prob = false;  // renormalise the k routing weights to sum 1 (HF norm_topk_prob)
    ExpertGating expert_gating = ExpertGating::SOFTMAX;
    float expert_weights_scale = 1.0f;  // {arch}.expert_weights_scale: routing weights times this (HF routed_scaling_factor)
    int64_t n_expert_group = 1;       // {arch}.expert_group_count: experts split into this many groups
    int64_t n_expert_group_used = 1;  // {arch}.expert_group_used_count: top-k only among this many best groups
    int64_t n_layer_dense = 0;        // {arch}.leading_dense_block_count: first layers with a dense FFN
    int64_t n_ff = 0;                 // {arch}.feed_forward_length: rows of the dense layers' gate/up matrices
    ExpertAct expert_act = ExpertAct::SWIGLU;
    /// MoE layers: il in [n_layer_dense, n_layer) has a router and experts, the leading ones a dense FFN. The
    /// offload stack indexes by model layer (dense layers get no slots); traces and predictors number the MoE
    /// layers from 0 (trace layer = il - n_layer_dense, docs/decisions/0134).
    int64_t n_layer_moe() const { return n_layer - n_layer_dense; }
    bool has_experts(int64_t il) const { return il >= n_layer_dense && il < n_layer; }

    // gpt-oss: biases on the attention output, the router and the experts; per-head attention sinks; a sliding
    // window on every layer il with il % swa_pattern < swa_pattern - 1 (llama.cpp set_swa_pattern: gpt-oss's
    // pattern 2 slides the even layers, HF GptOssConfig.layer_types "sliding_attention" there too).
    bool attn_out_bias = false;  // blk.N.attn_output.bias
    bool moe_bias = false;       // blk.N.ffn_gate_inp.bias and blk.N.ffn_{gate,up,down}_exps.bias
    bool attn_sinks = false;     // blk.N.attn_sinks.weight
    int64_t n_swa = 0;           // {arch}.attention.sliding_window: positions a sliding layer sees; 0: none
    int64_t swa_pattern = 0;
    /// The window of layer il in positions, 0 for full attention.
    int64_t window(int64_t il) const { return n_swa > 0 && il % swa_pattern < swa_pattern - 1 ? n_swa : 0; }

    // Multi-head latent attention (deepseek2; llama.cpp writes it as MQA of one KV head, so n_head_kv = 1 and
    // head_dim = kv_lora_rank + head_dim_rope: the size of one cached latent row).
    bool mla = false;
    int64_t q_lora_rank = 0;    // {arch}.attention.q_lora_rank; 0: a plain attn_q (DeepSeek-V2-Lite)
    int64_t kv_lora_rank = 0;   // {arch}.attention.kv_lora_rank: compressed KV latent per token
    int64_t head_dim_nope = 0;  // key_length_mla - rope.dimension_count: query/key head part without RoPE
    int64_t head_dim_rope = 0;  // {arch}.rope.dimension_count: the rotated part, shared by all heads for keys
    int64_t head_dim_v = 0;     // {arch}.attention.value_length_mla: value head size after attn_v_b
    float kq_scale = 0.0f;      // MLA score scale: mscale^2 / sqrt(head_dim_nope + head_dim_rope) (arch/deepseek2.cpp)
    std::optional<cpu::RopeYarn> rope_yarn;  // {arch}.rope.scaling.type "yarn" (ArchLoader::read_rope_scaling)
};

/// Weights of one transformer block. 1-D weights are F32 pointers (converted once at load when the
/// file stores them in another dtype); matrices are views into the mapping. Optional ones are empty.
struct LayerWeights {
    const float *attn_norm = nullptr;   // [n_embd]
    TensorView wq, wk, wv, wo;          // [n_embd -> n_head*head_dim], [n_embd -> n_head_kv*head_dim] x2, [n_head*head_dim -> n_embd]
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // qkv_bias only
    const float *bo = nullptr;          // [n_embd] (attn_out_bias only)
    const float *attn_sinks = nullptr;  // [n_head] sink logit per query head (attn_sinks only)
    const float *q_norm = nullptr, *k_norm = nullptr;         // qk_norm only
    const float *ffn_norm = nullptr;    // [n_embd]
    TensorView gate_inp;                // router: [n_embd -> n_expert]
    TensorView gate_exps, up_exps;      // [n_embd, n_ff_exp, n_expert]
    TensorView down_exps;               // [n_ff_exp, n_embd, n_expert]
    const float *gate_inp_b = nullptr;  // [n_expert] router bias (moe_bias only)
    const float *gate_exps_b = nullptr, *up_exps_b = nullptr;  // [n_expert][n_ff_exp] (moe_bias only)
    const float *down_exps_b = nullptr;                         // [n_expert][n_embd] (moe_bias only)
    TensorView gate_shexp, up_shexp;    // [n_embd -> n_ff_shexp] (shared_expert only)
    TensorView down_shexp;              // [n_ff_shexp -> n_embd]
    const float *gate_inp_shexp = nullptr;  // [n_embd]: shared-expert gate vector (shared_expert_gate only)
    const float *exp_probs_b = nullptr;     // [n_expert]: bias added to expert scores for choosing only (optional)
    TensorView ffn_gate, ffn_up;            // dense layers (il < n_layer_dense): [n_embd -> n_ff]
    TensorView ffn_down;                    // [n_ff -> n_embd]
    // MLA (hp.mla): wq is [n_embd -> n_head * (head_dim_nope + head_dim_rope)] when q_lora_rank == 0.
    TensorView wq_a, wq_b;                  // [n_embd -> q_lora_rank], [q_lora_rank -> n_head * (nope + rope)]
    const float *q_a_norm = nullptr;        // [q_lora_rank]
    TensorView wkv_a_mqa;                   // [n_embd -> kv_lora_rank + head_dim_rope]
    const float *kv_a_norm = nullptr;       // [kv_lora_rank]
    TensorView wk_b;                        // [head_dim_nope -> kv_lora_rank] per head: ne {nope, kv_lora_rank, n_head}
    TensorView wv_b;                        // [kv_lora_rank -> head_dim_v] per head: ne {kv_lora_rank, v, n_head}
};

struct ModelWeights {
    TensorView tok_embd;                 // [n_embd, n_vocab]
    const float *output_norm = nullptr;  // [n_embd]
    TensorView output;                   // [n_embd, n_vocab]; tok_embd when tied
    std::vector<LayerWeights> layers;
};

/// A loaded model: the mapped GGUF file, its hyper-parameters and weight views.
class Model {
  public:
    /// Opens and validates a GGUF model. Throws prescope::Error naming the file and, where it applies,
    /// the tensor and the expected shape/dtype, for: unreadable or malformed files, unsupported
    /// architectures, missing tensors, wrong shapes, unsupported dtypes, and tensors the architecture
    /// does not use (unknown names, a shared expert in a model without one).
    static std::unique_ptr<Model> load(const std::string &path);

    const GgufFile &file() const { return file_; }
    const HParams &hp() const { return hp_; }
    const ModelWeights &weights() const { return w_; }
    /// Bytes of one expert (gate + up + down matrices) of layer `layer`.
    size_t expert_bytes(int64_t layer) const;

  private:
    explicit Model(const std::string &path) : file_(path) {}
    friend class ArchLoader;
    GgufFile file_;
    HParams hp_;
    ModelWeights w_;
    std::vector<std::vector<float>> converted_;  // 1-D weights converted to F32 at load
};

/// Helper the architecture files use to read hyper-parameters and bind tensors with shape checks.
class ArchLoader {
  public:
    ArchLoader(Model &m) : m_(m), f_(m.file_) {}
    const GgufFile &file() const { return f_; }
    HParams &hp() { return m_.hp_; }
    ModelWeights &w() { return m_.w_; }

    /// Reads the hyper-parameters every architecture shares ({arch}.block_count, ...) and binds
    /// every tensor; architecture files set their flags in hp() first.
    void load_standard();
    /// Reads the hyper-parameters every architecture shares ({arch}.block_count, ...).
    void read_common_hparams();
    /// Tensor `name` with exactly shape `ne` (ggml order); throws Error naming file, tensor,
    /// actual and expected shape. Optional tensors return an empty view when absent.
    TensorView matrix(const std::string &name, std::vector<int64_t> ne, bool optional = false);
    /// 1-D F32 weight of n elements (converted from F16/BF16 if needed).
    const float *vector(const std::string &name, int64_t n, bool optional = false);
    /// An F32 tensor of exactly shape `ne` (converted as vector() does), e.g. per-expert biases [n, n_expert].
    const float *f32_tensor(const std::string &name, std::vector<int64_t> ne, bool optional = false);
    /// The {arch}.rope.scaling.* values an architecture may need beyond hp().rope_yarn (deepseek2's score scale).
    struct RopeScaling {
        double factor = 1.0;          // rope.scaling.factor (1 without YaRN)
        double attn_factor = 1.0;     // rope.scaling.attn_factor
        double mscale_all_dim = 0.0;  // rope.scaling.yarn_log_multiplier / 0.1
    };
    /// {arch}.rope.scaling.*: type none (or absent) or yarn; anything else, a factor below 1 or a length that is
    /// not positive throws Error naming the file and key. For yarn, sets hp().rope_yarn (factor,
    /// original_context_length, yarn_beta_fast / _slow, yarn_ext_factor) with cos/sin scaled as llama.cpp's
    /// llama_context does (ggml's own 1 + 0.1 ln(factor) folded in): rope.scaling.attn_factor x (1 + 0.1
    /// ln(factor)) without rope.scaling.yarn_log_multiplier, attn_factor alone with it (llama.cpp's deepseek2
    /// case, [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]).
    RopeScaling read_rope_scaling();
    /// Binds token embedding, output norm and output head (falls back to tied embeddings).
    void bind_embeddings();
    /// Binds attention tensors of layer il (norm, q/k/v/o, biases per hp().qkv_bias / attn_out_bias, q/k norms
    /// per hp().qk_norm, sinks per hp().attn_sinks).
    void bind_attention(int64_t il);
    /// Binds the MoE block of layer il (the norm blk.N.<norm>.weight, router, experts, their biases if
    /// hp().moe_bias, shared expert if hp().shared_expert, its gate if hp().shared_expert_gate).
    void bind_moe(int64_t il, const std::string &norm = "ffn_norm");
    /// n F32 values owned by the model, zeroed: weights an architecture derives at load (arch/deepseek2.cpp).
    float *owned_f32(size_t n);
    /// Whether matrix() or vector() bound the tensor `name` (Model::load refuses files with unbound tensors).
    bool used(const std::string &name) const { return used_.count(name) != 0; }

  private:
    Model &m_;
    const GgufFile &f_;
    std::set<std::string> used_;
};

/// One supported architecture: its GGUF name and the function that fills HParams/ModelWeights.
struct ArchInfo {
    const char *name;
    void (*load)(ArchLoader &);
};
/// The registry (arch/arch.cpp); each architecture file defines its loader.
const std::vector<ArchInfo> &arch_registry();

void load_qwen3moe(ArchLoader &l);
void load_qwen2moe(ArchLoader &l);
void load_mixtral(ArchLoader &l);
void load_olmoe(ArchLoader &l);
void load_deepseek2(ArchLoader &l);
void load_gpt_oss(ArchLoader &l);

} // namespace prescope

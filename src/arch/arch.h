// Model architectures: hyper-parameters, weight bindings and the registry of supported GGUF
// architectures (qwen3moe, qwen2moe, llama-with-experts = Mixtral, olmoe). One file per architecture
// (docs/style R2) fills these structs; the forward pass (runtime/context) reads only the flags.
#pragma once

#include "backend/cpu/ops.h"
#include "core/tensor.h"
#include "format/gguf.h"

#include <cstdint>
#include <memory>
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
    bool shared_expert = false;   // qwen2moe: shared expert scaled by sigmoid(ffn_gate_inp_shexp . x)
    bool norm_topk_prob = false;  // renormalise the k routing weights to sum 1 (HF norm_topk_prob)
};

/// Weights of one transformer block. 1-D weights are F32 pointers (converted once at load when the
/// file stores them in another dtype); matrices are views into the mapping. Optional ones are empty.
struct LayerWeights {
    const float *attn_norm = nullptr;   // [n_embd]
    TensorView wq, wk, wv, wo;          // [n_embd -> n_head*head_dim], [n_embd -> n_head_kv*head_dim] x2, [n_head*head_dim -> n_embd]
    const float *bq = nullptr, *bk = nullptr, *bv = nullptr;  // qkv_bias only
    const float *q_norm = nullptr, *k_norm = nullptr;         // qk_norm only
    const float *ffn_norm = nullptr;    // [n_embd]
    TensorView gate_inp;                // router: [n_embd -> n_expert]
    TensorView gate_exps, up_exps;      // [n_embd, n_ff_exp, n_expert]
    TensorView down_exps;               // [n_ff_exp, n_embd, n_expert]
    TensorView gate_shexp, up_shexp;    // [n_embd -> n_ff_shexp] (shared_expert only)
    TensorView down_shexp;              // [n_ff_shexp -> n_embd]
    const float *gate_inp_shexp = nullptr;  // [n_embd]: shared-expert gate vector
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
    /// Binds token embedding, output norm and output head (falls back to tied embeddings).
    void bind_embeddings();
    /// Binds attention tensors of layer il (norm, q/k/v/o, biases, q/k norms per hp().qk_norm).
    void bind_attention(int64_t il);
    /// Binds the MoE block of layer il (ffn_norm, router, experts, shared expert if hp().shared_expert).
    void bind_moe(int64_t il);
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

} // namespace prescope

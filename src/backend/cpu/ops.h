// CPU kernels: the operations of a MoE transformer forward pass on F32 activations.
// Weights may be of any core/dtype.h weight type (read in place from the mapping). Threaded with OpenMP;
// SIMD paths chosen at run time from the CPU's features. Reference semantics: HF transformers
// (modeling_qwen3_moe.py, modeling_mixtral.py) and ggml (ggml-cpu/ops.cpp).
#pragma once

#include "core/dtype.h"
#include "core/tensor.h"

#include <cstdint>
#include <string>
#include <vector>

namespace prescope::cpu {

/// Sets the number of threads the kernels use (OpenMP and OpenBLAS). n <= 0: physical_cores().
void set_threads(int n);
/// Threads the kernels use now.
int get_threads();
/// Physical cores this process may use: the distinct (package, core) pairs of the CPUs in its affinity mask
/// (/sys topology; the CPU count when that is unreadable, hardware_concurrency without a mask), at most the
/// cgroup CPU quota (cgroup_cpu_limit()). Computed once.
int physical_cores();
/// CPUs the cgroup CPU quota of this process allows, rounded up (cgroup v2 cpu.max "quota period", v1
/// cpu.cfs_quota_us / cpu.cfs_period_us; the lowest over the cgroup and its parents), or 0 when there is no
/// quota. The paths are parameters for tests.
int cgroup_cpu_limit(const std::string &proc_self_cgroup = "/proc/self/cgroup",
                     const std::string &cgroup_root = "/sys/fs/cgroup");

/// Instruction sets of the kernels' inner loops, in increasing order. Chosen at run time from the
/// CPU's features (docs/decisions/0010-cpu-kernels.md); every op gives the same results on each up to
/// F32 rounding.
enum class CpuIsa {
    SCALAR,  // portable C++
    AVX2,    // AVX2 + FMA + F16C
    AVX512,  // AVX-512 F, BW, VL, VNNI (+ the AVX2 set)
};
/// Best ISA this CPU (and OS) supports.
CpuIsa cpu_isa_supported();
/// ISA the kernels use now: cpu_isa_supported(), or lower when set_cpu_isa or the environment
/// variable PRESCOPE_CPU_ISA (scalar, avx2, avx512) asked for it.
CpuIsa get_cpu_isa();
/// Selects the ISA (tests and benchmarks compare them). Throws Error if the CPU lacks it.
void set_cpu_isa(CpuIsa isa);
/// "scalar", "avx2", "avx512".
const char *cpu_isa_name(CpuIsa isa);

/// y[t][o] = sum_i W[o][i] * x[t][i] for t < n_tok, o < n_out.
/// W: n_out rows of n_in elements of dtype `type`, packed (row o at w + o * dtype_row_bytes(type, n_in));
/// n_in must be a multiple of the dtype's block size. x: [n_tok][n_in] F32, y: [n_tok][n_out] F32
/// (overwritten). For quantized weights under ActivationQuant::INT8 (core/dtype.h, the default) each
/// token's x is quantized to vec_dot_type(type) first, as llama.cpp does, on every path; otherwise the
/// weights are dequantized and x stays F32.
/// Threaded over output rows; safe to call from inside an OpenMP parallel region (runs serially).
void matmul(DType type, const void *w, int64_t n_in, int64_t n_out, const float *x, int64_t n_tok, float *y);

/// One product of a batched matmul: y = W x with W at w (n_out rows), x: [n_tok][n_in], y: [n_tok][n_out].
struct MatmulJob {
    const void *w;     // weights (e.g. one expert's matrix inside the mapping)
    const float *x;    // [n_tok][n_in] F32
    int64_t n_tok;     // may be 0 (job skipped)
    float *y;          // [n_tok][n_out] F32, overwritten
};
/// Batch-invariant kernels (ContextParams::deterministic, docs/decisions/0111-batch-invariance.md): while one
/// lives on a thread, matmul and matmul_batch called from that thread take the GEMM path for every job (own
/// GEMM, never OpenBLAS: one FMA chain per output, over the inputs in order, whatever n_tok), and attention runs
/// the query heads of each KV head in one task whatever n_tok and the thread count. A token's outputs are then
/// bit-identical whatever the other tokens of the call. Nests; `on` false does nothing.
class BatchInvariantScope {
  public:
    explicit BatchInvariantScope(bool on = true);
    ~BatchInvariantScope();
    BatchInvariantScope(const BatchInvariantScope &) = delete;
    BatchInvariantScope &operator=(const BatchInvariantScope &) = delete;

  private:
    bool on_;
};
/// Whether a BatchInvariantScope is alive on this thread.
bool batch_invariant();

/// Several matmuls of one dtype and shape (e.g. the experts of one layer, each with the tokens
/// routed to it) in one parallel region, the rows of all jobs shared out among the threads. Same
/// results as calling matmul once per job. Safe inside an OpenMP parallel region (runs serially).
void matmul_batch(DType type, int64_t n_in, int64_t n_out, const MatmulJob *jobs, int64_t n_jobs);

/// matmul over matrix m of a weight tensor (ne[0] = n_in, ne[1] = n_out).
inline void matmul(const TensorView &w, const float *x, int64_t n_tok, float *y, int64_t m = 0) {
    matmul(w.type, w.matrix(m), w.ne[0], w.ne[1], x, n_tok, y);
}

/// y[t][o] += b[o] for a bias b of n_out F32 values.
void add_bias(float *y, const float *b, int64_t n_tok, int64_t n_out);

/// Writes n F32 values as a row of dtype t (dtype_row_bytes(t, n) bytes at dst) with core/dtype.h's
/// conversions (F16/BF16 round to nearest even; Q8_0 as ggml quantize_row_q8_0_ref; n % 32 == 0
/// for Q8_0). The inverse of dequantize_row up to rounding; for tests, benchmarks and tools. Other
/// dtypes throw Error (PreScope does not write them; llama-quantize does).
void convert_row_from_f32(DType t, const float *src, void *dst, int64_t n);

/// Embedding lookup: out[t] = row ids[t] of `table` (ne[0] = n_embd, ne[1] = n_vocab), as F32.
/// ids must be < ne[1] (callers validate token ids first).
void get_rows(const TensorView &table, const int32_t *ids, int64_t n_tok, float *out);

/// RMSNorm (HF Qwen3MoeRMSNorm / ggml_rms_norm then mul): y = x / sqrt(mean(x^2) + eps) * w,
/// over n_rows rows of n elements each. w: n F32 values. y may alias x.
void rms_norm(const float *x, const float *w, int64_t n_rows, int64_t n, float eps, float *y);

/// Rotary position embedding variants (llama.cpp LLAMA_ROPE_TYPE_NORM / NEOX).
enum class RopeMode {
    NORM,  // rotates pairs (x[2i], x[2i+1]) (llama, Mixtral GGUF with permuted q/k)
    NEOX,  // rotates pairs (x[i], x[i + d/2]) (HF rotate_half: Qwen2/3-MoE, OLMoE)
};
/// YaRN RoPE scaling (arXiv 2309.00071; ggml rope_yarn, HF _compute_yarn_parameters): each pair's frequency
/// blends the original one (extrapolation) and freq_scale times it (interpolation) by a ramp over the pair index
/// between the correction dims of beta_fast and beta_slow rotations in n_ctx_orig positions (floor / ceil,
/// clamped to [0, head_dim - 1]); ext_factor scales the ramp; cos and sin are multiplied by mscale.
struct RopeYarn {
    float freq_scale = 1.0f;  // 1 / rope.scaling.factor
    int64_t n_ctx_orig = 0;   // rope.scaling.original_context_length
    float beta_fast = 32.0f, beta_slow = 1.0f;
    float ext_factor = 1.0f;
    float mscale = 1.0f;
};
/// The inverse frequency of each pair i < head_dim/2, in F32 as HF computes them (1 / base^(2i/head_dim)), or the
/// YaRN blend of them when yarn is given. The one table cpu::rope and cuda::rope (uploaded) turn by.
std::vector<float> rope_inv_freq(int64_t head_dim, float freq_base, const RopeYarn *yarn = nullptr);
/// Rotates x: [n_tok][n_head][head_dim] in place; token t sits at position pos[t].
/// theta_i = pos * rope_inv_freq(...)[i], i < head_dim/2; cos and sin times yarn->mscale when yarn is given.
void rope(float *x, int64_t n_tok, int64_t n_head, int64_t head_dim, const int32_t *pos, float freq_base,
          RopeMode mode, const RopeYarn *yarn = nullptr);

/// Causal grouped-query attention of n_tok new queries at positions [pos0, pos0 + n_tok).
/// q: [n_tok][n_head][head_dim]; k_cache, v_cache: [>= pos0 + n_tok][n_head_kv][head_dim] holding
/// every position up to pos0 + n_tok - 1; out: [n_tok][n_head][head_dim].
/// Query head h uses KV head h / (n_head / n_head_kv). scores = q.k * scale, softmax in F32.
/// Options (gpt-oss; HF GptOssAttention / eager_attention_forward, llama.cpp LLAMA_SWA_TYPE_STANDARD):
/// sinks: [n_head] F32 logits, one per query head, that join each row's softmax denominator as an extra
/// (unscaled) score with no value: out = sum_j exp(s_j) v_j / (exp(sink) + sum_j exp(s_j)). null: none.
/// window > 0: the query at position p sees only positions (p - window, p] (sliding window); 0: all of [0, p].
void attention(const float *q, const float *k_cache, const float *v_cache, int64_t n_tok, int64_t pos0,
               int64_t n_head, int64_t n_head_kv, int64_t head_dim, float scale, float *out,
               const float *sinks = nullptr, int64_t window = 0);

/// In-place softmax over each of n_rows rows of n values (max-subtracted, F32).
void softmax(float *x, int64_t n_rows, int64_t n);

/// out[i] = silu(gate[i]) * up[i], silu(x) = x / (1 + exp(-x)); n elements. out may alias gate.
void swiglu(const float *gate, const float *up, float *out, int64_t n);

/// gpt-oss's clamped SwiGLU (HF GptOssExperts, ggml swiglu_oai): with g = min(gate[i], limit) and
/// u = clamp(up[i], -limit, limit), out[i] = g * sigmoid(alpha * g) * (u + 1); n elements, F32. out may alias
/// gate. gpt-oss uses alpha 1.702 and limit 7 (kSwigluOaiAlpha / kSwigluOaiLimit).
void swiglu_oai(const float *gate, const float *up, float *out, int64_t n, float alpha, float limit);
/// The constants llama.cpp's LLM_FFN_SWIGLU_OAI_MOE and HF GptOssExperts (alpha; config swiglu_limit) use.
constexpr float kSwigluOaiAlpha = 1.702f;
constexpr float kSwigluOaiLimit = 7.0f;

/// The k largest of n scores: ids in descending score order (ties: lower index first), values too.
void top_k(const float *scores, int64_t n, int64_t k, int32_t *ids, float *values);

/// How a router turns gate logits into the scores its weights come from (arch/arch.h ExpertGating).
enum class RouterScore : uint8_t {
    SOFTMAX,  // softmax over all experts (Qwen, Mixtral, OLMoE, DeepSeek-V2)
    SIGMOID,  // per-expert sigmoid (DeepSeek-V3)
    LOGITS,   // the logits themselves (gpt-oss, with softmax_topk)
};

/// A router's steps after the gate matmul, as data (runtime/moe.h router_spec builds it from a model). The bias
/// pointers live where the router runs (host memory for cpu::route, device memory for cuda::router_topk).
struct RouterSpec {
    RouterScore score = RouterScore::SOFTMAX;
    const float *logit_bias = nullptr;   // [n_expert] added to the logits first (ffn_gate_inp.bias), or null
    const float *select_bias = nullptr;  // [n_expert] added to the scores for choosing only (exp_probs_b), or null
    int n_group = 1, n_group_used = 1;   // choose only among the n_group_used groups whose two best scores sum highest
    bool softmax_topk = false;           // weights = softmax over the k chosen (HF GptOssTopKRouter)
    bool renorm = false;                 // weights divided by their sum, summed in top-k order (norm_topk_prob)
    float scale = 1.0f;                  // weights times this, last (expert_weights_scale)
};

/// Routes n_tok tokens (HF Qwen3MoeSparseMoeBlock, DeepseekV3TopkRouter, GptOssTopKRouter; llama.cpp
/// build_moe_ffn): scores v = score(logits + logit_bias) in F32, written over `logits` ([n_tok][n_expert]);
/// choosing scores c = v + select_bias, -inf outside the n_group_used groups (of n_expert / n_group consecutive
/// experts) with the largest sums of their two best c; ids = the k largest c (top_k's order); weights = those
/// experts' v, then softmax_topk, renorm and scale in that order. ids, weights: [n_tok][k]. n_expert <= 1024.
void route(const RouterSpec &spec, float *logits, int64_t n_tok, int64_t n_expert, int64_t k, int32_t *ids,
           float *weights);

} // namespace prescope::cpu

// MoE routing on the GPU: the router's softmax + top-k + renormalisation in one kernel, and the
// weighted combination of the expert outputs of each token.
#pragma once

#include "backend/cpu/ops.h"

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prescope::cuda {

using RouterScore = cpu::RouterScore;
using RouterSpec = cpu::RouterSpec;

/// Router of one MoE layer from its gate logits (moe_route after the gate matmul; llama.cpp build_moe_ffn, HF
/// Qwen3MoeSparseMoeBlock, DeepseekV3TopkRouter, GptOssTopKRouter): scores v = score(logits + logit_bias) in F32;
/// choosing scores c = v + select_bias, set to -inf outside the kept groups; ids = the k largest c in descending
/// order (ties to the lower id, NaN below every number: cpu::top_k's order); weights = those experts' v, then
/// softmax_topk, renorm and scale in that order. probs: [n_tok][n_expert] receives v (or nullptr: not written).
/// logits: [n_tok][n_expert] F32; ids: [n_tok][k] int32; weights: [n_tok][k] F32; all on the device.
/// n_expert <= 1024, k <= min(32, n_expert); groups: n_group <= 32 dividing n_expert into groups of >= 2 (others
/// throw Error). Asynchronous on `stream`.
void router_topk(const float *logits, int64_t n_tok, int64_t n_expert, int64_t k, const RouterSpec &spec,
                 float *probs, int32_t *ids, float *weights, cudaStream_t stream);

/// A decode pass's router in one launch (decision 0143): the MoE block's RMSNorm, the F32 router matmul and
/// router_topk. All pointers on the device.
struct MoeRouterArgs {
    const float *x = nullptr;      // [n_tok][n_embd] residual stream
    const float *norm = nullptr;   // [n_embd] the block's RMSNorm weights
    float eps = 0.0f;
    float *h = nullptr;            // [n_tok][n_embd] out: the normalized rows (the experts' input)
    const float *w = nullptr;      // [n_expert][n_embd] F32 router matrix
    float *logits = nullptr;       // [n_tok][n_expert] out
    int32_t *ids = nullptr;        // [n_tok][k] out, as router_topk
    float *weights = nullptr;      // [n_tok][k] out
    unsigned *counter = nullptr;   // one word, 0 before the call and after it (the launch's block tickets)
    int64_t n_tok = 0, n_embd = 0;
    int32_t n_expert = 0, k = 0;
};

/// Most tokens moe_router takes (its last block routes them all).
constexpr int64_t kMoeRouterMaxTokens = 8;
/// Widest rows moe_router takes: each block holds one normalized row in shared memory (32 KiB at most, beside the
/// 8 KiB of the slot resolution's scans, within the 48 KiB a launch gets without opting in).
constexpr int64_t kMoeRouterMaxEmbd = 8192;

/// out[t] = sum_{j < k} weights[t][j] * y[pair_ids[t][j]] for t < n_tok, summed from 0 in ascending j (the
/// top-k order the CPU executor sums in); with `residual` ([n_tok][n_embd], may be out itself), out[t] =
/// residual[t] + that sum, rounded as cuda::add rounds it (the MoE output onto the residual stream).
/// pair_ids[t][j] < 0 skips that slot (its expert ran elsewhere, e.g. on the CPU, and the caller adds
/// its share). y: [n_pairs][n_embd] expert outputs in pair order (expert_matmul's y); out:
/// [n_tok][n_embd]; pair_ids, weights: [n_tok][k]; all F32/int32 on the device; out must not alias y.
/// Asynchronous on `stream`.
void moe_combine(const float *y, const int32_t *pair_ids, const float *weights, int64_t n_tok, int64_t k,
                 int64_t n_embd, const float *residual, float *out, cudaStream_t stream);

/// y[p][i] += bias_g[i] for every pair p of group g (p in [offsets[g], offsets[g + 1])) and i < n, where bias_g is
/// the F32 vector at byte `bias_offset` from base[g]: the biases an expert carries in its slot (ExpertLayout's
/// bias part; gpt-oss). base: device [n_groups] (each group's expert bytes, e.g. its gate matrix pointer);
/// offsets: device [n_groups + 1] (empty groups past the last allowed, as device-resolved groups have); y:
/// [n_pairs][n] F32. Asynchronous on `stream`.
void add_group_bias(float *y, int64_t n, const void *const *base, uint64_t bias_offset, const int32_t *offsets,
                    int64_t n_groups, cudaStream_t stream);

/// The device-resolved hit path (issue 14): the experts of one layer that the device runs without the host.
struct DeviceHitsArgs {
    const void **table = nullptr;      // device [n_layers * n_expert]: each expert's slot bytes, or nullptr
    int64_t layer = 0;
    int32_t n_expert = 0;              // <= 1024
    const int32_t *ids = nullptr;      // device [n_tok][k]: the layer's routed experts
    int64_t n_tok = 0, k = 0;
    int64_t up_offset = 0, down_offset = 0;  // bytes from an expert's start to its up and down matrices
    // Outputs, device: n_groups = min(n_expert, n_tok * k) groups, n_tok * k pairs.
    const void **gate_w = nullptr, **up_w = nullptr, **down_w = nullptr;  // [n_groups]
    int32_t *offsets = nullptr;        // [n_groups + 1]
    int32_t *rows = nullptr;           // [n_tok * k]
    // The combine's arrays of a whole step (decision 0138), or pair_ids == nullptr: none. Column j < k of token t
    // is its pair of (t, j) and weights_in[t * k + j]; with k_comb == k + 1 column k is a shared expert's row
    // n_tok * k + t at weight 1 (ungated). Every routed expert's entry must be set.
    const float *weights_in = nullptr;  // device [n_tok][k] routing weights
    int32_t *pair_ids = nullptr;        // device [n_tok][k_comb]
    float *weights = nullptr;           // device [n_tok][k_comb]
    int64_t k_comb = 0;
};

/// Applies the updates table[index[i]] = data[i] (an expert's slot bytes, or nullptr: not resident for the device),
/// i < n_updates (host arrays, read before the call returns), to args.table in stream order, then lists the routed experts of args.layer whose table
/// entry is set, in ascending id, as groups of an ExpertMatmul whose offsets live on the device only: group g
/// = the g-th such expert, its pairs its (token, slot) pairs in token order (rows = the token), pairs numbered
/// from 0 group by group; groups past the last are empty (offsets = the pair count), rows past the last pair
/// are 0. This is the layout HybridMoe::build_step gives device hits. With n_tok == 0 only the updates apply.
/// Asynchronous on `stream`; any number of updates (a launch per 64).
void resolve_device_hits(const DeviceHitsArgs &args, const int32_t *index, const void *const *data, int64_t n_updates,
                         cudaStream_t stream);

/// h = rms_norm(x, norm, eps); logits = h W^T; ids, weights = router_topk(logits, spec): bit for bit those three
/// calls (rms_norm; matmul's GEMV path, F32 weights; router_topk without probs). n_tok in
/// [1, kMoeRouterMaxTokens], n_embd a multiple of 8 and at most kMoeRouterMaxEmbd (else throws Error), w 16-byte
/// aligned; n_expert, k and spec as router_topk requires (else throws Error). Calls on one counter must not overlap
/// (one stream). Asynchronous on `stream`.
/// With `resolve`, then resolve_device_hits(*resolve, index, data, n_updates) (its ids and weights_in may be the
/// ones this call writes): in the router's own launch, by its last block, when the updates fit one batch (64) and
/// n_expert <= 4 x the block (row_threads(n_embd)); else as resolve_device_hits' own launches after it. The
/// results are the same either way; the fused form saves the launch and its place in the stream's chain (issue 14).
void moe_router(const MoeRouterArgs &args, const RouterSpec &spec, cudaStream_t stream,
                const DeviceHitsArgs *resolve = nullptr, const int32_t *index = nullptr,
                const void *const *data = nullptr, int64_t n_updates = 0);

} // namespace prescope::cuda

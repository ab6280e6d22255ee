// deepseek2 (DeepSeek-V2/V2-Lite, V3/R1, Kimi-K2): multi-head latent attention (MLA), leading dense layers,
// routed experts with softmax or sigmoid scores, a selection bias and group-limited top-k, plus ungated shared
// experts. Keys and tensors as llama.cpp writes them (conversion/deepseek.py DeepseekV2Model,
// src/models/deepseek2.cpp); the formulas of HF DeepseekV3Attention / DeepseekV3MoE. RoPE is NORM (interleaved
// pairs) on the rope part of each head, in HF's own weight order (HF rotates interleaved pairs too).
#include "arch/arch.h"

#include "core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace prescope {

namespace {

/// llama.cpp LLM_KV_EXPERT_GATING_FUNC values.
ExpertGating gating_of(const GgufFile &f, const std::string &key) {
    const uint32_t v = f.get_u32_or(key, 1);  // absent: softmax, as llama.cpp assumes for DeepSeek-V2 files
    if (v == 1) return ExpertGating::SOFTMAX;
    if (v == 2) return ExpertGating::SIGMOID;
    fail("{}: metadata '{}' is {}, expected 1 (softmax) or 2 (sigmoid)", f.path(), key, v);
}

/// The second dimension of tensor `name` must be what the key gives: names the key, not just the shape.
void check_rows(const GgufFile &f, const std::string &name, int64_t want, const std::string &from) {
    const GgufTensorInfo *t = f.find_tensor(name);
    if (t && t->ne.size() >= 2 && t->ne[1] != want) {
        fail("{}: tensor '{}' has {} rows, but {} gives {}", f.path(), name, t->ne[1], from, want);
    }
}

/// Legacy files: attn_kv_b (HF kv_b_proj: per head nope key rows, then v value rows, of kv_lora_rank inputs)
/// split at load into F32 k_b (transposed per head) and v_b, as llama.cpp's converter splits it now (decision
/// 0120): n_head * (nope + v) * kv_lora_rank floats per layer owned by the model.
void split_kv_b(ArchLoader &l, LayerWeights &w, const TensorView &kv_b) {
    const HParams &hp = l.hp();
    const int64_t r = hp.kv_lora_rank, nope = hp.head_dim_nope, dv = hp.head_dim_v, n_head = hp.n_head;
    float *k_b = l.owned_f32(size_t(n_head * r * nope)), *v_b = l.owned_f32(size_t(n_head * dv * r));
    std::vector<float> row(static_cast<size_t>(r));
    for (int64_t h = 0; h < n_head; ++h) {
        for (int64_t i = 0; i < nope + dv; ++i) {
            dequantize_row(kv_b.type, kv_b.row(h * (nope + dv) + i), row.data(), r);
            if (i < nope) {
                for (int64_t c = 0; c < r; ++c) k_b[(h * r + c) * nope + i] = row[size_t(c)];
            } else {
                std::copy(row.begin(), row.end(), v_b + (h * dv + i - nope) * r);
            }
        }
    }
    const auto view = [](const float *data, int64_t n_in, int64_t n_out, int64_t n_mat) {
        TensorView v;
        v.type = DType::F32;
        v.ne = {n_in, n_out, n_mat, 1};
        v.data = data;
        return v;
    };
    w.wk_b = view(k_b, nope, r, n_head);
    w.wv_b = view(v_b, r, dv, n_head);
}

} // namespace

void load_deepseek2(ArchLoader &l) {
    HParams &hp = l.hp();
    const GgufFile &f = l.file();
    const std::string a = "deepseek2";
    hp.mla = true;
    hp.rope_mode = cpu::RopeMode::NORM;
    l.read_common_hparams();

    // Attention: llama.cpp states the MQA view (one KV head of kv_lora_rank + rope) in key_length/value_length
    // and the per-head sizes in the *_mla keys.
    hp.q_lora_rank = int64_t(f.get_u32_or(a + ".attention.q_lora_rank", 0));
    hp.kv_lora_rank = int64_t(f.get_u64(a + ".attention.kv_lora_rank"));
    hp.head_dim_rope = int64_t(f.get_u64(a + ".rope.dimension_count"));
    // Files from before llama.cpp split attn_kv_b (April 2025) have no *_mla keys: key/value_length are the
    // per-head sizes there, and head_count_kv is the head count.
    const bool legacy = !f.has(a + ".attention.key_length_mla");
    const int64_t key_length = int64_t(f.get_u64(a + ".attention.key_length"));
    const int64_t value_length = int64_t(f.get_u64(a + ".attention.value_length"));
    const int64_t head_k = legacy ? key_length : int64_t(f.get_u64(a + ".attention.key_length_mla"));
    hp.head_dim_v = legacy ? value_length : int64_t(f.get_u64(a + ".attention.value_length_mla"));
    hp.head_dim_nope = head_k - hp.head_dim_rope;
    if (legacy) hp.n_head_kv = 1;  // computed as MQA over the latent like the split layout
    if (hp.n_head_kv != 1 || hp.kv_lora_rank <= 0 || hp.head_dim_rope <= 0 || hp.head_dim_rope % 2 != 0 ||
        hp.head_dim_nope <= 0 || hp.head_dim_v <= 0 ||
        (!legacy && (key_length != hp.kv_lora_rank + hp.head_dim_rope || value_length != hp.kv_lora_rank))) {
        fail("{}: inconsistent MLA shape: head_count_kv {}, kv_lora_rank {}, rope.dimension_count {} (even), "
             "key_length_mla {}, value_length_mla {}, key_length {}, value_length {} (expected head_count_kv 1, "
             "key_length = kv_lora_rank + rope, value_length = kv_lora_rank, key_length_mla > rope)",
             f.path(), hp.n_head_kv, hp.kv_lora_rank, hp.head_dim_rope, head_k, hp.head_dim_v, key_length,
             value_length);
    }
    hp.head_dim = hp.kv_lora_rank + hp.head_dim_rope;
    // YaRN as llama.cpp runs deepseek2 (llama-context.cpp, src/models/deepseek2.cpp [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]):
    // cos/sin times rope.scaling.attn_factor (read_rope_scaling), scores times mscale^2 with mscale = attn_factor *
    // (1 + 0.1 * mscale_all_dim * ln(factor)); the file stores 0.1 * mscale_all_dim as yarn_log_multiplier. Equal
    // to HF DeepseekV3 when mscale == mscale_all_dim (DeepSeek-V2-Lite, V3, Kimi-K2), which our converter requires.
    const ArchLoader::RopeScaling yarn = l.read_rope_scaling();
    const float mscale = float(yarn.attn_factor * (1.0 + 0.1 * yarn.mscale_all_dim * std::log(yarn.factor)));  // 1 without YaRN
    hp.kq_scale = mscale * mscale / std::sqrt(float(head_k));

    // Experts.
    hp.n_layer_dense = int64_t(f.get_u32_or(a + ".leading_dense_block_count", 0));
    if (hp.n_layer_dense >= hp.n_layer) {
        fail("{}: metadata '{}.leading_dense_block_count' is {}, expected fewer than the {} blocks", f.path(), a,
             hp.n_layer_dense, hp.n_layer);
    }
    if (hp.n_layer_dense > 0) hp.n_ff = int64_t(f.get_u64(a + ".feed_forward_length"));
    const int64_t n_shared = int64_t(f.get_u32_or(a + ".expert_shared_count", 0));
    hp.shared_expert = n_shared > 0;
    hp.n_ff_shexp = n_shared * hp.n_ff_exp;  // the shared experts are stored as one FFN of n_shared * n_ff_exp rows
    hp.norm_topk_prob = f.get_bool_or(a + ".expert_weights_norm", false);
    const double scale = f.get_f64_or(a + ".expert_weights_scale", 0.0);
    hp.expert_weights_scale = scale == 0.0 ? 1.0f : float(scale);  // llama.cpp: 0 (absent) means no scaling
    hp.expert_gating = gating_of(f, a + ".expert_gating_func");
    hp.n_expert_group = int64_t(f.get_u32_or(a + ".expert_group_count", 1));
    hp.n_expert_group_used = int64_t(f.get_u32_or(a + ".expert_group_used_count", hp.n_expert_group));
    if (hp.n_expert_group <= 0 || hp.n_expert % hp.n_expert_group != 0 || hp.n_expert_group_used <= 0 ||
        hp.n_expert_group_used > hp.n_expert_group ||
        hp.n_expert_used > hp.n_expert_group_used * (hp.n_expert / hp.n_expert_group) ||
        (hp.n_expert_group > 1 && hp.n_expert / hp.n_expert_group < 2)) {
        fail("{}: metadata '{}.expert_group_count' {} and '{}.expert_group_used_count' {} do not fit expert_count "
             "{} and expert_used_count {} (expected groups dividing the experts, at least 2 experts a group, "
             "1 <= groups used <= groups, top-k <= experts in the groups used)",
             f.path(), a, hp.n_expert_group, a, hp.n_expert_group_used, hp.n_expert, hp.n_expert_used);
    }

    l.bind_embeddings();
    const int64_t n_q = hp.n_head * (hp.head_dim_nope + hp.head_dim_rope);
    const std::string kv_from =
        fmt::format("'{}.attention.kv_lora_rank' {} + '{}.rope.dimension_count' {}", a, hp.kv_lora_rank, a,
                    hp.head_dim_rope);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        LayerWeights &w = l.w().layers[size_t(il)];
        const std::string p = fmt::format("blk.{}.", il);
        w.attn_norm = l.vector(p + "attn_norm.weight", hp.n_embd);
        if (hp.q_lora_rank > 0) {
            w.wq_a = l.matrix(p + "attn_q_a.weight", {hp.n_embd, hp.q_lora_rank});
            w.q_a_norm = l.vector(p + "attn_q_a_norm.weight", hp.q_lora_rank);
            w.wq_b = l.matrix(p + "attn_q_b.weight", {hp.q_lora_rank, n_q});
        } else {
            w.wq = l.matrix(p + "attn_q.weight", {hp.n_embd, n_q});
        }
        check_rows(f, p + "attn_kv_a_mqa.weight", hp.kv_lora_rank + hp.head_dim_rope, kv_from);
        w.wkv_a_mqa = l.matrix(p + "attn_kv_a_mqa.weight", {hp.n_embd, hp.kv_lora_rank + hp.head_dim_rope});
        w.kv_a_norm = l.vector(p + "attn_kv_a_norm.weight", hp.kv_lora_rank);
        if (legacy) {
            split_kv_b(l, w, l.matrix(p + "attn_kv_b.weight", {hp.kv_lora_rank, hp.n_head * (hp.head_dim_nope + hp.head_dim_v)}));
        } else {
            w.wk_b = l.matrix(p + "attn_k_b.weight", {hp.head_dim_nope, hp.kv_lora_rank, hp.n_head});
            w.wv_b = l.matrix(p + "attn_v_b.weight", {hp.kv_lora_rank, hp.head_dim_v, hp.n_head});
        }
        w.wo = l.matrix(p + "attn_output.weight", {hp.n_head * hp.head_dim_v, hp.n_embd});
        if (il < hp.n_layer_dense) {
            w.ffn_norm = l.vector(p + "ffn_norm.weight", hp.n_embd);
            w.ffn_gate = l.matrix(p + "ffn_gate.weight", {hp.n_embd, hp.n_ff});
            w.ffn_up = l.matrix(p + "ffn_up.weight", {hp.n_embd, hp.n_ff});
            w.ffn_down = l.matrix(p + "ffn_down.weight", {hp.n_ff, hp.n_embd});
        } else {
            l.bind_moe(il);
            w.exp_probs_b = l.vector(p + "exp_probs_b.bias", hp.n_expert, /*optional=*/true);
        }
    }
}

} // namespace prescope

// gpt-oss (OpenAI gpt-oss-20b / -120b; llama.cpp LLM_ARCH_OPENAI_MOE, src/models/openai-moe.cpp): biases on
// q/k/v/o, a learned sink logit per head in every attention softmax, a sliding window on the even layers,
// NEOX RoPE with YaRN, a biased router whose top-k logits are softmaxed (SOFTMAX_WEIGHT), biased experts with
// the clamped SwiGLU (swiglu_oai) and the FFN norm stored as post_attention_norm. Formulas of HF
// GptOssAttention / GptOssTopKRouter / GptOssExperts; decision 0140.
#include "arch/arch.h"

#include "core/error.h"

namespace prescope {

void load_gpt_oss(ArchLoader &l) {
    HParams &hp = l.hp();
    const GgufFile &f = l.file();
    hp.rope_mode = cpu::RopeMode::NEOX;
    hp.qkv_bias = true;
    hp.attn_out_bias = true;
    hp.attn_sinks = true;
    hp.moe_bias = true;
    hp.expert_gating = ExpertGating::SOFTMAX_WEIGHT;
    hp.expert_act = ExpertAct::SWIGLU_OAI;
    l.read_common_hparams();
    // Required, as llama.cpp's loader requires it; the pattern is fixed (llama.cpp set_swa_pattern(2)).
    const std::string swa_key = hp.arch + ".attention.sliding_window";
    hp.n_swa = int64_t(f.get_u32(swa_key));
    if (hp.n_swa <= 0) fail("{}: metadata '{}' is {}, expected a positive window", f.path(), swa_key, hp.n_swa);
    hp.swa_pattern = 2;
    // llama.cpp scales cos/sin by get_mscale(factor) / get_mscale(factor, mscale_all_dim) for such a key outside
    // deepseek2, which read_rope_scaling does not: no released gpt-oss file has one.
    if (l.read_rope_scaling().mscale_all_dim != 0.0) {
        fail("{}: metadata '{}.rope.scaling.yarn_log_multiplier' is not supported for gpt-oss (expected none)",
             f.path(), hp.arch);
    }
    l.bind_embeddings();
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        l.bind_attention(il);
        l.bind_moe(il, "post_attention_norm");
    }
}

} // namespace prescope

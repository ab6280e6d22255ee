// qwen2moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): QKV bias, NEOX RoPE, routed experts without
// renormalisation (HF norm_topk_prob=False) plus a shared expert scaled by
// sigmoid(ffn_gate_inp_shexp . x) (HF Qwen2MoeSparseMoeBlock; llama.cpp src/models/qwen2moe.cpp).
#include "arch/arch.h"

namespace prescope {

void load_qwen2moe(ArchLoader &l) {
    HParams &hp = l.hp();
    hp.rope_mode = cpu::RopeMode::NEOX;
    hp.qkv_bias = true;
    hp.shared_expert = true;
    hp.shared_expert_gate = true;
    hp.norm_topk_prob = false;
    l.load_standard();
}

} // namespace prescope

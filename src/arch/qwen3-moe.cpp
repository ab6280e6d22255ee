// qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): per-head RMSNorm on q and k, NEOX RoPE, no QKV bias,
// top-k weights renormalised (HF Qwen3MoeSparseMoeBlock with norm_topk_prob=True; llama.cpp
// src/models/qwen3moe.cpp always renormalises).
#include "arch/arch.h"

namespace prescope {

void load_qwen3moe(ArchLoader &l) {
    HParams &hp = l.hp();
    hp.rope_mode = cpu::RopeMode::NEOX;
    hp.qk_norm = QkNorm::PER_HEAD;
    hp.norm_topk_prob = true;
    l.load_standard();
}

} // namespace prescope

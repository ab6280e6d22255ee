// olmoe (OLMoE-1B-7B): RMSNorm over the whole q and k projections before NEOX RoPE, no bias,
// top-k weights not renormalised (HF OlmoeSparseMoeBlock, norm_topk_prob=False; llama.cpp
// src/models/olmoe.cpp).
#include "arch/arch.h"

namespace prescope {

void load_olmoe(ArchLoader &l) {
    HParams &hp = l.hp();
    hp.rope_mode = cpu::RopeMode::NEOX;
    hp.qk_norm = QkNorm::FULL;
    hp.norm_topk_prob = false;
    l.load_standard();
}

} // namespace prescope

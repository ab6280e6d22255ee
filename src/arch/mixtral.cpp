// Mixtral (GGUF architecture "llama" with experts): NORM RoPE on q/k weights that the converter
// permuted (convert_hf_to_gguf.py LlamaModel.permute), no QKV bias or q/k norm, top-k weights always
// renormalised (HF MixtralSparseMoeBlock).
#include "arch/arch.h"

#include "core/error.h"

namespace prescope {

void load_mixtral(ArchLoader &l) {
    HParams &hp = l.hp();
    hp.rope_mode = cpu::RopeMode::NORM;
    hp.norm_topk_prob = true;
    if (l.file().get_u32_or("llama.expert_count", 0) == 0) {
        fail("{}: architecture 'llama' without experts (llama.expert_count) is a dense model; PreScope runs "
             "Mixture-of-Experts models", l.file().path());
    }
    l.load_standard();
}

} // namespace prescope

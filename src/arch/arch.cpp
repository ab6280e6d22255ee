// Architecture registry, shared hyper-parameter reading and tensor binding with shape checks.
#include "arch/arch.h"

#include "core/error.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>

namespace prescope {

namespace {

/// Metadata value v of key `key` in `path` must be finite and above lo (at or above with `or_equal`): a NaN or a
/// negative frequency base or epsilon only shows later as NaN logits or, for YaRN's ramp, as silently other tokens.
void check_real(const std::string &path, const std::string &key, double v, double lo, bool or_equal) {
    if (std::isfinite(v) && (v > lo || (or_equal && v == lo))) return;
    fail("{}: metadata '{}' is {}, expected a finite value {} {}", path, key, v, or_equal ? ">=" : ">", lo);
}

} // namespace

const std::vector<ArchInfo> &arch_registry() {
    static const std::vector<ArchInfo> registry = {
        {"qwen3moe", load_qwen3moe},
        {"qwen2moe", load_qwen2moe},
        {"llama", load_mixtral},
        {"olmoe", load_olmoe},
        {"deepseek2", load_deepseek2},
        {"gpt-oss", load_gpt_oss},
    };
    return registry;
}

std::unique_ptr<Model> Model::load(const std::string &path) {
    std::unique_ptr<Model> m(new Model(path));
    const std::string arch = m->file_.get_str("general.architecture");
    const ArchInfo *info = nullptr;
    for (const auto &a : arch_registry()) {
        if (arch == a.name) info = &a;
    }
    if (!info) {
        std::vector<std::string> names;
        for (const auto &a : arch_registry()) names.emplace_back(a.name);
        fail("{}: unsupported architecture '{}' (supported: {})", path, arch, fmt::join(names, ", "));
    }
    m->hp_.arch = arch;
    ArchLoader loader(*m);
    info->load(loader);
    // A tensor the forward pass never reads means the file is for another model variant (or was edited):
    // running without it would give wrong text silently. llama.cpp refuses such files too.
    std::vector<std::string> unused;
    for (const GgufTensorInfo &t : m->file_.tensors()) {
        if (!loader.used(t.name)) unused.push_back(fmt::format("'{}'", t.name));
    }
    if (!unused.empty()) {
        const size_t shown = std::min<size_t>(unused.size(), 5);
        fail("{}: {} tensor{} that a {} model does not have: {}{}", path, unused.size(), unused.size() == 1 ? "" : "s",
             arch, fmt::join(unused.begin(), unused.begin() + ptrdiff_t(shown), ", "),
             unused.size() > shown ? fmt::format(" and {} more", unused.size() - shown) : std::string());
    }
    return m;
}

size_t Model::expert_bytes(int64_t layer) const {
    const LayerWeights &l = w_.layers.at(size_t(layer));
    return l.gate_exps.matrix_bytes() + l.up_exps.matrix_bytes() + l.down_exps.matrix_bytes();
}

void ArchLoader::read_common_hparams() {
    HParams &hp = m_.hp_;
    const std::string &a = hp.arch;
    hp.n_ctx_train = int64_t(f_.get_u64(a + ".context_length"));
    hp.n_embd = int64_t(f_.get_u64(a + ".embedding_length"));
    hp.n_layer = int64_t(f_.get_u64(a + ".block_count"));
    // Each block has a dozen tensors: a count beyond the file's tensors is corrupt, not a reason to allocate.
    if (hp.n_layer > int64_t(f_.tensors().size())) {
        fail("{}: metadata '{}.block_count' is {}, but the file holds only {} tensors", f_.path(), a, hp.n_layer,
             f_.tensors().size());
    }
    hp.n_head = int64_t(f_.get_u64(a + ".attention.head_count"));
    hp.n_head_kv = int64_t(f_.get_u32_or(a + ".attention.head_count_kv", uint32_t(hp.n_head)));
    const double eps = f_.get_f64(a + ".attention.layer_norm_rms_epsilon");
    check_real(f_.path(), a + ".attention.layer_norm_rms_epsilon", eps, 0.0, true);
    hp.rms_eps = float(eps);
    const double freq_base = f_.get_f64_or(a + ".rope.freq_base", 10000.0);
    check_real(f_.path(), a + ".rope.freq_base", freq_base, 0.0, false);
    hp.rope_freq_base = float(freq_base);
    hp.n_expert = int64_t(f_.get_u32_or(a + ".expert_count", 0));
    hp.n_expert_used = int64_t(f_.get_u32_or(a + ".expert_used_count", 0));
    if (hp.n_embd <= 0 || hp.n_layer <= 0 || hp.n_head <= 0 || hp.n_head_kv <= 0 || hp.n_head % hp.n_head_kv != 0) {
        fail("{}: invalid attention shape: n_embd {}, n_layer {}, n_head {}, n_head_kv {} (n_head must be a "
             "positive multiple of n_head_kv)", f_.path(), hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv);
    }
    hp.head_dim = int64_t(f_.get_u32_or(a + ".attention.key_length", uint32_t(hp.n_embd / hp.n_head)));
    const int64_t head_dim_v = int64_t(f_.get_u32_or(a + ".attention.value_length", uint32_t(hp.head_dim)));
    // MLA files state the cached latent row as key_length and its value part as value_length (arch/deepseek2.cpp).
    if (!hp.mla && (head_dim_v != hp.head_dim || hp.head_dim <= 0 || hp.head_dim % 2 != 0)) {
        fail("{}: unsupported head dims: key_length {}, value_length {} (expected equal and even)", f_.path(),
             hp.head_dim, head_dim_v);
    }
    if (hp.n_expert <= 0 || hp.n_expert_used <= 0 || hp.n_expert_used > hp.n_expert || hp.n_expert > kMaxExperts) {
        fail("{}: '{}' with expert_count {} and expert_used_count {} is not a supported MoE model (expected "
             "1 <= top-k <= experts <= {})", f_.path(), a, hp.n_expert, hp.n_expert_used, kMaxExperts);
    }
    const std::string ff_key = f_.has(a + ".expert_feed_forward_length") ? a + ".expert_feed_forward_length"
                                                                          : a + ".feed_forward_length";
    hp.n_ff_exp = int64_t(f_.get_u64(ff_key));
    hp.norm_topk_prob = f_.get_bool_or(a + ".expert_weights_norm", hp.norm_topk_prob);
    if (hp.shared_expert_gate) hp.n_ff_shexp = int64_t(f_.get_u64(a + ".expert_shared_feed_forward_length"));
}

void ArchLoader::load_standard() {
    read_common_hparams();
    bind_embeddings();
    for (int64_t il = 0; il < m_.hp_.n_layer; ++il) {
        bind_attention(il);
        bind_moe(il);
    }
}

namespace {

std::string shape_str(const std::vector<int64_t> &ne) {
    return fmt::format("[{}]", fmt::join(ne, ", "));
}

/// Shapes match up to trailing 1s, as llama_model_loader::check_tensor_dims accepts ([n] == [n, 1]:
/// converted Qwen2-MoE files store the shared-expert gate as [n_embd, 1]).
bool same_shape(std::vector<int64_t> a, std::vector<int64_t> b) {
    while (a.size() > 1 && a.back() == 1) a.pop_back();
    while (b.size() > 1 && b.back() == 1) b.pop_back();
    return a == b;
}

} // namespace

TensorView ArchLoader::matrix(const std::string &name, std::vector<int64_t> ne, bool optional) {
    const GgufTensorInfo *t = f_.find_tensor(name);
    if (!t) {
        if (optional) return {};
        fail("{}: missing tensor '{}' (expected shape {})", f_.path(), name, shape_str(ne));
    }
    used_.insert(name);
    if (!same_shape(t->ne, ne)) {
        fail("{}: tensor '{}' has shape {}, expected {}", f_.path(), name, shape_str(t->ne), shape_str(ne));
    }
    return f_.tensor_view(name);
}

const float *ArchLoader::vector(const std::string &name, int64_t n, bool optional) {
    return f32_tensor(name, {n}, optional);
}

const float *ArchLoader::f32_tensor(const std::string &name, std::vector<int64_t> ne, bool optional) {
    const TensorView v = matrix(name, ne, optional);
    if (v.empty()) return nullptr;
    if (v.type == DType::F32) return static_cast<const float *>(v.data);
    int64_t n = 1;
    for (int64_t d : ne) n *= d;
    std::vector<float> &buf = m_.converted_.emplace_back(size_t(n));
    dequantize_row(v.type, v.data, buf.data(), n);
    return buf.data();
}

ArchLoader::RopeScaling ArchLoader::read_rope_scaling() {
    const std::string a = m_.hp_.arch;
    RopeScaling r;
    const std::string scaling = f_.get_str_or(a + ".rope.scaling.type", "none");
    if (scaling == "none") return r;
    if (scaling != "yarn") {
        fail("{}: metadata '{}.rope.scaling.type' is '{}' (expected none or yarn)", f_.path(), a, scaling);
    }
    cpu::RopeYarn y;
    r.factor = f_.get_f64(a + ".rope.scaling.factor");
    y.n_ctx_orig = int64_t(f_.get_u64(a + ".rope.scaling.original_context_length"));
    if (!(r.factor >= 1.0) || y.n_ctx_orig <= 0) {
        fail("{}: YaRN with rope.scaling.factor {} and original_context_length {} (expected factor >= 1 and a "
             "positive length)", f_.path(), r.factor, y.n_ctx_orig);
    }
    y.freq_scale = float(1.0 / r.factor);
    const auto real = [&](const char *name, double fallback, double lo, bool or_equal) {
        const std::string key = a + ".rope.scaling." + name;
        const double v = f_.get_f64_or(key, fallback);
        check_real(f_.path(), key, v, lo, or_equal);
        return v;
    };
    y.beta_fast = float(real("yarn_beta_fast", 32.0, 0.0, false));
    y.beta_slow = float(real("yarn_beta_slow", 1.0, 0.0, false));
    y.ext_factor = float(real("yarn_ext_factor", 1.0, 0.0, true));
    r.attn_factor = real("attn_factor", 1.0, 0.0, false);
    const double log_mul = real("yarn_log_multiplier", 0.0, 0.0, true);
    r.mscale_all_dim = log_mul / 0.1;
    // llama.cpp (llama_context): yarn_attn_factor = get_mscale(factor) / (1 + 0.1 ln factor) x attn_factor, and
    // ggml's rope multiplies cos/sin by 1 + 0.1 ln factor again, so without a log multiplier they are scaled by
    // attn_factor x get_mscale(factor) (HF _compute_yarn_parameters' default attention_factor); deepseek2 files
    // carry the multiplier and get the ratio 1 there (its mscale goes to the scores, arch/deepseek2.cpp).
    const double get_mscale = 1.0 + 0.1 * std::log(r.factor);
    y.mscale = float(r.attn_factor * (log_mul == 0.0 ? get_mscale : 1.0));
    m_.hp_.rope_yarn = y;
    return r;
}

float *ArchLoader::owned_f32(size_t n) {
    return m_.converted_.emplace_back(n).data();
}

void ArchLoader::bind_embeddings() {
    HParams &hp = m_.hp_;
    const GgufTensorInfo *emb = f_.find_tensor("token_embd.weight");
    if (!emb) fail("{}: missing tensor 'token_embd.weight'", f_.path());
    if (emb->ne.size() != 2) {
        fail("{}: tensor 'token_embd.weight' has shape {}, expected [{}, n_vocab]", f_.path(), shape_str(emb->ne),
             hp.n_embd);
    }
    hp.n_vocab = emb->ne[1];
    ModelWeights &w = m_.w_;
    w.tok_embd = matrix("token_embd.weight", {hp.n_embd, hp.n_vocab});
    w.output_norm = vector("output_norm.weight", hp.n_embd);
    w.output = matrix("output.weight", {hp.n_embd, hp.n_vocab}, /*optional=*/true);
    if (w.output.empty()) w.output = w.tok_embd;
    w.layers.resize(size_t(hp.n_layer));
}

void ArchLoader::bind_attention(int64_t il) {
    const HParams &hp = m_.hp_;
    LayerWeights &l = m_.w_.layers[size_t(il)];
    const std::string p = fmt::format("blk.{}.", il);
    const int64_t n_q = hp.n_head * hp.head_dim, n_kv = hp.n_head_kv * hp.head_dim;
    l.attn_norm = vector(p + "attn_norm.weight", hp.n_embd);
    l.wq = matrix(p + "attn_q.weight", {hp.n_embd, n_q});
    l.wk = matrix(p + "attn_k.weight", {hp.n_embd, n_kv});
    l.wv = matrix(p + "attn_v.weight", {hp.n_embd, n_kv});
    l.wo = matrix(p + "attn_output.weight", {n_q, hp.n_embd});
    if (hp.qkv_bias) {
        l.bq = vector(p + "attn_q.bias", n_q);
        l.bk = vector(p + "attn_k.bias", n_kv);
        l.bv = vector(p + "attn_v.bias", n_kv);
    }
    if (hp.attn_out_bias) l.bo = vector(p + "attn_output.bias", hp.n_embd);
    if (hp.attn_sinks) {
        l.attn_sinks = vector(p + "attn_sinks.weight", hp.n_head);
        // One more score per head in every softmax: NaN or +inf there would turn every attention row into NaN
        // (-inf is a sink that takes nothing, and fine).
        for (int64_t h = 0; h < hp.n_head; ++h) {
            const float v = l.attn_sinks[h];
            if (std::isnan(v) || v == INFINITY) {
                fail("{}: tensor '{}attn_sinks.weight' holds {} at head {}, expected finite values or -inf",
                     f_.path(), p, v, h);
            }
        }
    }
    if (hp.qk_norm == QkNorm::PER_HEAD) {
        l.q_norm = vector(p + "attn_q_norm.weight", hp.head_dim);
        l.k_norm = vector(p + "attn_k_norm.weight", hp.head_dim);
    } else if (hp.qk_norm == QkNorm::FULL) {
        l.q_norm = vector(p + "attn_q_norm.weight", n_q);
        l.k_norm = vector(p + "attn_k_norm.weight", n_kv);
    }
}

void ArchLoader::bind_moe(int64_t il, const std::string &norm) {
    const HParams &hp = m_.hp_;
    LayerWeights &l = m_.w_.layers[size_t(il)];
    const std::string p = fmt::format("blk.{}.", il);
    l.ffn_norm = vector(p + norm + ".weight", hp.n_embd);
    l.gate_inp = matrix(p + "ffn_gate_inp.weight", {hp.n_embd, hp.n_expert});
    l.gate_exps = matrix(p + "ffn_gate_exps.weight", {hp.n_embd, hp.n_ff_exp, hp.n_expert});
    l.up_exps = matrix(p + "ffn_up_exps.weight", {hp.n_embd, hp.n_ff_exp, hp.n_expert});
    l.down_exps = matrix(p + "ffn_down_exps.weight", {hp.n_ff_exp, hp.n_embd, hp.n_expert});
    if (hp.moe_bias) {
        l.gate_inp_b = vector(p + "ffn_gate_inp.bias", hp.n_expert);
        l.gate_exps_b = f32_tensor(p + "ffn_gate_exps.bias", {hp.n_ff_exp, hp.n_expert});
        l.up_exps_b = f32_tensor(p + "ffn_up_exps.bias", {hp.n_ff_exp, hp.n_expert});
        l.down_exps_b = f32_tensor(p + "ffn_down_exps.bias", {hp.n_embd, hp.n_expert});
    }
    if (hp.shared_expert) {
        l.gate_shexp = matrix(p + "ffn_gate_shexp.weight", {hp.n_embd, hp.n_ff_shexp});
        l.up_shexp = matrix(p + "ffn_up_shexp.weight", {hp.n_embd, hp.n_ff_shexp});
        l.down_shexp = matrix(p + "ffn_down_shexp.weight", {hp.n_ff_shexp, hp.n_embd});
        if (hp.shared_expert_gate) l.gate_inp_shexp = vector(p + "ffn_gate_inp_shexp.weight", hp.n_embd);
    }
}

} // namespace prescope

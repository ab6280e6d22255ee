// Test-only builder of a tiny random-weight qwen3moe, deepseek2 or gpt-oss GGUF (F32), with hooks to break it on
// purpose.
#pragma once

#include "format/gguf.h"
#include "gguf-writer.h"
#include "random-blocks.h"

#include <functional>
#include <map>
#include <random>
#include <set>

namespace prescope::test {

struct TinyModelSpec {
    std::string arch = "qwen3moe";
    uint32_t n_layer = 2, n_embd = 32, n_head = 4, n_head_kv = 2, head_dim = 8;
    uint32_t n_expert = 4, n_expert_used = 2, n_ff = 32, n_vocab = 64, n_ctx = 128;
    /// arch "deepseek2": MLA sizes (q_lora_rank 0: plain attn_q), leading dense layers (n_ff rows), one shared
    /// expert, sigmoid scores with a selection bias, expert groups; head_dim and n_head_kv are not used.
    uint32_t q_lora_rank = 16, kv_lora_rank = 16, head_dim_nope = 8, head_dim_rope = 8, head_dim_v = 8;
    uint32_t n_layer_dense = 1, n_expert_group = 2, n_expert_group_used = 1;
    /// deepseek2 as written before llama.cpp split attn_kv_b (no *_mla keys, key/value_length per head).
    bool legacy_kv_b = false;
    /// arch "gpt-oss": {arch}.attention.sliding_window (biases, sinks, post_attention_norm as llama.cpp's files).
    uint32_t sliding_window = 3;
    /// Integer metadata keys written as the string "x" instead (wrong-type tests).
    std::set<std::string> keys_as_string;
    /// Float metadata keys written with these values instead of the model's (bad-value tests).
    std::map<std::string, float> f32_values;
    /// Called for every tensor before it is written: may rename it (empty name drops it), change its
    /// shape or its ggml type id. Tensors given a weight dtype other than F32 hold random blocks of it
    /// (test::random_weights, seeded by the name); other ids get bytes of the right size.
    std::function<void(std::string &name, std::vector<uint64_t> &ne, uint32_t &type)> edit;
    /// Write such tensors as F32 holding their dequantized values: the same model in F32.
    bool dequantize = false;
    /// Tensors written after the model's own (F32, random), e.g. ones the architecture does not use.
    std::vector<std::pair<std::string, std::vector<uint64_t>>> extra;
};

/// Writes the model to `path`; weights ~ N(0, 0.5), norms 1. Vocabulary: byte-level BPE over the
/// letters a-z (no merges) so the tokenizer loads.
inline void write_tiny_model(const std::string &path, const TinyModelSpec &s) {
    GgufWriter w;
    const std::string a = s.arch;
    const auto u32 = [&](const std::string &key, uint32_t v) {
        if (s.keys_as_string.count(key)) {
            w.kv_str(key, "x");
        } else {
            w.kv_u32(key, v);
        }
    };
    const auto f32 = [&](const std::string &key, float v) {
        const auto it = s.f32_values.find(key);
        w.kv_f32(key, it != s.f32_values.end() ? it->second : v);
    };
    w.kv_str("general.architecture", a);
    u32(a + ".context_length", s.n_ctx);
    u32(a + ".embedding_length", s.n_embd);
    u32(a + ".block_count", s.n_layer);
    u32(a + ".attention.head_count", s.n_head);
    const bool mla = a == "deepseek2";
    const bool split = mla && !s.legacy_kv_b;
    u32(a + ".attention.head_count_kv", split ? 1 : mla ? s.n_head : s.n_head_kv);
    u32(a + ".attention.key_length", split ? s.kv_lora_rank + s.head_dim_rope
                                          : mla ? s.head_dim_nope + s.head_dim_rope : s.head_dim);
    u32(a + ".attention.value_length", split ? s.kv_lora_rank : mla ? s.head_dim_v : s.head_dim);
    if (mla) {  // keys as llama.cpp's DeepseekV2Model writes them
        if (s.q_lora_rank > 0) u32(a + ".attention.q_lora_rank", s.q_lora_rank);
        u32(a + ".attention.kv_lora_rank", s.kv_lora_rank);
        if (split) {
            u32(a + ".attention.key_length_mla", s.head_dim_nope + s.head_dim_rope);
            u32(a + ".attention.value_length_mla", s.head_dim_v);
        }
        u32(a + ".rope.dimension_count", s.head_dim_rope);
        u32(a + ".leading_dense_block_count", s.n_layer_dense);
        u32(a + ".feed_forward_length", s.n_ff);
        u32(a + ".expert_shared_count", 1);
        u32(a + ".expert_gating_func", 2);
        u32(a + ".expert_group_count", s.n_expert_group);
        u32(a + ".expert_group_used_count", s.n_expert_group_used);
        w.kv_f32(a + ".expert_weights_scale", 2.5f);
        w.kv_bool(a + ".expert_weights_norm", true);
    }
    f32(a + ".attention.layer_norm_rms_epsilon", 1e-6f);
    f32(a + ".rope.freq_base", 10000.0f);
    if (a == "gpt-oss") u32(a + ".attention.sliding_window", s.sliding_window);
    u32(a + ".expert_count", s.n_expert);
    u32(a + ".expert_used_count", s.n_expert_used);
    u32(a + ".expert_feed_forward_length", s.n_ff);
    w.kv_str("tokenizer.ggml.model", "gpt2");
    w.kv_str("tokenizer.ggml.pre", "qwen2");
    // GPT-2 byte alphabet (bytes_to_unicode) so every input byte has a token.
    std::vector<std::string> tokens;
    for (int b = 0; b < 256; ++b) {
        int cp = b;
        if (!((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255))) {
            int n = 0;
            for (int c = 0; c < b; ++c) {
                if (!((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255))) ++n;
            }
            cp = 256 + n;
        }
        std::string u;
        if (cp < 0x80) {
            u += char(cp);
        } else {
            u += char(0xC0 | (cp >> 6));
            u += char(0x80 | (cp & 0x3F));
        }
        tokens.push_back(u);
    }
    tokens.push_back("<|endoftext|>");
    w.kv_str_array("tokenizer.ggml.tokens", tokens);
    std::vector<int32_t> types(tokens.size(), 1);
    types.back() = 3;
    w.kv_array<int32_t>("tokenizer.ggml.token_type", 5, types);
    w.kv_str_array("tokenizer.ggml.merges", {});
    w.kv_u32("tokenizer.ggml.eos_token_id", uint32_t(tokens.size() - 1));
    const uint32_t n_vocab = uint32_t(tokens.size());

    std::mt19937 rng(42);
    std::normal_distribution<float> dist(0.0f, 0.5f);
    // Writes tensor `name` (already through `edit`) from the F32 values v, converted to `type`.
    auto write_tensor = [&](const std::string &name, const std::vector<uint64_t> &ne, uint32_t type,
                            std::vector<float> v) {
        uint64_t n = 1;
        for (uint64_t d : ne) n *= d;
        v.resize(n);
        std::vector<uint8_t> bytes(v.size() * 4);
        std::memcpy(bytes.data(), v.data(), bytes.size());
        if (const auto dt = dtype_from_ggml(type); dt && type != 0) {
            const uint32_t seed = uint32_t(std::hash<std::string>{}(name));
            bytes = random_weights(*dt, int64_t(n / ne[0]), int64_t(ne[0]), seed);
            if (s.dequantize) {
                dequantize_row(*dt, bytes.data(), v.data(), int64_t(n));
                bytes.resize(v.size() * 4);
                std::memcpy(bytes.data(), v.data(), bytes.size());
                type = 0;
            }
        } else if (const auto block = ggml_type_block(type); block && type != 0) {
            bytes.resize(n / uint64_t(block->first) * block->second);
        }
        w.tensor(name, type, ne, bytes);
    };
    // A tensor of random values (ones for norms), drawn after `edit` so that its shape counts.
    auto add = [&](std::string name, std::vector<uint64_t> ne, bool ones) {
        uint32_t type = 0;
        if (s.edit) s.edit(name, ne, type);
        if (name.empty()) return;
        uint64_t n = 1;
        for (uint64_t d : ne) n *= d;
        std::vector<float> v(n);
        for (float &x : v) x = ones ? 1.0f : dist(rng);
        write_tensor(name, ne, type, std::move(v));
    };
    // A tensor of given values.
    auto put = [&](std::string name, std::vector<uint64_t> ne, std::vector<float> v) {
        uint32_t type = 0;
        if (s.edit) s.edit(name, ne, type);
        if (!name.empty()) write_tensor(name, ne, type, std::move(v));
    };
    const uint64_t q = s.n_head * s.head_dim, kv = s.n_head_kv * s.head_dim;
    add("token_embd.weight", {s.n_embd, n_vocab}, false);
    add("output_norm.weight", {s.n_embd}, true);
    for (uint32_t i = 0; mla && i < s.n_layer; ++i) {
        const std::string p = "blk." + std::to_string(i) + ".";
        const uint64_t r = s.kv_lora_rank, n_q = s.n_head * (s.head_dim_nope + s.head_dim_rope);
        add(p + "attn_norm.weight", {s.n_embd}, true);
        if (s.q_lora_rank > 0) {
            add(p + "attn_q_a.weight", {s.n_embd, s.q_lora_rank}, false);
            add(p + "attn_q_a_norm.weight", {s.q_lora_rank}, true);
            add(p + "attn_q_b.weight", {s.q_lora_rank, n_q}, false);
        } else {
            add(p + "attn_q.weight", {s.n_embd, n_q}, false);
        }
        add(p + "attn_kv_a_mqa.weight", {s.n_embd, r + s.head_dim_rope}, false);
        add(p + "attn_kv_a_norm.weight", {r}, true);
        // One random kv_b (HF kv_b_proj: per head nope key rows, then v value rows, of r inputs), written as is
        // (legacy) or split per head into k_b transposed and v_b as llama.cpp's converter does: the same weights.
        const uint64_t nope = s.head_dim_nope, dv = s.head_dim_v;
        std::vector<float> kv_b(s.n_head * (nope + dv) * r), k_b, v_b;
        for (float &x : kv_b) x = dist(rng);
        if (s.legacy_kv_b) {
            put(p + "attn_kv_b.weight", {r, s.n_head * (nope + dv)}, kv_b);
        } else {
            for (uint64_t h = 0; h < s.n_head; ++h) {
                const float *head = kv_b.data() + h * (nope + dv) * r;
                for (uint64_t c = 0; c < r; ++c)
                    for (uint64_t i = 0; i < nope; ++i) k_b.push_back(head[i * r + c]);
                v_b.insert(v_b.end(), head + nope * r, head + (nope + dv) * r);
            }
            put(p + "attn_k_b.weight", {nope, r, s.n_head}, k_b);
            put(p + "attn_v_b.weight", {r, dv, s.n_head}, v_b);
        }
        add(p + "attn_output.weight", {uint64_t(s.n_head) * s.head_dim_v, s.n_embd}, false);
        add(p + "ffn_norm.weight", {s.n_embd}, true);
        if (i < s.n_layer_dense) {
            add(p + "ffn_gate.weight", {s.n_embd, s.n_ff}, false);
            add(p + "ffn_up.weight", {s.n_embd, s.n_ff}, false);
            add(p + "ffn_down.weight", {s.n_ff, s.n_embd}, false);
            continue;
        }
        add(p + "ffn_gate_inp.weight", {s.n_embd, s.n_expert}, false);
        add(p + "exp_probs_b.bias", {s.n_expert}, false);
        add(p + "ffn_gate_exps.weight", {s.n_embd, s.n_ff, s.n_expert}, false);
        add(p + "ffn_up_exps.weight", {s.n_embd, s.n_ff, s.n_expert}, false);
        add(p + "ffn_down_exps.weight", {s.n_ff, s.n_embd, s.n_expert}, false);
        add(p + "ffn_gate_shexp.weight", {s.n_embd, s.n_ff}, false);
        add(p + "ffn_up_shexp.weight", {s.n_embd, s.n_ff}, false);
        add(p + "ffn_down_shexp.weight", {s.n_ff, s.n_embd}, false);
    }
    const bool oss = a == "gpt-oss";
    for (uint32_t i = 0; !mla && i < s.n_layer; ++i) {
        const std::string p = "blk." + std::to_string(i) + ".";
        add(p + "attn_norm.weight", {s.n_embd}, true);
        add(p + "attn_q.weight", {s.n_embd, q}, false);
        add(p + "attn_k.weight", {s.n_embd, kv}, false);
        add(p + "attn_v.weight", {s.n_embd, kv}, false);
        add(p + "attn_output.weight", {q, s.n_embd}, false);
        if (oss) {  // llama.cpp's gpt-oss tensors (src/models/openai-moe.cpp)
            add(p + "attn_q.bias", {q}, false);
            add(p + "attn_k.bias", {kv}, false);
            add(p + "attn_v.bias", {kv}, false);
            add(p + "attn_output.bias", {s.n_embd}, false);
            add(p + "attn_sinks.weight", {s.n_head}, false);
            add(p + "post_attention_norm.weight", {s.n_embd}, true);
            add(p + "ffn_gate_inp.bias", {s.n_expert}, false);
            add(p + "ffn_gate_exps.bias", {s.n_ff, s.n_expert}, false);
            add(p + "ffn_up_exps.bias", {s.n_ff, s.n_expert}, false);
            add(p + "ffn_down_exps.bias", {s.n_embd, s.n_expert}, false);
        } else {
            add(p + "attn_q_norm.weight", {s.head_dim}, true);
            add(p + "attn_k_norm.weight", {s.head_dim}, true);
            add(p + "ffn_norm.weight", {s.n_embd}, true);
        }
        add(p + "ffn_gate_inp.weight", {s.n_embd, s.n_expert}, false);
        add(p + "ffn_gate_exps.weight", {s.n_embd, s.n_ff, s.n_expert}, false);
        add(p + "ffn_up_exps.weight", {s.n_embd, s.n_ff, s.n_expert}, false);
        add(p + "ffn_down_exps.weight", {s.n_ff, s.n_embd, s.n_expert}, false);
    }
    for (const auto &[name, ne] : s.extra) add(name, ne, false);
    w.write(path);
}

/// A model whose tensors mix dtypes as llama-quantize's presets do (Q4_K_M keeps some expert down
/// projections in Q6_K; gate and up, attention, router and embeddings each in their own type), covering
/// every weight type; with `dequantize`, the same model with every tensor stored as F32.
inline TinyModelSpec mixed_type_spec(bool dequantize) {
    TinyModelSpec s;
    s.n_embd = 256, s.n_ff = 256, s.head_dim = 64;  // K-quant rows are multiples of 256
    s.dequantize = dequantize;
    s.edit = [](std::string &name, auto &, uint32_t &type) {
        static const std::map<std::string, DType> types = {
            {"token_embd.weight", DType::Q6_K},
            {"blk.0.attn_q.weight", DType::Q8_0},        {"blk.0.attn_k.weight", DType::Q5_0},
            {"blk.0.attn_v.weight", DType::IQ4_NL},      {"blk.0.attn_output.weight", DType::Q4_1},
            {"blk.0.ffn_gate_exps.weight", DType::Q4_K}, {"blk.0.ffn_up_exps.weight", DType::Q5_K},
            {"blk.0.ffn_down_exps.weight", DType::Q6_K}, {"blk.1.attn_q.weight", DType::Q3_K},
            {"blk.1.attn_k.weight", DType::Q2_K},        {"blk.1.attn_v.weight", DType::MXFP4},
            {"blk.1.attn_output.weight", DType::Q5_1},   {"blk.1.ffn_gate_inp.weight", DType::Q4_0},
            {"blk.1.ffn_gate_exps.weight", DType::IQ4_XS}, {"blk.1.ffn_up_exps.weight", DType::Q4_K},
            {"blk.1.ffn_down_exps.weight", DType::Q4_K},
        };
        if (const auto it = types.find(name); it != types.end()) type = uint32_t(it->second);
    };
    return s;
}

} // namespace prescope::test

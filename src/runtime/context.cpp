// Forward pass of the supported MoE transformers on the CPU backend. Per block (HF
// Qwen3MoeDecoderLayer and relatives): x += Wo . attn(rope(norm_qk(Wq h)), rope(norm_qk(Wk h)), Wv h)
// with h = rmsnorm(x); then x += MoE(rmsnorm(x)) (+ sigmoid-gated shared expert for qwen2moe). deepseek2: MLA
// attention (mla_attention_block), dense FFN in the leading layers, ungated shared experts. gpt-oss: the same
// block with biases, attention sinks and a sliding window on some layers (HF GptOssDecoderLayer).
#include "runtime/context.h"

#include "core/error.h"
#include "core/log.h"
#include "core/memory.h"

#include <algorithm>
#include <array>
#include <cmath>

namespace prescope {

namespace {

/// Sizes of the MLA scratch regions for nb tokens, in the order mla_attention_block carves them: the full
/// query, the q-LoRA latent, the query and key rope parts, one head's gathered input and output, the values.
std::array<int64_t, 7> mla_scratch(const HParams &hp, int64_t nb) {
    if (!hp.mla) return {};
    const int64_t nope = hp.head_dim_nope, rope = hp.head_dim_rope, r = hp.kv_lora_rank;
    return {nb * hp.n_head * (nope + rope), nb * hp.q_lora_rank, nb * hp.n_head * rope, nb * rope,
            nb * std::max(nope, r), nb * std::max(r, hp.head_dim_v), nb * hp.n_head * hp.head_dim_v};
}

} // namespace

void warn_beyond_training_context(const HParams &hp, int64_t n_ctx) {
    if (hp.n_ctx_train > 0 && n_ctx > hp.n_ctx_train) {
        spdlog::warn("-c {} is more than the {} tokens the model was trained on ({}.context_length): "
                     "text past that may degrade", n_ctx, hp.n_ctx_train, hp.arch);
    }
}

int64_t resolve_n_ctx(const Model &model, int64_t n_ctx) {
    if (n_ctx > 0) return n_ctx;
    const HParams &hp = model.hp();
    if (hp.n_ctx_train <= 0) {
        fail("{}: metadata '{}.context_length' is {}, so the context size must be given (-c N)", model.file().path(),
             hp.arch, hp.n_ctx_train);
    }
    return hp.n_ctx_train;
}

Context::Context(const Model &model, ContextParams params, ExpertExecutor *executor)
    : model_(model), params_(params) {
    const HParams &hp = model.hp();
    params_.n_ctx = resolve_n_ctx(model, params_.n_ctx);
    if (params_.n_batch <= 0 || params_.n_seq <= 0) {
        fail("invalid context: n_ctx {}, n_batch {} and n_seq {} must be positive", params_.n_ctx, params_.n_batch,
             params_.n_seq);
    }
    warn_beyond_training_context(hp, params_.n_ctx);
    // No pass holds more tokens than all caches together (n_ctx * n_seq, without overflowing).
    if (params_.n_ctx < (params_.n_batch + params_.n_seq - 1) / params_.n_seq) {
        params_.n_batch = params_.n_ctx * params_.n_seq;
    }

    // Everything below is sized by -c, -b and n_seq: check it fits before touching it (std::vector zero-fills,
    // so an over-committed allocation would end in the kernel's OOM kill half-way through).
    const int64_t nb = params_.n_batch, n_q = hp.n_head * hp.head_dim, n_kv = hp.n_head_kv * hp.head_dim;
    // In double: a file's context_length (-c 0) may be any 64-bit number.
    const auto mla = mla_scratch(hp, nb);
    int64_t mla_floats = 0;
    for (int64_t m : mla) mla_floats += m;
    const bool ffn_scratch = hp.shared_expert || hp.n_layer_dense > 0;
    const int64_t n_ff_scratch = std::max(hp.shared_expert ? hp.n_ff_shexp : 0, hp.n_ff);
    // MLA caches one latent row per position (k_cache_ only).
    const double floats =
        (hp.mla ? 1.0 : 2.0) * double(hp.n_layer) * double(params_.n_seq) * double(params_.n_ctx) * double(n_kv) +
        double(nb) * double(3 * hp.n_embd + 2 * n_q + 2 * n_kv + hp.n_expert + 4 +
                            (ffn_scratch ? 2 * n_ff_scratch + hp.n_embd : 0)) +
        double(mla_floats);
    check_host_memory(uint64_t(std::min(floats * sizeof(float), 1.8e19)),
                      params_.n_seq == 1
                          ? fmt::format("the KV cache and activations for -c {} -b {}", params_.n_ctx, nb)
                          : fmt::format("the KV caches and activations for -c {} -b {} and {} sequences",
                                        params_.n_ctx, nb, params_.n_seq));
    const size_t cache = size_t(hp.n_layer * params_.n_seq * params_.n_ctx * n_kv);
    if (!executor) {
        own_executor_ = std::make_unique<CpuExpertExecutor>(model, params_.n_batch);
        executor = own_executor_.get();
    }
    executor_ = executor;

    k_cache_.resize(cache);
    if (!hp.mla) v_cache_.resize(cache);
    x_.resize(size_t(nb * hp.n_embd));
    h_.resize(size_t(nb * hp.n_embd));
    ffn_.resize(size_t(nb * hp.n_embd));
    q_.resize(size_t(nb * n_q));
    attn_.resize(size_t(nb * n_q));
    k_.resize(size_t(nb * n_kv));
    v_.resize(size_t(nb * n_kv));
    probs_.resize(size_t(nb * hp.n_expert));
    pos_.resize(size_t(nb));
    scratch_.tokens.reserve(size_t(nb));
    scratch_.runs.reserve(size_t(std::min(nb, params_.n_seq)) + 1);
    scratch_.out_rows.reserve(size_t(nb));
    n_past_.assign(size_t(params_.n_seq), 0);
    if (ffn_scratch) shexp_.resize(size_t(nb * (2 * n_ff_scratch + hp.n_embd)));
    mla_.resize(size_t(mla_floats));
    routing_.ids.reserve(size_t(nb * hp.n_expert_used));
    routing_.weights.reserve(size_t(nb * hp.n_expert_used));
    logits_.reserve(size_t(hp.n_vocab));
}

void check_eval_input(const HParams &hp, std::span<const int32_t> tokens, int64_t n_past, int64_t n_ctx) {
    const auto n = int64_t(tokens.size());
    if (n == 0) fail("eval: no tokens to evaluate");
    if (n_past + n > n_ctx) {
        fail("{} tokens at position {} do not fit the context of {} tokens (use a larger -c)", n, n_past, n_ctx);
    }
    for (int32_t t : tokens) {
        if (t < 0 || t >= hp.n_vocab) fail("token id {} is outside the vocabulary [0, {})", t, hp.n_vocab);
    }
}

void check_batch_input(const HParams &hp, std::span<const SeqTokens> batch, std::span<const int64_t> n_past,
                       int64_t n_ctx) {
    if (batch.empty()) fail("eval_batch: no entries to evaluate");
    const auto n_seq = int64_t(n_past.size());
    for (size_t e = 0; e < batch.size(); ++e) {
        const int32_t seq = batch[e].seq;
        if (seq < 0 || seq >= n_seq) {
            fail("eval_batch entry {}: sequence {} is outside [0, {}) (the context holds {} sequences)", e, seq,
                 n_seq, n_seq);
        }
        for (size_t f = 0; f < e; ++f) {
            if (batch[f].seq == seq) fail("eval_batch: sequence {} is listed twice (entries {} and {})", seq, f, e);
        }
        try {
            check_eval_input(hp, batch[e].tokens, n_past[size_t(seq)], n_ctx);
        } catch (const Error &err) {
            fail("eval_batch entry {} (sequence {}): {}", e, seq, err.what());
        }
    }
}

void Context::check_seq(int32_t seq) const {
    if (seq < 0 || seq >= params_.n_seq) {
        fail("sequence {} is outside [0, {}) (the context holds {} sequences)", seq, params_.n_seq, params_.n_seq);
    }
}

int64_t Context::n_past(int32_t seq) const {
    check_seq(seq);
    return n_past_[size_t(seq)];
}

void Context::clear() {
    std::fill(n_past_.begin(), n_past_.end(), 0);
}

void Context::clear(int32_t seq) {
    check_seq(seq);
    n_past_[size_t(seq)] = 0;
}

void Context::eval(std::span<const int32_t> tokens, bool all_logits) {
    const HParams &hp = model_.hp();
    const auto n = int64_t(tokens.size());
    check_eval_input(hp, tokens, n_past_[0], params_.n_ctx);
    const size_t n_logits = size_t((all_logits ? n : 1) * hp.n_vocab);
    if (n_logits > logits_.capacity()) {
        check_host_memory(n_logits * sizeof(float), fmt::format("the logits of {} tokens", all_logits ? n : 1));
    }
    logits_.resize(n_logits);
    for (int64_t i = 0; i < n; i += params_.n_batch) {
        const int64_t m = std::min(params_.n_batch, n - i);
        const SeqRun run{0, m, n_past_[0]};
        std::vector<int64_t> &out_rows = scratch_.out_rows;
        out_rows.clear();
        if (all_logits) {
            for (int64_t r = 0; r < m; ++r) out_rows.push_back(r);
        } else if (i + m == n) {
            out_rows.push_back(m - 1);
        }
        forward_pass(tokens.data() + i, m, {&run, 1}, out_rows, logits_.data() + (all_logits ? i * hp.n_vocab : 0));
    }
}

void Context::eval_batch(std::span<const SeqTokens> batch) {
    const HParams &hp = model_.hp();
    check_batch_input(hp, batch, n_past_, params_.n_ctx);
    int64_t n_out = 0;
    for (const SeqTokens &e : batch) n_out += e.logits ? 1 : 0;
    const size_t n_logits = size_t(n_out * hp.n_vocab);
    if (n_logits > logits_.capacity()) {
        check_host_memory(n_logits * sizeof(float), fmt::format("the logits of {} sequences", n_out));
    }
    logits_.resize(n_logits);

    split_batch(batch, n_past_, params_.n_batch, scratch_,
                [&](std::span<const int32_t> tokens, std::span<const SeqRun> runs, std::span<const int64_t> out_rows,
                    int64_t first_row) {
                    forward_pass(tokens.data(), int64_t(tokens.size()), runs, out_rows,
                                 logits_.data() + first_row * hp.n_vocab);
                });
}

void Context::forward_pass(const int32_t *tokens, int64_t n, std::span<const SeqRun> runs,
                           std::span<const int64_t> out_rows, float *logits_out) {
    const HParams &hp = model_.hp();
    const ModelWeights &w = model_.weights();
    const cpu::BatchInvariantScope invariant(params_.deterministic);
    cpu::get_rows(w.tok_embd, tokens, n, x_.data());
    int64_t t = 0;
    for (const SeqRun &r : runs) {
        for (int64_t i = 0; i < r.n; ++i) pos_[size_t(t++)] = int32_t(r.pos0 + i);
    }
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        if (hp.mla) {
            mla_attention_block(il, n, runs);
        } else {
            attention_block(il, n, runs);
        }
        if (il < hp.n_layer_dense) {
            dense_ffn_block(il, n);
        } else {
            moe_block(il, n);
        }
    }
    for (const SeqRun &r : runs) n_past_[size_t(r.seq)] = r.pos0 + r.n;
    if (out_rows.empty()) return;
    // Only the rows whose logits are wanted go through the output head (gathered unless they are the last ones).
    const auto rows = int64_t(out_rows.size());
    const float *xo = x_.data() + (n - rows) * hp.n_embd;
    if (out_rows.front() != n - rows || out_rows.back() != n - 1) {
        for (int64_t i = 0; i < rows; ++i) {
            std::copy_n(x_.data() + out_rows[size_t(i)] * hp.n_embd, hp.n_embd, ffn_.data() + i * hp.n_embd);
        }
        xo = ffn_.data();
    }
    cpu::rms_norm(xo, w.output_norm, rows, hp.n_embd, hp.rms_eps, h_.data());
    cpu::matmul(w.output, h_.data(), rows, logits_out);
}

void Context::attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs) {
    const HParams &hp = model_.hp();
    const LayerWeights &l = model_.weights().layers[size_t(il)];
    const int64_t n_q = hp.n_head * hp.head_dim, n_kv = hp.n_head_kv * hp.head_dim;

    cpu::rms_norm(x_.data(), l.attn_norm, n, hp.n_embd, hp.rms_eps, h_.data());
    cpu::matmul(l.wq, h_.data(), n, q_.data());
    cpu::matmul(l.wk, h_.data(), n, k_.data());
    cpu::matmul(l.wv, h_.data(), n, v_.data());
    if (hp.qkv_bias) {
        cpu::add_bias(q_.data(), l.bq, n, n_q);
        cpu::add_bias(k_.data(), l.bk, n, n_kv);
        cpu::add_bias(v_.data(), l.bv, n, n_kv);
    }
    if (hp.qk_norm == QkNorm::PER_HEAD) {
        cpu::rms_norm(q_.data(), l.q_norm, n * hp.n_head, hp.head_dim, hp.rms_eps, q_.data());
        cpu::rms_norm(k_.data(), l.k_norm, n * hp.n_head_kv, hp.head_dim, hp.rms_eps, k_.data());
    } else if (hp.qk_norm == QkNorm::FULL) {
        cpu::rms_norm(q_.data(), l.q_norm, n, n_q, hp.rms_eps, q_.data());
        cpu::rms_norm(k_.data(), l.k_norm, n, n_kv, hp.rms_eps, k_.data());
    }
    const cpu::RopeYarn *yarn = hp.rope_yarn ? &*hp.rope_yarn : nullptr;
    cpu::rope(q_.data(), n, hp.n_head, hp.head_dim, pos_.data(), hp.rope_freq_base, hp.rope_mode, yarn);
    cpu::rope(k_.data(), n, hp.n_head_kv, hp.head_dim, pos_.data(), hp.rope_freq_base, hp.rope_mode, yarn);

    // Each run against its own sequence's cache.
    int64_t t0 = 0;
    for (const SeqRun &r : runs) {
        const int64_t cache_offset = (il * params_.n_seq + r.seq) * params_.n_ctx * n_kv;
        float *kc = k_cache_.data() + cache_offset;
        float *vc = v_cache_.data() + cache_offset;
        std::copy_n(k_.data() + t0 * n_kv, r.n * n_kv, kc + r.pos0 * n_kv);
        std::copy_n(v_.data() + t0 * n_kv, r.n * n_kv, vc + r.pos0 * n_kv);
        cpu::attention(q_.data() + t0 * n_q, kc, vc, r.n, r.pos0, hp.n_head, hp.n_head_kv, hp.head_dim,
                       1.0f / std::sqrt(float(hp.head_dim)), attn_.data() + t0 * n_q, l.attn_sinks, hp.window(il));
        t0 += r.n;
    }
    cpu::matmul(l.wo, attn_.data(), n, ffn_.data());
    if (l.bo) cpu::add_bias(ffn_.data(), l.bo, n, hp.n_embd);
    for (int64_t i = 0; i < n * hp.n_embd; ++i) x_[size_t(i)] += ffn_[size_t(i)];
}

void Context::moe_block(int64_t il, int64_t n) {
    const HParams &hp = model_.hp();
    const LayerWeights &l = model_.weights().layers[size_t(il)];
    const int64_t n_embd = hp.n_embd;

    cpu::rms_norm(x_.data(), l.ffn_norm, n, n_embd, hp.rms_eps, h_.data());
    if (on_router_input) on_router_input(il, h_.data(), n);
    moe_route(hp, l, h_.data(), n, probs_.data(), routing_);
    if (routing_override) routing_override(il, routing_);
    if (on_routing) on_routing(il, routing_);
    executor_->run(il, h_.data(), routing_, ffn_.data());

    if (hp.shared_expert && !executor_->adds_shared_expert()) {
        // HF Qwen2MoeSparseMoeBlock: out += sigmoid(shared_expert_gate(x)) * shared_expert(x); DeepseekV3MoE adds
        // the shared experts ungated.
        float *y = shexp_.data(), *scratch = y + n * n_embd;
        cpu_expert_ffn(l.gate_shexp, l.up_shexp, l.down_shexp, 0, h_.data(), n, scratch, y);
        for (int64_t t = 0; t < n; ++t) {
            const float *ht = h_.data() + t * n_embd;
            float g = 1.0f;
            if (hp.shared_expert_gate) {
                float dot = 0.0f;
                for (int64_t c = 0; c < n_embd; ++c) dot += l.gate_inp_shexp[c] * ht[c];
                g = 1.0f / (1.0f + std::exp(-dot));
            }
            for (int64_t c = 0; c < n_embd; ++c) ffn_[size_t(t * n_embd + c)] += g * y[t * n_embd + c];
        }
    }
    for (int64_t i = 0; i < n * n_embd; ++i) x_[size_t(i)] += ffn_[size_t(i)];
}

void Context::dense_ffn_block(int64_t il, int64_t n) {
    const HParams &hp = model_.hp();
    const LayerWeights &l = model_.weights().layers[size_t(il)];
    cpu::rms_norm(x_.data(), l.ffn_norm, n, hp.n_embd, hp.rms_eps, h_.data());
    cpu_expert_ffn(l.ffn_gate, l.ffn_up, l.ffn_down, 0, h_.data(), n, shexp_.data(), ffn_.data());
    for (int64_t i = 0; i < n * hp.n_embd; ++i) x_[size_t(i)] += ffn_[size_t(i)];
}

// HF DeepseekV3Attention, computed as llama.cpp does with absorbed weights (src/models/deepseek2.cpp): the cache
// holds per position c = rmsnorm(kv_a(h)[:r]) and k_pe = rope(kv_a(h)[r:]). Head j's score q_nope . (k_b_j c) +
// q_pe . k_pe equals (k_b_j^T q_nope, q_pe) . (c, k_pe), so attention runs as MQA of one KV head of r + rope
// dims over the cached rows, with the rows themselves as values; v_b_j maps head j's first r output dims (the
// softmax-weighted latent) to its value.
void Context::mla_attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs) {
    const HParams &hp = model_.hp();
    const LayerWeights &l = model_.weights().layers[size_t(il)];
    const int64_t n_head = hp.n_head, nope = hp.head_dim_nope, rope = hp.head_dim_rope, r = hp.kv_lora_rank;
    const int64_t dq = nope + rope, dkv = r + rope, dv = hp.head_dim_v;
    const auto sizes = mla_scratch(hp, params_.n_batch);
    std::array<float *, 7> part;
    float *next = mla_.data();
    for (size_t i = 0; i < part.size(); ++i) {
        part[i] = next;
        next += sizes[i];
    }
    float *q = part[0], *qa = part[1], *q_pe = part[2], *k_pe = part[3], *g_in = part[4], *g_out = part[5];
    float *v = part[6];

    cpu::rms_norm(x_.data(), l.attn_norm, n, hp.n_embd, hp.rms_eps, h_.data());
    if (hp.q_lora_rank > 0) {
        cpu::matmul(l.wq_a, h_.data(), n, qa);
        cpu::rms_norm(qa, l.q_a_norm, n, hp.q_lora_rank, hp.rms_eps, qa);
        cpu::matmul(l.wq_b, qa, n, q);
    } else {
        cpu::matmul(l.wq, h_.data(), n, q);
    }
    // The new latent rows ([n][dkv] in k_), then into each run's sequence cache.
    float *rows = k_.data();
    cpu::matmul(l.wkv_a_mqa, h_.data(), n, rows);
    for (int64_t t = 0; t < n; ++t) {
        float *row = rows + t * dkv;
        cpu::rms_norm(row, l.kv_a_norm, 1, r, hp.rms_eps, row);
        std::copy_n(row + r, rope, k_pe + t * rope);
        for (int64_t j = 0; j < n_head; ++j) std::copy_n(q + (t * n_head + j) * dq + nope, rope, q_pe + (t * n_head + j) * rope);
    }
    const cpu::RopeYarn *yarn = hp.rope_yarn ? &*hp.rope_yarn : nullptr;
    cpu::rope(k_pe, n, 1, rope, pos_.data(), hp.rope_freq_base, hp.rope_mode, yarn);
    cpu::rope(q_pe, n, n_head, rope, pos_.data(), hp.rope_freq_base, hp.rope_mode, yarn);
    for (int64_t t = 0; t < n; ++t) std::copy_n(k_pe + t * rope, rope, rows + t * dkv + r);
    const auto seq_cache = [&](const SeqRun &run) {
        return k_cache_.data() + (il * params_.n_seq + run.seq) * params_.n_ctx * dkv;
    };
    int64_t t0 = 0;
    for (const SeqRun &run : runs) {
        std::copy_n(rows + t0 * dkv, run.n * dkv, seq_cache(run) + run.pos0 * dkv);
        t0 += run.n;
    }

    // Absorbed queries in q_: [n][n_head][r + rope].
    float *qabs = q_.data();
    for (int64_t j = 0; j < n_head; ++j) {
        for (int64_t t = 0; t < n; ++t) std::copy_n(q + (t * n_head + j) * dq, nope, g_in + t * nope);
        cpu::matmul(l.wk_b, g_in, n, g_out, j);
        for (int64_t t = 0; t < n; ++t) {
            float *dst = qabs + (t * n_head + j) * dkv;
            std::copy_n(g_out + t * r, r, dst);
            std::copy_n(q_pe + (t * n_head + j) * rope, rope, dst + r);
        }
    }
    // Keys and values are both the latent row (the values' first kv_lora_rank columns go through wv_b below).
    t0 = 0;
    for (const SeqRun &run : runs) {
        const float *kc = seq_cache(run);
        cpu::attention(qabs + t0 * n_head * dkv, kc, kc, run.n, run.pos0, n_head, 1, dkv, hp.kq_scale,
                       attn_.data() + t0 * n_head * dkv);
        t0 += run.n;
    }
    for (int64_t j = 0; j < n_head; ++j) {
        for (int64_t t = 0; t < n; ++t) std::copy_n(attn_.data() + (t * n_head + j) * dkv, r, g_in + t * r);
        cpu::matmul(l.wv_b, g_in, n, g_out, j);
        for (int64_t t = 0; t < n; ++t) std::copy_n(g_out + t * dv, dv, v + (t * n_head + j) * dv);
    }
    cpu::matmul(l.wo, v, n, ffn_.data());
    for (int64_t i = 0; i < n * hp.n_embd; ++i) x_[size_t(i)] += ffn_[size_t(i)];
}

} // namespace prescope

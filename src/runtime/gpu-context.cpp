// GpuContext: the forward pass on the GPU with experts offloaded (runtime/gpu-context.h). Per block, as the
// CPU Context computes it (runtime/context.cpp): x += Wo attn(...); then x += MoE(rmsnorm(x)) with the MoE
// block split between GPU and CPU by runtime/hybrid-moe.
#include "runtime/gpu-context.h"

#include "backend/cuda/attention.cuh"
#include "backend/cuda/convert.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/moe.cuh"
#include "backend/cuda/norm.cuh"
#include "backend/cuda/rope.cuh"
#include "backend/cpu/ops.h"
#include "core/error.h"
#include "offload/byte-size.h"
#include "offload/predictor-baselines.h"
#include "runtime/calibrate.h"
#include "runtime/numa.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <nvtx3/nvToolsExt.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>

namespace prescope {

namespace {

constexpr int64_t kLogitRows = 32;  // rows of the output head per pass (all_logits runs in pieces)

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
size_t a256(size_t n) { return align_up(n, 256); }

/// An NVTX range for nsys timelines (docs/style R15); costs a few ns without a profiler attached.
struct NvtxRange {
    explicit NvtxRange(const char *name) { nvtxRangePushA(name); }
    ~NvtxRange() { nvtxRangePop(); }
    NvtxRange(const NvtxRange &) = delete;
    NvtxRange &operator=(const NvtxRange &) = delete;
};

/// Hands out 256-byte aligned pieces of one allocation: a sizing pass with base == nullptr, then the same
/// calls again with the real base.
struct Carver {
    uint8_t *base = nullptr;
    size_t used = 0;
    template <typename T>
    T *take(size_t n_elements) {
        T *p = base ? reinterpret_cast<T *>(base + used) : nullptr;
        used += a256(n_elements * sizeof(T));
        return p;
    }
};

} // namespace

// ---------------------------------------------------------------------------------------------------------------
// construction

GpuContext::GpuContext(const Model &model, ContextParams params, const OffloadConfig &config)
    : model_(model), params_(params), config_(config) {
    try {
        init();
    } catch (...) {
        release();  // a failed start-up (no memory, bad file) gives back what it took
        throw;
    }
}

void GpuContext::init() {
    const Model &model = model_;
    const OffloadConfig &config = config_;
    const HParams &hp = model.hp();
    params_.n_ctx = resolve_n_ctx(model, params_.n_ctx);
    if (params_.n_batch <= 0) {
        fail("invalid context: n_ctx {} and n_batch {} must be positive", params_.n_ctx, params_.n_batch);
    }
    if (params_.n_seq <= 0 || params_.n_ctx > INT32_MAX / params_.n_seq) {
        // KV cache rows are int32 on the device.
        fail("invalid context: n_seq {} must be positive and n_seq x n_ctx ({} x {}) at most {}", params_.n_seq,
             params_.n_seq, params_.n_ctx, INT32_MAX);
    }
    // No pass holds more tokens than all caches together (as Context).
    if (params_.n_ctx < (params_.n_batch + params_.n_seq - 1) / params_.n_seq) {
        params_.n_batch = params_.n_ctx * params_.n_seq;
    }
    if (params_.deterministic) {
        // The expert placement itself depends on the batch (the plan picks GPU or CPU per expert and step), so
        // batch-invariant kernels alone would not make a token's logits batch-independent here (decision 0130).
        fail("--deterministic runs on the CPU only: on the GPU the offloading plan, which sees the whole batch, "
             "decides where each expert runs; leave out the GPU flags or --deterministic");
    }
    n_past_.assign(size_t(params_.n_seq), 0);
    std::string why;
    if (cuda_device_count(&why) == 0) {
        fail("--gpu-expert-budget (gpu_cache) needs a CUDA GPU, but none is usable here ({}); leave the flag out "
             "to run on the CPU",
             why);
    }
    if (hp.mla && (hp.kv_lora_rank + hp.head_dim_rope) % 4 != 0) {
        // Latent rows are written by 16-byte vector stores (matmul outputs, scatter_rows).
        fail("{}: the GPU runtime needs kv_lora_rank + rope dimensions ({} + {}) to be a multiple of 4",
             model.file().path(), hp.kv_lora_rank, hp.head_dim_rope);
    }
    if (hp.n_expert > 1024 || hp.n_expert_used > 32) {
        fail("{}: the GPU router handles at most 1024 experts and top-32; the model has {} experts, top-{}",
             model.file().path(), hp.n_expert, hp.n_expert_used);
    }
    backend_ = std::make_unique<CudaBackend>(config.gpu_device);
    compute_ = backend_->stream_create();
    routing_ready_ = backend_->event_create();
    routing_side_ = backend_->stream_create();
    routing_fork_ = backend_->event_create();
    routing_join_ = backend_->event_create();
    logits_ready_ = backend_->event_create();
    step_ready_.resize(size_t(hp.n_layer));
    for (Event &e : step_ready_) e = backend_->event_create();
    device_steps_.reserve(size_t(hp.n_layer));
    cuda::cublas_handle();  // created here, not on the first forward pass

    if (!config.routing_trace.empty()) replay_ = std::make_unique<RoutingReplay>(config.routing_trace, hp);
    const auto L = int32_t(hp.n_layer), E = int32_t(hp.n_expert);
    plan_ = config.placement.empty() ? PlacementPlan::uniform(L, E) : PlacementPlan::load(config.placement);
    plan_.check_shape(L, E, config.placement.empty() ? "placement plan" : config.placement);

    // Host tier: experts that may be fetched are repacked (and page-locked unless their home is the mapping).
    ExpertStoreConfig sc;
    sc.fetchable.assign(size_t(L) * size_t(E), 0);
    sc.pinned.assign(size_t(L) * size_t(E), 1);
    for (size_t i = 0; i < sc.fetchable.size(); ++i) {
        const ExpertPlacement &p = plan_.experts[i];
        const bool dense = int64_t(i) / E < hp.n_layer_dense;  // a dense layer has no experts to fetch
        sc.fetchable[i] = config.gpu_cache_bytes > 0 && p.exec != ExecSite::CPU && !dense;
        sc.pinned[i] = p.home != HomeTier::MMAP;
    }

    // Device memory: sizes first, so a shortfall is reported with every part named.
    ExpertCacheConfig cc;
    cc.n_layers = L;
    cc.n_experts = E;
    cc.top_k = int32_t(hp.n_expert_used);
    cc.policy = config.cache_policy;
    cc.budget_bytes = config.gpu_cache_bytes;
    int64_t n_ff = 0;
    {
        std::vector<uint64_t> bytes(size_t(L) * size_t(E));
        for (int32_t l = int32_t(hp.n_layer_dense); l < L; ++l) {  // dense layers: no experts, 0 bytes
            const ExpertLayout x = ExpertLayout::of(model, l);
            n_ff = std::max(n_ff, x.n_ff);
            std::fill_n(bytes.begin() + ptrdiff_t(size_t(l) * size_t(E)), E, x.bytes);
        }
        cc.expert_bytes = std::move(bytes);
    }
    ExpertCache::slot_bytes_for(cc);  // validates, and names the minimum budget below
    if (cc.budget_bytes > 0 && cc.budget_bytes < ExpertCache::min_budget_bytes(cc)) {
        ExpertCache too_small(cc);  // throws the cache's message with the minimum
    }
    const uint64_t pool_bytes = ExpertCache::pool_bytes_for(cc);

    upload_weights();  // sizes weights_bytes_ and uploads

    const int64_t nb = params_.n_batch, k = hp.n_expert_used, n_embd = hp.n_embd;
    const int64_t n_q = hp.n_head * hp.head_dim, n_kv = hp.n_head_kv * hp.head_dim;
    const int64_t pairs = nb * k;
    CudaMoeDevice::Shape moe_shape;
    moe_shape.n_embd = n_embd;
    moe_shape.n_ff = n_ff;
    moe_shape.n_batch = nb;
    moe_shape.top_k = k;
    moe_shape.n_experts = E;
    moe_shape.n_ff_shexp = hp.shared_expert ? hp.n_ff_shexp : 0;
    moe_shape.n_layers = L;
    moe_shape.swiglu_oai = hp.expert_act == ExpertAct::SWIGLU_OAI;
    // The device-resolved hit path takes batches each of whose experts fit the GEMV path (decode sizes).
    device_hits_tokens_ = config.device_hits && cc.budget_bytes > 0 ? nb : 0;
    for (int32_t l = int32_t(hp.n_layer_dense); l < L; ++l) {
        const ExpertLayout x = ExpertLayout::of(model, l);
        for (DType t : {x.gate_type, x.up_type, x.down_type}) {
            device_hits_tokens_ = std::min<int64_t>(device_hits_tokens_, cuda::device_resolved_max_pairs(t));
        }
    }
    moe_shape.device_hits_tokens = device_hits_tokens_;
    // With a replayed trace the device resolves the trace's experts: they travel with the pass's tokens.
    const int64_t replay_ints = replay_ ? 2 * L * device_hits_tokens_ * k : 0;
    const uint64_t moe_bytes = CudaMoeDevice::device_bytes_for(moe_shape);

    // Workspace: the largest any op of a batch asks for (ops run in stream order and share it).
    size_t ws = 0;
    auto need = [&](size_t b) { ws = std::max(ws, b); };
    const int64_t H = hp.n_head;
    for (const DevLayer &l : layers_) {
        for (const DevMatrix *m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.gate_inp, &l.gate_shexp, &l.up_shexp,
                                   &l.down_shexp, &l.gate_inp_shexp, &l.wq_a, &l.wq_b, &l.wkv_a, &l.ffn_gate,
                                   &l.ffn_up, &l.ffn_down}) {
            if (!m->empty()) need(cuda::matmul_workspace_bytes(m->type, m->n_in, m->n_out, nb));
        }
        for (const DevMatrix *m : {&l.wk_b, &l.wv_b}) {
            if (m->empty()) continue;
            // The heads' products as one grouped matmul: at most what every pair on one matrix needs.
            const int32_t offsets[2] = {0, int32_t(nb * H)};
            cuda::ExpertMatmul g;
            g.type = m->type;
            g.n_in = m->n_in;
            g.n_out = m->n_out;
            g.n_expert = 1;
            g.offsets_host = offsets;
            need(cuda::expert_matmul_workspace_bytes(g, cuda::MatmulPath::CUBLAS));
        }
    }
    need(cuda::matmul_workspace_bytes(output_.type, output_.n_in, output_.n_out, kLogitRows));
    for (int32_t l = int32_t(hp.n_layer_dense); l < L; ++l) {
        const ExpertLayout x = ExpertLayout::of(model, l);
        const int32_t offsets[2] = {0, int32_t(pairs)};
        cuda::ExpertMatmul g;
        g.n_expert = 1;
        g.offsets_host = offsets;
        for (auto [type, n_in, n_out] : {std::tuple{x.gate_type, n_embd, x.n_ff}, std::tuple{x.up_type, n_embd, x.n_ff},
                                         std::tuple{x.down_type, x.n_ff, n_embd}}) {
            g.type = type;
            g.n_in = n_in;
            g.n_out = n_out;
            need(cuda::expert_matmul_workspace_bytes(g, cuda::MatmulPath::CUBLAS));
        }
    }
    for (int64_t t = 1; t <= nb; t = t * 2 > nb && t < nb ? nb : t * 2) {
        need(hp.mla ? cuda::attention_latent_workspace_bytes(t, params_.n_ctx - t, hp.n_head, hp.kv_lora_rank)
                    : cuda::attention_workspace_bytes(t, params_.n_ctx - t, hp.n_head, hp.n_head_kv, hp.head_dim));
    }
    const int64_t rope_dims = hp.mla ? hp.head_dim_rope : hp.head_dim;
    const int64_t dq = hp.head_dim_nope + hp.head_dim_rope;  // MLA query head
    const int64_t mla_io = std::max({hp.head_dim_nope, hp.kv_lora_rank, hp.head_dim_v});

    step_routing_bytes_ =
        device_hits_tokens_ > 0 && config.device_steps ? a256(routing_block(device_hits_tokens_).bytes) : 0;
    auto carve = [&](Carver &c) {
        x_ = c.take<float>(size_t(nb * n_embd));
        hb_ = c.take<float>(size_t(nb * n_embd));
        tmp_ = c.take<float>(size_t(nb * n_embd));
        q_ = c.take<float>(size_t(nb * n_q));
        attn_ = c.take<float>(size_t(nb * n_q));
        k_cache_ = c.take<float>(size_t(hp.n_layer * params_.n_seq * params_.n_ctx * n_kv));
        v_cache_ = hp.mla ? nullptr : c.take<float>(size_t(hp.n_layer * params_.n_seq * params_.n_ctx * n_kv));
        rope_freq_ = c.take<float>(size_t(rope_dims / 2));
        if (hp.mla) {
            mla_q_ = c.take<float>(size_t(nb * H * dq));
            mla_qa_ = hp.q_lora_rank > 0 ? c.take<float>(size_t(nb * hp.q_lora_rank)) : nullptr;
            mla_in_ = c.take<float>(size_t(nb * H * mla_io));
            mla_out_ = c.take<float>(size_t(nb * H * mla_io));
            mla_v_ = c.take<float>(size_t(nb * H * hp.head_dim_v));
            mla_w_ = c.take<const void *>(size_t(L * 2 * H));
            mla_offsets_ = c.take<int32_t>(size_t(nb * (H + 1)));
        }
        if (hp.n_layer_dense > 0) {
            ffn_g_ = c.take<float>(size_t(nb * hp.n_ff));
            ffn_u_ = c.take<float>(size_t(nb * hp.n_ff));
        }
        // Several runs in a pass, or a captured decode pass (graph_pass: one row, never MLA), go through them.
        const bool graphs = config.cuda_graphs && !hp.mla;
        k_new_ = params_.n_seq > 1 || graphs ? c.take<float>(size_t(nb * n_kv)) : nullptr;
        v_new_ = (params_.n_seq > 1 || graphs) && !hp.mla ? c.take<float>(size_t(nb * n_kv)) : nullptr;
        router_logits_ = c.take<float>(size_t(nb * E));
        router_counter_ = c.take<unsigned>(1);
        routing_dev_ = c.take<uint8_t>(routing_block(nb).bytes);
        step_routing_dev_ = c.take<uint8_t>(size_t(L) * step_routing_bytes_);
        tok_dev_ = c.take<int32_t>(size_t(4 * nb + replay_ints));
        logits_dev_ = c.take<float>(size_t(kLogitRows * hp.n_vocab));
        ws_.ptr = c.take<uint8_t>(ws);
        ws_.bytes = ws;
    };
    Carver sizing;
    carve(sizing);
    arena_bytes_ = sizing.used;

    const MemoryInfo mem = backend_->memory_info();
    const uint64_t reserve = uint64_t(256) << 20;  // cuBLAS, kernels, the driver's own allocations
    if (arena_bytes_ + moe_bytes + pool_bytes + reserve > mem.free_bytes) {
        fail("not enough GPU memory on {}: non-expert weights {} (already there) + KV cache and activations {} + "
             "MoE buffers {} + expert budget {} + {} reserve, but {} free of {}; lower --gpu-expert-budget, -c or -b",
             backend_->name(), format_byte_size(weights_bytes_), format_byte_size(arena_bytes_),
             format_byte_size(moe_bytes), format_byte_size(pool_bytes), format_byte_size(reserve),
             format_byte_size(mem.free_bytes), format_byte_size(mem.total_bytes));
    }
    arena_dev_ = backend_->alloc(MemoryKind::DEVICE, arena_bytes_);
    Carver real{static_cast<uint8_t *>(arena_dev_), 0};
    carve(real);
    // Tables the kernels read: RoPE frequencies (the CPU's own table); MLA's per-head matrices and, for each pass
    // size n, the heads' pair offsets (head j's pairs are its n tokens: [j n, (j + 1) n)).
    const std::vector<float> inv_freq =
        cpu::rope_inv_freq(rope_dims, hp.rope_freq_base, hp.rope_yarn ? &*hp.rope_yarn : nullptr);
    backend_->copy_h2d_async(rope_freq_, inv_freq.data(), inv_freq.size() * 4, compute_);
    static constexpr unsigned kZero = 0;  // cuda::moe_router's counter starts at 0
    backend_->copy_h2d_async(router_counter_, &kZero, sizeof kZero, compute_);
    if (hp.mla) {
        mla_w_host_.assign(size_t(L * 2 * H), nullptr);
        for (int32_t l = 0; l < L; ++l) {
            const DevLayer &d = layers_[size_t(l)];
            for (int which = 0; which < 2; ++which) {
                const DevMatrix &m = which == 0 ? d.wk_b : d.wv_b;
                const size_t head_bytes = cuda::row_bytes(m.type, m.n_in) * size_t(m.n_out);
                for (int64_t j = 0; j < H; ++j) {
                    mla_w_host_[size_t((l * 2 + which) * H + j)] = static_cast<const uint8_t *>(m.data) + j * head_bytes;
                }
            }
        }
        mla_offsets_host_.resize(size_t(nb * (H + 1)));
        for (int64_t n = 1; n <= nb; ++n) {
            for (int64_t j = 0; j <= H; ++j) mla_offsets_host_[size_t((n - 1) * (H + 1) + j)] = int32_t(j * n);
        }
        backend_->copy_h2d_async(mla_w_, mla_w_host_.data(), mla_w_host_.size() * sizeof(void *), compute_);
        backend_->copy_h2d_async(mla_offsets_, mla_offsets_host_.data(), mla_offsets_host_.size() * 4, compute_);
    }
    backend_->stream_synchronize(compute_);  // the host tables above are locals

    // Pinned host mirrors of what crosses the link every layer; pageable when page-locking is refused.
    Carver host_sizing;
    auto carve_host = [&](Carver &c) {
        routing_host_ = c.take<uint8_t>(routing_block(nb).bytes);
        step_routing_host_ = c.take<uint8_t>(size_t(L) * step_routing_bytes_);
        tok_host_ = c.take<int32_t>(size_t(4 * nb + replay_ints));
        logits_host_ = c.take<float>(size_t(kLogitRows * hp.n_vocab));
    };
    carve_host(host_sizing);
    pinned_bytes_ = host_sizing.used;
    try {
        pinned_ = backend_->alloc(MemoryKind::HOST_PINNED, pinned_bytes_);
    } catch (const Error &e) {
        spdlog::warn("{}; using pageable memory for the per-layer transfers (slower)", e.what());
        pageable_.reset(new uint8_t[pinned_bytes_ + 256]);
        pinned_ = nullptr;
    }
    Carver host{pinned_ ? static_cast<uint8_t *>(pinned_)
                        : reinterpret_cast<uint8_t *>(a256(reinterpret_cast<uintptr_t>(pageable_.get()))),
                0};
    carve_host(host);
    routing_.ids.reserve(size_t(pairs));
    routing_.weights.reserve(size_t(pairs));
    logits_.reserve(size_t(hp.n_vocab));
    // eval/eval_batch fill these every pass: sized once, as Context does.
    scratch_.tokens.reserve(size_t(nb));
    scratch_.runs.reserve(size_t(std::min(nb, params_.n_seq)) + 1);
    scratch_.out_rows.reserve(size_t(nb));

    // Offloading: host tier, hot-expert table, copy engine, loader, predictor, hybrid block.
    numa_text_ = apply_numa(config.numa, pci_numa_node(backend_->info().pci_bus_id));
    store_ = std::make_unique<ExpertStore>(model, backend_.get(), sc);
    cc.expert_bytes = store_->expert_bytes();
    cache_ = std::make_unique<ExpertCache>(cc, backend_.get());
    bool holds_all = config.placement.empty() && hp.n_layer_moe() > 0;
    for (int32_t l = int32_t(hp.n_layer_dense); l < L; ++l) holds_all = holds_all && cache_->layer_slots(l) >= E;
    if (holds_all) {
        // A budget that holds every expert loads them all at start-up, as llama.cpp -ngl 99 does (decision 0139):
        // every layer then runs whole on the device from the first step.
        plan_ = PlacementPlan::uniform(L, E, {HomeTier::GPU, ExecSite::AUTO});
    }
    CopyEngineConfig copy = config.copy;
    // load_fixed queues every fixed expert at once: room for all of them besides the usual requests.
    for (int32_t l = int32_t(hp.n_layer_dense); l < L; ++l) {
        for (int32_t e = 0; e < E; ++e) copy.max_requests += plan_.at(l, e).home == HomeTier::GPU;
    }
    engine_ = std::make_unique<CopyEngine>(*backend_, copy);
    loader_ = std::make_unique<ExpertLoader>(*backend_, *cache_, *engine_, plan_, store_->host_experts());
    loader_->load_fixed();
    const int32_t predict_tokens = int32_t(std::min<int64_t>(config.predict_max_tokens, nb));
    predictor_ = make_predictor(config, model, config.predictor == "oracle" ? 1 : predict_tokens, replay_.get(),
                                &oracle_);
    HybridMoeConfig hc;
    hc.planner.cpu_threshold = config.cpu_threshold;
    hc.planner.stream_min_batch = config.stream_min_batch;
    hc.planner.prefetch_window = predictor_ && cache_->n_slots() > 0 ? config.prefetch_window : 0;
    hc.planner.prefetch_max_per_layer = config.prefetch_max_per_layer;
    hc.planner.max_prefetch_in_flight = config.prefetch_in_flight;
    hc.planner.balance = config.load_balance;
    hc.planner.link_price = config.link_price;
    hc.planner.dump_path = config.dump_layer_states;
    hc.predict_max_tokens = oracle_ ? 1 : predict_tokens;
    const CostModel cost = runtime_cost_model(model, config, cpu::get_threads(), 1.5, &cost_notes_);
    std::vector<GpuSharedExpert> shared(static_cast<size_t>(L));
    for (int32_t l = 0; l < L; ++l) {
        shared[size_t(l)] = {layers_[size_t(l)].gate_shexp, layers_[size_t(l)].up_shexp, layers_[size_t(l)].down_shexp};
    }
    moe_device_ = std::make_unique<CudaMoeDevice>(*backend_, compute_, *store_, moe_shape, std::move(shared), ws_);
    moe_ = std::make_unique<HybridMoe>(model, *store_, plan_, cache_.get(), loader_.get(), engine_.get(),
                                       predictor_.get(), *moe_device_, backend_.get(), cost, hc, nb, hp.shared_expert);
    backend_->stream_synchronize(compute_);
    engine_->drain();  // the fixed experts' loads, so that the counters start from zero
    reset_stats();
}

GpuContext::~GpuContext() { release(); }

void GpuContext::release() noexcept {
    if (!backend_) return;
    try {
        // Work queued on the device may still read the buffers and wait on the loader's events.
        if (compute_) backend_->stream_synchronize(compute_);
        if (routing_side_) backend_->stream_synchronize(routing_side_);  // a copy a failed pass never joined
        moe_.reset();
        moe_device_.reset();
        loader_.reset();
        engine_.reset();
        cache_.reset();
        store_.reset();
        if (pinned_) backend_->free(MemoryKind::HOST_PINNED, pinned_);
        if (arena_dev_) backend_->free(MemoryKind::DEVICE, arena_dev_);
        if (weights_dev_) backend_->free(MemoryKind::DEVICE, weights_dev_);
        if (routing_ready_) backend_->event_destroy(routing_ready_);
        for (Event e : {routing_fork_, routing_join_}) {
            if (e) backend_->event_destroy(e);
        }
        if (routing_side_) backend_->stream_destroy(routing_side_);
        if (logits_ready_) backend_->event_destroy(logits_ready_);
        for (Event e : step_ready_) backend_->event_destroy(e);
        if (compute_) backend_->stream_destroy(compute_);
    } catch (const Error &e) {
        spdlog::error("while releasing the GPU runtime: {}", e.what());  // a dead device: nothing more to do
    }
    backend_.reset();
}

int64_t GpuContext::replay_ids(int64_t layer, int64_t n_tok) const {
    return 4 * params_.n_batch + layer * n_tok * model_.hp().n_expert_used;
}

int64_t GpuContext::replay_weights(int64_t layer, int64_t n_tok) const {
    return replay_ids(model_.hp().n_layer + layer, n_tok);
}

GpuContext::RoutingBlock GpuContext::routing_block(int64_t n_tok) const {
    const HParams &hp = model_.hp();
    RoutingBlock b;
    b.h = 0;
    b.ids = a256(size_t(n_tok * hp.n_embd) * 4);
    b.weights = b.ids + a256(size_t(n_tok * hp.n_expert_used) * 4);
    b.shared_gate = b.weights + a256(size_t(n_tok * hp.n_expert_used) * 4);
    b.bytes = b.shared_gate + (hp.shared_expert_gate ? size_t(n_tok) * 4 : 0);
    return b;
}

void GpuContext::upload_weights() {
    const HParams &hp = model_.hp();
    const ModelWeights &w = model_.weights();
    const int64_t n_q = hp.n_head * hp.head_dim, n_kv = hp.n_head_kv * hp.head_dim;
    // Every tensor once (a tied output head shares the embedding's bytes), 256-byte aligned.
    std::unordered_map<const void *, size_t> placed;
    std::vector<std::tuple<const void *, size_t, size_t>> copies;  // host, bytes, offset
    std::vector<std::pair<const void **, size_t>> fixups;          // device pointer field, offset
    size_t total = 0;
    auto place = [&](const void *host, size_t bytes, const void **field) {
        auto [it, fresh] = placed.try_emplace(host, total);
        if (fresh) {
            copies.emplace_back(host, bytes, total);
            total += a256(bytes);
        }
        fixups.emplace_back(field, it->second);
    };
    // A matrix, or n_head matrices back to back (MLA's per-head wk_b / wv_b): every byte of the tensor.
    auto matrix = [&](const TensorView &t, DevMatrix &m) {
        if (t.empty()) return;
        m.type = t.type;
        m.n_in = t.ne[0];
        m.n_out = t.ne[1];
        place(t.data, t.n_bytes(), &m.data);
    };
    auto vec = [&](const float *v, int64_t n, const float *&field) {
        if (v) place(v, size_t(n) * 4, reinterpret_cast<const void **>(&field));
    };
    matrix(w.tok_embd, tok_embd_);
    matrix(w.output, output_);
    vec(w.output_norm, hp.n_embd, output_norm_);
    layers_.resize(size_t(hp.n_layer));
    for (int64_t il = 0; il < hp.n_layer; ++il) {
        const LayerWeights &l = w.layers[size_t(il)];
        DevLayer &d = layers_[size_t(il)];
        vec(l.attn_norm, hp.n_embd, d.attn_norm);
        vec(l.ffn_norm, hp.n_embd, d.ffn_norm);
        vec(l.bq, n_q, d.bq);
        vec(l.bk, n_kv, d.bk);
        vec(l.bv, n_kv, d.bv);
        const bool per_head = hp.qk_norm == QkNorm::PER_HEAD;
        vec(l.q_norm, per_head ? hp.head_dim : n_q, d.q_norm);
        vec(l.k_norm, per_head ? hp.head_dim : n_kv, d.k_norm);
        matrix(l.wq, d.wq);
        matrix(l.wk, d.wk);
        matrix(l.wv, d.wv);
        matrix(l.wo, d.wo);
        matrix(l.gate_inp, d.gate_inp);
        vec(l.gate_inp_b, hp.n_expert, d.gate_inp_b);
        vec(l.bo, hp.n_embd, d.bo);
        vec(l.attn_sinks, hp.n_head, d.attn_sinks);
        vec(l.exp_probs_b, hp.n_expert, d.exp_probs_b);
        matrix(l.wq_a, d.wq_a);
        matrix(l.wq_b, d.wq_b);
        matrix(l.wkv_a_mqa, d.wkv_a);
        matrix(l.wk_b, d.wk_b);
        matrix(l.wv_b, d.wv_b);
        vec(l.q_a_norm, hp.q_lora_rank, d.q_a_norm);
        vec(l.kv_a_norm, hp.kv_lora_rank, d.kv_a_norm);
        matrix(l.ffn_gate, d.ffn_gate);
        matrix(l.ffn_up, d.ffn_up);
        matrix(l.ffn_down, d.ffn_down);
        matrix(l.gate_shexp, d.gate_shexp);
        matrix(l.up_shexp, d.up_shexp);
        matrix(l.down_shexp, d.down_shexp);
        if (l.gate_inp_shexp) {
            // The shared-expert gate vector as a 1-row F32 matrix: its logit comes from the matmul kernel.
            d.gate_inp_shexp = {DType::F32, hp.n_embd, 1, nullptr};
            place(l.gate_inp_shexp, size_t(hp.n_embd) * 4, &d.gate_inp_shexp.data);
        }
    }
    weights_bytes_ = total;
    weights_dev_ = backend_->alloc(MemoryKind::DEVICE, total);
    auto *base = static_cast<uint8_t *>(weights_dev_);
    for (auto [field, off] : fixups) *field = base + off;
    for (auto [host, bytes, off] : copies) backend_->copy_h2d_async(base + off, host, bytes, compute_);
    backend_->stream_synchronize(compute_);
}

// ---------------------------------------------------------------------------------------------------------------
// forward pass

void GpuContext::matmul(const DevMatrix &w, const float *x, int64_t n_tok, float *y, const float *residual) {
    const cuda::MatmulPart part{w.type, w.data, w.n_out, y, residual};
    cuda::matmul_parts(std::span<const cuda::MatmulPart>(&part, 1), w.n_in, x, n_tok, ws_, stream());
}

void GpuContext::eval(std::span<const int32_t> tokens, bool all_logits) {
    const HParams &hp = model_.hp();
    const auto n = int64_t(tokens.size());
    check_eval_input(hp, tokens, n_past_[0], params_.n_ctx);
    logits_.resize(size_t((all_logits ? n : 1) * hp.n_vocab));
    for (int64_t i = 0; i < n; i += params_.n_batch) {
        const int64_t m = std::min(params_.n_batch, n - i);
        const SeqRun run{0, m, n_past_[0]};
        scratch_.out_rows.clear();
        if (all_logits) {
            for (int64_t r = 0; r < m; ++r) scratch_.out_rows.push_back(r);
        } else if (i + m == n) {
            scratch_.out_rows.push_back(m - 1);
        }
        forward_pass(tokens.data() + i, m, {&run, 1}, scratch_.out_rows,
                     logits_.data() + (all_logits ? i * hp.n_vocab : 0));
    }
    moe_->collect_timings();
    (n == 1 ? tokens_decode_ : tokens_prefill_) += n;
}

void GpuContext::eval_batch(std::span<const SeqTokens> batch) {
    const HParams &hp = model_.hp();
    check_batch_input(hp, batch, n_past_, params_.n_ctx);
    int64_t n_out = 0;
    for (const SeqTokens &e : batch) {
        n_out += e.logits ? 1 : 0;
        (e.tokens.size() == 1 ? tokens_decode_ : tokens_prefill_) += int64_t(e.tokens.size());
    }
    logits_.resize(size_t(n_out * hp.n_vocab));
    split_batch(batch, n_past_, params_.n_batch, scratch_,
                [&](std::span<const int32_t> tokens, std::span<const SeqRun> runs, std::span<const int64_t> out_rows,
                    int64_t first_row) {
                    forward_pass(tokens.data(), int64_t(tokens.size()), runs, out_rows,
                                 logits_.data() + first_row * hp.n_vocab);
                });
    moe_->collect_timings();
}

int64_t GpuContext::n_past(int32_t seq) const {
    if (seq < 0 || seq >= params_.n_seq) {
        fail("sequence {} is outside [0, {}) (the context holds {} sequences)", seq, params_.n_seq, params_.n_seq);
    }
    return n_past_[size_t(seq)];
}

void GpuContext::clear() {
    std::fill(n_past_.begin(), n_past_.end(), 0);
    graph_seq_ = -1;
    moe_->reset();
}

void GpuContext::clear(int32_t seq) {
    n_past(seq);  // range check
    n_past_[size_t(seq)] = 0;  // the hot-expert table and predictor state are shared by every sequence: kept
}

void GpuContext::forward_pass(const int32_t *tokens, int64_t n, std::span<const SeqRun> runs,
                              std::span<const int64_t> out_rows, float *logits_out) {
    const HParams &hp = model_.hp();
    const int64_t nb = params_.n_batch;
    if (oracle_) {
        // The oracle scores the pass's last token's next layers from the replayed trace.
        oracle_->set_token((replay_->cursor() + n - 1) % replay_->trace().n_tokens());
    }
    // One upload per pass: token ids, positions, KV cache rows (sequence * n_ctx + position), logits rows.
    std::copy_n(tokens, n, tok_host_);
    int64_t t = 0;
    for (const SeqRun &r : runs) {
        for (int64_t i = 0; i < r.n; ++i, ++t) {
            tok_host_[nb + t] = int32_t(r.pos0 + i);
            tok_host_[2 * nb + t] = int32_t(r.seq * params_.n_ctx + r.pos0 + i);
        }
    }
    const auto n_rows = int64_t(out_rows.size());
    for (int64_t i = 0; i < n_rows; ++i) tok_host_[3 * nb + i] = int32_t(out_rows[size_t(i)]);
    size_t n_ints = size_t(4 * nb);
    if (replay_on_device(n)) {
        // [n_layer][n][k] after the four rows, then their weights: what the device resolves at each layer.
        for (int64_t il = hp.n_layer_dense; il < hp.n_layer; ++il) {
            replay_->peek_ids(il, n, tok_host_ + replay_ids(il, n));
            replay_->peek_weights(il, n, reinterpret_cast<float *>(tok_host_ + replay_weights(il, n)));
        }
        n_ints += size_t(2 * hp.n_layer * n * hp.n_expert_used);
    }
    const bool resident = moe_->device_resident();  // one scan of the slot table a pass
    const bool graph = resident && graph_pass(n, runs, n_rows);
    if (graph && graph_seq_ == runs[0].seq) {
        // The captured pass again: the same launches, with this pass's tokens and positions read on the device.
        for (int64_t il = hp.n_layer_dense; il < hp.n_layer; ++il) {
            moe_->replayed_device_layer(int32_t(il));
            device_steps_.emplace_back(int32_t(il), n);
        }
        graph_.launch(stream());
        ++graph_replays_;
    } else if (graph) {
        graph_.begin_capture(stream());
        capturing_ = true;
        try {
            queue_layers(n, runs, n_ints);
            queue_head(0, n_rows);
        } catch (...) {
            capturing_ = false;
            graph_seq_ = -1;
            routing_join_pending_ = false;  // its join was recorded in the dropped capture; its copies never ran
            graph_.abandon_capture(stream());
            throw;
        }
        capturing_ = false;
        graph_.end_capture(stream());
        graph_seq_ = runs[0].seq;
        graph_.launch(stream());
        ++graph_captures_;
    } else {
        if (!resident) graph_seq_ = -1;  // the slots may change: capture anew
        queue_layers(n, runs, n_ints);
    }
    for (const SeqRun &r : runs) n_past_[size_t(r.seq)] = r.pos0 + r.n;
    if (graph) {
        read_logits(n_rows, logits_out);
    } else {
        for (int64_t r0 = 0; r0 < n_rows; r0 += kLogitRows) {
            const int64_t m = std::min(kLogitRows, n_rows - r0);
            queue_head(r0, m);
            read_logits(m, logits_out + r0 * hp.n_vocab);
        }
    }
    account_device_steps(true);  // none pending between passes
}

bool GpuContext::graph_pass(int64_t n, std::span<const SeqRun> runs, int64_t n_rows) const {
    return config_.cuda_graphs && n == 1 && runs.size() == 1 && n_rows == 1 && !model_.hp().mla && !routing_override &&
           pinned_ != nullptr && step_routing_bytes_ > 0 && !cuda::sync_debug() && cuda::StreamGraph::available();
}

void GpuContext::queue_layers(int64_t n, std::span<const SeqRun> runs, size_t n_ints) {
    const HParams &hp = model_.hp();
    moe_device_->drop_router();  // one still held was left by a pass that failed
    backend_->copy_h2d_async(tok_dev_, tok_host_, n_ints * 4, compute_);
    cuda::get_rows(tok_embd_.type, tok_embd_.data, hp.n_embd, hp.n_vocab, tok_dev_, n, x_, stream());
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
    join_routing_copy();  // a captured pass must join its forks before it ends
}

void GpuContext::join_routing_copy() {
    if (!routing_join_pending_) return;
    backend_->stream_wait_event(compute_, routing_join_);
    routing_join_pending_ = false;
}

void GpuContext::attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs) {
    const NvtxRange range("attention");
    const HParams &hp = model_.hp();
    const DevLayer &l = layers_[size_t(il)];
    const int64_t n_q = hp.n_head * hp.head_dim, n_kv = hp.n_head_kv * hp.head_dim;
    const cudaStream_t s = stream();
    const int32_t *pos = tok_dev_ + params_.n_batch;

    const int64_t seq_stride = params_.n_ctx * n_kv;  // one sequence's cache of one layer
    float *kc = k_cache_ + il * params_.n_seq * seq_stride, *vc = v_cache_ + il * params_.n_seq * seq_stride;
    // One run writes its new keys and values straight to their cache rows; several go through k_new_/v_new_
    // and one scatter each (the projections stay one matmul over the whole pass), as does a captured pass, whose
    // launches may not depend on the position (its attention reads the position on the device too).
    const bool direct = runs.size() == 1 && !capturing_;
    float *k_new = direct ? kc + runs[0].seq * seq_stride + runs[0].pos0 * n_kv : k_new_;
    float *v_new = direct ? vc + runs[0].seq * seq_stride + runs[0].pos0 * n_kv : v_new_;
    const cuda::MatmulPart qkv[3] = {{l.wq.type, l.wq.data, l.wq.n_out, q_}, {l.wk.type, l.wk.data, l.wk.n_out, k_new},
                                     {l.wv.type, l.wv.data, l.wv.n_out, v_new}};
    // One launch, the activations quantized once; at decode the attention norm too (decision 0149).
    if (cuda::matmul_parts_fuse_norm(qkv, n)) {
        const cuda::RowNorm norm{l.attn_norm, hp.rms_eps};
        cuda::matmul_parts(qkv, hp.n_embd, x_, n, ws_, s, cuda::MatmulPath::AUTO, &norm);
    } else {
        cuda::rms_norm(x_, l.attn_norm, n, hp.n_embd, hp.rms_eps, hb_, s);
        cuda::matmul_parts(qkv, hp.n_embd, hb_, n, ws_, s);
    }
    const float mscale = hp.rope_yarn ? hp.rope_yarn->mscale : 1.0f;
    if (hp.qk_norm != QkNorm::FULL) {
        // Biases, per-head norms, RoPE and the moves into the cache rows in one launch (decision 0143).
        cuda::QkNormRopeArgs a;
        a.q = q_;
        a.k = k_new;
        const bool move_v = !direct || hp.qkv_bias;  // direct values without a bias are in place already
        a.v = move_v ? v_new : nullptr;
        a.k_out = direct ? k_new : kc;
        a.v_out = move_v ? (direct ? v_new : vc) : nullptr;
        a.rows = direct ? nullptr : tok_dev_ + 2 * params_.n_batch;
        if (hp.qkv_bias) a.bq = l.bq, a.bk = l.bk, a.bv = l.bv;
        if (hp.qk_norm == QkNorm::PER_HEAD) a.q_norm = l.q_norm, a.k_norm = l.k_norm;
        a.pos = pos;
        a.inv_freq = rope_freq_;
        a.n_head = hp.n_head, a.n_head_kv = hp.n_head_kv, a.head_dim = hp.head_dim;
        a.eps = hp.rms_eps, a.mscale = mscale;
        cuda::qk_norm_rope(a, n, hp.rope_mode, s);
    } else {
        if (hp.qkv_bias) {
            cuda::add_bias(q_, l.bq, n, n_q, s);
            cuda::add_bias(k_new, l.bk, n, n_kv, s);
            cuda::add_bias(v_new, l.bv, n, n_kv, s);
        }
        cuda::rms_norm(q_, l.q_norm, n, n_q, hp.rms_eps, q_, s);
        cuda::rms_norm(k_new, l.k_norm, n, n_kv, hp.rms_eps, k_new, s);
        cuda::rope(q_, n, hp.n_head, hp.head_dim, hp.head_dim, pos, rope_freq_, mscale, hp.rope_mode, s);
        cuda::rope(k_new, n, hp.n_head_kv, hp.head_dim, hp.head_dim, pos, rope_freq_, mscale, hp.rope_mode, s);
        if (!direct) {
            const int32_t *cache_rows = tok_dev_ + 2 * params_.n_batch;
            cuda::scatter_rows(k_new_, n, n_kv, cache_rows, kc, s);
            cuda::scatter_rows(v_new_, n, n_kv, cache_rows, vc, s);
        }
    }
    const int64_t n_q_row = hp.n_head * hp.head_dim;
    int64_t t0 = 0;
    for (const SeqRun &r : runs) {
        cuda::attention(q_ + t0 * n_q_row, kc + r.seq * seq_stride, vc + r.seq * seq_stride, r.n, r.pos0, hp.n_head,
                        hp.n_head_kv, hp.head_dim, 1.0f / std::sqrt(float(hp.head_dim)), attn_ + t0 * n_q_row, ws_,
                        s, l.attn_sinks, hp.window(il), capturing_ ? pos + t0 : nullptr);
        t0 += r.n;
    }
    if (l.bo) {
        matmul(l.wo, attn_, n, tmp_);
        cuda::add_bias(tmp_, l.bo, n, hp.n_embd, s);
        cuda::add(x_, tmp_, x_, n * hp.n_embd, s);
    } else {
        matmul(l.wo, attn_, n, x_, x_);  // onto the residual stream in place
    }
}

void GpuContext::mla_heads(int64_t il, int which, const DevMatrix &m, const float *x, int64_t n, float *y) {
    const int64_t H = model_.hp().n_head;
    cuda::ExpertMatmul g;
    g.type = m.type;
    g.n_in = m.n_in;
    g.n_out = m.n_out;
    g.n_expert = int32_t(H);
    g.w_dev = mla_w_ + (il * 2 + which) * H;
    g.w_host = mla_w_host_.data() + (il * 2 + which) * H;
    g.offsets_dev = mla_offsets_ + (n - 1) * (H + 1);
    g.offsets_host = mla_offsets_host_.data() + (n - 1) * (H + 1);
    cuda::expert_matmul(g, x, y, ws_, stream());  // rows_dev null: x is in pair (head-major) order
}

// runtime/context.cpp's mla_attention_block on the device: the cache holds per position c = rmsnorm(kv_a(h)[:r])
// and k_pe = rope(kv_a(h)[r:]); head j's query is (k_b_j^T q_nope_j, q_pe_j); attention is MQA over the cached
// rows with their first r floats as values; v_b_j maps head j's output to its value.
void GpuContext::mla_attention_block(int64_t il, int64_t n, std::span<const SeqRun> runs) {
    const NvtxRange range("attention (MLA)");
    const HParams &hp = model_.hp();
    const DevLayer &l = layers_[size_t(il)];
    const int64_t H = hp.n_head, nope = hp.head_dim_nope, rope = hp.head_dim_rope, r = hp.kv_lora_rank;
    const int64_t dq = nope + rope, dkv = r + rope, dv = hp.head_dim_v;
    const cudaStream_t s = stream();
    const int32_t *pos = tok_dev_ + params_.n_batch;
    const float mscale = hp.rope_yarn ? hp.rope_yarn->mscale : 1.0f;

    cuda::rms_norm(x_, l.attn_norm, n, hp.n_embd, hp.rms_eps, hb_, s);
    const int64_t seq_stride = params_.n_ctx * dkv;
    float *kc = k_cache_ + il * params_.n_seq * seq_stride;
    // The new latent rows: one run writes them to its cache rows, several through k_new_ and one scatter.
    const bool direct = runs.size() == 1;
    float *rows = direct ? kc + runs[0].seq * seq_stride + runs[0].pos0 * dkv : k_new_;
    if (hp.q_lora_rank > 0) {
        const cuda::MatmulPart parts[2] = {{l.wq_a.type, l.wq_a.data, l.wq_a.n_out, mla_qa_},
                                           {l.wkv_a.type, l.wkv_a.data, l.wkv_a.n_out, rows}};
        cuda::matmul_parts(parts, hp.n_embd, hb_, n, ws_, s);
        cuda::rms_norm(mla_qa_, l.q_a_norm, n, hp.q_lora_rank, hp.rms_eps, mla_qa_, s);
        matmul(l.wq_b, mla_qa_, n, mla_q_);
    } else {
        const cuda::MatmulPart parts[2] = {{l.wq.type, l.wq.data, l.wq.n_out, mla_q_},
                                           {l.wkv_a.type, l.wkv_a.data, l.wkv_a.n_out, rows}};
        cuda::matmul_parts(parts, hp.n_embd, hb_, n, ws_, s);
    }
    cuda::rms_norm(rows, l.kv_a_norm, n, r, hp.rms_eps, rows, s, dkv);
    cuda::rope(rows + r, n, 1, rope, dkv, pos, rope_freq_, mscale, hp.rope_mode, s);
    cuda::rope(mla_q_ + nope, n, H, rope, dq, pos, rope_freq_, mscale, hp.rope_mode, s);
    if (!direct) cuda::scatter_rows(k_new_, n, dkv, tok_dev_ + 2 * params_.n_batch, kc, s);

    // Absorbed queries in q_: [n][H][r + rope].
    cuda::copy_heads(mla_q_, {H * dq, dq}, mla_in_, {nope, n * nope}, n, H, nope, s);
    mla_heads(il, 0, l.wk_b, mla_in_, n, mla_out_);
    cuda::copy_heads(mla_out_, {r, n * r}, q_, {H * dkv, dkv}, n, H, r, s);
    cuda::copy_heads(mla_q_ + nope, {H * dq, dq}, q_ + r, {H * dkv, dkv}, n, H, rope, s);
    int64_t t0 = 0;
    for (const SeqRun &run : runs) {
        cuda::attention_latent(q_ + t0 * H * dkv, kc + run.seq * seq_stride, run.n, run.pos0, H, dkv, r, hp.kq_scale,
                               attn_ + t0 * H * r, ws_, s);
        t0 += run.n;
    }
    cuda::copy_heads(attn_, {H * r, r}, mla_in_, {r, n * r}, n, H, r, s);
    mla_heads(il, 1, l.wv_b, mla_in_, n, mla_out_);
    cuda::copy_heads(mla_out_, {dv, n * dv}, mla_v_, {H * dv, dv}, n, H, dv, s);
    matmul(l.wo, mla_v_, n, x_, x_);
}

void GpuContext::dense_ffn_block(int64_t il, int64_t n) {
    const NvtxRange range("dense FFN");
    const HParams &hp = model_.hp();
    const DevLayer &l = layers_[size_t(il)];
    const cudaStream_t s = stream();
    cuda::rms_norm(x_, l.ffn_norm, n, hp.n_embd, hp.rms_eps, hb_, s);
    const cuda::MatmulPart gate_up[2] = {{l.ffn_gate.type, l.ffn_gate.data, l.ffn_gate.n_out, ffn_g_},
                                         {l.ffn_up.type, l.ffn_up.data, l.ffn_up.n_out, ffn_u_}};
    cuda::matmul_parts(gate_up, hp.n_embd, hb_, n, ws_, s);
    cuda::swiglu(ffn_g_, ffn_u_, ffn_g_, n * hp.n_ff, s);
    matmul(l.ffn_down, ffn_g_, n, x_, x_);
}

void GpuContext::moe_block(int64_t il, int64_t n) {
    const HParams &hp = model_.hp();
    const DevLayer &l = layers_[size_t(il)];
    const int64_t k = hp.n_expert_used;
    const RoutingBlock b = routing_block(n);
    // The one device-to-host copy of the layer: routing, router input, shared gate; a decode-sized pass's comes from
    // and goes to the layer's own blocks, where it may wait to be read (below), so that the next router need not
    // wait for it. Then the device runs the routed experts it holds (issue 14), resolved from the routing it has (the
    // router's or the replayed trace's), while the host waits for the copy; a layer whose every expert it holds it
    // runs whole (decision 0138), and the host reads that routing later.
    const bool own_block = step_routing_bytes_ > 0 && n <= device_hits_tokens_;
    uint8_t *const dev_block = own_block ? step_routing_dev_ + size_t(il) * step_routing_bytes_ : routing_dev_;
    uint8_t *const host_block = own_block ? step_routing_host_ + size_t(il) * step_routing_bytes_ : routing_host_;
    auto *h = reinterpret_cast<float *>(dev_block + b.h);

    {
        const NvtxRange range("router and routing copy");
        cuda::RouterSpec spec = router_spec(hp);
        spec.logit_bias = l.gate_inp_b;
        spec.select_bias = l.exp_probs_b;
        auto *ids = reinterpret_cast<int32_t *>(dev_block + b.ids);
        auto *weights = reinterpret_cast<float *>(dev_block + b.weights);
        if (!own_block) join_routing_copy();  // the last layer's copy has read the block this router writes
        const Event copied = own_block ? step_ready_[size_t(il)] : routing_ready_;
        // The one-launch router (norm, router, top-k; decision 0143) goes to the MoE device, which fuses the
        // layer's slot resolution into it when it runs the layer's resident experts (then the copy follows).
        const bool one_launch =
            l.gate_inp.type == DType::F32 && n <= cuda::kMoeRouterMaxTokens && hp.n_embd <= cuda::kMoeRouterMaxEmbd;
        const bool handed_over = one_launch && !hp.shared_expert_gate;
        if (one_launch) {
            cuda::MoeRouterArgs a;
            a.x = x_, a.norm = l.ffn_norm, a.eps = hp.rms_eps, a.h = h;
            a.w = static_cast<const float *>(l.gate_inp.data), a.logits = router_logits_;
            a.ids = ids, a.weights = weights, a.counter = router_counter_;
            a.n_tok = n, a.n_embd = hp.n_embd, a.n_expert = int32_t(hp.n_expert), a.k = int32_t(k);
            if (handed_over) {
                moe_device_->defer_router(
                    {a, spec, {host_block, dev_block, b.bytes, routing_side_, routing_fork_, copied, routing_join_}});
            } else {
                cuda::moe_router(a, spec, stream());
            }
        } else {
            cuda::rms_norm(x_, l.ffn_norm, n, hp.n_embd, hp.rms_eps, h, stream());
            matmul(l.gate_inp, h, n, router_logits_);
            cuda::router_topk(router_logits_, n, hp.n_expert, k, spec, nullptr, ids, weights, stream());
        }
        if (!handed_over) {
            if (hp.shared_expert_gate) {
                matmul(l.gate_inp_shexp, h, n, reinterpret_cast<float *>(dev_block + b.shared_gate));
            }
            backend_->copy_d2h_forked(host_block, dev_block, b.bytes, compute_, routing_side_, routing_fork_, copied,
                                      routing_join_);
        }
        routing_join_pending_ = true;  // queued now, or with the router by the MoE device below
        const bool replayed = replay_on_device(n);
        moe_device_->set_layer(
            h, replayed ? tok_dev_ + replay_ids(il, n) : ids,
            replayed ? reinterpret_cast<const float *>(tok_dev_ + replay_weights(il, n)) : weights,
            x_, x_);  // the combine adds the MoE output to the residual stream in place
        const DeviceLaunch launched =
            routing_override ? DeviceLaunch::NONE : moe_->launch_device(int32_t(il), n, own_block);
        moe_device_->flush_router();  // no device launch took it: the router and its copy alone
        if (launched == DeviceLaunch::LAYER) {
            device_steps_.emplace_back(int32_t(il), n);
            if (!capturing_) account_device_steps(false);  // those already copied, while the device works
            return;
        }
        PRESCOPE_ASSERT(!capturing_);  // graph_pass: every layer runs whole
        moe_->mark_routing_copied(int32_t(il), compute_);
        backend_->event_synchronize(copied);
    }
    account_device_steps(true);  // copied before this layer's routing: their accounting comes first

    read_routing(il, n, host_block);
    const auto *h_host = reinterpret_cast<const float *>(host_block + b.h);
    const std::span<const float> shared_gate =
        hp.shared_expert_gate ? std::span<const float>(reinterpret_cast<const float *>(host_block + b.shared_gate),
                                                       size_t(n))
                              : std::span<const float>();
    const NvtxRange range("moe: plan, copies, GPU experts, prefetch, CPU experts, combine");
    moe_->run_layer(int32_t(il), h_host, routing_, shared_gate);
}

void GpuContext::read_routing(int64_t il, int64_t n, const uint8_t *block) {
    const RoutingBlock b = routing_block(n);
    const int64_t k = model_.hp().n_expert_used;
    routing_.n_tok = n;
    routing_.k = k;
    routing_.ids.resize(size_t(n * k));
    routing_.weights.resize(size_t(n * k));
    std::memcpy(routing_.ids.data(), block + b.ids, size_t(n * k) * 4);
    std::memcpy(routing_.weights.data(), block + b.weights, size_t(n * k) * 4);
    if (replay_) replay_->apply(il, routing_);
    if (routing_override) routing_override(il, routing_);
    if (on_routing) on_routing(il, routing_);
}

void GpuContext::account_device_steps(bool wait) {
    for (; device_steps_done_ < device_steps_.size(); ++device_steps_done_) {
        const auto [il, n] = device_steps_[device_steps_done_];
        const Event copied = step_ready_[size_t(il)];
        if (wait) {
            backend_->event_synchronize(copied);
        } else if (!backend_->event_query(copied)) {
            return;
        }
        const uint8_t *block = step_routing_host_ + size_t(il) * step_routing_bytes_;
        read_routing(il, n, block);
        moe_->account_device_layer(il, reinterpret_cast<const float *>(block + routing_block(n).h), routing_);
    }
    device_steps_.clear();
    device_steps_done_ = 0;
}

void GpuContext::queue_head(int64_t r0, int64_t m) {
    const NvtxRange range("output head");
    const HParams &hp = model_.hp();
    const int32_t *rows = tok_dev_ + 3 * params_.n_batch;
    // The wanted rows of the residual stream, gathered (F32 -> F32), then norm and head on m rows.
    cuda::convert_rows(DType::F32, x_, hp.n_embd, rows + r0, params_.n_batch, m, DType::F32, tmp_, stream());
    cuda::rms_norm(tmp_, output_norm_, m, hp.n_embd, hp.rms_eps, hb_, stream());
    matmul(output_, hb_, m, logits_dev_);
    backend_->copy_d2h_async(logits_host_, logits_dev_, size_t(m * hp.n_vocab) * 4, compute_);
    backend_->event_record(logits_ready_, compute_);
}

void GpuContext::read_logits(int64_t m, float *logits_out) {
    account_device_steps(true);  // while the head runs
    backend_->event_synchronize(logits_ready_);
    std::memcpy(logits_out, logits_host_, size_t(m * model_.hp().n_vocab) * 4);
}

// ---------------------------------------------------------------------------------------------------------------
// reports

std::string GpuContext::startup_text() const {
    const HParams &hp = model_.hp();
    std::string out;
    out += fmt::format("device: {}\n", backend_->info().describe());
    out += fmt::format("model: {} | {} layers, {} experts, top-{} | expert {} | non-expert weights on the GPU {}\n",
                       hp.arch, hp.n_layer, hp.n_expert, hp.n_expert_used,
                       format_byte_size(store_->layout(int32_t(hp.n_layer_dense)).bytes), format_byte_size(weights_bytes_));
    out += fmt::format("GPU memory: weights {} + KV cache and activations {} + MoE buffers {} + expert slots {} | "
                       "host transfers: {}\n",
                       format_byte_size(weights_bytes_), format_byte_size(arena_bytes_),
                       format_byte_size(moe_device_->device_bytes()),
                       format_byte_size(cache_->pool_bytes()),
                       pinned_ && moe_device_->host_pinned()
                           ? "pinned " + format_byte_size(pinned_bytes_ + moe_device_->host_bytes())
                           : std::string("pageable (pinning refused)"));
    out += store_->describe() + "\n";
    out += cache_->describe() + "\n";
    out += plan_.summary();
    if (!out.ends_with('\n')) out += '\n';
    out += fmt::format("predictor: {} (window {}) | plan: {} | stream_min_batch {} | copy engine: chunk {}, "
                       "depth {}{}\n",
                       predictor_ ? predictor_->name() : "none", predictor_ ? config_.prefetch_window : 0,
                       config_.cpu_threshold < 0 ? std::string("cost-model scheduler")
                                                 : fmt::format("threshold rule, cpu_threshold {}", config_.cpu_threshold),
                       config_.stream_min_batch, format_byte_size(config_.copy.chunk_bytes),
                       config_.copy.queue_depth,
                       config_.copy.bandwidth_cap_bytes_per_s > 0
                           ? fmt::format(", cap {:.2f} GB/s", config_.copy.bandwidth_cap_bytes_per_s / 1e9)
                           : std::string());
    out += (replay_ ? replay_->describe() : std::string("routing: the model's router")) + "\n";
    out += moe_->planner()->cost().describe();
    out += fmt::format("  terms: {}\n", cost_notes_);
    out += numa_text_;
    return out;
}

namespace {

CopyStats minus(CopyStats a, const CopyStats &b) {
    a.requests_submitted -= b.requests_submitted;
    a.requests_done -= b.requests_done;
    a.requests_cancelled -= b.requests_cancelled;
    a.requests_promoted -= b.requests_promoted;
    a.chunks_done -= b.chunks_done;
    a.bytes_done -= b.bytes_done;
    a.bytes_demand -= b.bytes_demand;
    a.bytes_prefetch -= b.bytes_prefetch;
    a.busy_us -= b.busy_us;
    return a;
}

} // namespace

void GpuContext::reset_stats() {
    cache_->reset_stats();
    copy_base_ = engine_->stats();
    tokens_prefill_ = tokens_decode_ = 0;
    graph_captures_ = graph_replays_ = 0;
}

std::string GpuContext::stats_text() const {
    const LayerStats t = cache_->total_stats();
    const CopyStats c = minus(engine_->stats(), copy_base_);
    const int64_t tokens = tokens_prefill_ + tokens_decode_;
    std::string out = fmt::format("offload counters: {} tokens ({} prefill, {} decode)\n", tokens, tokens_prefill_,
                                  tokens_decode_);
    out += cache_->stats_table();
    out += fmt::format("hit rate {:.1f}% | prefetch hits {} | wasted prefetch {} | demand misses {} | CPU runs {} | "
                       "stall {:.2f} ms (device waits {:.2f} ms, waits for copy issue {:.2f} ms)\n",
                       100.0 * t.hit_rate(), t.prefetch_hits, format_byte_size(t.wasted_prefetch_bytes),
                       t.demand_misses, t.cpu_runs, t.stall_us * 1e-3, t.device_stall_us * 1e-3,
                       t.wait_issue_us * 1e-3);
    out += fmt::format("PCIe: {} host-to-device ({} demand, {} prefetch), {:.2f} GB/s while copying, {} per token; "
                       "requests {} done, {} cancelled, {} promoted\n",
                       format_byte_size(c.bytes_done), format_byte_size(c.bytes_demand),
                       format_byte_size(c.bytes_prefetch), c.achieved_gb_s(),
                       format_byte_size(tokens ? c.bytes_done / uint64_t(tokens) : 0), c.requests_done,
                       c.requests_cancelled, c.requests_promoted);
    out += fmt::format("host: CPU experts {:.1f} ms, predictor and prefetch {:.1f} ms | streamed {} experts in {} "
                       "waves | split layers {}\n",
                       t.cpu_expert_us * 1e-3, t.predict_us * 1e-3, t.streamed, t.stream_waves, t.split_steps);
    // Where a token's time goes besides the GPU's own work (issue 14): the host's MoE steps, and the compute
    // stream waiting for the host's plan or for expert bytes (both event-timed on timed steps).
    const double per_token = tokens > 0 ? 1e-3 / double(tokens) : 0.0;
    out += fmt::format("per token: host MoE steps {:.3f} ms ({:.1f} us per layer step) | GPU idle {:.3f} ms waiting for "
                       "the host's plan + {:.3f} ms waiting for expert bytes\n",
                       t.host_us * per_token, t.steps ? t.host_us / double(t.steps) : 0.0, t.gpu_idle_us * per_token,
                       t.device_stall_us * per_token);
    const CostCorrections &k = moe_->planner()->balancer().corrections();
    out += fmt::format("scheduler: predicted critical path {:.2f} ms, CPU-GPU finish gap {:.2f} ms (|gap| {:.2f} ms), "
                       "prefetches planned {}, corrections {} (now cpu x{:.3f} gpu x{:.3f} link x{:.3f})\n",
                       t.predicted_us * 1e-3, t.finish_gap_us * 1e-3, t.finish_gap_abs_us * 1e-3, t.prefetch_planned,
                       t.corrections, k.cpu, k.gpu, k.link);
    if (replay_) out += fmt::format("routing: {} tokens replayed from {}\n", replay_->tokens_replayed(), replay_->path());
    out += fmt::format("CUDA graphs: {} decode passes replayed, {} captured ({})\n", graph_replays_, graph_captures_,
                       !config_.cuda_graphs || !cuda::StreamGraph::available() ? "off"
                       : moe_->device_resident() ? "every expert has its home on the GPU"
                                                 : "off while some expert is not resident");
    return out;
}

nlohmann::json GpuContext::stats_json() const {
    const LayerStats t = cache_->total_stats();
    const CopyStats c = minus(engine_->stats(), copy_base_);
    const int64_t tokens = tokens_prefill_ + tokens_decode_;
    nlohmann::json j;
    j["routing"] = routing_source(replay_.get());
    j["device"] = backend_->name();
    j["gpu_mem_gib"] = double(weights_bytes_ + arena_bytes_ + moe_device_->device_bytes() +
                              cache_->pool_bytes()) /
                       double(uint64_t(1) << 30);
    j["expert_slots"] = cache_->n_slots();
    j["hit_rate"] = t.hit_rate();
    j["pcie_gb_s"] = c.achieved_gb_s();
    j["pcie_bytes"] = c.bytes_done;
    j["pcie_bytes_per_token"] = tokens ? double(c.bytes_done) / double(tokens) : 0.0;
    j["tokens"] = tokens;
    j["stall_ms"] = t.stall_us * 1e-3;
    j["device_stall_ms"] = t.device_stall_us * 1e-3;
    j["cpu_expert_ms"] = t.cpu_expert_us * 1e-3;
    j["predict_ms"] = t.predict_us * 1e-3;
    j["streamed_experts"] = t.streamed;
    j["stream_waves"] = t.stream_waves;
    j["split_layers"] = t.split_steps;
    j["finish_gap_ms"] = t.finish_gap_us * 1e-3;
    j["corrections"] = t.corrections;
    j["graph_replays"] = graph_replays_;
    j["graph_captures"] = graph_captures_;
    j["cost_model"] = moe_->planner()->cost().to_json();
    j["copy"] = {{"bytes_done", c.bytes_done},
                 {"bytes_demand", c.bytes_demand},
                 {"bytes_prefetch", c.bytes_prefetch},
                 {"requests_done", c.requests_done},
                 {"requests_cancelled", c.requests_cancelled},
                 {"requests_promoted", c.requests_promoted},
                 {"busy_ms", c.busy_us * 1e-3}};
    j["cache"] = cache_->stats_json();
    j["predictor"] = predictor_ ? predictor_->name() : "none";
    return j;
}

} // namespace prescope

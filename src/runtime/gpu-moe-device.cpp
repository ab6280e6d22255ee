// CudaMoeDevice: buffers, the grouped expert products of a wave, the shared expert, the combine. The kernels
// and their order are those of the former GpuContext::launch_gpu / combine (decision 0035).
#include "runtime/gpu-moe-device.h"

#include "backend/cpu/ops.h"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/moe.cuh"
#include "core/error.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>

namespace prescope {

namespace {

size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }
size_t a256(size_t n) { return align_up(n, 256); }

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

// A layer's waves (at most one per expert, plus the split FETCH wave) split the expert arrays between them:
// 5 more alignments each.
uint64_t meta_bytes_for(const CudaMoeDevice::Shape &s) {
    const auto E = size_t(s.n_experts), pairs = size_t(s.n_batch * s.top_k), nb = size_t(s.n_batch);
    return 3 * align_up(E * sizeof(void *), 16) + align_up((E + 1) * 4, 16) + align_up(pairs * 4, 16) +
           2 * align_up(nb * size_t(s.top_k + 1) * 4, 16) + (E + 1) * (4 + 5 * 16);
}

template <typename Take>
void carve_device(const CudaMoeDevice::Shape &s, Take &&take) {
    const int64_t pairs = s.n_batch * s.top_k;
    take(0, size_t(pairs * s.n_ff) * 4);                 // gate
    take(1, size_t(pairs * s.n_ff) * 4);                 // up
    take(2, size_t((pairs + s.n_batch) * s.n_embd) * 4); // pairs
    if (s.n_ff_shexp > 0) {
        take(3, size_t(s.n_batch * s.n_ff_shexp) * 4);
        take(4, size_t(s.n_batch * s.n_ff_shexp) * 4);
    }
    take(5, meta_bytes_for(s));
    if (s.device_hits_tokens > 0) {
        take(6, size_t(s.n_layers * s.n_experts) * sizeof(void *));
        take(7, size_t(3 * s.n_experts) * sizeof(void *));
        take(8, size_t(s.n_experts + 1) * 4);
        take(9, size_t(s.device_hits_tokens * s.top_k) * 4);
        take(10, size_t(s.device_hits_tokens * (s.top_k + 1)) * 4);
        take(11, size_t(s.device_hits_tokens * (s.top_k + 1)) * 4);
    }
}

} // namespace

uint64_t CudaMoeDevice::device_bytes_for(const Shape &s) {
    uint64_t total = 0;
    carve_device(s, [&](int, size_t bytes) { total += a256(bytes); });
    return total;
}

CudaMoeDevice::CudaMoeDevice(CudaBackend &backend, Stream compute, const ExpertStore &store, const Shape &shape,
                             std::vector<GpuSharedExpert> shared, cuda::Workspace ws)
    : backend_(backend), compute_(compute), store_(store), shape_(shape), shared_(std::move(shared)), ws_(ws) {
    meta_bytes_ = meta_bytes_for(shape);
    device_bytes_ = device_bytes_for(shape);
    device_ = backend_.alloc(MemoryKind::DEVICE, device_bytes_);
    auto *base = static_cast<uint8_t *>(device_);
    size_t off = 0;
    carve_device(shape, [&](int part, size_t bytes) {
        uint8_t *p = base + off;
        off += a256(bytes);
        switch (part) {
        case 0: gate_ = reinterpret_cast<float *>(p); break;
        case 1: up_ = reinterpret_cast<float *>(p); break;
        case 2: pairs_ = reinterpret_cast<float *>(p); break;
        case 3: sh_gate_ = reinterpret_cast<float *>(p); break;
        case 4: sh_up_ = reinterpret_cast<float *>(p); break;
        case 5: meta_dev_ = p; break;
        case 6: table_dev_ = reinterpret_cast<const void **>(p); break;
        case 7: hit_w_dev_ = reinterpret_cast<const void **>(p); break;
        case 8: hit_offsets_dev_ = reinterpret_cast<int32_t *>(p); break;
        case 9: hit_rows_dev_ = reinterpret_cast<int32_t *>(p); break;
        case 10: step_pair_ids_dev_ = reinterpret_cast<int32_t *>(p); break;
        case 11: step_weights_dev_ = reinterpret_cast<float *>(p); break;
        }
    });
    if (table_dev_) {
        // Nothing is resident for the device until HybridMoe sets entries.
        const std::vector<const void *> empty(size_t(shape.n_layers * shape.n_experts), nullptr);
        backend_.copy_h2d_async(table_dev_, empty.data(), empty.size() * sizeof(void *), compute_);
        backend_.stream_synchronize(compute_);
    }
    // Pinned host mirrors of what crosses the link every layer; pageable when page-locking is refused.
    auto carve_host = [&](Carver &c) {
        meta_host_ = c.take<uint8_t>(meta_bytes_);
        cpu_out_host_ = c.take<float>(size_t(shape.n_batch * shape.top_k * shape.n_embd));
    };
    Carver sizing;
    carve_host(sizing);
    host_bytes_ = sizing.used;
    try {
        pinned_ = backend_.alloc(MemoryKind::HOST_PINNED, host_bytes_);
    } catch (const Error &e) {
        spdlog::warn("{}; using pageable memory for the MoE step arrays and CPU expert rows (slower)", e.what());
        pageable_.reset(new uint8_t[host_bytes_ + 256]);
        pinned_ = nullptr;
    }
    Carver host{pinned_ ? static_cast<uint8_t *>(pinned_)
                        : reinterpret_cast<uint8_t *>(a256(reinterpret_cast<uintptr_t>(pageable_.get()))),
                0};
    carve_host(host);
}

CudaMoeDevice::~CudaMoeDevice() {
    try {
        backend_.stream_synchronize(compute_);  // queued work reads these buffers
        if (pinned_) backend_.free(MemoryKind::HOST_PINNED, pinned_);
        backend_.free(MemoryKind::DEVICE, device_);
    } catch (const Error &e) {
        spdlog::error("while releasing the MoE device buffers: {}", e.what());
    }
}

void CudaMoeDevice::matmul(const GpuMatrix &w, const float *x, int64_t n_tok, float *y) {
    cuda::matmul(w.type, w.data, w.n_in, w.n_out, x, n_tok, y, ws_, stream());
}

void CudaMoeDevice::launch_gpu(const MoeStep &s) {
    const ExpertLayout &x = store_.layout(s.layer);
    PRESCOPE_ASSERT(h_dev_ && out_dev_);
    // Pack the wave's arrays into the pinned mirror; one host-to-device copy moves them. The waves of a layer
    // fill consecutive parts of it (an earlier wave's copy may not have run yet); wave 0 starts over, since
    // the host read the previous layer's routing, after its copies ran, before this layer began.
    const size_t start = s.wave == 0 ? 0 : meta_used_;
    size_t off = start;
    auto put = [&](const void *src, size_t bytes) {
        const size_t o = off;
        if (bytes) std::memcpy(meta_host_ + o, src, bytes);
        off = align_up(o + bytes, 16);
        return o;
    };
    const int32_t n_gpu = s.wave_end - s.wave_begin;
    const int32_t pair0 = s.gpu_offsets[size_t(s.wave_begin)];
    const int64_t n_pairs = s.gpu_offsets[size_t(s.wave_end)] - pair0;
    const size_t n_ptr = size_t(n_gpu) * sizeof(void *);
    const size_t o_gate = off;
    off = align_up(o_gate + n_ptr, 16);
    const size_t o_up = off;
    off = align_up(o_up + n_ptr, 16);
    const size_t o_down = off;
    off = align_up(o_down + n_ptr, 16);
    auto *gate_w = reinterpret_cast<const void **>(meta_host_ + o_gate);
    auto *up_w = reinterpret_cast<const void **>(meta_host_ + o_up);
    auto *down_w = reinterpret_cast<const void **>(meta_host_ + o_down);
    auto *offsets = reinterpret_cast<int32_t *>(meta_host_ + off);  // the wave's, from 0
    const size_t o_off = off;
    off = align_up(o_off + size_t(n_gpu + 1) * 4, 16);
    for (int32_t i = 0; i < n_gpu; ++i) {
        const auto *slot = static_cast<const uint8_t *>(s.gpu_expert[size_t(s.wave_begin + i)]);
        gate_w[i] = slot;
        up_w[i] = slot + x.up_offset;
        down_w[i] = slot + x.down_offset;
    }
    for (int32_t i = 0; i <= n_gpu; ++i) offsets[i] = s.gpu_offsets[size_t(s.wave_begin + i)] - pair0;
    const size_t o_rows = put(s.gpu_rows.data() + pair0, size_t(n_pairs) * 4);
    if (s.wave == 0) {
        const size_t o_pid = put(s.pair_ids.data(), size_t(s.n_tok * s.k_comb) * 4);
        const size_t o_w = put(s.weights.data(), size_t(s.n_tok * s.k_comb) * 4);
        pair_ids_dev_ = reinterpret_cast<const int32_t *>(meta_dev_ + o_pid);
        weights_dev_ = reinterpret_cast<const float *>(meta_dev_ + o_w);
    }
    PRESCOPE_ASSERT(off <= meta_bytes_);
    backend_.copy_h2d_async(meta_dev_ + start, meta_host_ + start, off - start, compute_);
    meta_used_ = off;

    if (n_gpu > 0) {
        cuda::ExpertMatmul g;
        g.n_expert = n_gpu;
        g.offsets_dev = reinterpret_cast<const int32_t *>(meta_dev_ + o_off);
        g.offsets_host = offsets;
        g.rows_dev = reinterpret_cast<const int32_t *>(meta_dev_ + o_rows);
        const ExpertLists w{{reinterpret_cast<const void *const *>(meta_dev_ + o_gate),
                             reinterpret_cast<const void *const *>(meta_dev_ + o_up),
                             reinterpret_cast<const void *const *>(meta_dev_ + o_down)},
                            {gate_w, up_w, down_w}};
        expert_ffn(x, g, w, pair0, n_pairs);
    }
    if (s.wave == 0 && s.k_comb > s.k) shared_expert(s.layer, s.n_tok, s.n_gpu_pairs + s.n_cpu_pairs);
}

void CudaMoeDevice::shared_expert(int32_t layer, int64_t n_tok, int64_t row0) {
    const GpuSharedExpert &l = shared_[size_t(layer)];
    const cudaStream_t st = stream();
    const cuda::MatmulPart gate_up[2] = {{l.gate.type, l.gate.data, l.gate.n_out, sh_gate_},
                                         {l.up.type, l.up.data, l.up.n_out, sh_up_}};
    cuda::matmul_parts(gate_up, l.gate.n_in, h_dev_, n_tok, ws_, st);
    cuda::swiglu(sh_gate_, sh_up_, sh_gate_, n_tok * shape_.n_ff_shexp, st);
    matmul(l.down, sh_gate_, n_tok, pairs_ + row0 * shape_.n_embd);
}

void CudaMoeDevice::defer_router(const RouterLaunch &r) {
    const RoutingCopy &c = r.copy;
    PRESCOPE_ASSERT(!router_held_ && c.dst && c.src && c.side && c.fork && c.done && c.join);
    router_ = r;
    router_held_ = true;
}

void CudaMoeDevice::flush_router() {
    if (router_held_) launch_router(nullptr, {}, {});
}

void CudaMoeDevice::launch_router(const cuda::DeviceHitsArgs *resolve, std::span<const int32_t> index,
                                  std::span<const void *const> data) {
    PRESCOPE_ASSERT(router_held_ && index.size() == data.size());
    router_held_ = false;
    cuda::moe_router(router_.args, router_.spec, stream(), resolve, index.data(), data.data(), int64_t(index.size()));
    const RoutingCopy &c = router_.copy;
    backend_.copy_d2h_forked(c.dst, c.src, c.n_bytes, compute_, c.side, c.fork, c.done, c.join);
}

void CudaMoeDevice::launch_device_hits(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                                      std::span<const void *const> data) {
    resolve_and_run(layer, n_tok, index, data, false);
}

void CudaMoeDevice::launch_device_layer(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                                       std::span<const void *const> data) {
    PRESCOPE_ASSERT(n_tok >= 1 && out_dev_);
    resolve_and_run(layer, n_tok, index, data, true);
    const bool shared = shape_.n_ff_shexp > 0;
    if (shared) shared_expert(layer, n_tok, n_tok * shape_.top_k);
    cuda::moe_combine(pairs_, step_pair_ids_dev_, step_weights_dev_, n_tok, shape_.top_k + shared, shape_.n_embd,
                      residual_dev_, out_dev_, stream());
}

void CudaMoeDevice::resolve_and_run(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                                    std::span<const void *const> data, bool whole) {
    PRESCOPE_ASSERT(table_dev_ && n_tok >= 0 && n_tok <= shape_.device_hits_tokens && index.size() == data.size());
    PRESCOPE_ASSERT(n_tok == 0 || (h_dev_ && ids_dev_));
    PRESCOPE_ASSERT(!whole || routing_weights_dev_);
    const ExpertLayout &x = store_.layout(layer);
    const cudaStream_t st = stream();
    const int64_t E = shape_.n_experts, n_pairs = n_tok * shape_.top_k;
    cuda::DeviceHitsArgs a;
    a.table = table_dev_;
    a.layer = layer;
    a.n_expert = int32_t(E);
    a.ids = ids_dev_;
    a.n_tok = n_tok;
    a.k = shape_.top_k;
    a.up_offset = int64_t(x.up_offset);
    a.down_offset = int64_t(x.down_offset);
    a.gate_w = hit_w_dev_;
    a.up_w = hit_w_dev_ + E;
    a.down_w = hit_w_dev_ + 2 * E;
    a.offsets = hit_offsets_dev_;
    a.rows = hit_rows_dev_;
    if (whole) {
        a.weights_in = routing_weights_dev_;
        a.pair_ids = step_pair_ids_dev_;
        a.weights = step_weights_dev_;
        a.k_comb = shape_.top_k + (shape_.n_ff_shexp > 0);
    }
    if (router_held_) {
        launch_router(&a, index, data);  // one launch: the router, then the resolution by its last block
    } else {
        cuda::resolve_device_hits(a, index.data(), data.data(), int64_t(index.size()), st);
    }
    if (n_tok == 0) return;

    // The grouped products with the groups known to the device only: a GEMV block per group and row block, the
    // empty groups leaving at once; pair rows [0, n) as the host's layout numbers them.
    cuda::ExpertMatmul g;
    g.n_expert = int32_t(std::min(E, n_pairs));
    g.offsets_dev = hit_offsets_dev_;
    g.rows_dev = hit_rows_dev_;
    g.n_pairs_max = n_pairs;
    g.max_group_pairs = int32_t(n_tok);
    expert_ffn(x, g, ExpertLists{{a.gate_w, a.up_w, a.down_w}, {}}, 0, n_pairs);
}

void CudaMoeDevice::expert_ffn(const ExpertLayout &x, cuda::ExpertMatmul g, const ExpertLists &w, int64_t pair0,
                               int64_t n_pairs) {
    const cudaStream_t st = stream();
    float *gate = gate_ + pair0 * x.n_ff, *up = up_ + pair0 * x.n_ff;
    g.n_in = shape_.n_embd;
    g.n_out = x.n_ff;
    g.type = x.gate_type;
    g.w_dev = w.dev[0];
    g.w_host = w.host[0];
    g.type2 = x.up_type;
    g.w2_dev = w.dev[1];
    g.w2_host = w.host[1];
    // Plain SwiGLU experts take it in the gate/up product (decision 0143); biased experts (gpt-oss) carry their
    // biases in their slot, after the matrices (ExpertLayout::bias_offset), added before their clamped SwiGLU.
    const bool plain = x.bias_offset == 0 && !shape_.swiglu_oai;
    g.glu = plain;
    cuda::expert_matmul(g, h_dev_, gate, ws_, st, cuda::MatmulPath::AUTO, up);
    const int64_t n_groups = g.n_expert;
    if (x.bias_offset > 0) {
        cuda::add_group_bias(gate, x.n_ff, w.dev[0], x.bias_offset, g.offsets_dev, n_groups, st);
        cuda::add_group_bias(up, x.n_ff, w.dev[0], x.bias_offset + uint64_t(x.n_ff) * 4, g.offsets_dev, n_groups, st);
    }
    if (shape_.swiglu_oai) {
        cuda::swiglu_oai(gate, up, gate, n_pairs * x.n_ff, cpu::kSwigluOaiAlpha, cpu::kSwigluOaiLimit, st);
    } else if (!plain) {
        cuda::swiglu(gate, up, gate, n_pairs * x.n_ff, st);
    }
    g.type = x.down_type;
    g.n_in = x.n_ff;
    g.n_out = shape_.n_embd;
    g.rows_dev = nullptr;  // the intermediates are already in pair order
    g.w_dev = w.dev[2];
    g.w_host = w.host[2];
    g.w2_dev = g.w2_host = nullptr;
    g.glu = false;
    float *y = pairs_ + pair0 * shape_.n_embd;
    cuda::expert_matmul(g, gate, y, ws_, st);
    if (x.bias_offset > 0) {
        cuda::add_group_bias(y, shape_.n_embd, w.dev[0], x.bias_offset + uint64_t(2 * x.n_ff) * 4, g.offsets_dev,
                             n_groups, st);
    }
}

void CudaMoeDevice::combine(const MoeStep &s) {
    const int64_t n_embd = shape_.n_embd;
    if (s.n_cpu_pairs > 0) {
        backend_.copy_h2d_async(pairs_ + s.n_gpu_pairs * n_embd, cpu_out_host_, size_t(s.n_cpu_pairs * n_embd) * 4,
                                compute_);
    }
    cuda::moe_combine(pairs_, pair_ids_dev_, weights_dev_, s.n_tok, s.k_comb, n_embd, residual_dev_, out_dev_,
                      stream());
}

} // namespace prescope

// The device half of the MoE block on CUDA (CUDA builds only): the grouped expert products over slot
// pointers, the shared expert, and the combine in top-k order; it owns its buffers (expert intermediates, the
// pair buffer, the shared expert's scratch, the per-layer step arrays and their pinned mirror, the pinned rows
// of the CPU experts). GpuContext keeps attention, router and head, and hands it the router input per layer.
#pragma once

#include "backend/cuda/common.cuh"
#include "backend/cuda/cuda-backend.h"
#include "backend/cuda/matmul.cuh"
#include "backend/cuda/moe.cuh"
#include "offload/expert-store.h"
#include "runtime/hybrid-moe.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace prescope {

/// A weight matrix on the device in its file dtype: n_out rows of n_in elements.
struct GpuMatrix {
    DType type = DType::F32;
    int64_t n_in = 0, n_out = 0;
    const void *data = nullptr;
    bool empty() const { return data == nullptr; }
};

/// The shared expert of one layer (qwen2moe), empty matrices when the model has none.
struct GpuSharedExpert {
    GpuMatrix gate, up, down;
};

class CudaMoeDevice final : public MoeDevice {
  public:
    struct Shape {
        int64_t n_embd = 0;
        int64_t n_ff = 0;         // largest expert FFN of any layer
        int64_t n_batch = 0;      // tokens per forward pass at most
        int64_t top_k = 0;
        int64_t n_experts = 0;
        int64_t n_ff_shexp = 0;   // shared expert FFN, 0 = none
        int64_t n_layers = 0;
        int64_t device_hits_tokens = 0;  // most tokens of the device-resolved hit path (issue 14), 0 = off
        bool swiglu_oai = false;         // the experts' activation is gpt-oss's clamped SwiGLU (HParams::expert_act)
    };
    /// Device bytes the constructor allocates for `shape` (for the start-up memory check).
    static uint64_t device_bytes_for(const Shape &shape);

    /// Allocates its buffers (device; host pinned, or pageable with a warning when pinning is refused).
    /// backend, store and the matrices outlive it; ws is the context's workspace (ops run in stream order and
    /// share it). Throws prescope::Error when device memory runs out.
    CudaMoeDevice(CudaBackend &backend, Stream compute, const ExpertStore &store, const Shape &shape,
                  std::vector<GpuSharedExpert> shared, cuda::Workspace ws);
    ~CudaMoeDevice() override;
    CudaMoeDevice(const CudaMoeDevice &) = delete;
    CudaMoeDevice &operator=(const CudaMoeDevice &) = delete;

    /// The running layer's router input [n_tok][n_embd], its routed experts and their weights [n_tok][top_k]
    /// (read by launch_device_hits and launch_device_layer) and where combine writes [n_tok][n_embd], on the
    /// device: the MoE output, or with residual_dev (which may be out_dev itself) the residual stream plus it
    /// (cuda::moe_combine).
    void set_layer(const float *h_dev, const int32_t *ids_dev, const float *weights_dev, float *out_dev,
                   const float *residual_dev = nullptr) {
        h_dev_ = h_dev;
        ids_dev_ = ids_dev;
        routing_weights_dev_ = weights_dev;
        out_dev_ = out_dev;
        residual_dev_ = residual_dev;
    }
    /// The routing copy that follows a router: CudaBackend::copy_d2h_forked's arguments after the compute stream.
    struct RoutingCopy {
        void *dst = nullptr;        // host: the routing block
        const void *src = nullptr;  // device
        size_t n_bytes = 0;
        Stream side = nullptr;
        Event fork = nullptr, done = nullptr, join = nullptr;
    };
    /// A decode-sized layer's router launch (cuda::moe_router) and the routing copy that must follow it, handed
    /// over by GpuContext so that the layer's slot resolution runs in the router's own launch (issue 14).
    struct RouterLaunch {
        cuda::MoeRouterArgs args;
        cuda::RouterSpec spec;
        RoutingCopy copy;
    };
    /// Holds r until the next launch_device_hits / launch_device_layer, which queues the router with its
    /// resolution fused in, then the copy, then the experts; or until flush_router or drop_router.
    void defer_router(const RouterLaunch &r);
    /// Queues a deferred router that no device launch took (and its copy); nothing when none is held.
    void flush_router();
    /// Forgets a deferred router without queueing it (one left by a pass that failed).
    void drop_router() { router_held_ = false; }
    uint64_t device_bytes() const { return device_bytes_; }
    uint64_t host_bytes() const { return host_bytes_; }
    bool host_pinned() const { return pinned_ != nullptr; }

    Stream compute_stream() override { return compute_; }
    void launch_gpu(const MoeStep &s) override;
    float *cpu_out() override { return cpu_out_host_; }
    void combine(const MoeStep &s) override;
    int64_t device_hits_max_tokens() const override { return shape_.device_hits_tokens; }
    void launch_device_hits(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                            std::span<const void *const> data) override;
    void launch_device_layer(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                             std::span<const void *const> data) override;

  private:
    /// The table updates, then the routed experts the table holds (whole: every one, and the combine's pair ids
    /// and weights into step_pair_ids_dev_ / step_weights_dev_) into pair rows [0, n_tok * top_k).
    void resolve_and_run(int32_t layer, int64_t n_tok, std::span<const int32_t> index, std::span<const void *const> data,
                         bool whole);
    /// The layer's shared expert over the router input's n_tok rows into pair rows [row0, row0 + n_tok).
    void shared_expert(int32_t layer, int64_t n_tok, int64_t row0);
    void matmul(const GpuMatrix &w, const float *x, int64_t n_tok, float *y);
    /// Each expert's gate, up and down matrices: device lists and their host copies (all null for groups the
    /// device resolved itself, cuda::ExpertMatmul's device-resolved mode).
    struct ExpertLists {
        const void *const *dev[3];
        const void *const *host[3];
    };
    /// The routed FFN of g's groups (g: the group fields set, offsets, rows, counts): gate and up over the router
    /// input, SwiGLU, down, into pair rows [pair0, pair0 + n_pairs) of the pair buffer; intermediates in the
    /// same rows of gate_ / up_. Async on the compute stream.
    void expert_ffn(const ExpertLayout &x, cuda::ExpertMatmul g, const ExpertLists &w, int64_t pair0, int64_t n_pairs);
    cudaStream_t stream() const { return CudaBackend::cuda_stream(compute_); }
    /// The deferred router with `resolve` fused in (nullptr: alone), then its routing copy.
    void launch_router(const cuda::DeviceHitsArgs *resolve, std::span<const int32_t> index,
                       std::span<const void *const> data);

    CudaBackend &backend_;
    Stream compute_;
    RouterLaunch router_;         // defer_router's, while router_held_
    bool router_held_ = false;
    const ExpertStore &store_;
    Shape shape_;
    std::vector<GpuSharedExpert> shared_;  // [n_layers]
    cuda::Workspace ws_;

    void *device_ = nullptr;  // one allocation for the buffers below
    uint64_t device_bytes_ = 0;
    float *gate_ = nullptr, *up_ = nullptr;  // [n_batch * top_k][n_ff] expert intermediates
    float *pairs_ = nullptr;                 // [n_batch * top_k + n_batch][n_embd] pair outputs: GPU, CPU, shared rows
    float *sh_gate_ = nullptr, *sh_up_ = nullptr;  // [n_batch][n_ff_shexp]
    uint8_t *meta_dev_ = nullptr;            // per-layer step arrays (expert pointers, offsets, rows, pair ids, weights)
    void *pinned_ = nullptr;                 // one cudaHostAlloc for the host mirrors, or null when refused:
    std::unique_ptr<uint8_t[]> pageable_;    // then they live here
    uint64_t host_bytes_ = 0;
    uint8_t *meta_host_ = nullptr;
    float *cpu_out_host_ = nullptr;          // [n_batch * top_k][n_embd]
    uint64_t meta_bytes_ = 0;
    size_t meta_used_ = 0;                   // end of the running layer's waves in meta_host_ / meta_dev_
    const float *h_dev_ = nullptr;
    const int32_t *ids_dev_ = nullptr;
    float *out_dev_ = nullptr;
    const float *residual_dev_ = nullptr;
    // The device-resolved hit path: the slot table and the groups resolve_device_hits lists.
    const void **table_dev_ = nullptr;                      // [n_layers * n_experts]
    const void **hit_w_dev_ = nullptr;                      // [3][n_experts]: gate, up, down of each group
    int32_t *hit_offsets_dev_ = nullptr;                    // [n_experts + 1]
    int32_t *hit_rows_dev_ = nullptr;                       // [device_hits_tokens * top_k]
    const int32_t *pair_ids_dev_ = nullptr;
    const float *weights_dev_ = nullptr;
    const float *routing_weights_dev_ = nullptr;
    int32_t *step_pair_ids_dev_ = nullptr;  // [device_hits_tokens][top_k + 1] a whole step's combine arrays
    float *step_weights_dev_ = nullptr;     // [device_hits_tokens][top_k + 1]
};

} // namespace prescope

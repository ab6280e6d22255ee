// The host tier of the expert store: each (layer, expert) that may be copied to the GPU is repacked once
// into the canonical layout (docs/style R4: gate, up, down back to back, one DMA per expert) in host memory
// that is page-locked through Backend::host_register, and the file mapping's pages of those bytes are
// dropped, so the bytes live in host memory exactly once. Decision: docs/decisions/0034.
#pragma once

#include "backend/backend.h"
#include "core/tensor.h"

#include <cstdint>
#include <string>
#include <vector>

namespace prescope {

class Model;

/// Byte layout of one expert of a layer in canonical form: [gate | up | down (| biases)], each part starting at a
/// multiple of 256 bytes (cuBLAS and the CUDA kernels want 16-byte aligned rows).
struct ExpertLayout {
    DType gate_type = DType::F32, up_type = DType::F32, down_type = DType::F32;
    int64_t n_embd = 0;        // gate/up: n_embd -> n_ff; down: n_ff -> n_embd
    int64_t n_ff = 0;
    uint64_t gate_bytes = 0, up_bytes = 0, down_bytes = 0;  // the parts as stored in the file
    uint64_t up_offset = 0, down_offset = 0;                // from the expert's first byte
    // Experts with biases (HParams::moe_bias, gpt-oss): F32 [gate_b n_ff | up_b n_ff | down_b n_embd] from here, so
    // that a slot holds all the expert needs; 0 = none.
    uint64_t bias_offset = 0;
    uint64_t bytes = 0;                                     // whole expert, padding included (multiple of 256)

    /// The layout of `layer`'s experts in `model`; all sizes 0 (bytes 0, n_ff 0) for a layer without experts
    /// (a leading dense layer, HParams::has_experts).
    static ExpertLayout of(const Model &model, int64_t layer);
};

/// An expert's three matrices as TensorViews for cpu_expert_ffn (runtime/moe.h), with the matrix index to
/// pass it: 0 for a repacked expert (single-matrix views), the expert id for one read from the mapping.
/// gate_b / up_b ([n_ff]) and down_b ([n_embd]) are the expert's F32 biases (HParams::moe_bias; cpu_views
/// only), else null.
struct ExpertViews {
    TensorView gate, up, down;
    int64_t index = 0;
    const float *gate_b = nullptr, *up_b = nullptr, *down_b = nullptr;
};

struct ExpertStoreConfig {
    /// [n_layers * n_experts], layer-major: 1 = the expert may be fetched to the GPU (repack it), 0 = it
    /// only ever runs on the CPU (read it in place from the mapping). Empty = all 1.
    std::vector<uint8_t> fetchable;
    /// Same shape: 1 = page-lock the expert's bytes (home tier PINNED or GPU), 0 = leave them pageable
    /// (home tier MMAP). Empty = all 1.
    std::vector<uint8_t> pinned;
    /// Drop the mapping's pages of repacked bytes (madvise + posix_fadvise DONTNEED), so the same bytes are
    /// not held twice. Off only in tests that compare against the mapping afterwards.
    bool drop_mapped_pages = true;

    /// Every expert read in place from the mapping, never repacked or copied: the CPU engine's store.
    static ExpertStoreConfig cpu_only(const Model &model);
};

/// PRECONDITIONS: the model outlives the store; `backend` (may be null: nothing is page-locked) outlives it.
/// Allocates only in the constructor. Indexed by model layer: a layer without experts (leading dense layer) has
/// a layout of 0 bytes and nothing repacked or page-locked, whatever the masks say.
class ExpertStore {
  public:
    /// Repacks (in parallel) and registers. When the backend refuses to page-lock, keeps the pageable copy
    /// and logs one warning (copies then run at pageable speed). Throws prescope::Error when host memory for
    /// the repacked experts cannot be mapped (with the size).
    ExpertStore(const Model &model, Backend *backend, const ExpertStoreConfig &config = {});
    ~ExpertStore();
    ExpertStore(const ExpertStore &) = delete;
    ExpertStore &operator=(const ExpertStore &) = delete;

    int32_t n_layers() const { return n_layers_; }
    int32_t n_experts() const { return n_experts_; }
    const ExpertLayout &layout(int32_t layer) const { return layouts_[size_t(layer)]; }
    /// Bytes of every expert in canonical form, [n_layers * n_experts] (ExpertCacheConfig::expert_bytes); 0 for
    /// the layers without experts.
    std::vector<uint64_t> expert_bytes() const;
    /// Host address of the expert's canonical bytes, or nullptr when it was not repacked (CPU-only).
    const void *host_expert(int32_t layer, int32_t expert) const {
        return host_[size_t(layer) * size_t(n_experts_) + size_t(expert)];
    }
    /// host_expert() of every expert, layer-major (ExpertLoader's host_experts).
    const std::vector<const void *> &host_experts() const { return host_; }
    /// Views for running the expert on the CPU from wherever its bytes live.
    ExpertViews cpu_views(int32_t layer, int32_t expert) const;
    /// Views of an expert in canonical form at `bytes` (host memory, or a GPU slot's copy of it).
    static ExpertViews canonical_views(const ExpertLayout &layout, const void *bytes);

    uint64_t pinned_bytes() const { return pinned_ok_ ? region_bytes_[0] : 0; }
    uint64_t pageable_bytes() const { return region_bytes_[1] + (pinned_ok_ ? 0 : region_bytes_[0]); }
    bool pin_refused() const { return region_bytes_[0] > 0 && !pinned_ok_; }
    /// One line for the start-up banner.
    std::string describe() const;

  private:
    const Model &model_;
    Backend *backend_;
    int32_t n_layers_ = 0, n_experts_ = 0;
    std::vector<ExpertLayout> layouts_;  // [n_layers]
    std::vector<const void *> host_;     // [n_layers * n_experts]
    uint8_t *region_[2] = {nullptr, nullptr};  // anonymous mappings: [0] to page-lock, [1] pageable
    uint64_t region_bytes_[2] = {0, 0};
    bool pinned_ok_ = false;
    uint64_t dropped_bytes_ = 0;  // mapping bytes released after repacking
};

} // namespace prescope

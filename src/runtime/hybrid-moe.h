// The hybrid CPU/GPU MoE block, host side: per layer, decide HIT / FETCH / CPU for each routed expert
// (offload/placement.h decide_layer), grant slots and queue copies (ExpertLoader), hand the GPU experts to
// the device, prefetch for the next layers, run the CPU experts on host threads meanwhile, and combine in
// top-k order. The device half sits behind MoeDevice, so the whole flow runs on FakeBackend in tests.
#pragma once

#include "offload/expert-cache.h"
#include "offload/expert-loader.h"
#include "offload/expert-store.h"
#include "offload/placement.h"
#include "offload/predictor.h"
#include "runtime/moe.h"

#include <cstdint>
#include <span>
#include <vector>

namespace prescope {

/// What the device runs for one layer: plain data the host fills (sized once, reused every layer).
/// Expert outputs are rows of one pair buffer: GPU pairs [0, n_gpu_pairs) expert by expert, then CPU pairs
/// [n_gpu_pairs, n_gpu_pairs + n_cpu_pairs), then (with a device-side shared expert) one row per token.
struct MoeStep {
    int32_t layer = 0;
    int64_t n_tok = 0;
    int64_t k = 0;       // routed experts per token
    int64_t k_comb = 0;  // columns of pair_ids / weights: k, or k + 1 with the shared expert
    // GPU experts: HIT and FETCH ones (wave 0), then STREAM ones (later waves), each part in ascending id.
    int32_t n_gpu = 0;
    std::vector<const void *> gpu_expert;  // [n_gpu] device address of each expert's canonical bytes (its slot)
    std::vector<int32_t> gpu_offsets;      // [n_gpu + 1] pairs of GPU expert i: [gpu_offsets[i], gpu_offsets[i+1])
    std::vector<int32_t> gpu_rows;         // [n_gpu_pairs] token (row of the router input) of each GPU pair
    int64_t n_gpu_pairs = 0;
    // CPU experts, ascending id; their pairs numbered from 0 in cpu_rows and from n_gpu_pairs in the buffer.
    int32_t n_cpu = 0;
    std::vector<int32_t> cpu_expert;   // [n_cpu]
    std::vector<int32_t> cpu_offsets;  // [n_cpu + 1]
    std::vector<int32_t> cpu_rows;     // [n_cpu_pairs]
    int64_t n_cpu_pairs = 0;
    std::vector<int32_t> pair_ids;  // [n_tok][k_comb] pair-buffer row of each (token, top-k slot)
    std::vector<float> weights;     // [n_tok][k_comb] routing weight (shared column: sigmoid of its gate)
    // The wave launch_gpu queues now: GPU experts [wave_begin, wave_end), whose gpu_expert entries are set.
    // Wave 0 holds the HIT and FETCH experts and also uploads pair_ids / weights and runs the shared expert;
    // waves 1, 2, ... hold STREAM experts, each loaded into slots the wave before freed.
    int32_t wave = 0, wave_begin = 0, wave_end = 0;
};

/// The device half of the hybrid block. Calls come from the runtime thread in this order per layer:
/// (copies waited for on compute_stream()) launch_gpu (wave 0) -> (CPU experts write cpu_out()) ->
/// [launch_gpu (wave 1, 2, ...), each after its copies were waited for] -> combine.
class MoeDevice {
  public:
    virtual ~MoeDevice() = default;
    /// The stream the expert compute runs on; the loader makes it wait for expert copies.
    virtual Stream compute_stream() = 0;
    /// Queues the GPU experts of s's wave [s.wave_begin, s.wave_end) (and, in wave 0, the shared expert when
    /// s.k_comb > s.k). Returns at once; the host arrays of s may change before the queued work runs.
    virtual void launch_gpu(const MoeStep &s) = 0;
    /// Host rows [max pairs][n_embd] F32 for the CPU experts' outputs: CPU pair i writes row i. Its previous
    /// contents must have been consumed (the device guarantees it by the time the layer's routing was read).
    virtual float *cpu_out() = 0;
    /// Queues out[t] = sum_j weights[t][j] * pair_row(pair_ids[t][j]), j ascending (runtime/moe.h's order).
    virtual void combine(const MoeStep &s) = 0;
};

struct HybridMoeConfig {
    HybridRule rule;                     // cpu_threshold
    int32_t prefetch_window = 0;         // layers ahead the predictor is asked about; 0 = no prefetch
    int32_t prefetch_max_per_layer = 0;  // new prefetch loads per predicted layer and step; 0 = top_k
    int64_t predict_max_tokens = 4;      // the predictor sees at most the last this many tokens of a batch
                                         // (prefill would cost tokens x window x experts x n_embd for Fate)
};

/// Timings of the host side, for the exit summary (microseconds, summed over layers and steps).
struct HybridMoeStats {
    double cpu_expert_us = 0;  // host threads running CPU experts
    double predict_us = 0;     // predictor + prefetch submission
    double wait_issue_us = 0;  // host blocked until demand copies were issued (also in the cache's stall_us)
    double device_stall_us = 0;  // compute stream waiting for expert bytes (event-timed; in stall_us too)
    uint64_t layers = 0;
    uint64_t streamed = 0;     // STREAM experts run on the GPU in waves after wave 0
    uint64_t stream_waves = 0; // those waves
};

/// PRECONDITIONS: one thread (the runtime's); model, store, plan, device and (optional) cache, loader,
/// predictor, backend outlive it. cache and loader are both set or both null (null: every expert on the CPU).
/// Nothing allocates after the constructor.
class HybridMoe {
  public:
    HybridMoe(const Model &model, const ExpertStore &store, const PlacementPlan &plan, ExpertCache *cache,
              ExpertLoader *loader, Predictor *predictor, MoeDevice &device, Backend *backend,
              const HybridMoeConfig &config, int64_t max_tokens, bool shared_on_device);
    ~HybridMoe();
    HybridMoe(const HybridMoe &) = delete;
    HybridMoe &operator=(const HybridMoe &) = delete;

    /// One layer. h: host [r.n_tok][n_embd] F32 router input (the ffn-norm output), valid until the call
    /// returns; r: the routing (ids, weights) of those tokens; shared_gate: [r.n_tok] shared-expert gate
    /// logits when the device runs the shared expert, else empty. Queues the combined output on the device.
    void run_layer(int32_t layer, const float *h, const Routing &r, std::span<const float> shared_gate);
    /// Reads the device stall timings of layers whose events completed (call after a step's final sync).
    void collect_timings();
    /// A new sequence: the predictor forgets its history.
    void reset() {
        if (predictor_) predictor_->reset();
    }

    const LayerDecision &last_decision() const { return decision_; }
    const MoeStep &last_step() const { return step_; }
    const HybridMoeStats &stats() const { return stats_; }

  private:
    void build_step(int32_t layer, const Routing &r, std::span<const float> shared_gate);
    void begin_wave(int32_t first);
    void run_cpu_experts(const float *h);
    void prefetch(int32_t layer, const float *h, const Routing &r);

    const Model &model_;
    const ExpertStore &store_;
    const PlacementPlan &plan_;
    ExpertCache *cache_;
    ExpertLoader *loader_;
    Predictor *predictor_;
    MoeDevice &device_;
    Backend *backend_;
    HybridMoeConfig config_;
    bool shared_on_device_;
    int64_t max_tokens_;

    LayerDecision decision_;
    LayerDecision wave_;  // the STREAM experts of the next wave, as FETCH entries (in gpu order)
    MoeStep step_;
    int32_t n_wave0_ = 0;  // HIT + FETCH experts: GPU experts [0, n_wave0_) of step_
    std::vector<int32_t> stream_index_;  // [n_experts] decision_.experts index of GPU expert n_wave0_ + i
    std::vector<int8_t> site_;        // [n_experts] scratch: 0 not routed, 1 GPU, 2 CPU
    std::vector<int32_t> index_;      // [n_experts] scratch: position of the expert in gpu_/cpu_ lists
    std::vector<int32_t> fill_;       // [n_experts] scratch: next pair of each expert
    std::vector<std::vector<float>> scratch_;  // per thread: gathered rows, gate/up, output
    PrefetchList prefetch_list_;
    std::vector<Event> stall_begin_, stall_end_;  // [n_layers] timing events around the copy waits
    std::vector<uint8_t> stall_pending_;          // [n_layers]
    HybridMoeStats stats_;
};

} // namespace prescope

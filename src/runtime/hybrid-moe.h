// The MoE block of every engine, as plan then execute: per layer the planner (offload/layer-planner.h) turns
// the routing, the cache state, the copies in flight and the predictor's scores into a LayerPlan (HIT / FETCH /
// STREAM / CPU per routed expert, prefetches), and one executor runs it: slots and copies (ExpertLoader), GPU
// waves on the device half (MoeDevice), CPU experts on host threads, prefetches, combine in top-k order, and
// the measurements that correct the cost model. Without a GPU cache the plan is all-CPU and the device half
// is HostMoeDevice: that is the CPU engine's MoE block (CpuExpertExecutor, runtime/moe.h).
#pragma once

#include "offload/expert-cache.h"
#include "offload/expert-loader.h"
#include "offload/expert-store.h"
#include "offload/layer-planner.h"
#include "offload/placement.h"
#include "offload/predictor.h"
#include "runtime/moe.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace prescope {

/// The steps of one MoE layer, in the only order HybridMoe::run_layer takes them (each at most once; those that
/// do not apply are skipped). With a routed expert missing from the GPU the predictor runs first, so the plan
/// weighs the next layers; with every routed expert resident it runs after the launch, off the GPU's path.
enum class LayerStep : uint8_t {
    PREDICT_FIRST,         // predictor for l+1..l+w (a routed expert is missing)
    PLAN,                  // the planner's LayerPlan
    SLOTS_AND_COPIES,      // slots for HIT then FETCH, demand copies queued, prefetches of hits promoted
    WAIT_WAVE0,            // compute waits for wave 0's copies (host blocks until they are issued)
    LAUNCH_WAVE0,          // HIT (+ FETCH unless split) experts and the shared expert on the device
    PREDICT_AFTER_LAUNCH,  // predictor and the plan's prefetches (every routed expert was resident)
    RELEASE_WAVE0,         // layer event recorded, slots unpinned (not split)
    QUEUE_STREAM_WAVE,     // the first streamed wave's copies, behind the layer event
    PREFETCH,              // the plan's prefetches queued (behind demand copies)
    CPU_EXPERTS,           // CPU experts on host threads, while the copies travel and the GPU computes
    LAUNCH_FETCH_WAVE,     // split: wait for the FETCH copies, launch them, release the slots
    STREAM_WAVES,          // streamed waves: wait, launch, release, queue the next
    COMBINE,               // CPU rows to the device, weighted sum in top-k order (+ shared expert)
    MEASURE,               // CPU time and finish gap to the load balancer
};
const char *layer_step_name(LayerStep s);

/// What the device runs for one layer: plain data the host fills (sized once, reused every layer).
/// Expert outputs are rows of one pair buffer: GPU pairs [0, n_gpu_pairs) expert by expert, then CPU pairs
/// [n_gpu_pairs, n_gpu_pairs + n_cpu_pairs), then (with a device-side shared expert) one row per token.
struct MoeStep {
    int32_t layer = 0;
    int64_t n_tok = 0;
    int64_t k = 0;       // routed experts per token
    int64_t k_comb = 0;  // columns of pair_ids / weights: k, or k + 1 with the shared expert
    // GPU experts in wave order: wave 0 (HIT and FETCH, or HIT only when the plan splits), then the FETCH
    // wave (split), then the STREAM experts; each part in ascending id.
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
    std::vector<float> weights;     // [n_tok][k_comb] routing weight (shared column: sigmoid of its gate, or 1
                                    // for an ungated shared expert)
    // The wave launch_gpu queues now: GPU experts [wave_begin, wave_end), whose gpu_expert entries are set.
    // Wave 0 also uploads pair_ids / weights and runs the shared expert; later waves hold FETCH experts (split)
    // or STREAM experts, each loaded into slots the wave before freed.
    int32_t wave = 0, wave_begin = 0, wave_end = 0;
};

/// The device half of the MoE block. Calls come from the runtime thread in this order per layer:
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

    /// The device-resolved hit path (issue 14): most tokens of a layer launch_device_hits takes; 0 = none (the
    /// host launches every GPU expert once it has read the routing).
    virtual int64_t device_hits_max_tokens() const { return 0; }
    /// Queues, in stream order: the slot-table updates table[index[i]] = data[i] (index = layer * n_experts +
    /// expert; data = the expert's bytes in its slot, or nullptr: not resident for the device), then the products
    /// of the layer's routed experts (the device's own copy of the routing) whose entry is set, into pair rows
    /// [0, n) in ascending expert id, each expert's pairs in token order: the layout run_layer then gives the
    /// first GPU experts of its MoeStep. n_tok in [0, device_hits_max_tokens()]; 0 applies the updates only.
    virtual void launch_device_hits(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                                    std::span<const void *const> data);
    /// The whole step on the device, for a layer whose every expert the slot table holds (decision 0138): the
    /// updates and every routed expert's products as launch_device_hits queues them, the shared expert (ungated:
    /// weight 1), and the combine of pair rows in top-k order with the pair ids and weights the device derives
    /// from its own routing (ids and weights). The host's MoeStep is not read. n_tok in [1,
    /// device_hits_max_tokens()].
    virtual void launch_device_layer(int32_t layer, int64_t n_tok, std::span<const int32_t> index,
                                     std::span<const void *const> data);
};

/// The device half of the all-CPU plan: no GPU experts; combine on the host into the output set by
/// set_output() (the CPU engine's MoE block).
class HostMoeDevice final : public MoeDevice {
  public:
    HostMoeDevice(int64_t n_embd, int64_t max_pairs);
    void set_output(float *out) { out_ = out; }
    Stream compute_stream() override { return nullptr; }
    void launch_gpu(const MoeStep &s) override;
    float *cpu_out() override { return rows_.data(); }
    void combine(const MoeStep &s) override;

  private:
    int64_t n_embd_;
    std::vector<float> rows_;  // [max_pairs][n_embd]
    float *out_ = nullptr;
};

/// What HybridMoe::launch_device queued: nothing, the resident experts (run_layer plans the rest), or the whole step.
enum class DeviceLaunch : uint8_t { NONE, HITS, LAYER };

struct HybridMoeConfig {
    PlannerConfig planner;           // rule (cost model or --cpu-threshold), streaming, prefetch limits, dump
    int64_t predict_max_tokens = 4;  // the predictor sees at most the last this many tokens of a batch
                                     // (prefill would cost tokens x window x experts x n_embd for Fate)
};

/// PRECONDITIONS: one thread (the runtime's); model, store, placement, device and (optional) cache, loader,
/// engine, predictor, backend outlive it. cache, loader and engine are all set or all null (null: the all-CPU
/// plan). Nothing allocates after the constructor (but the layer-state dump when asked for). Layers are model
/// layers; only MoE layers (hp.has_experts: not the leading dense ones) run through it (asserted). The predictor
/// numbers MoE layers from 0 (offload/predictor.h); run_layer turns its requests into model layers.
class HybridMoe {
  public:
    /// max_tokens: the most tokens of one run_layer. shared_on_device: the device runs the model's shared expert
    /// in wave 0 and the combine adds it as column k (MoeStep::k_comb = k + 1), weighted sigmoid(shared_gate[t])
    /// when hp.shared_expert_gate (HF Qwen2MoeSparseMoeBlock), else exactly 1 (HF DeepseekV3MoE adds
    /// shared_experts(x) unscaled); false: the caller adds it (the CPU engine).
    HybridMoe(const Model &model, const ExpertStore &store, const PlacementPlan &placement, ExpertCache *cache,
              ExpertLoader *loader, CopyEngine *engine, Predictor *predictor, MoeDevice &device, Backend *backend,
              const CostModel &cost, const HybridMoeConfig &config, int64_t max_tokens, bool shared_on_device);
    ~HybridMoe();
    HybridMoe(const HybridMoe &) = delete;
    HybridMoe &operator=(const HybridMoe &) = delete;

    /// One MoE layer (hp.has_experts(layer)). h: host [r.n_tok][n_embd] F32 router input (the ffn-norm output),
    /// valid until the call returns; r: the routing (ids, weights) of those tokens; shared_gate: [r.n_tok] F32
    /// shared-expert gate logits when the device runs a gated shared expert, else empty (ignored when the shared
    /// expert is ungated). Queues the combined output on the device.
    void run_layer(int32_t layer, const float *h, const Routing &r, std::span<const float> shared_gate);
    /// Issue 14: before the layer's routing reaches the host, brings the device's slot table up to date with the
    /// hot-expert table (an entry is set only once its copy is done, cleared once the slot holds another expert
    /// or is being reloaded) and has the device run the routed experts it holds (MoeDevice::launch_device_hits,
    /// DeviceLaunch::HITS): run_layer(layer) then plans them as hits already computed and launches only the rest.
    /// With whole_steps, when the row holds every expert of `layer` and the model has no gated shared expert (its
    /// weight is a host sigmoid), queues the whole step instead (MoeDevice::launch_device_layer,
    /// DeviceLaunch::LAYER, decision 0138): nothing of it waits for the host. A full row stays full (slots are
    /// per layer and a resident expert is never loaded again), so the host may read that step's routing later;
    /// it must call account_device_layer(layer, ...) before run_layer or account_device_layer of a later layer,
    /// and before this layer's next launch. Queues nothing (NONE) without a cache or when the device cannot take
    /// n_tok tokens. Call after the layer's routing is on the device, before run_layer(layer) with that routing.
    DeviceLaunch launch_device(int32_t layer, int64_t n_tok, bool whole_steps);
    /// The host's part of a step launch_device ran whole (DeviceLaunch::LAYER): the plan (every expert a HIT the
    /// device ran), the hot-expert table's counters and policy, the predictor and its prefetches, LayerStats; no
    /// launch, no combine. h, r: as for run_layer (the routing the device used).
    void account_device_layer(int32_t layer, const float *h, const Routing &r);
    /// Every MoE layer runs whole on the device from slots that never change: each expert has its home there
    /// (a fixed slot, placement tier GPU), its copy done and its slot in the device's table. Then a pass of n_tok
    /// in [1, device_hits_max_tokens()] queues the same launches every time, and may be captured once as a CUDA
    /// graph and replayed (decision 0142): replayed_device_layer stands for launch_device's LAYER outcome.
    bool device_resident() const;
    /// The host's record of a whole step the device ran from a replayed launch (device_resident() must hold):
    /// as launch_device's LAYER outcome, without queueing anything; account_device_layer follows as usual.
    void replayed_device_layer(int32_t layer);
    /// Marks, on `stream`, the point where the layer's routing has been copied to the host (call before waiting
    /// for it): the compute stream is idle from there until run_layer queues the layer's first work, which is
    /// LayerStats::gpu_idle_us. Collects the layer's previous timings first when they are complete.
    void mark_routing_copied(int32_t layer, Stream stream);
    /// Reads the device timings of layers whose events completed (stall, GPU finish) and the copy engine's
    /// speed, and hands them to the load balancer (call after a step's final sync).
    void collect_timings();
    /// A new sequence: the predictor forgets its history.
    void reset() {
        if (predictor_) predictor_->reset();
    }

    const LayerPlan &last_plan() const { return plan_; }
    const MoeStep &last_step() const { return step_; }
    /// The planner (cost model, load balancer); null for the all-CPU plan.
    const LayerPlanner *planner() const { return planner_.get(); }
    /// Called at each step of run_layer (tests assert the order).
    std::function<void(int32_t layer, LayerStep)> on_step;

  private:
    void run_step(int32_t layer, const float *h, const Routing &r, std::span<const float> shared_gate,
                  bool on_device);
    /// Brings the layer's row of the device slot table up to date (update_index_ / update_data_); returns the
    /// experts the row holds.
    int32_t update_table(int32_t layer);
    void step(LayerStep s);
    /// The predictor's scores for the layers after `layer` (none when window_resident: nothing could be fetched).
    void predict(int32_t layer, const float *h, const Routing &r);
    /// Every expert of the prefetch window's layers after `layer` has a fixed home on the GPU (a full budget): a
    /// prediction there would be thrown away, and a hidden-state predictor costs the host ~0.1 ms a layer.
    bool window_resident(int32_t layer) const;
    void build_step(const Routing &r, std::span<const float> shared_gate);
    bool device_hit(const RoutedExpert &x) const;  // x ran in this layer's device launch
    void launch(int32_t wave, int32_t begin, int32_t end);
    void begin_wave(int32_t first);
    void prefetch();
    void run_cpu_experts(const float *h);
    LayerStats *stats(int32_t layer) { return cache_ ? &cache_->layer_stats(layer) : nullptr; }

    const Model &model_;
    const ExpertStore &store_;
    const PlacementPlan &placement_;
    ExpertCache *cache_;
    ExpertLoader *loader_;
    CopyEngine *engine_;
    Predictor *predictor_;
    MoeDevice &device_;
    Backend *backend_;
    HybridMoeConfig config_;
    bool shared_on_device_;
    bool shared_gated_;  // shared_on_device_ and hp.shared_expert_gate: its column is weighted sigmoid(gate)
    int64_t max_tokens_;
    std::unique_ptr<LayerPlanner> planner_;  // null without a cache

    LayerPlan plan_;
    LayerDecision wave_;  // the experts of the next wave (split FETCH or STREAM), as FETCH entries
    MoeStep step_;
    int32_t n_wave0_ = 0;   // GPU experts [0, n_wave0_) of step_ are wave 0
    int32_t n_device_ = 0;  // of them, [0, n_device_) the device ran (launch_device)
    int32_t n_fetch_wave_ = 0;  // split: the FETCH wave [n_wave0_, n_wave0_ + n_fetch_wave_)
    std::vector<int32_t> gpu_index_;  // [n_experts] plan_.decision.experts index of GPU expert i
    std::vector<int8_t> site_;        // [n_experts] scratch: 0 not routed, 1 GPU, 2 CPU
    std::vector<int32_t> index_;      // [n_experts] scratch: position of the expert in gpu_/cpu_ lists
    std::vector<int32_t> fill_;       // [n_experts] scratch: next pair of each expert
    CpuExpertRunner cpu_runner_;
    PrefetchList predicted_;
    std::vector<PrefetchRequest> prefetch_list_;  // the plan's prefetches as loader requests
    std::vector<int32_t> prefetch_slots_;         // the slot each of them got
    int32_t step_layer_ = -1;
    int last_step_ = -1;
    double layer_t0_us_ = 0;      // host clock at run_layer's start
    double cpu_end_us_ = -1;      // this layer's CPU experts finished, from layer_t0_us_
    double host_us_estimate_ = 0; // moving average of predictor + prefetch time
    // Device timings, read one step later: events around the copy waits and after the last launch.
    std::vector<Event> stall_begin_, stall_end_, gpu_done_;  // [n_layers]
    std::vector<Event> routing_copied_;                       // [n_layers] mark_routing_copied
    std::vector<uint8_t> routing_marked_;                     // [n_layers] routing_copied_ belongs to this step
    std::vector<uint8_t> timing_pending_;                     // [n_layers]
    std::vector<double> pending_cpu_end_us_, pending_gpu_predicted_us_;
    std::vector<uint8_t> pending_simple_;                     // [n_layers] one wave, no split: compute is timed
    LinkMeter link_meter_;  // the copy engine's busy share and speed (collect_timings)
    // Shortest window a link measurement covers: the busy share of a few microseconds is noise.
    static constexpr double kLinkWindowUs = 200;
    /// The copy engine's counters now, as link_meter_ reads them.
    LinkMeter::Reading link_reading() const;
    // The device slot table as queued (issue 14).
    std::vector<int32_t> table_slot_;          // [n_layers * n_experts] slot of each expert, or -1
    std::vector<Ticket> done_ticket_;          // [n_slots] the last ticket of each slot seen DONE
    std::vector<int32_t> update_index_;        // [n_experts] scratch: the updates of one launch
    std::vector<const void *> update_data_;    // [n_experts]
    int32_t device_hits_layer_ = -1;           // the layer launch_device queued HITS for, until its run_layer
    bool step_on_device_ = false;              // the step being accounted ran whole on the device
    std::vector<uint8_t> device_layer_;        // [n_layers] a whole step was launched, its accounting pending
};

} // namespace prescope

// PreSched's cost model: how long one expert takes on the GPU, on the CPU and over the PCIe link, from a
// profile (measured by `prescope calibrate`, or the built-in H200 reference derived from
// ../shared/design/reference-numbers.md) plus online corrections (offload/load-balancer.h). Plain data and
// arithmetic: no device, no threads; the measurements live in runtime/calibrate.h.
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace prescope {

struct ExpertLayout;

/// The shape of one routed expert: gate and up [n_ff x n_embd], down [n_embd x n_ff].
struct ExpertShape {
    int64_t n_embd = 0;
    int64_t n_ff = 0;
    uint64_t bytes = 0;   // canonical bytes of one expert (ExpertLayout::bytes: three parts, 256-byte aligned)
    std::string dtype;    // weight type of the parts ("q8_0", "bf16", "f32", or "mixed")

    /// Multiply-adds x 2 of one token through the three matrices: 6 n_embd n_ff.
    double flops_per_token() const { return 6.0 * double(n_embd) * double(n_ff); }
    /// "4096x14336:q8_0", the key of measured timings in a profile.
    std::string key() const;
    static ExpertShape of(const ExpertLayout &layout);
    /// The benchmark shapes by name: "qwen3-30b-a3b" (2048 x 768) and "mixtral-8x7b" (4096 x 14336), in Q8_0
    /// (bytes as ExpertLayout computes them). Throws prescope::Error on another name.
    static ExpertShape named(std::string_view name);
};

/// A measured point: x (tokens, bytes or threads, as the field says) -> value.
struct CostPoint {
    double x = 0;
    double value = 0;
};

/// Piecewise-linear interpolation through points sorted by x; beyond the ends the first / last segment is
/// extended (one point: constant). Empty: 0.
double interpolate(const std::vector<CostPoint> &points, double x);

/// Measured timings of one expert shape on one machine (override the profile's formulas for that shape).
struct ShapeTimings {
    std::string shape;                // ExpertShape::key()
    std::vector<CostPoint> gpu_us;    // tokens -> microseconds of one expert inside a grouped launch
    std::vector<CostPoint> cpu_us;    // tokens -> microseconds one more expert adds to a layer's CPU share at
                                      // cpu_threads (with cpu_layer_us measured; else a lone expert's time)
    double cpu_layer_us = -1;         // fixed time of a layer's CPU share (parallel regions, gathers), or < 0:
                                      // not measured (the profile's cpu_layer_us)
    std::string gpu_source, cpu_source;
};

/// The machine's numbers. Every group names where its numbers came from (`*_source`): "measured ..." or
/// "reference ..." (derived, not measured on this machine).
struct CostProfile {
    std::string source;  // one line: what produced the profile
    std::string gpu;     // GPU name (the profile's key with cpu and the shapes)
    std::string cpu;     // CPU model name (/proc/cpuinfo)

    // PCIe host-to-device link (pinned memory).
    std::vector<CostPoint> h2d_gb_s;  // chunk bytes -> GB/s (1e9 bytes/s)
    double h2d_request_us = 10;       // fixed cost per copy request (driver launch, event)
    std::string link_source;

    // GPU, for shapes without measured points: expert = max(bytes / hbm, tokens x flops / peak) + fixed.
    double gpu_hbm_gb_s = 3700;        // effective HBM read bandwidth of the expert products
    double gpu_tflops = 760;           // effective throughput of the expert products
    double gpu_expert_us = 1;          // fixed per expert inside a grouped launch
    double gpu_wave_us = 22;           // one grouped launch (gate, up, SwiGLU, down, step-array copy)
    double gpu_layer_us = 140;         // the rest of a decode layer: attention, router, routing copy and sync
    double gpu_layer_us_per_token = 0; // added per token of the batch (prefill attention and projections)
    std::string gpu_source;

    // CPU, for shapes without measured points: expert = fixed + max(bytes / (read bandwidth x fraction),
    // tokens x flops / gflops).
    int32_t cpu_threads = 16;
    std::vector<CostPoint> host_read_gb_s;  // threads -> GB/s of a parallel sequential read
    double cpu_bw_fraction = 0.73;          // share of that bandwidth the expert products reach
    double cpu_gflops = 450;                // expert products at cpu_threads
    double cpu_expert_us = 25;              // fixed per expert (parallel regions, gather)
    double cpu_layer_us = 10;               // fixed per layer with CPU experts (rows to the device)
    std::string cpu_source;

    // NUMA: host reads from a remote node are slower by this factor (numa_distance / 10 of libnuma).
    int32_t numa_nodes = 1;
    double numa_remote_factor = 1.0;

    std::vector<ShapeTimings> shapes;

    /// The built-in profile of the H200 host (16-core Sapphire Rapids, PCIe Gen5), derived from
    /// ../shared/design/reference-numbers.md and the issue-10 measurements; not a measurement of any machine
    /// this runs on. Its `source` says so.
    static CostProfile h200_reference();

    const ShapeTimings *find_shape(const std::string &key) const;
    ShapeTimings &shape_entry(const std::string &key);  // adds an empty entry when missing

    /// {"format": "prescope-cost-profile", "version": 1, ...} with the field names above.
    nlohmann::json to_json() const;
    /// Throws prescope::Error naming `source` and the field on a bad document.
    static CostProfile from_json(const nlohmann::json &j, std::string_view source);
    static CostProfile load(const std::string &path);
    void save(const std::string &path) const;
};

/// Multiplicative corrections of the model's times from measurements (1 = the profile is right).
struct CostCorrections {
    double cpu = 1.0;   // measured / predicted CPU expert time
    double gpu = 1.0;   // measured / predicted GPU expert time
    double link = 1.0;  // measured / predicted copy time
};

/// The model for one expert shape on one machine. Times in microseconds. Cheap to copy.
class CostModel {
  public:
    CostModel() = default;
    /// threads: CPU threads the experts run on; chunk_bytes: the copy engine's chunk (link speed depends on
    /// it); numa_remote: the expert store sits on a node other than the CPU threads' (reads slower).
    CostModel(const CostProfile &profile, const ExpertShape &shape, int32_t threads, uint64_t chunk_bytes,
              bool numa_remote = false);

    const ExpertShape &shape() const { return shape_; }
    const CostProfile &profile() const { return profile_; }
    int32_t threads() const { return threads_; }

    /// One host-to-device request of n bytes: fixed + n / bandwidth(min(chunk, n)), times corrections.link.
    double h2d_us(uint64_t bytes) const;
    /// Fetching one expert of the shape.
    double fetch_us() const { return h2d_us(shape_.bytes); }
    /// Microseconds for `requests` copies of `bytes` in all: requests x h2d_request_us x the link correction +
    /// bytes at link_gb_s() (corrected). What the copy engine's busy time should be: the load balancer's
    /// prediction of it (LinkMeter).
    double link_us(uint64_t bytes, uint64_t requests) const;
    /// Link bandwidth at the chunk size, GB/s (corrected).
    double link_gb_s() const;
    /// One expert with `tokens` tokens on the GPU inside a grouped launch (measured points or formula).
    double gpu_us(int64_t tokens) const;
    /// One expert with `tokens` tokens on the CPU at threads() threads.
    double cpu_us(int64_t tokens) const;
    double gpu_wave_us() const { return profile_.gpu_wave_us * corrections.gpu; }
    /// The fixed part of a layer's CPU share: the shape's measured term, else the profile's.
    double cpu_layer_us() const;
    /// The non-expert part of a layer for a batch of n_tokens (attention, router, routing copy).
    double layer_us(int64_t n_tokens) const {
        return profile_.gpu_layer_us + profile_.gpu_layer_us_per_token * double(n_tokens);
    }
    /// Host read bandwidth at threads() (GB/s), NUMA factor included.
    double host_read_gb_s() const;

    /// The model as printed at start-up: one line per term with its source.
    std::string describe() const;
    nlohmann::json to_json() const;

    CostCorrections corrections;

  private:
    CostProfile profile_;
    ExpertShape shape_;
    int32_t threads_ = 1;
    uint64_t chunk_bytes_ = uint64_t(4) << 20;
    bool numa_remote_ = false;
    int32_t measured_ = -1;  // index of this shape's measured timings in profile_.shapes, -1 = formulas
};

} // namespace prescope

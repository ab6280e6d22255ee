// Calibration of the cost model (offload/cost-model.h) on the machine it runs on: the CPU terms (host read
// bandwidth against threads, one expert's CPU time against tokens) measured here in a time budget; the GPU
// and link terms measured on the GPU (runtime/gpu-calibrate.cpp, CUDA builds). `prescope calibrate` writes the
// result as a profile; the runtime measures the CPU terms at start-up when its profile lacks them.
#pragma once

#include "offload/cost-model.h"
#include "offload/offload-config.h"

#include <cstdint>
#include <string>

namespace prescope {

class Model;

/// "model name" of /proc/cpuinfo, or "unknown CPU".
std::string cpu_model_name();

/// Host read bandwidth (GB/s) with 1, 2, 4, ... up to `threads` threads, each reading its share of a buffer,
/// best of a few passes; within about budget_s seconds.
std::vector<CostPoint> measure_host_read(int32_t threads, double budget_s);

/// A layer's CPU share split into a fixed part and a per-expert part (microseconds at the measured threads).
struct CpuExpertTimings {
    std::vector<CostPoint> us_by_tokens;  // tokens -> what one more expert with that many tokens adds
    double layer_us = -1;                 // the fixed part (< 0: not split, a model with one expert per layer)
};

/// One expert of `layer` (a layer with experts) on the CPU (the executor's batched runner) at 1, 2, 4, ... tokens
/// with `threads` threads, best of a few runs each, until budget_s seconds are spent or 512 tokens are reached;
/// then min(8, n_expert) experts at one token each in one run, which splits a lone expert's time into the layer's
/// fixed part (parallel regions, gathers: ShapeTimings::cpu_layer_us) and the expert's own.
CpuExpertTimings measure_cpu_expert(const Model &model, int32_t layer, int32_t threads, double budget_s);

/// Measures the CPU terms into `profile`: name, threads, host read bandwidth, and the model's expert shape
/// (layer 0) CPU timings, each labelled "measured ...". About budget_s seconds.
void calibrate_cpu(CostProfile &profile, const Model &model, int32_t threads, double budget_s);

/// Measures the GPU and link terms on CUDA device `device` into `profile` (pinned H2D GB/s by chunk size,
/// request latency, the model's expert on the GPU against tokens, one grouped launch). Returns false and says
/// why (no CUDA in this build, no device) when it cannot; the profile is then unchanged.
bool calibrate_gpu(CostProfile &profile, const Model &model, int32_t device, std::string *why);

/// The runtime's cost model for `model` under `config`: the profile named by config.cost_profile (or the built-in
/// H200 reference), its CPU terms measured now (budget_s; once per process, expert shape and thread count) unless
/// the profile holds measured ones for this CPU and the model's expert shape. *notes (optional) gets one line on
/// where each group of terms came from.
CostModel runtime_cost_model(const Model &model, const OffloadConfig &config, int32_t threads, double budget_s,
                             std::string *notes);

} // namespace prescope
